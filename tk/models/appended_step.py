"""A decoder's generation step with a cache that grows: each layer's keys and values before the step in, the
same followed by the step's out; the form OpenVINO makes stateful.

The artifact's step (``tk.models.decoder``, ``tk.models.hf_generation``) reads a static cache of every slot and
returns only the new tokens' keys and values, which the loop writes into its cache. OpenVINO's stateful form
keeps the cache inside the infer request instead: its ``make_stateful`` transformation turns each pair of a
cache input and the output that extends it into a variable (``ReadValue``/``Assign``), and its CPU plugin then
runs each layer's attention over the cache it holds (``ScaledDotProductAttentionWithKVCache``), reading the filled
slots only, with nothing to copy in or out at each step. That needs one input and one output per layer and
kind, the cache's length ``past`` dynamic, and the output the input followed by the step's keys (a
concatenation the attention reads): what ``appended_step`` returns, for the built-in decoder and a
transformers causal LM alike.

Inputs: ``input_ids``, ``position_ids`` (batch, seq); ``attention_mask`` (batch, past + seq): 1 where a cached
slot or a new token holds a token of that row; then ``past_key_0``, ``past_value_0``, ... (batch, kv_heads,
past, head_dim). Outputs: ``logits`` (batch, vocab) and ``present_key_0``, ``present_value_0``, ... (batch,
kv_heads, past + seq, head_dim). The step's tokens come after every cached slot, so a new token sees the
cached slots its row holds and the step's tokens up to itself that it holds, and always itself: what
``step_visibility`` gives the static cache's step, which is the same computation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tk.models.decoder import Decoder
from tk.models.hf_generation import next_token_logits, transformers_attention


def appended_visibility(
    attention_mask: torch.Tensor, past: int | torch.SymInt, steps: int | torch.SymInt
) -> torch.Tensor:
    """Which keys each of a step's ``steps`` tokens sees (batch, 1, steps, past + steps): the ``past`` cached
    slots its row holds, then the step's tokens up to itself that its row holds, and itself."""
    held = attention_mask.bool()
    step = torch.arange(steps, device=attention_mask.device)
    cached = held[:, None, :past].expand(-1, steps, -1)
    same = step[None, :] == step[:, None]
    new = ((step[None, :] < step[:, None])[None] & held[:, None, past:]) | same[None]
    return torch.cat([cached, new], dim=2)[:, None]


def state_names(layers: int) -> tuple[list[str], list[str]]:
    """The cache's inputs and outputs, layer by layer: ``past_key_i``, ``past_value_i`` and ``present_*``."""
    past = [f"past_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    return past, [name.replace("past_", "present_", 1) for name in past]


class DecoderAppendedStep(nn.Module):
    """The built-in decoder's step over a growing cache (the module docstring's inputs and outputs)."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        d = self.decoder
        x = d.token_embedding(input_ids) + d.position_embedding(position_ids)
        visible = appended_visibility(attention_mask, past[0].shape[2], input_ids.shape[1])
        present: list[torch.Tensor] = []
        for i, block in enumerate(d.blocks):
            x, keys, values = block.step(x, visible, past[2 * i], past[2 * i + 1], appended=True)
            present += [keys, values]
        return (d.head(d.ln_final(x[:, -1])), *present)


class AppendCache:
    """The cache transformers' attention layers read: each layer's cached keys and values followed by the
    step's, kept as the layer's output."""

    is_compileable = False

    def __init__(self, past: tuple[torch.Tensor, ...]) -> None:
        self.past = past
        self.present: list[torch.Tensor] = list(past)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = key_states.dtype  # the cache keeps its own (float32 at the graph's edge)
        keys = torch.cat([self.past[2 * layer_idx], key_states.to(self.past[0].dtype)], dim=2)
        values = torch.cat([self.past[2 * layer_idx + 1], value_states.to(self.past[0].dtype)], dim=2)
        self.present[2 * layer_idx], self.present[2 * layer_idx + 1] = keys, values
        return keys.to(dtype), values.to(dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.past[0].shape[2])


class CausalLMAppendedStep(nn.Module):
    """A transformers causal LM's step over a growing cache (the module docstring's inputs and outputs)."""

    def __init__(self, model: nn.Module, cache_keyword: str) -> None:
        super().__init__()
        self.model = model
        self.cache_keyword = cache_keyword

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        cache = AppendCache(past)
        visible = appended_visibility(attention_mask, past[0].shape[2], input_ids.shape[1])
        # transformers' own attention, which repeats a shared key/value head for its query heads: OpenVINO's fusion
        # of the cache into attention takes that form (and drops the repeat), not tk's grouped queries
        with transformers_attention(self.model):
            logits = next_token_logits(
                self.model, self.cache_keyword, cache, input_ids, position_ids, visible, past[0].dtype
            )
        return (logits, *cache.present)


def appended_step(step: nn.Module) -> nn.Module | None:
    """The growing-cache form of a decoder artifact's step module (``ModelSpec.module``), or None where tk has
    none (a user's own decoder)."""
    from tk.models.hf_generation import CausalLMStep

    if isinstance(step, Decoder):
        return DecoderAppendedStep(step)
    if isinstance(step, CausalLMStep):
        return CausalLMAppendedStep(step.model, step.cache_keyword)
    return None
