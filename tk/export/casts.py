"""Reduced precision inside the graph, float32 at its edges, and modules kept in float32.

TensorRT 11 builds strongly typed networks only: a layer's precision is its tensors' dtype in
the ONNX graph. So reduced precision is exported, not requested from a builder. The model runs
under an autocast-like cast policy while it is captured: matrix products and convolutions run in
float16/bfloat16, LayerNorm, softmax and the other normalizations in float32 (about 4x more
accurate than casting the whole model, per our field notes), and the capture turns that into
explicit casts. Inputs and outputs stay float32, so the artifact's signature is the same at
every precision.

Why not ``torch.autocast`` itself: torch.export captures an autocast region as one
higher-order operator whose body loses the ``nn_module_stack`` of every node in it, so the graph
(and the ONNX file made from it) no longer says which of the user's modules an operator belongs
to. ``tk debug`` needs those names, and ``keep_fp32`` (modules left in float32, found by
``tk debug precision``) needs a policy that can be switched off per module. The policy is a
``TorchFunctionMode``: it runs in Python during capture, like the model's own code, and leaves
plain casts in the graph, each under its module's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tk.errors import UsageError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# autocast's CPU/CUDA "lower precision" list, at the level of the Python functions a model calls
LOWER: frozenset[Any] = frozenset(
    {
        F.linear,
        F.bilinear,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        F.scaled_dot_product_attention,
        F.prelu,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.einsum,
    }
)
# kept in float32 (inputs cast up): normalizations and softmax, as autocast does on CUDA
FLOAT32: frozenset[Any] = frozenset(
    {
        F.layer_norm,
        F.group_norm,
        F.batch_norm,
        F.instance_norm,
        F.rms_norm,
        F.softmax,
        F.log_softmax,
        torch.softmax,
        torch.log_softmax,
        torch.Tensor.softmax,
        torch.Tensor.log_softmax,
    }
)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class CastPolicy(TorchFunctionMode):
    """Matrix products in ``dtype``, normalizations in float32; everything in float32 while ``kept`` > 0."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.kept = 0  # depth of keep_fp32 modules being run

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in LOWER:
            target = torch.float32 if self.kept else self.dtype
        elif func in FLOAT32:
            target = torch.float32
        else:
            return func(*args, **kwargs)
        return func(*_cast(tuple(args), target), **{k: _cast(v, target) for k, v in kwargs.items()})


class MixedPrecision(nn.Module):
    """Runs ``module`` under the cast policy to ``dtype``; floating outputs come back as float32.

    The modules named in ``keep_fp32`` (paths such as ``encoder.layers.2.attn``) run in float32:
    their matrix products take float32 inputs and weights.
    """

    def __init__(
        self, module: nn.Module, dtype: torch.dtype, device_type: str = "cpu", keep_fp32: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.device_type = device_type
        self.keep_fp32 = tuple(keep_fp32)
        self._kept = [resolve_module(module, path) for path in self.keep_fp32]

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        policy = CastPolicy(self.dtype)
        with policy, _kept_in_float32(self._kept, policy):
            out = self.module(*args)
        if isinstance(out, (tuple, list)):
            return tuple(o.float() if o.is_floating_point() else o for o in out)
        return out.float() if out.is_floating_point() else out


@contextlib.contextmanager
def _kept_in_float32(modules: list[nn.Module], policy: CastPolicy) -> Iterator[None]:
    """Hooks that switch the policy to float32 while one of ``modules`` runs; removed on exit."""

    def enter(*_: Any) -> None:
        policy.kept += 1

    def leave(*_: Any) -> None:
        policy.kept -= 1

    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def resolve_module(root: nn.Module, path: str) -> nn.Module:
    """The submodule at ``path`` (``blocks.2.attn``), or a ``UsageError`` listing the nearest names."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        names = [name for name, _ in root.named_modules() if name]
        parent = path.rpartition(".")[0]
        near = [n for n in names if parent and n.startswith(parent + ".") and n.count(".") == path.count(".")]
        shown = ", ".join((near or names)[:12]) or "none"
        raise UsageError(f"--keep-fp32 {path}: the model has no module of that name; modules include {shown}") from None


def module_at_precision(
    module: nn.Module, precision: str, device: str = "cpu", keep_fp32: Sequence[str] = ()
) -> nn.Module:
    """``module`` itself for fp32 and tf32 (float32 weights; tf32 only lets cuBLAS/cuDNN round inside
    matrix products) and int8 (quantized after export); wrapped in the cast policy otherwise.

    ``keep_fp32`` names modules left in float32 (for int8 see ``tk.export.onnx.dynamic_int8``).
    """
    for path in keep_fp32:
        resolve_module(module, path)  # a wrong name fails at every precision
    if precision in ("fp32", "tf32", "int8"):
        return module
    return MixedPrecision(module, DTYPES[precision], device, keep_fp32).eval()
