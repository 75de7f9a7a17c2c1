"""A small multilayer perceptron that classifies points by a hidden linear rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tk.models.base import ModelEntry, ModelSpec, TrainingTask, classification_task, classifier_signature
from tk.spec import TensorSpec


@dataclass
class MLPConfig:
    in_features: int = 32  # size of each input point
    hidden: int = 128  # width of each hidden layer
    layers: int = 2  # number of hidden layers
    num_classes: int = 4  # classes of the output
    dropout: float = 0.0  # dropout after each hidden layer (training only)
    truth_seed: int = 99  # seed of the hidden rule that labels the training points


SIZES = {
    "tiny": MLPConfig(in_features=8, hidden=16),
    "small": MLPConfig(),
    "base": MLPConfig(in_features=256, hidden=1024, layers=4, num_classes=10),
}


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = cfg.in_features
        for _ in range(cfg.layers):
            layers += [nn.Linear(width, cfg.hidden), nn.GELU(), nn.Dropout(cfg.dropout)]
            width = cfg.hidden
        layers.append(nn.Linear(width, cfg.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, num_classes)


def make_task(cfg: MLPConfig) -> TrainingTask:
    """The label of a point is the argmax of a hidden random projection of it."""
    rule = torch.randn(cfg.num_classes, cfg.in_features, generator=torch.Generator().manual_seed(cfg.truth_seed))

    def make_batch(gen: torch.Generator, batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x = torch.randn(batch, cfg.in_features, generator=gen)
        return (x,), (x @ rule.T).argmax(dim=1)

    return classification_task(make_batch, lr=3e-3, steps=300, batch_size=64)


def build(cfg: MLPConfig) -> ModelSpec:
    inputs = [TensorSpec("x", "float32", ("batch", cfg.in_features))]
    signature = classifier_signature(inputs, cfg.num_classes, batch_max=1024)
    return ModelSpec("mlp", None, {}, MLP(cfg), signature, make_task(cfg))


ENTRY = ModelEntry(
    name="mlp",
    description="multilayer perceptron classifying points by a hidden rule",
    config_cls=MLPConfig,
    sizes=SIZES,
    build_spec=build,
)
