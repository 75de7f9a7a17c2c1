"""A user's own model, given as ``package.module:callable``.

The callable takes no arguments and returns either an ``nn.Module`` (then the inputs are
described on the command line with ``--input``) or a ``UserModel`` with example inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    # default: output, or output_0, output_1, ...; for a forward that returns a dict, a ModelOutput or a
    # dataclass, its tensor fields by name (these names pick and order them)
    output_names: list[str] | None = None
    max_sizes: dict[str, int] | None = (
        None  # dimension -> the largest size the model takes; default: seq from a position table
    )


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _specs_from_examples(model: UserModel, limits: dict[str, int]) -> tuple[list[TensorSpec], dict[str, Dim]]:
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
    return specs, _dims(sizes, limits)


def _dims(example_sizes: dict[str, int], limits: dict[str, int] | None = None) -> dict[str, Dim]:
    dims = {}
    for name, size in example_sizes.items():
        top = max(DEFAULT_MAX.get(name, FALLBACK_MAX), size)
        if limits and name in limits:
            top = max(min(top, limits[name]), size)
        dims[name] = Dim(name, 1, size, top)
    return dims


def position_limits(module: nn.Module) -> dict[str, int]:
    """``{"seq": rows}`` where the module has a learned position table (an ``nn.Embedding`` named like
    ``pos_emb``, ``position_embeddings`` or GPT-2's ``wpe``): a longer sequence indexes past it."""
    for name, sub in module.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(sub, nn.Embedding) and ("pos" in last or last == "wpe"):
            reserved = sub.padding_idx + 1 if sub.padding_idx is not None else 0
            return {"seq": sub.num_embeddings - reserved}
    return {}


def named_fields(out: Any) -> dict[str, Any] | None:
    """The fields of a forward's dict, ``ModelOutput`` (a dict too) or dataclass result; None for anything else."""
    if isinstance(out, Mapping):
        return dict(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return None


def _as_tuple_hook(keys: list[str]) -> Any:
    """A forward hook returning the fields ``keys`` of the module's named result as a tuple: the graph a
    static format holds has positional outputs, and the eager reference must return the same."""

    def hook(_module: nn.Module, _args: Any, out: Any) -> tuple[torch.Tensor, ...]:
        fields = named_fields(out)
        return tuple(fields[k] for k in keys) if fields is not None else out

    return hook


def _tensor_outputs(
    module: nn.Module, out: Any, names: list[str] | None
) -> tuple[list[torch.Tensor], list[str] | None]:
    """The forward's result as tensors, and their names; a named result makes the module return a tuple of
    the chosen fields from now on (a forward hook, so its weights keep their names)."""
    fields = named_fields(out)
    if fields is None:
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            got = type(out).__name__ if not isinstance(out, (tuple, list)) else f"a sequence holding {_kinds(outs)}"
            raise UsageError(
                f"user model: expected forward to return a tensor, a tuple of tensors, or a dict, ModelOutput or "
                f"dataclass of tensors (outputs named by their keys), found {got}"
            )
        return outs, names
    tensors = [k for k, v in fields.items() if isinstance(v, torch.Tensor)]
    keys = list(names) if names is not None else tensors
    unknown = [k for k in keys if k not in tensors]
    if unknown or not keys:
        raise UsageError(
            f"user model: forward returns a {type(out).__name__} whose tensor fields are {', '.join(tensors) or 'none'}; "
            f"output_names asks for {', '.join(unknown) or 'none'}: name outputs among its tensor fields"
        )
    module.register_forward_hook(_as_tuple_hook(keys))
    return [fields[k] for k in keys], keys


def _kinds(values: list[Any]) -> str:
    return ", ".join(sorted({type(v).__name__ for v in values}))


def _output_specs(
    module: nn.Module, examples: tuple[torch.Tensor, ...], names: list[str] | None, batch: int | None
) -> list[TensorSpec]:
    module.eval()
    with torch.no_grad():
        out = module(*examples)
    outs, names = _tensor_outputs(module, out, names)
    if names is None:
        names = ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]
    if len(names) != len(outs):
        raise UsageError(f"user model: output_names has {len(names)} names, forward returns {len(outs)} outputs")
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
    path = _module_path(path)
    with _working_directory_importable():
        factory = import_callable(path)
    try:
        made = factory()
    except (Exception, SystemExit) as exc:  # the user's code can fail (or exit) in any way
        raise UsageError(f"model {path!r}: calling it failed: {type(exc).__name__}: {first_line(exc)}") from exc
    if not isinstance(made, (nn.Module, UserModel)):
        raise UsageError(f"model {path!r}: expected an nn.Module or tk.models.UserModel, got {type(made).__name__}")
    module = made.module if isinstance(made, UserModel) else made
    names = made.output_names if isinstance(made, UserModel) else None
    limits = _declared_limits(made) or position_limits(module)
    if isinstance(made, UserModel) and not input_descriptions:
        inputs, dims = _specs_from_examples(made, limits)
    else:
        inputs, dims = _specs_from_descriptions(path, input_descriptions, limits)
    signature = Signature(inputs, [], dims)
    spec = ModelSpec(path, None, {}, module, signature, input_descriptions=tuple(input_descriptions),
                     max_sizes={n: v for n, v in limits.items() if n in dims})  # fmt: skip
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


def _specs_from_descriptions(path: str, descriptions: tuple[str, ...], limits: dict[str, int]
                             ) -> tuple[list[TensorSpec], dict[str, Dim]]:  # fmt: skip
    if not descriptions:
        raise UsageError(
            f"model {path!r} gives no example inputs: describe each with --input NAME:DTYPE:SHAPE, "
            "such as --input x:float32:2x16"
        )
    parsed = [parse_input_description(d) for d in descriptions]
    sizes: dict[str, int] = {}
    for spec, example in parsed:
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str):
                sizes.setdefault(dim, example[axis])
    return [spec for spec, _ in parsed], _dims(sizes, limits)


def _declared_limits(made: nn.Module | UserModel) -> dict[str, int]:
    limits = made.max_sizes if isinstance(made, UserModel) else None
    if limits is None:
        return {}
    if not isinstance(limits, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1 for k, v in limits.items()
    ):
        raise UsageError(f"UserModel.max_sizes: expected a dict of dimension name -> size of 1 or more, got {limits!r}")
    return dict(limits)


def _module_path(path: str) -> str:
    """``FILE.py:callable`` as ``package.module:callable`` when the file lies under the working directory
    (``models/net.py:build`` -> ``models.net:build``); anything else as given, with a hint for a file path."""
    module, sep, attr = path.partition(":")
    if not module.endswith(".py"):
        return path
    file = Path(module)
    try:
        relative = file.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        relative = None
    if not sep or not attr or relative is None or not file.is_file():
        where = "is not a file" if not file.is_file() else "is outside the working directory"
        raise UsageError(
            f"model {path!r}: expected package.module:callable, or FILE.py:callable for a file under the working "
            f"directory; {module} {where if sep and attr else 'names no callable after a colon'}"
        )
    return ".".join(relative.with_suffix("").parts) + ":" + attr
