"""``hf:DIR --task text-generation``: a transformers causal LM as one generation step with a static KV cache.

The step takes and returns what the built-in decoder's does (``tk.models.decoder``): new tokens, their
positions and cache slots, the attention mask over the slots and the cache before the step; the
next-token logits and the new tokens' keys and values. transformers' attention layers call the cache's
``update`` with each layer's new keys and values; ``SlotCache`` returns the cache's slots followed by the
new tokens' keys and values (a concatenation, which every runtime does as one copy: writing them into
their slots in the graph cost OpenVINO a scatter and two index broadcasts per layer, ~9% of a decode
step of a 110M Llama-style model in bf16), and the mask (4D and additive, which transformers uses as
given) is ``tk.models.decoder.step_visibility``'s. The cache is an input and an output rather than module
state (transformers' ``TorchExportableModuleForDecoderOnlyLM`` keeps it in buffers), so that ONNX
Runtime, OpenVINO and AOTInductor run the same graph and the loop owns the cache: it writes the step's
keys and values at ``cache_position`` after the step.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tk.errors import UsageError
from tk.models.decoder import step_visibility
from tk.spec import Dim, Signature, TensorSpec

MIN_CACHE = 4  # slots: a two-token prompt and two new tokens, the least the export check generates
DEFAULT_MAX_CACHE = 1024  # slots when --max-cache-len is not given: the config's limit, at most this
MAX_BATCH = 8
# bf16 step parity: the table's atol (0.05) sits at the error of ~100M decoders' steps on the check's random
# feeds (a 12-layer Llama-style config on the AMX Xeon: logits 0.056, present keys 0.054 through the static
# cache's graph and 0.061 through OpenVINO's stateful one, at 32-36 dB SQNR), on values near zero where a sum
# cancels; the SQNR floor (25 dB) and the generation check's near-tie-aware token comparison judge them too
STEP_TOLERANCES = {"bf16": (5e-2, 1e-1)}
PROMPT_OPT = 32


class SlotCache:
    """The cache transformers' attention layers read: each layer's cache slots of ``past_keys``/``past_values``
    (batch, layer, kv_heads, slots, head_dim) followed by the step's new keys and values, kept for the output."""

    is_compileable = False

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor) -> None:
        self.past_keys, self.past_values = past_keys, past_values
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = key_states.dtype  # the cache keeps its own (float32 at the graph's edge) at any weights' precision
        key_states, value_states = key_states.to(self.past_keys.dtype), value_states.to(self.past_values.dtype)
        self.new_keys.append(key_states)
        self.new_values.append(value_states)
        keys = torch.cat([self.past_keys[:, layer_idx], key_states], dim=2)
        values = torch.cat([self.past_values[:, layer_idx], value_states], dim=2)
        return keys.to(dtype), values.to(dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.past_keys.shape[3])


class CausalLMStep(nn.Module):
    """One generation step of a transformers causal LM (prefill or decode), with the cache as tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        takes = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in takes else "past_key_values"  # renamed in transformers 5

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = SlotCache(past_keys, past_values)
        visible = step_visibility(cache_position, attention_mask)  # (B, 1, T, slots + T)
        logits = next_token_logits(
            self.model, self.cache_keyword, cache, input_ids, position_ids, visible, past_keys.dtype
        )
        return logits, torch.stack(cache.new_keys, dim=1), torch.stack(cache.new_values, dim=1)


def next_token_logits(
    model: nn.Module,
    cache_keyword: str,
    cache: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    visible: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The causal LM's next-token logits (batch, vocab) after each row's last token, its attention layers
    reading ``cache`` and seeing what ``visible`` allows (as the additive 4D mask transformers uses as given,
    in ``dtype``: the cache's)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=input_ids.device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    )
    return out.logits[:, -1]


GROUPED_SDPA = "tk_sdpa_grouped"  # transformers' SDPA attention, the key/value heads shared in the kernel


def grouped_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with the query heads that share a key/value head stacked along the query's
    tokens, so that keys and values are read as they are: transformers' own repeats them (an ``expand``)
    whenever a mask is given, which OpenVINO runs as a broadcast and a multiply by ones per layer (~15% of a
    decode step of a 110M Llama-style model with 4 key/value heads for 12, in bf16), and OpenVINO's converter
    cannot compile SDPA's own ``enable_gqa``."""
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias")):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # what this does not do

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is None and causal and tokens > 1:  # the stacked rows need the causal mask spelled out
        seen = torch.ones(tokens, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - tokens)
        attention_mask = torch.zeros(seen.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~seen, torch.finfo(query.dtype).min
        )[None, None]
    groups = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, groups * tokens, head_dim)  # row j * tokens + t: head kv * groups + j
    if attention_mask is not None:
        attention_mask = attention_mask.repeat(1, 1, groups, 1) if attention_mask.shape[1] == 1 else (
            attention_mask.reshape(attention_mask.shape[0], kv_heads, groups * tokens, -1)
        )  # fmt: skip
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, tokens, head_dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module, config: Any) -> None:
    """Switch a model that shares key/value heads (GQA) from transformers' SDPA to ``grouped_sdpa_attention``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return
    _layers, kv_heads, _head_dim = cache_layout(config)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    if kv_heads == heads:
        return
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks transformers makes for SDPA
    model.set_attn_implementation(GROUPED_SDPA)


@contextlib.contextmanager
def transformers_attention(model: nn.Module) -> Iterator[None]:
    """transformers' own SDPA attention on ``model`` inside the block, where tk switched it to
    ``grouped_sdpa_attention``: the reference tk's tokens are compared with and the rivals tk is timed against
    run transformers as its users do."""
    switched = getattr(getattr(model, "config", None), "_attn_implementation", None) == GROUPED_SDPA
    if switched:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if switched:
            model.set_attn_implementation(GROUPED_SDPA)


def cache_layout(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head_dim) of a causal LM's config (GPT-2's ``n_layer``/``n_head`` included)."""
    layers = int(getattr(config, "num_hidden_layers", None) or config.n_layer)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    return layers, kv_heads, head_dim


