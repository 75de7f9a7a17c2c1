"""A model defined in a user's own file, for `tk ... examples.user_model:CALLABLE`.

``regressor`` returns a bare module: describe its input on the command line with
``--input features:float32:4x16``. ``scorer`` returns a ``tk.models.UserModel`` that carries
its own example inputs and names its dynamic dimensions.
"""

from __future__ import annotations

import torch
from torch import nn

from tk.models import UserModel


class Regressor(nn.Module):
    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.body(features)  # (B, 1)


class TokenScorer(nn.Module):
    """Mean-pooled token embeddings, scored; the mask keeps padding out of the mean."""

    def __init__(self, vocab: int = 500, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.score = nn.Linear(width, 3)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        weights = tokens_mask.unsqueeze(-1).float()  # (B, T, 1)
        pooled = (self.embed(tokens) * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (B, width)
        return self.score(pooled)  # (B, 3)


def regressor() -> nn.Module:
    torch.manual_seed(0)
    return Regressor()


def scorer() -> UserModel:
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (4, 12))
    return UserModel(
        module=TokenScorer(),
        example_inputs={"tokens": tokens, "tokens_mask": torch.ones_like(tokens)},
        dynamic_dims={"tokens": {0: "batch", 1: "seq"}, "tokens_mask": {0: "batch", 1: "seq"}},
        output_names=["scores"],
    )
