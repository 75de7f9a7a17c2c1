"""A GPT-style Transformer decoder that continues sequences, with a static KV cache as inputs and outputs.

Token and learned position embeddings, N pre-LayerNorm blocks (causal self-attention with one fused
QKV projection and ``scaled_dot_product_attention``, a GELU feed-forward), a final LayerNorm and a
language-model head.

Called with ``input_ids`` alone (training) it returns the logits of every position. Called with the
cache (what is exported) it is one step of generation, prefill or decode, in one graph:

- ``input_ids``, ``position_ids`` (batch, seq): the new tokens and their positions (a left-padded
  prompt's positions start at its first token);
- ``cache_position`` (seq,): the cache slots the new tokens fill, the same for every row;
- ``attention_mask`` (batch, slots): 1 where a slot holds a token of that row (the new ones included);
- ``past_keys``, ``past_values`` (batch, layers, heads, slots, head_dim): the cache before this step;

and returns the next-token ``logits`` (batch, vocab) of each row's last position and the new tokens'
``present_keys``/``present_values`` (batch, layers, heads, seq, head_dim), which the caller writes into
its cache at ``cache_position`` (``tk.runtime.generation``). Attention runs over the cache's slots
followed by the step's own keys (a concatenation: no scatter into the cache in the graph), as
``step_visibility`` says: a new token sees the earlier slots its row holds and the step's tokens up
to itself, and always itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tk.errors import UsageError
from tk.models.base import ModelEntry, ModelSpec, TrainingTask
from tk.models.transformer import FeedForward, init_weights
from tk.spec import Dim, Signature, TensorSpec


@dataclass
class DecoderConfig:
    vocab_size: int = 256  # token ids are in [0, vocab_size)
    max_positions: int = 256  # learned positions: the longest prompt plus output the model knows
    max_cache_len: int | None = None  # static KV cache slots (tk export --max-cache-len); None: max_positions
    hidden: int = 256  # width of the residual stream
    layers: int = 4  # number of decoder blocks
    heads: int = 4  # attention heads; hidden must divide by it
    ffn: int = 1024  # width of the feed-forward layer
    dropout: float = 0.0  # dropout in embeddings, attention and feed-forward (training only)
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    seq_len: int = 32  # typical prompt length: the opt size of the ``seq`` dimension
    max_step: int = 3  # the training rule's largest step (sequences count up by 1..max_step)
    max_batch: int = 8  # the most prompts generated together


SIZES = {
    "tiny": DecoderConfig(vocab_size=64, max_positions=64, hidden=64, layers=2, heads=2, ffn=256, seq_len=24),
    "small": DecoderConfig(),
    # GPT-2 small's blocks over the rule's vocabulary (85M parameters): trainable here in minutes, and large
    # enough that its decode step is bound by memory bandwidth (weight-only int8's speed is measured on it)
    "medium": DecoderConfig(hidden=768, layers=12, heads=12, ffn=3072, max_positions=128, seq_len=32),
    # GPT-2 small's shape (124M parameters): the size decode speed is measured at
    "base": DecoderConfig(vocab_size=50257, max_positions=1024, hidden=768, layers=12, heads=12, ffn=3072, seq_len=128),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden ({cfg.hidden}) must be a multiple of heads ({cfg.heads})")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, hidden = x.shape
        # (B, T, 3, heads, head_dim) -> 3 x (B, heads, T, head_dim)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        return q, k, v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        batch, _, seq, _ = y.shape
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, -1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        dropout = self.attn_dropout if self.training else 0.0
        return self._out(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True))

    def step(
        self,
        x: torch.Tensor,
        visible: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
        appended: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention of the new tokens over the cache followed by their own keys; also their keys and values
        (``appended``: the cache's followed by theirs, the whole cache after the step)."""
        q, k, v = self._qkv(x)
        # the cache keeps its own dtype (float32 at the graph's edge) whatever the weights' precision
        keys = torch.cat([past_keys.to(q.dtype), k], dim=2)  # (B, heads, slots + T, head_dim)
        values = torch.cat([past_values.to(q.dtype), v], dim=2)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        if appended:
            return self._out(attended), keys.to(past_keys.dtype), values.to(past_values.dtype)
        return self._out(attended), k.to(past_keys.dtype), v.to(past_values.dtype)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_ffn = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg.hidden, cfg.ffn, cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.ffn(self.ln_ffn(x))

    def step(
        self,
        x: torch.Tensor,
        visible: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
        appended: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attended, k, v = self.attn.step(self.ln_attn(x), visible, past_keys, past_values, appended)
        x = x + attended
        return x + self.ffn(self.ln_ffn(x)), k, v


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position_embedding = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_final = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.apply(init_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_keys: torch.Tensor | None = None,
        past_values: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if past_keys is None or past_values is None:
            return self.sequence_logits(input_ids)
        assert position_ids is not None and cache_position is not None and attention_mask is not None
        x = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        visible = step_visibility(cache_position, attention_mask)  # (B, 1, T, slots + T)
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            x, k, v = block.step(x, visible, past_keys[:, i], past_values[:, i])
            keys.append(k)
            values.append(v)
        logits = self.head(self.ln_final(x[:, -1]))  # (B, vocab): the next token after each row's last
        return logits, torch.stack(keys, dim=1), torch.stack(values, dim=1)

    def sequence_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits of every position (B, T, vocab), without a cache: training and the no-cache reference."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding_dropout(self.token_embedding(input_ids) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def step_visibility(cache_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Which keys each of a step's tokens sees (batch, 1, step, slots + step): the cache's slots, then the step's
    own tokens (``cache_position``: their slots, ascending).

    A token sees a cache slot before its own that its row holds and that is not one of the step's slots (those
    hold nothing yet: the step's keys come after the cache), and the step's tokens up to itself whose slots its
    row holds. A token always sees itself, so no row of the softmax is empty (OpenVINO and ONNX Runtime give NaN
    there, which would reach real tokens through the padding's keys); real tokens never see padding.
    """
    slots = torch.arange(attention_mask.shape[1], device=cache_position.device)
    held = attention_mask.bool()
    step_slots = (slots[None, :] == cache_position[:, None]).any(dim=0)  # (slots,)
    earlier = slots[None, :] < cache_position[:, None]  # (step, slots)
    cached = earlier[None] & (held & ~step_slots[None])[:, None, :]  # (batch, step, slots)
    step = torch.arange(cache_position.shape[0], device=cache_position.device)
    causal = step[None, :] <= step[:, None]  # (step, step)
    fed = held.index_select(1, cache_position)  # (batch, step): the step's tokens that are not padding
    new = (causal[None] & fed[:, None, :]) | (step[None, :] == step[:, None])[None]
    return torch.cat([cached, new], dim=2)[:, None]


def rule_sequences(cfg: DecoderConfig, gen: torch.Generator, count: int, length: int) -> torch.Tensor:
    """``count`` sequences of the rule the decoder learns: count up from a random start by a step of 1 to
    ``max_step`` (the sequence's own, read from its first two tokens), modulo the vocabulary."""
    starts = torch.randint(0, cfg.vocab_size, (count, 1), generator=gen)
    steps = torch.randint(1, cfg.max_step + 1, (count, 1), generator=gen)
    return (starts + steps * torch.arange(length)[None, :]) % cfg.vocab_size


def make_task(cfg: DecoderConfig) -> TrainingTask:
    """Next-token prediction on ``rule_sequences``: every position after the second has one right answer,
    so greedy generation can be scored (``rule_accuracy``); accuracy at validation is per token. Sequences
    span every learned position, so prompt plus output may be as long as the model allows."""
    length = cfg.max_positions

    def make_batch(gen: torch.Generator, batch: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        sequences = rule_sequences(cfg, gen, batch, length + 1)
        return (sequences[:, :-1],), sequences[:, 1:]

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the first position cannot know the step: it is left out of the loss
        return F.cross_entropy(logits[:, 1:].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))

    return TrainingTask(
        make_batch=make_batch,
        loss=loss,
        make_optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        lr=3e-3,
        steps=400,
        batch_size=32,
        target_loss=0.02,
    )


def rule_accuracy(prompts: list[list[int]], outputs: list[list[int]], vocab_size: int) -> float:
    """The share of generated tokens that continue their prompt by its rule (prompts of two or more tokens)."""
    right = total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        step = (prompt[1] - prompt[0]) % vocab_size
        expected = [(prompt[-1] + step * (i + 1)) % vocab_size for i in range(len(output))]
        right += sum(a == b for a, b in zip(output, expected, strict=True))
        total += len(output)
    return right / total if total else 0.0


def cache_slots(cfg: DecoderConfig) -> int:
    """The static cache's slots: ``max_cache_len``, at most the model's positions."""
    slots = cfg.max_positions if cfg.max_cache_len is None else cfg.max_cache_len
    if not 4 <= slots <= cfg.max_positions:  # a two-token prompt and two new tokens: the export check's least
        raise UsageError(f"--max-cache-len: expected 4 to {cfg.max_positions} (the model's positions), got {slots}")
    return slots


def cache_signature(cfg: DecoderConfig) -> Signature:
    """The one-step signature: new tokens and the static cache in, next-token logits and new keys/values out."""
    head_dim = cfg.hidden // cfg.heads
    slots = cache_slots(cfg)
    cache = ("batch", cfg.layers, cfg.heads, slots, head_dim)
    present = ("batch", cfg.layers, cfg.heads, "seq", head_dim)
    return Signature(
        inputs=[
            TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=cfg.vocab_size),
            TensorSpec("position_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=cfg.max_positions),
            TensorSpec("cache_position", "int64", ("seq",), kind="slots", low=0, high=slots),
            TensorSpec("attention_mask", "int64", ("batch", slots), kind="mask", low=0, high=2),
            TensorSpec("past_keys", "float32", cache),
            TensorSpec("past_values", "float32", cache),
        ],
        outputs=[
            TensorSpec("logits", "float32", ("batch", cfg.vocab_size)),
            TensorSpec("present_keys", "float32", present),
            TensorSpec("present_values", "float32", present),
        ],
        dims={
            "batch": Dim("batch", 1, 2, cfg.max_batch),
            "seq": Dim("seq", 1, min(cfg.seq_len, slots), slots),
        },
    )


def build(cfg: DecoderConfig) -> ModelSpec:
    head_dim = cfg.hidden // cfg.heads
    generation = {
        "cache": {
            "slots": cache_slots(cfg),
            "layers": cfg.layers,
            "heads": cfg.heads,
            "head_dim": head_dim,
            "layout": "batch, layer, head, slot, head_dim",
        },
        "vocab_size": cfg.vocab_size,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": 0,
    }
    spec = ModelSpec("decoder", None, {}, Decoder(cfg), cache_signature(cfg), make_task(cfg))
    spec.max_sizes = {"seq": cache_slots(cfg)}
    spec.generation = generation
    return spec


ENTRY = ModelEntry(
    name="decoder",
    description="GPT-style pre-LN decoder with a static KV cache (prefill and decode in one graph)",
    config_cls=DecoderConfig,
    sizes=SIZES,
    build_spec=build,
)


def greedy_without_cache(module: Decoder, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt that recomputes every position at each step: the eager loop with
    no cache and no padding, which the cached, batched loop (``tk.runtime.generation``) must reproduce."""
    ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.no_grad():
        for _ in range(new_tokens):
            following = module.sequence_logits(ids)[:, -1].argmax(dim=-1)
            ids = torch.cat([ids, following[:, None]], dim=1)
    return ids[0, len(prompt) :].tolist()
