"""A user's inputs file as arrays: ``.npz``/``.npy``/a directory (``tk.runtime.inputs.read_inputs``), or for
an ``hf:DIR`` model a ``.txt``/``.jsonl`` of texts that its tokenizer reads (``tk.models.hf_text``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tk.errors import UsageError
from tk.models.hf_text import is_text_file, read_text_samples
from tk.runtime.inputs import check_arrays, read_inputs
from tk.spec import DTYPES, Dim, Signature, TensorSpec

LABELS = "labels"  # the array of labels in an .npz or a directory (a "label" per .jsonl line)


def read_user_inputs(
    path: str | Path, model: str, specs: list[TensorSpec], dims: dict[str, Dim]
) -> dict[str, np.ndarray]:
    """Every sample of ``path`` for the inputs ``specs`` of ``model`` (its registry or ``hf:DIR`` name);
    texts are padded to the longest (at least ``dims["seq"].min``) and cut at ``dims["seq"].max``. An
    array of ``labels`` (``tk train --samples`` writes one) is read and left out, unless an input has
    that name."""
    path = Path(path)
    stored = None if any(s.name == LABELS for s in specs) or is_text_file(path) else _stored_spec(path, LABELS)
    arrays, _ = read_labeled_inputs(path, model, specs, dims, labels=None if stored is None else lambda: stored)
    return arrays


def read_labeled_inputs(
    path: str | Path,
    model: str,
    specs: list[TensorSpec],
    dims: dict[str, Dim],
    *,
    labels: Callable[[], TensorSpec] | None,
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """``read_user_inputs`` and the samples' labels when the file has them (an array named ``labels``, or a
    ``"label"`` on every ``.jsonl`` line), checked against the spec ``labels()`` returns; it is called only
    then, so a model without class scores fails only on labelled data. ``labels=None`` reads no labels."""
    path = Path(path)
    found: np.ndarray | None = None
    if is_text_file(path):
        seq = dims.get("seq")
        if seq is None:
            raise UsageError(f"{path}: texts need a model with a seq dimension; {model} has none")
        arrays, found = read_text_samples(path, model, [s.name for s in specs], min_seq=seq.min, max_seq=seq.max)
        if found is not None and labels is not None:
            check_arrays({LABELS: found}, [labels()], source=str(path))
    else:
        label_spec = labels() if labels is not None and _has_array(path, LABELS) else None
        arrays = read_inputs(path, specs + ([label_spec] if label_spec else []))
        found = arrays.pop(LABELS) if label_spec else None
    check_arrays(arrays, specs, dims=dims, source=str(path))
    return arrays, (found if labels is not None else None)


def _has_array(path: Path, name: str) -> bool:
    """Whether the directory or ``.npz`` archive (whatever its name) at ``path`` holds an array ``name`` (a
    ``.npy`` holds one, unnamed)."""
    return _stored_spec(path, name) is not None


def _stored_spec(path: Path, name: str) -> TensorSpec | None:
    """The spec of the array ``name`` as the directory or ``.npz`` archive at ``path`` stores it (its dtype, and
    its shape past the samples' axis), or None where it holds none (or none that ``tk`` reads)."""
    import zipfile

    try:
        if path.is_dir():
            if not (path / f"{name}.npy").is_file():
                return None
            array = np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        else:
            with np.load(path, mmap_mode="r", allow_pickle=False) as archive:
                if name not in getattr(archive, "files", []):
                    return None
                array = archive[name]
    except (OSError, ValueError, TypeError, AttributeError, zipfile.BadZipFile, EOFError):
        return None  # read_inputs says what is wrong with the file
    if array.ndim < 1 or str(array.dtype) not in DTYPES:
        return None
    return TensorSpec(name, str(array.dtype), ("batch", *array.shape[1:]))


def labels_spec(signature: Signature) -> TensorSpec:
    """Labels index the last axis of the first output: (batch,) for a classifier, (batch, seq) per token."""
    out = signature.outputs[0]
    if len(out.shape) < 2:
        raise UsageError(
            f"an array of {LABELS} needs a class-score output to index; {out.name} has shape {list(out.shape)}"
        )
    classes = out.shape[-1]
    return TensorSpec(
        LABELS, "int64", tuple(out.shape[:-1]), kind="ids", low=0, high=classes if isinstance(classes, int) else None
    )