def generation_graph(
    model: nn.Module, config: Any, where: str, cache_len: int | None
) -> tuple[nn.Module, Signature, dict[str, Any]]:
    """The step module, its signature and the manifest's ``generation`` facts for a causal LM."""
    if getattr(config, "is_encoder_decoder", False):
        raise UsageError(f"{where}: --task text-generation takes a decoder-only model; this one has an encoder")
    positions = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048)
    slots = min(positions, DEFAULT_MAX_CACHE) if cache_len is None else cache_len
    if not MIN_CACHE <= slots <= positions:
        raise UsageError(f"--max-cache-len: expected {MIN_CACHE} to {positions} (the config's positions), got {slots}")
    layers, kv_heads, head_dim = cache_layout(config)
    use_grouped_attention(model, config)
    vocab = int(config.vocab_size)
    cache = ("batch", layers, kv_heads, slots, head_dim)
    present = ("batch", layers, kv_heads, "seq", head_dim)
    signature = Signature(
        inputs=[
            TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=vocab),
            TensorSpec("position_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=slots),
            TensorSpec("cache_position", "int64", ("seq",), kind="slots", low=0, high=slots),
            TensorSpec("attention_mask", "int64", ("batch", slots), kind="mask", low=0, high=2),
            TensorSpec("past_keys", "float32", cache),
            TensorSpec("past_values", "float32", cache),
        ],
        outputs=[
            TensorSpec("logits", "float32", ("batch", vocab)),
            TensorSpec("present_keys", "float32", present),
            TensorSpec("present_values", "float32", present),
        ],
        dims={"batch": Dim("batch", 1, 2, MAX_BATCH), "seq": Dim("seq", 1, min(PROMPT_OPT, slots), slots)},
    )
    layout = {"slots": slots, "layers": layers, "heads": kv_heads, "head_dim": head_dim}
    generation = {
        "cache": {**layout, "layout": "batch, layer, head, slot, head_dim"},
        "vocab_size": vocab,
        **special_tokens(config, vocab),
    }
    return CausalLMStep(model), signature, generation


def special_tokens(config: Any, vocab: int) -> dict[str, int | None]:
    """bos, eos and pad token ids from the config (the first eos where it lists several); pad defaults to eos."""

    def token(name: str) -> int | None:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return int(value) if isinstance(value, int) and 0 <= value < vocab else None

    eos = token("eos_token_id")
    pad = token("pad_token_id")
    return {"bos_token_id": token("bos_token_id"), "eos_token_id": eos, "pad_token_id": pad if pad is not None else eos}


def transformers_greedy(step: CausalLMStep, prompt: list[int], new_tokens: int, eos: int | None) -> list[int]:
    """transformers' own greedy ``generate`` of one prompt (no padding), stopping at ``eos``: what the
    artifact's step, driven by tk's loop, must reproduce."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], dtype=torch.int64)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos if eos is not None else 0
    )
    with torch.no_grad(), transformers_attention(step.model):
        out = step.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()
