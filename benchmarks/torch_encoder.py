"""A user's Transformer built from PyTorch's own layers (``nn.TransformerEncoder``: 4 pre-norm layers, 256
wide, 4 heads, FFN 1024) over token ids, mean-pooled into 3 classes, random weights. A user model for
``tk optimize`` (history: "PyTorch's own Transformer layers and GPT-2's Conv1D")::

    tk optimize benchmarks.torch_encoder:model --input input_ids:int64:8x128:0-1000 --out OUT --seconds 1
"""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids)).mean(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Encoder().eval()
