"""The few types every stage shares: named dimensions, tensor specs, and valid random inputs.

A ``Dim`` is the one source of truth for a dynamic dimension: it becomes a ``torch.export.Dim``,
an ONNX dynamic axis and a TensorRT optimization profile. A ``TensorSpec`` names an input or
output, its dtype, its shape (ints and dimension names) and, for integer inputs, which values
are valid, so random inputs made from specs are always inputs the model accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tk.errors import UsageError
from tk.limits import require_within_budget

CHUNK_ELEMENTS = 1 << 22  # elements per slice when scanning a (possibly memory-mapped) array
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool")


def dim_flag(name: str, sizes: str | None = None) -> str:
    """The option that sets dimension ``name`` (``--batch`` and ``--seq`` have their own, the rest ``--dim
    NAME``), with ``sizes`` (``MIN:OPT:MAX``) as the user would type it: ``--seq 1:8:64``, ``--dim x=1:8:64``."""
    own = name in ("batch", "seq")
    flag = f"--{name}" if own else f"--dim {name}"
    return flag if sizes is None else f"{flag}{' ' if own else '='}{sizes}"


@dataclass(frozen=True)
class Dim:
    """A named dynamic dimension with the smallest, typical and largest size it takes."""

    name: str
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise UsageError(
                f"dimension {self.name!r}: expected 1 <= min <= opt <= max, got {self.min}:{self.opt}:{self.max}"
            )

    @classmethod
    def parse(cls, name: str, text: str) -> Dim:
        """Parse ``min:opt:max`` (or a single size, which makes the dimension static)."""
        parts = text.split(":")
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            sizes = []
        if len(sizes) == 1:
            sizes = sizes * 3
        if len(sizes) != 3:
            raise UsageError(f"{dim_flag(name)}: expected MIN:OPT:MAX or one size, such as 1:8:64; got {text!r}")
        return cls(name, *sizes)

    @property
    def static(self) -> bool:
        return self.min == self.max

    def sizes_to_check(self) -> list[int]:
        """min, opt, max and an odd size inside the range, without repeats, in order."""
        odd = self.min + (self.max - self.min) // 3
        odd = odd if odd % 2 else odd + 1
        odd = min(max(odd, self.min), self.max)
        return sorted({self.min, self.opt, self.max, odd})


@dataclass(frozen=True)
class TensorSpec:
    """An input or output: its name, dtype and shape; for integer inputs the valid values.

    ``shape`` holds ints for fixed sizes and dimension names for dynamic ones, e.g.
    ``("batch", "seq")``. ``low``/``high`` bound integer values as ``[low, high)``;
    ``kind`` is ``"data"``, ``"ids"`` (token ids), ``"mask"`` (an attention mask of 0/1
    with padding on the right and at least one 1 per row) or ``"slots"`` (consecutive cache slots in
    ``[low, high)``: a decoder's ``cache_position``).
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    kind: str = "data"
    low: int | None = None
    high: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"input {self.name!r}: expected a dtype in {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))

    def concrete_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorSpec:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass
class Signature:
    """Inputs, outputs and the dynamic dimensions they share."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    dims: dict[str, Dim] = field(default_factory=dict)

    def opt_sizes(self) -> dict[str, int]:
        return {name: dim.opt for name, dim in self.dims.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "dims": {n: asdict(d) for n, d in self.dims.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Signature:
        return cls(
            inputs=[TensorSpec.from_json(s) for s in data["inputs"]],
            outputs=[TensorSpec.from_json(s) for s in data["outputs"]],
            dims={n: Dim(**d) for n, d in data["dims"].items()},
        )


def require_names(expected: list[str], got: list[str], what: str) -> None:
    """Raise ``InputError`` naming the missing and unexpected names when ``got`` differs from ``expected``."""
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    if missing or extra:
        from tk.errors import InputError

        raise InputError(
            f"{what}: expected {expected}, got {got}"
            + (f" (missing {missing})" if missing else "")
            + (f" (unexpected {extra})" if extra else "")
        )


def numpy_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def random_array(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One valid random array for ``spec`` at ``shape``."""
    if spec.kind == "mask":
        if len(shape) < 2:
            return np.ones(shape, dtype=numpy_dtype(spec.dtype))
        lengths = rng.integers(1, shape[-1] + 1, size=shape[:-1])
        lengths.reshape(-1)[0] = shape[-1]  # one full row, so padding never shortens the batch
        positions = np.arange(shape[-1])
        return (positions < lengths[..., None]).astype(numpy_dtype(spec.dtype))
    if spec.kind == "slots" and len(shape) == 1:
        low, high = spec.low or 0, spec.high if spec.high is not None else shape[0]
        start = int(rng.integers(low, max(low, high - shape[0]) + 1))
        return np.arange(start, start + shape[0]).astype(numpy_dtype(spec.dtype))
    if spec.dtype in ("int64", "int32"):
        low = 0 if spec.low is None else spec.low
        high = 100 if spec.high is None else spec.high
        return rng.integers(low, high, size=shape).astype(spec.dtype)
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(numpy_dtype(spec.dtype))


def feeds_nbytes(inputs: list[TensorSpec], sizes: dict[str, int]) -> int:
    """Bytes that inputs of ``inputs`` take at ``sizes`` (every size checked to be at least 1)."""
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise UsageError(f"dimension {name!r}: expected a size of at least 1, got {size!r}")
    return sum(math.prod(s.concrete_shape(sizes)) * numpy_dtype(s.dtype).itemsize for s in inputs)


def random_feeds(inputs: list[TensorSpec], sizes: dict[str, int], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Valid random inputs for every spec, with dynamic dimensions set by ``sizes`` (within the memory budget)."""
    require_within_budget(feeds_nbytes(inputs, sizes), f"inputs at sizes {sizes}")
    rng = np.random.default_rng(seed)
    return {s.name: random_array(s, s.concrete_shape(sizes), rng) for s in inputs}


def batch_dim(inputs: list[TensorSpec]) -> str | None:
    """The batch dimension's name: axis 0 of the first input whose axis 0 is named (None: every batch is static)."""
    return next((s.shape[0] for s in inputs if s.shape and isinstance(s.shape[0], str)), None)


def fitted_samples(
    samples: Mapping[str, np.ndarray], inputs: list[TensorSpec], sizes: dict[str, int], *, seed: int = 0
) -> dict[str, np.ndarray] | None:
    """The user's ``samples`` (axis 0: samples) fitted to ``sizes``, or None where they cannot be.

    The batch holds ``sizes`` of the batch dimension samples, taken in turn from sample ``seed *
    batch`` (wrapping around), so different seeds see different samples. A dimension that a mask input
    spans (a sequence) is right-padded with zeros, which the mask marks as not attended (as a tokenizer
    pads a short text in a long batch), or cut: each sample keeps the window that starts at its first
    attended position (0 for right-padded samples), or its last positions where fewer remain, so a
    left-padded sample keeps its tokens rather than its padding. Any other dimension must already
    have the size asked for (an image is not resized): None where it does not, or where an input is
    missing from ``samples``.
    """
    batch = batch_dim(inputs)
    masks = {d: s for s in inputs if s.kind == "mask" for d in s.shape[1:] if isinstance(d, str)}
    chosen: dict[str, np.ndarray] = {}
    for spec in inputs:
        array = samples.get(spec.name)
        if array is None or not spec.shape or array.ndim != len(spec.shape) or array.shape[0] < 1:
            return None
        if spec.shape[0] == batch:
            want = sizes[batch]
            array = np.take(array, np.arange(seed * want, (seed + 1) * want) % array.shape[0], axis=0)
        chosen[spec.name] = array
    starts = {d: _window_starts(chosen[m.name], m.shape.index(d), sizes[d]) for d, m in masks.items()}
    fitted: dict[str, np.ndarray] = {}
    for spec in inputs:
        array = chosen[spec.name]
        for axis, dim in enumerate(spec.shape):
            want = sizes[dim] if isinstance(dim, str) else dim
            have = array.shape[axis]
            if (dim == batch and axis == 0) or have == want:
                continue
            if dim not in masks:
                return None
            if have > want:
                start = starts[dim]
                if start is None or start.shape[0] != array.shape[0]:
                    return None  # an input whose batch is not the mask's (static, or no batch dimension)
                window = [
                    np.take(row, np.arange(s, s + want), axis=axis - 1) for row, s in zip(array, start, strict=True)
                ]
                array = np.stack(window)
            else:
                pad = [(0, 0)] * array.ndim
                pad[axis] = (0, want - have)
                array = np.pad(array, pad)
        fitted[spec.name] = np.ascontiguousarray(array.astype(numpy_dtype(spec.dtype), copy=False))
    return fitted


def _window_starts(mask: np.ndarray, axis: int, want: int) -> np.ndarray | None:
    """Per sample of ``mask`` (axis 0), where a window of ``want`` positions along ``axis`` starts: at the
    first attended position, moved back so that the window fits (None: the axis is not longer than that)."""
    length = mask.shape[axis]
    if length <= want:
        return None
    attended = np.moveaxis(mask != 0, axis, -1).reshape(mask.shape[0], -1, length).any(axis=1)
    first = np.where(attended.any(axis=1), attended.argmax(axis=1), 0)
    return np.minimum(first, length - want)


_INPUT_RE = re.compile(
    r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*):(?P<dtype>[a-z0-9]+):(?P<shape>\d+(?:x\d+)*)(?::(?P<range>\d+-\d+))?$"
)


def parse_input_description(
    text: str, dim_names: tuple[str, ...] = ("batch", "seq")
) -> tuple[TensorSpec, tuple[int, ...]]:
    """Parse ``name:dtype:SHAPE[:LOW-HIGH]`` such as ``input_ids:int64:2x128:0-30522``.

    The first axis is the dynamic ``batch`` dimension, the second (for integer inputs of rank 2)
    the dynamic ``seq`` dimension; the other sizes are fixed. The example sizes become the
    dimensions' typical (opt) sizes.
    """
    match = _INPUT_RE.match(text.strip())
    if not match:
        raise UsageError(
            f"--input: expected NAME:DTYPE:SHAPE[:LOW-HIGH] such as input_ids:int64:2x128:0-1000, got {text!r}"
        )
    dtype = match["dtype"]
    if dtype not in DTYPES:
        raise UsageError(f"--input {text!r}: expected a dtype in {', '.join(DTYPES)}, got {dtype!r}")
    sizes = [int(s) for s in match["shape"].split("x")]
    if any(s < 1 for s in sizes):
        raise UsageError(f"--input {text!r}: expected sizes of at least 1, got {match['shape']!r}")
    shape: list[int | str] = list(sizes)
    shape[0] = dim_names[0]
    if dtype in ("int64", "int32") and len(sizes) == 2:
        shape[1] = dim_names[1]
    low = high = None
    if match["range"]:
        low, high = (int(v) for v in match["range"].split("-"))
        if high <= low:
            raise UsageError(f"--input {text!r}: expected LOW-HIGH with LOW < HIGH, got {match['range']!r}")
    kind = "mask" if "mask" in match["name"] and dtype in ("int64", "int32", "bool") else "data"
    if kind == "data" and dtype in ("int64", "int32"):
        kind = "ids"
    return TensorSpec(match["name"], dtype, tuple(shape), kind=kind, low=low, high=high), tuple(sizes)


def shapes_to_check(dims: dict[str, Dim]) -> list[dict[str, int]]:
    """All-min, all-opt, an odd size of each, then each dimension at its max with the others at opt.

    Every bound is exercised without running every dimension at its max at once (batch 64 x
    sequence 512 would dominate the check's time and prove nothing more).
    """
    opt = {name: dim.opt for name, dim in dims.items()}
    candidates = [{name: dim.min for name, dim in dims.items()}, opt]
    candidates.append({name: _odd_inside(dim) for name, dim in dims.items()})
    candidates += [{**opt, name: dim.max} for name, dim in dims.items()]
    shapes: list[dict[str, int]] = []
    for sizes in candidates:
        if sizes not in shapes:
            shapes.append(sizes)
    return shapes


def _odd_inside(dim: Dim) -> int:
    inside = [s for s in dim.sizes_to_check() if s not in (dim.min, dim.opt, dim.max)]
    return inside[0] if inside else dim.opt


def count_nonfinite(arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
    """NaN and Inf values per floating-point array (other arrays are left out), read in slices."""
    counts: dict[str, int] = {}
    for name, array in arrays.items():
        if not _is_float(array.dtype):
            continue
        rows = array.reshape(array.shape[0], math.prod(array.shape[1:])) if array.ndim else array.reshape(1, 1)
        step = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
        total = 0
        for start in range(0, rows.shape[0], step):
            chunk = rows[start : start + step]
            total += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
        counts[name] = total
    return counts


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"
