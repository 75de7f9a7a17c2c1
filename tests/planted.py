"""A user model with a planted reduced-precision divergence, for the ``tk debug`` tests.

Four residual blocks; ``blocks.2`` is planted twice, and harmless in float32 both times:
- it multiplies its input by ``GAIN`` (past float16's largest finite value, 65504) and
  normalizes the result back: at fp16 the cast of ``up``'s input to float16 overflows to Inf
  and the projections after it turn that into NaN (in the torch and aoti programs; onnxruntime's
  CPU kernels compute float16 graphs in float32 and do not overflow);
- it drops input feature 0 (gain 0) whose weights in ``up`` are ``OUTLIER``: at int8, the
  per-tensor weight scale is set by that outlier and every other weight of ``up`` rounds to 0.
Keeping ``blocks.2`` (or ``blocks.2.up``) in float32 is the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from tk.models.user import UserModel

WIDTH = 32  # hidden features
CLASSES = 5  # logits per sample
BLOCKS = 4  # residual blocks
GAIN = 1e5  # blocks.2 multiplies its input by this: |activations| ~ 1e5 > 65504
OUTLIER = 1e4  # blocks.2.up's weights from the dropped feature 0


class Block(nn.Module):
    def __init__(self, width: int, gain: float = 1.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        gains = torch.full((width,), gain)
        if gain != 1.0:
            gains[0] = 0.0  # feature 0 is dropped, so its (outlier) weights never matter in float32
            with torch.no_grad():
                self.up.weight[:, 0] = OUTLIER
        self.register_buffer("gain", gains)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.act(self.up(x * self.gain)))  # (B, width)
        return x + self.norm(h)


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH, GAIN if i == 2 else 1.0) for i in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, width)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, classes)


def build() -> UserModel:
    torch.manual_seed(0)
    return UserModel(Planted(), {"x": torch.randn(4, 16)}, output_names=["logits"])


class DataDependent(nn.Module):
    """Branches on a tensor's value: no single static graph holds both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (B, 4)
        if h.sum() > 0:  # planted: a Python branch on data
            return h * 2
        return h - 1


class FixedBatch(nn.Module):
    """Reshapes with a literal batch size, so a dynamic batch dimension specialises to 4."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).reshape(4, -1).sum(1)  # planted: the batch size written as 4


def data_dependent() -> UserModel:
    torch.manual_seed(0)
    return UserModel(DataDependent(), {"x": torch.randn(4, 8)})


def fixed_batch() -> UserModel:
    torch.manual_seed(0)
    return UserModel(FixedBatch(), {"x": torch.randn(4, 8)})


@torch.library.custom_op("tkplanted::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An operator torch.export captures and torch.onnx cannot translate (no ONNX function for it)."""
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class NoOnnx(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(x) + 1  # planted: a custom operator without an ONNX translation


def no_onnx() -> UserModel:
    return UserModel(NoOnnx(), {"x": torch.randn(4, 8)})


class NoConverter(nn.Module):
    """An ATen operator (``linalg_eigh``) that torch runs and that neither torch.onnx nor OpenVINO converts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gram = x @ x.transpose(-1, -2)  # (B, 4, 4), symmetric
        return torch.linalg.eigh(gram).eigenvalues  # planted: no ONNX function, no OpenVINO conversion rule


def no_converter() -> UserModel:
    torch.manual_seed(0)
    return UserModel(NoConverter(), {"x": torch.randn(2, 4, 4)})
