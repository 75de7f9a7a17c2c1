"""Reduced precision inside the graph, float32 at its edges.

TensorRT 11 builds strongly typed networks only: a layer's precision is its tensors' dtype in
the ONNX graph. So reduced precision is exported, not requested from a builder: the weights are
cast to float16 or bfloat16 and the floating inputs and outputs stay float32, which keeps the
artifact's signature the same at every precision.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ReducedPrecision(nn.Module):
    """Runs ``module`` in ``dtype``; floating inputs are cast in, floating outputs cast back to float32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module.to(dtype)
        self.dtype = dtype

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        cast = [a.to(self.dtype) if a.is_floating_point() else a for a in args]
        out = self.module(*cast)
        if isinstance(out, (tuple, list)):
            return tuple(o.float() if o.is_floating_point() else o for o in out)
        return out.float() if out.is_floating_point() else out


def module_at_precision(module: nn.Module, precision: str) -> nn.Module:
    """``module`` itself for fp32 (and int8, which is quantized after export); a cast copy otherwise."""
    if precision in ("fp32", "int8"):
        return module
    return ReducedPrecision(copy.deepcopy(module), DTYPES[precision]).eval()
