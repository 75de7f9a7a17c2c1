"""A user's own model, given as ``package.module:callable``.

The callable takes no arguments and returns either an ``nn.Module`` (then the inputs are
described on the command line with ``--input``) or a ``UserModel`` with example inputs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tk.errors import UsageError, first_line
from tk.models.base import ModelSpec, import_callable
from tk.spec import Dim, Signature, TensorSpec, parse_input_description

DEFAULT_MAX = {"batch": 64}  # largest size of a user model's dynamic dimension, by name
FALLBACK_MAX = 512


@dataclass
class UserModel:
    """What a user's callable may return instead of a bare module."""

    module: nn.Module
    example_inputs: dict[str, torch.Tensor]  # in the order of forward's positional arguments
    dynamic_dims: dict[str, dict[int, str]] | None = None  # input -> {axis: dimension name}; default: axis 0 is "batch"
    output_names: list[str] | None = None  # default: output, or output_0, output_1, ...


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _specs_from_examples(model: UserModel) -> tuple[list[TensorSpec], dict[str, Dim]]:
    specs: list[TensorSpec] = []
    sizes: dict[str, int] = {}
    examples = model.example_inputs
    if (
        not isinstance(examples, dict)
        or not examples
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in examples.items())
    ):
        raise UsageError(
            f"UserModel.example_inputs: expected a dict of input name -> torch.Tensor, got {type(examples).__name__}"
        )
    dynamic = model.dynamic_dims or {}
    if not isinstance(dynamic, dict) or not set(dynamic) <= set(examples):
        raise UsageError(
            f"UserModel.dynamic_dims: expected a dict keyed by input names {list(examples)}, got {dynamic!r}"
        )
    for name, tensor in examples.items():
        axes = dynamic.get(name, {0: "batch"} if tensor.dim() else {})
        if not isinstance(axes, dict):
            raise UsageError(f"UserModel.dynamic_dims[{name!r}]: expected {{axis: dimension name}}, got {axes!r}")
        for axis, dim_name in axes.items():
            if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < tensor.dim():
                raise UsageError(
                    f"UserModel.dynamic_dims[{name!r}]: axis {axis!r} is not an axis of the example of shape "
                    f"{tuple(tensor.shape)} (expected 0 to {tensor.dim() - 1})"
                )
            if not isinstance(dim_name, str) or not dim_name:
                raise UsageError(
                    f"UserModel.dynamic_dims[{name!r}][{axis}]: expected a dimension name, got {dim_name!r}"
                )
        shape: list[int | str] = list(tensor.shape)
        for axis, dim_name in axes.items():
            shape[axis] = dim_name
            if sizes.setdefault(dim_name, tensor.shape[axis]) != tensor.shape[axis]:
                raise UsageError(
                    f"dimension {dim_name!r} has two example sizes: {sizes[dim_name]} and {tensor.shape[axis]}"
                )
        dtype = _dtype_name(tensor)
        kind = "mask" if dtype in ("int64", "int32") and "mask" in name else "data"
        low = high = None
        if dtype in ("int64", "int32") and kind == "data" and tensor.numel():
            # random integer inputs stay inside what the example shows; not enforced on real inputs
            # (kind "data"): describe the input with --input NAME:DTYPE:SHAPE:LOW-HIGH for a checked range
            low, high = 0, int(tensor.max()) + 1
        specs.append(TensorSpec(name, dtype, tuple(shape), kind=kind, low=low, high=high))
    return specs, _dims(sizes)


def _dims(example_sizes: dict[str, int]) -> dict[str, Dim]:
    dims = {}
    for name, size in example_sizes.items():
        top = max(DEFAULT_MAX.get(name, FALLBACK_MAX), size)
        dims[name] = Dim(name, 1, size, top)
    return dims


def _output_specs(
    module: nn.Module, examples: tuple[torch.Tensor, ...], names: list[str] | None, batch: int | None
) -> list[TensorSpec]:
    module.eval()
    with torch.no_grad():
        out = module(*examples)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise UsageError("user model: expected forward to return a tensor or a tuple of tensors")
    if names is None:
        names = ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]
    specs = []
    for name, o in zip(names, outs, strict=True):
        shape: list[int | str] = list(o.shape)
        if shape and batch is not None and shape[0] == batch:
            shape[0] = "batch"
        specs.append(TensorSpec(name, _dtype_name(o), tuple(shape)))
    return specs


@contextlib.contextmanager
def _working_directory_importable() -> Iterator[None]:
    """The working directory on ``sys.path`` while the user's module is imported, then removed.

    It goes last, so the user's own files are importable (as under ``python -m``) but a stray
    file of the working directory never shadows an installed package (``./onnxruntime.py``).
    """
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def build_user_model(path: str, input_descriptions: tuple[str, ...] = ()) -> ModelSpec:
    with _working_directory_importable():
        factory = import_callable(path)
    try:
        made = factory()
    except (Exception, SystemExit) as exc:  # the user's code can fail (or exit) in any way
        raise UsageError(f"model {path!r}: calling it failed: {type(exc).__name__}: {first_line(exc)}") from exc
    if isinstance(made, UserModel) and not input_descriptions:
        inputs, dims = _specs_from_examples(made)
        module, names = made.module, made.output_names
    elif isinstance(made, (nn.Module, UserModel)):
        module = made.module if isinstance(made, UserModel) else made
        names = made.output_names if isinstance(made, UserModel) else None
        if not input_descriptions:
            raise UsageError(
                f"model {path!r} gives no example inputs: describe each with --input NAME:DTYPE:SHAPE, "
                "such as --input x:float32:2x16"
            )
        parsed = [parse_input_description(d) for d in input_descriptions]
        inputs = [spec for spec, _ in parsed]
        sizes: dict[str, int] = {}
        for spec, example in parsed:
            for axis, dim in enumerate(spec.shape):
                if isinstance(dim, str):
                    sizes.setdefault(dim, example[axis])
        dims = _dims(sizes)
    else:
        raise UsageError(f"model {path!r}: expected an nn.Module or tk.models.UserModel, got {type(made).__name__}")
    signature = Signature(inputs, [], dims)
    spec = ModelSpec(path, None, {}, module, signature, input_descriptions=tuple(input_descriptions))
    batch = dims["batch"].opt if "batch" in dims else None
    try:
        signature.outputs = _output_specs(module, spec.example_inputs(), names, batch)
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:  # the user's forward can fail (or exit) in any way
        raise UsageError(
            f"model {path!r}: forward failed on the described inputs: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return spec
