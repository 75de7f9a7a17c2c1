"""Input files for batched inference: read and check them against an engine's input specs.

A file holds every sample at once; axis 0 of each array is the batch dimension. Three layouts:

- ``.npz``: one array per input name (loaded into memory);
- ``.npy``: the one array of a single-input model, memory-mapped, so files larger than memory
  are read batch by batch;
- a directory of ``<input name>.npy`` files: the memory-mapped layout for several inputs.

Files are never unpickled (``allow_pickle=False``). Dtypes must match the spec, except for casts
that cannot change a value and keep the kind of number: a wider integer or float (``int32`` ids
for an ``int64`` input, ``float16`` for ``float32``) or ``bool``/unsigned integers for an integer
input. Everything else is refused (``float64`` for ``float32`` loses precision; integers for a
float input usually need scaling), so the model sees exactly what the file says.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.errors import InputError, UsageError, first_line
from tk.limits import require_within_budget
from tk.runtime.dtypes import dtype_name
from tk.safefiles import require_regular_file
from tk.spec import CHUNK_ELEMENTS, Dim, TensorSpec, numpy_dtype, random_feeds, require_names

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
EMPTY_ZIP_MAGIC = b"PK\x05\x06"  # a zip archive of no members: its end record alone


def sample_dim(specs: list[TensorSpec]) -> str:
    """The name of the batch dimension: axis 0 of every input, named the same in all of them."""
    names = {s.shape[0] if s.shape else None for s in specs}
    if len(names) != 1 or not isinstance(next(iter(names)), str):
        found = ", ".join(f"{s.name}: {s.shape[0] if s.shape else 'scalar'}" for s in specs)
        raise UsageError(
            f"cannot split inputs into samples: expected axis 0 of every input to be one named dimension, found {found}"
        )
    return next(iter(names))


def castable(found: np.dtype, expected: np.dtype) -> bool:
    """Whether ``found`` converts to ``expected`` without changing any value or the kind of number."""
    if found == expected:
        return True
    same_kind = found.kind == expected.kind or (found.kind in "bu" and expected.kind in "iu")
    return same_kind and found.kind != "V" and np.can_cast(found, expected, "safe")


def check_arrays(
    arrays: Mapping[str, Any],
    specs: list[TensorSpec],
    *,
    dims: dict[str, Dim] | None = None,
    free: tuple[str, ...] = (),
    source: str | None = "inputs",
    exact_dtype: bool = False,
    check_batch_range: bool = False,
) -> dict[str, int]:
    """Check names, dtypes, ranks, sizes and valid values; return each named dimension's size.

    The one validator of ``tk``: engines call it on every batch (``exact_dtype``, ``check_batch_range``:
    torch tensors or NumPy arrays that must match the specs exactly), input files on the whole
    file (NumPy arrays whose dtype may widen safely; the batch is the sample count). Named
    dimensions must agree across inputs and, given ``dims``, lie in their range (except the
    ``free`` ones, which the caller checks itself). Token ids must lie in their ``[low, high)``
    and attention masks hold 0/1 with at least one 1 per row. ``source`` (a file name) starts
    each message; None for an engine's feeds. Raises ``InputError`` with what was expected and
    what was received.
    """
    got = "found" if source else "got"
    require_names([s.name for s in specs], list(arrays), f"{source}: arrays" if source else "inputs")
    batch = specs[0].shape[0] if specs and specs[0].shape and isinstance(specs[0].shape[0], str) else None
    named = _NamedSizes(source, batch, dims or {}, free, check_batch_range)
    for spec in specs:
        value = arrays[spec.name]
        prefix = f"{source}: input {spec.name!r}" if source else f"input {spec.name!r}"
        if not isinstance(value, (np.ndarray, torch.Tensor)):
            raise InputError(f"{prefix}: expected a NumPy array or torch tensor, {got} {type(value).__name__}")
        _check_dtype(value, spec, prefix, got, exact=exact_dtype)
        shape = tuple(value.shape)
        if len(shape) != len(spec.shape):
            raise InputError(f"{prefix}: expected rank {len(spec.shape)} {_shape_text(spec)}, {got} shape {shape}")
        for axis, (want, size) in enumerate(zip(spec.shape, shape, strict=True)):
            if not isinstance(want, int):
                named.add(want, size, spec.name, axis, prefix)
            elif size != want:
                raise InputError(
                    f"{prefix}: expected size {want} on axis {axis} {_shape_text(spec)}, {got} shape {shape}"
                )
        if 0 in shape:
            raise InputError(f"{prefix}: expected every size to be at least 1, {got} shape {shape}")
        _check_values(value, spec, prefix)
    return named.sizes


def _check_dtype(value: Any, spec: TensorSpec, prefix: str, got: str, *, exact: bool) -> None:
    """The spec's dtype; from a file (NumPy, not ``exact``) also a narrower type of the same kind."""
    found = dtype_name(value)
    if found == spec.dtype:
        return
    if exact or isinstance(value, torch.Tensor):
        raise InputError(f"{prefix}: expected dtype {spec.dtype}, {got} {found}")
    if not castable(value.dtype, numpy_dtype(spec.dtype)):
        raise InputError(
            f"{prefix}: expected dtype {spec.dtype} (or a narrower type of the same kind), found {found}; "
            f"convert it with .astype(np.{spec.dtype}) if that is what you mean"
        )


