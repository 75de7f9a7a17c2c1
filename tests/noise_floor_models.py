"""Models for the noise-floor tests (``tests/test_noise_floor.py``), importable as user models.

ResNet-50 with torchvision's own initialisation (random weights, small images) and the built-in
Transformer at 24 layers: deep enough that float32's own rounding reaches past a fixed tolerance.
``float32_only`` cannot run in float64, so its check falls back to the fixed tolerance.
"""

from __future__ import annotations

import torch
from torch import nn

from tk.models import ModelSpec, UserModel, build_model

IMAGE = 64  # side of the square images ResNet-50 is checked on

# the built-in transformer, 24 layers deep and small enough to check in seconds
TRANSFORMER_24 = {
    "layers": 24,
    "hidden": 64,
    "heads": 4,
    "ffn": 128,
    "vocab_size": 1000,
    "max_seq_len": 64,
    "seq_len": 16,
}


def resnet50() -> UserModel:
    """torchvision's ResNet-50 (weights=None: its own random initialisation), 64x64 images."""
    import torchvision

    return UserModel(
        torchvision.models.resnet50(weights=None).eval(),
        {"image": torch.randn(2, 3, IMAGE, IMAGE)},
        output_names=["logits"],
    )


def transformer_24() -> ModelSpec:
    """The built-in ``transformer`` with ``TRANSFORMER_24`` as its config."""
    return build_model("transformer", config=dict(TRANSFORMER_24))


def change_one_weight(module: nn.Module, name: str, share: float = 0.01, seed: int = 1) -> None:
    """Add to parameter ``name`` a random direction whose norm is ``share`` of the parameter's norm."""
    weight = dict(module.named_parameters())[name]
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        weight.add_(direction * (share * weight.norm() / direction.norm()))


class Float32Only(nn.Module):
    """Keeps its projection as a plain tensor attribute, which ``.double()`` does not cast: in float64
    the product mixes dtypes and fails, as a model with a float32-only op would."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.randn(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj  # (B, 4)


def float32_only() -> UserModel:
    return UserModel(Float32Only(), {"x": torch.randn(4, 8)}, output_names=["y"])
