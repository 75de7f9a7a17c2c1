"""A user's inputs file as arrays: ``.npz``/``.npy``/a directory (``tk.runtime.inputs.read_inputs``), or for
an ``hf:DIR`` model a ``.txt``/``.jsonl`` of texts that its tokenizer reads (``tk.models.hf_text``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tk.errors import UsageError
from tk.models.hf_text import is_text_file, read_text_samples
from tk.runtime.inputs import check_arrays, read_inputs
from tk.spec import Dim, TensorSpec


def read_user_inputs(
    path: str | Path, model: str, specs: list[TensorSpec], dims: dict[str, Dim]
) -> dict[str, np.ndarray]:
    """Every sample of ``path`` for the inputs ``specs`` of ``model`` (its registry or ``hf:DIR`` name);
    texts are padded to the longest (at least ``dims["seq"].min``) and cut at ``dims["seq"].max``."""
    if not is_text_file(path):
        return read_inputs(path, specs)
    seq = dims.get("seq")
    if seq is None:
        raise UsageError(f"{path}: texts need a model with a seq dimension; {model} has none")
    arrays, _ = read_text_samples(path, model, [s.name for s in specs], min_seq=seq.min, max_seq=seq.max)
    check_arrays(arrays, specs, dims=dims, source=str(path))
    return arrays
