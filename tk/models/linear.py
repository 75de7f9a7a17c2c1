"""Linear regression: ``MyLinear`` learns a hidden ground truth y = w·x + b with SGD and momentum."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.base import ModelEntry, ModelSpec, TrainingTask
from tk.spec import Dim, Signature, TensorSpec


@dataclass
class LinearConfig:
    in_features: int = 8  # size of x
    out_features: int = 1  # size of y
    truth_seed: int = 1234  # seed of the hidden ground truth w and b
    noise: float = 0.01  # standard deviation of the noise added to y in training data


SIZES = {
    "tiny": LinearConfig(in_features=4),
    "small": LinearConfig(),
    "base": LinearConfig(in_features=64, out_features=4),
}


class MyLinear(nn.Module):
    """y = x @ weight.T + bias, with weight and bias as plain ``nn.Parameter``s."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias  # (B, out_features)


def ground_truth(cfg: LinearConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden w (out, in) and b (out,) that the training data follows."""
    gen = torch.Generator().manual_seed(cfg.truth_seed)
    w = torch.randn(cfg.out_features, cfg.in_features, generator=gen)
    b = torch.randn(cfg.out_features, generator=gen)
    return w, b


def make_task(cfg: LinearConfig) -> TrainingTask:
    w, b = ground_truth(cfg)

    def make_batch(gen: torch.Generator, batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x = torch.randn(batch, cfg.in_features, generator=gen)
        y = x @ w.T + b + cfg.noise * torch.randn(batch, cfg.out_features, generator=gen)
        return (x,), y

    return TrainingTask(
        make_batch=make_batch,
        loss=F.mse_loss,
        make_optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
        lr=0.02,
        steps=1000,
        batch_size=32,
        target_loss=1e-3,
        average_over=50,  # a long window: when its average is under target, the current loss is far below
        classification=False,
    )


def build(cfg: LinearConfig) -> ModelSpec:
    signature = Signature(
        inputs=[TensorSpec("x", "float32", ("batch", cfg.in_features))],
        outputs=[TensorSpec("y", "float32", ("batch", cfg.out_features))],
        dims={"batch": Dim("batch", 1, 8, 1024)},
    )
    return ModelSpec("linear", None, {}, MyLinear(cfg.in_features, cfg.out_features), signature, make_task(cfg))


ENTRY = ModelEntry(
    name="linear",
    description="MyLinear: linear regression y = w·x + b, trained with SGD and momentum",
    config_cls=LinearConfig,
    sizes=SIZES,
    build_spec=build,
)
