"""The contract every engine keeps: specs, input checks, NumPy/torch in and out, and release.

Subclasses implement ``_load`` (open the session, load the program) and ``_run`` (one call of
the backend on feeds of its native kind). Loading happens on first use, not in ``__init__``.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from tk.errors import InputError
from tk.manifest import Manifest
from tk.spec import Dim, TensorSpec, require_names

Array = np.ndarray | torch.Tensor

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def dtype_name(array: Array) -> str:
    if isinstance(array, torch.Tensor):
        return _TORCH_NAMES.get(array.dtype) or str(array.dtype).removeprefix("torch.")
    return _numpy_dtype_name(array.dtype)


@functools.cache
def _numpy_dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # NumPy builds the name in Python on every access (4 us, twice per input per call)


class Engine(ABC):
    """One loaded artifact that runs feeds; use it as a context manager to release it."""

    name: ClassVar[str]
    native: ClassVar[str] = "torch"  # the kind of arrays ``_run`` takes and returns: torch or numpy

    def __init__(self, root: str | Path, manifest: Manifest, *, device: str = "cpu", **options: Any) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.device = device
        self.options = options
        self._loaded = False
        self._load_lock = threading.Lock()

    # -- what subclasses provide -------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        """Why this engine cannot run here (a missing package, no GPU), or None if it can."""
        return None

    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- the public contract -----------------------------------------------------------------
    @property
    def inputs(self) -> list[TensorSpec]:
        return self.manifest.signature.inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.manifest.signature.outputs

    @property
    def dims(self) -> dict[str, Dim]:
        return self.manifest.signature.dims

    def load(self) -> Engine:
        if not self._loaded:
            with self._load_lock:
                if not self._loaded:
                    self._load()
                    self._loaded = True
        return self

    def run(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        """Run one batch. NumPy in gives NumPy out; torch in gives torch out."""
        self.check_feeds(feeds)
        if not self._loaded:
            self.load()
        as_torch = isinstance(next(iter(feeds.values())), torch.Tensor) if feeds else False
        native = {name: self._to_native(value) for name, value in feeds.items()}
        outputs = self._run(native)
        return {name: _convert(value, as_torch) for name, value in outputs.items()}

    def settings(self) -> dict[str, Any]:
        """The settings this engine runs with (recorded in benchmark JSON); subclasses add theirs."""
        return {"device": self.device, "torch_threads": torch.get_num_threads(), **self.options}

    def close(self) -> None:
        if self._loaded:
            self._close()
            self._loaded = False

    def __enter__(self) -> Engine:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- input checks --------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Array]) -> dict[str, int]:
        """Check names, dtypes, ranks and sizes against the specs; return the dimension sizes."""
        require_names([s.name for s in self.inputs], list(feeds), "inputs")
        sizes: dict[str, int] = {}
        for spec in self.inputs:
            value = feeds[spec.name]
            if not isinstance(value, (np.ndarray, torch.Tensor)):
                raise InputError(
                    f"input {spec.name!r}: expected a NumPy array or torch tensor, got {type(value).__name__}"
                )
            got_dtype = dtype_name(value)
            if got_dtype != spec.dtype:
                raise InputError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {got_dtype}")
            shape = tuple(value.shape)
            if len(shape) != len(spec.shape):
                raise InputError(
                    f"input {spec.name!r}: expected rank {len(spec.shape)} {_shape_text(spec)}, got shape {shape}"
                )
            for axis, (want, got) in enumerate(zip(spec.shape, shape, strict=True)):
                if isinstance(want, int):
                    if got != want:
                        raise InputError(
                            f"input {spec.name!r}: expected size {want} on axis {axis} {_shape_text(spec)}, got shape {shape}"
                        )
                    continue
                dim = self.dims.get(want)
                if dim is not None and not dim.min <= got <= dim.max:
                    raise InputError(
                        f"input {spec.name!r}: dimension {want!r} (axis {axis}) must be in [{dim.min}, {dim.max}] "
                        f"for this artifact, got {got}"
                    )
                if sizes.setdefault(want, got) != got:
                    raise InputError(
                        f"inputs disagree on dimension {want!r}: {sizes[want]} and {got} (input {spec.name!r})"
                    )
        return sizes

    def _to_native(self, value: Array) -> Any:
        if self.native == "numpy":
            return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r}, device={self.device!r})"


def rebuild_command(manifest: Manifest, fmt: str, device: str) -> str:
    """The ``tk export`` command that writes ``fmt`` for ``device`` from the same model."""
    model = manifest.model
    size = f" --size {model['size']}" if model.get("size") else ""
    inputs = "".join(f" --input {d}" for d in model.get("input_descriptions") or ())
    return f"tk export {model['name']}{size}{inputs} --format {fmt} --device {device}"


def _shape_text(spec: TensorSpec) -> str:
    return "(" + ", ".join(str(d) for d in spec.shape) + ")"


def _convert(value: Any, as_torch: bool) -> Array:
    if as_torch:
        return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.cpu().numpy()
    return value
