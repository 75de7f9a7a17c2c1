"""Reduced precision inside the graph, float32 at its edges.

TensorRT 11 builds strongly typed networks only: a layer's precision is its tensors' dtype in
the ONNX graph. So reduced precision is exported, not requested from a builder. The model runs
under ``torch.autocast`` while it is captured: matrix products run in float16/bfloat16 and
autocast keeps LayerNorm, softmax and reductions in float32 (about 4x more accurate than casting
the whole model, per our field notes), and the capture turns that into explicit casts. Inputs
and outputs stay float32, so the artifact's signature is the same at every precision.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class MixedPrecision(nn.Module):
    """Runs ``module`` under autocast to ``dtype`` on ``device_type``; floating outputs come back as float32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.device_type = device_type

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            out = self.module(*args)
        if isinstance(out, (tuple, list)):
            return tuple(o.float() if o.is_floating_point() else o for o in out)
        return out.float() if out.is_floating_point() else out


def module_at_precision(module: nn.Module, precision: str, device: str = "cpu") -> nn.Module:
    """``module`` itself for fp32 and tf32 (float32 weights; tf32 only lets cuBLAS/cuDNN round inside
    matrix products) and int8 (quantized after export); wrapped in autocast otherwise."""
    if precision in ("fp32", "tf32", "int8"):
        return module
    return MixedPrecision(module, DTYPES[precision], device).eval()