@dataclass
class _NamedSizes:
    """Each named dimension's size as the inputs give it: the same in every input and, given its ``Dim``,
    inside its range (the batch only with ``check_batch_range``; never the ``free`` ones)."""

    source: str | None  # a file's name, or None for an engine's feeds
    batch: str | None
    dims: Mapping[str, Dim]
    free: tuple[str, ...]
    check_batch_range: bool
    sizes: dict[str, int] = field(default_factory=dict)
    first_input: dict[str, str] = field(default_factory=dict)  # the input that gave each size first

    def add(self, want: str, size: int, name: str, axis: int, prefix: str) -> None:
        got = "found" if self.source else "got"
        if self.sizes.setdefault(want, size) != size:
            if not self.source:
                raise InputError(
                    f"inputs disagree on dimension {want!r}: {self.sizes[want]} and {size} (input {name!r})"
                )
            what = "sample counts" if want == self.batch else f"dimension {want!r}"
            raise InputError(
                f"{self.source}: {what} differ: {self.first_input[want]!r} has {self.sizes[want]}, {name!r} has {size}"
            )
        self.first_input.setdefault(want, name)
        limits = self.dims.get(want)
        in_range = want not in self.free and (self.check_batch_range or want != self.batch)
        if in_range and limits is not None and not limits.min <= size <= limits.max:
            raise InputError(
                f"{prefix}: dimension {want!r} (axis {axis}) must be in [{limits.min}, {limits.max}] "
                f"for this artifact, {got} {size}"
            )


def _check_values(value: Any, spec: TensorSpec, prefix: str) -> None:
    """Token ids inside ``[low, high)``; masks of 0 and 1 with at least one 1 per row."""
    if spec.kind == "ids" and (spec.low is not None or spec.high is not None):
        low, high = _min_max(value)
        if (spec.low is not None and low < spec.low) or (spec.high is not None and high >= spec.high):
            bad = low if spec.low is not None and low < spec.low else high
            what = "class" if spec.name == "labels" else "token id"  # labels index the classes (labels_spec)
            raise InputError(
                f"{prefix}: {what} {bad} is outside the valid range [{spec.low}, {spec.high}) of this model"
            )
    elif spec.kind == "mask":
        low, high = _min_max(value)
        if low < 0 or high > 1:
            raise InputError(f"{prefix}: expected an attention mask of 0 and 1, found values in [{low}, {high}]")
        rows = value.reshape(-1, value.shape[-1]) if value.ndim >= 2 else value.reshape(1, -1)
        empty = _first_empty_row(rows)
        if empty is not None:
            raise InputError(
                f"{prefix}: row {empty} of the attention mask is all 0; every sample needs at least one token "
                "(an all-padding sample has no defined output)"
            )


def _min_max(value: Any) -> tuple[int, int]:
    if isinstance(value, torch.Tensor):
        return int(value.min()), int(value.max())
    return int(value.min()), int(value.max())


def _first_empty_row(rows: Any) -> int | None:
    if isinstance(rows, torch.Tensor):
        empty = ~(rows != 0).any(dim=-1)
        return int(empty.nonzero()[0, 0]) if bool(empty.any()) else None
    step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[-1]))
    for start in range(0, rows.shape[0], step):
        empty = ~np.any(rows[start : start + step] != 0, axis=-1)
        if empty.any():
            return start + int(np.argmax(empty))
    return None


def _shape_text(spec: TensorSpec) -> str:
    return "(" + ", ".join(str(d) for d in spec.shape) + ")"


def file_samples(arrays: Mapping[str, np.ndarray], specs: list[TensorSpec], **kwargs: Any) -> int:
    """``check_arrays`` for a whole file of samples: the number of samples (at least one)."""
    sizes = check_arrays(arrays, specs, **kwargs)
    batch = sample_dim(specs)
    return sizes[batch]


