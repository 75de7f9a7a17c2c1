"""A BERT-style Transformer encoder for sequence classification.

Token and learned position embeddings, N pre-LayerNorm blocks (multi-head self-attention with
one fused QKV projection and ``scaled_dot_product_attention``, then a GELU feed-forward), a final
LayerNorm, and a classification head on the first token. An attention mask (1 = token,
0 = padding, padding on the right) keeps padded keys out of attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tk.models.base import ModelEntry, ModelSpec, TrainingTask, classification_task, classifier_signature
from tk.spec import Dim, TensorSpec


@dataclass
class TransformerConfig:
    vocab_size: int = 8000  # token ids are in [0, vocab_size)
    max_seq_len: int = 512  # number of learned positions: the longest input
    hidden: int = 256  # width of the residual stream
    layers: int = 4  # number of encoder blocks
    heads: int = 4  # attention heads; hidden must divide by it
    ffn: int = 1024  # width of the feed-forward layer
    dropout: float = 0.1  # dropout in embeddings, attention and feed-forward (training only)
    num_classes: int = 2  # classes of the classification head
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    seq_len: int = 128  # typical sequence length: the opt size of the ``seq`` dimension


SIZES = {
    "tiny": TransformerConfig(vocab_size=1000, max_seq_len=64, hidden=32, layers=2, heads=2, ffn=64, seq_len=16),
    "small": TransformerConfig(),
    "base": TransformerConfig(vocab_size=30522, hidden=768, layers=12, heads=12, ffn=3072),
}


class SelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden ({cfg.hidden}) must be a multiple of heads ({cfg.heads})")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        # (B, T, 3, heads, head_dim) -> 3 x (B, heads, T, head_dim)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    """hidden -> ffn -> GELU -> hidden, with dropout (the encoder's and the decoder's, ``tk.models.decoder``)."""

    def __init__(self, hidden: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg)
        self.ln_ffn = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg.hidden, cfg.ffn, cfg.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), keep)
        return x + self.ffn(self.ln_ffn(x))


class TransformerClassifier(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embedding = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_final = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.num_classes)
        self.apply(init_weights)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)  # (B, T, hidden)
        x = self.embedding_dropout(x)
        if attention_mask is None:
            keep = None
        else:
            keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): which keys each query sees
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.ln_final(x)[:, 0])  # (B, num_classes) from the first token


def init_weights(module: nn.Module) -> None:
    """GPT-2's and BERT's initialization: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_task(cfg: TransformerConfig) -> TrainingTask:
    """Is the sequence mostly made of tokens from the lower half of the vocabulary?

    Each sequence draws its tokens from the lower half with probability 0.25 or 0.75, so the
    label is a clear majority vote that attention learns in a few hundred steps. Sequences are
    right-padded to random lengths, so the mask matters.
    """
    seq = min(cfg.seq_len, cfg.max_seq_len)
    half = cfg.vocab_size // 2

    def make_batch(gen: torch.Generator, batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        labels = torch.randint(0, 2, (batch,), generator=gen)
        p_lower = 0.25 + 0.5 * labels.float()  # (B,)
        lower = torch.rand(batch, seq, generator=gen) < p_lower[:, None]
        low_ids = torch.randint(0, half, (batch, seq), generator=gen)
        high_ids = torch.randint(half, cfg.vocab_size, (batch, seq), generator=gen)
        ids = torch.where(lower, low_ids, high_ids)
        lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=gen)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        return (ids * mask, mask), labels % cfg.num_classes

    return classification_task(make_batch, lr=1e-3, steps=300, batch_size=32)


def build(cfg: TransformerConfig) -> ModelSpec:
    seq_opt = min(cfg.seq_len, cfg.max_seq_len)
    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=cfg.vocab_size),
        TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask", low=0, high=2),
    ]
    seq = Dim("seq", 1, seq_opt, cfg.max_seq_len)
    signature = classifier_signature(inputs, cfg.num_classes, batch_max=64, dims={"seq": seq})
    module, limits = TransformerClassifier(cfg), {"seq": cfg.max_seq_len}  # its position table's length
    return ModelSpec("transformer", None, {}, module, signature, make_task(cfg), max_sizes=limits)


ENTRY = ModelEntry(
    name="transformer",
    description="BERT-style pre-LN encoder with a classification head",
    config_cls=TransformerConfig,
    sizes=SIZES,
    build_spec=build,
)