def read_inputs(path: str | Path, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Read every sample of every input from ``path`` (``.npz``, ``.npy`` or a directory of ``.npy``).

    Arrays come back in the specs' dtypes; ``.npy`` files whose dtype already matches stay
    memory-mapped (read-only). Raises ``UsageError`` for an unreadable, truncated or pickled file
    and ``InputError`` for arrays that do not fit the specs.
    """
    path = Path(path)
    if path.is_dir():
        arrays = {}
        for p in sorted(path.glob("*.npy")):
            if p.is_symlink():
                raise UsageError(f"{p}: a symbolic link; the arrays of an input directory must be regular files in it")
            require_regular_file(p, "a .npy file")
            arrays[p.stem] = _load_npy(p)
        if not arrays:
            raise UsageError(
                f"{path}: expected a .npz or .npy file, or a directory of <input>.npy files; found no .npy file"
            )
    else:
        magic = _magic(path)
        if magic.startswith(NPY_MAGIC):
            if len(specs) != 1:
                names = ", ".join(s.name for s in specs)
                raise InputError(
                    f"{path}: a .npy file holds one array, this model takes {len(specs)} inputs ({names}); "
                    "save them with np.savez(path, name=array, ...) or as a directory of <name>.npy files"
                )
            arrays = {specs[0].name: _load_npy(path)}
        elif magic.startswith(ZIP_MAGIC):
            arrays = load_npz(path)
        elif magic.startswith(EMPTY_ZIP_MAGIC):  # what np.savez(path) with no arrays writes
            raise UsageError(f"{path}: expected an .npz holding the model's inputs, found an .npz with no arrays")
        else:
            found = "an empty file" if not magic else f"a file starting with {magic[:8]!r}"
            raise UsageError(f"{path}: expected a NumPy .npz or .npy file, found {found}")
    check_arrays(arrays, specs, source=str(path))  # a decoder's step has inputs without the batch (cache_position)
    return {s.name: _as_dtype(arrays[s.name], numpy_dtype(s.dtype)) for s in specs}


def random_inputs(
    specs: list[TensorSpec],
    dims: dict[str, Dim],
    samples: int,
    *,
    seed: int = 0,
    sizes: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """``samples`` valid random samples (token ids in range, right-padded masks).

    Dimensions other than the batch take their size from ``sizes``, default: their opt size.
    """
    if samples < 1:
        raise UsageError(f"--random: expected at least 1 sample, got {samples}")
    chosen = {name: dim.opt for name, dim in dims.items()} | (sizes or {}) | {sample_dim(specs): samples}
    unknown = sorted({d for s in specs for d in s.dim_names} - set(chosen))
    if unknown:
        raise UsageError(f"random inputs: no size for dimension(s) {', '.join(unknown)}; give them in sizes")
    return random_feeds(specs, chosen, seed=seed)


def _magic(path: Path) -> bytes:
    require_regular_file(path, "a .npz or .npy file of inputs")
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except FileNotFoundError as exc:
        raise UsageError(f"{path}: no such file; expected a .npz or .npy file of inputs") from exc
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from exc


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        if "object" in str(exc).lower() or "pickle" in str(exc).lower():
            raise UsageError(
                f"{path}: holds Python objects; tk never unpickles input files: save numeric arrays"
            ) from exc
        raise UsageError(f"{path}: truncated or damaged .npy file ({exc})") from exc
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it as .npy ({exc})") from exc


def _npz_declared_bytes(archive: Any, path: Path) -> int:
    """Bytes the arrays of an open ``.npz`` declare in their headers, read before any is decompressed."""
    total = 0
    for info in archive.zip.infolist():
        with archive.zip.open(info) as member:
            try:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(member, max_header_size=1 << 16)
            except (ValueError, EOFError) as exc:
                raise UsageError(f"{path}: array {info.filename!r} has a damaged header ({first_line(exc)})") from exc
        if dtype.hasobject:
            raise UsageError(
                f"{path}: array {info.filename.removesuffix('.npy')!r} holds Python objects; tk never unpickles input "
                "files: save numeric arrays"
            )
        total += math.prod(shape) * dtype.itemsize
    return total


def load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path``, never unpickled, within the memory budget (``UsageError`` if damaged)."""
    arrays: dict[str, np.ndarray] = {}
    try:
        with np.load(path, allow_pickle=False) as archive:
            require_within_budget(_npz_declared_bytes(archive, path), f"{path} (the sizes its arrays declare)")
            for key in archive.files:
                try:
                    arrays[key] = archive[key]
                except ValueError as exc:
                    if "allow_pickle" in str(exc) or "object" in str(exc).lower():
                        raise UsageError(
                            f"{path}: array {key!r} holds Python objects; tk never unpickles input files: "
                            "save numeric arrays"
                        ) from exc
                    raise UsageError(f"{path}: array {key!r} is truncated or damaged ({exc})") from exc
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise UsageError(f"{path}: truncated or damaged .npz file ({exc})") from exc
    except (ValueError, TypeError, AttributeError) as exc:  # not a zip: numpy read it as .npy or as a pickle it refused
        raise UsageError(
            f"{path}: expected an .npz archive of arrays, found something else ({first_line(exc)})"
        ) from exc
    return arrays


def _as_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return array if array.dtype == dtype else array.astype(dtype)
