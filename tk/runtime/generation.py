"""The generation loop for decoder artifacts: prefill, then decode one token at a time, on any engine.

A decoder artifact's graph is one step of generation (``tk.models.decoder`` documents its inputs):
prefill feeds every prompt token at once, decode feeds one token per row; both return the next-token
logits and the new tokens' keys and values, which this loop writes into its static cache at the
slots it fed. Prompts of different lengths are left-padded, so every row's last token sits in the
same slot and each step fills one slot for all rows; the attention mask keeps padding unseen and the
position ids of a row start at its first token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from tk.errors import UsageError

Step = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]  # one run of the graph


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled (top-k, then top-p) with ``seed``."""

    temperature: float = 0.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # nucleus: the fewest tokens whose probabilities sum to at least top_p
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"--temperature: expected a number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k: expected 0 (all tokens) or more, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p: expected a number in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class CacheLayout:
    """The static KV cache a decoder artifact's graph reads and writes (the manifest's ``generation.cache``)."""

    slots: int
    layers: int
    heads: int
    head_dim: int

    @classmethod
    def from_generation(cls, generation: Mapping[str, Any]) -> CacheLayout:
        cache = generation["cache"]
        return cls(int(cache["slots"]), int(cache["layers"]), int(cache["heads"]), int(cache["head_dim"]))

    def empty(self, batch: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(batch, self.layers, self.heads, self.slots, self.head_dim, dtype=dtype)

    def nbytes(self, batch: int, itemsize: int = 4) -> int:
        """Bytes of keys and values together for ``batch`` rows."""
        return 2 * batch * self.layers * self.heads * self.slots * self.head_dim * itemsize


class KeptCache(Protocol):
    """A decoder's KV cache that its engine keeps (OpenVINO's stateful IR): ``step`` runs the graph on
    ``input_ids``, ``position_ids`` and the ``attention_mask`` of the filled and new slots, appending the new
    tokens' keys and values, and returns the next-token logits; ``read``/``write`` move slots of it to and from
    the static layout (batch, layers, kv heads, slots, head dim) where rows join or leave (``DecodeBatch``)."""

    def empty(self) -> None: ...

    def step(self, feeds: Mapping[str, Any]) -> np.ndarray: ...

    def write(self, keys: Any, values: Any, stop: int) -> None: ...

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class Generated:
    """What one ``generate`` call produced, row by row in the prompts' order."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # the new tokens (a stop token that ended a row is kept)
    finish: list[str]  # per row: "stop" (a stop token) or "length" (max_new_tokens)
    logits: list[np.ndarray] = field(default_factory=list)  # per step (batch, vocab), when kept
    step_seconds: list[float] = field(default_factory=list)  # prefill first, then each decode step

    @property
    def time_to_first_token(self) -> float:
        return self.step_seconds[0] if self.step_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode steps per second times the rows generated (the prefill's step left out)."""
        decode = self.step_seconds[1:]
        return len(decode) * len(self.prompts) / sum(decode) if decode and sum(decode) > 0 else 0.0


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, slots: int, max_new_tokens: int) -> None:
    """One ``UsageError`` line for prompts the artifact cannot take: empty, ids out of range, too long."""
    if not prompts:
        raise UsageError("expected at least one prompt, found none")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens: expected 1 or more, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise UsageError(f"prompt {i}: expected at least one token, found an empty prompt")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: expected token ids in [0, {vocab_size}), found {bad[0]}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > slots:
        raise UsageError(
            f"the longest prompt ({longest} tokens) plus --max-new-tokens {max_new_tokens} exceeds the "
            f"artifact's cache of {slots} slots; expected at most {slots - longest} new tokens, or re-export "
            "with a larger --max-cache-len"
        )


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row (batch,) from its logits (batch, vocab)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probabilities = torch.softmax(ordered, dim=-1)
        before = probabilities.cumsum(dim=-1) - probabilities  # the mass of the likelier tokens
        drop = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)


def generate(
    step: Step,
    layout: CacheLayout,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    on_tokens: Callable[[int, list[int | None]], None] | None = None,
    keep_logits: bool = False,
    empty_cache: Callable[[], None] | None = None,
) -> Generated:
    """Generate up to ``max_new_tokens`` for every prompt with ``step`` (one run of the artifact's graph).

    ``on_tokens(step_index, tokens)`` is called after each step with each row's new token (None for a
    row that has stopped): streaming. Rows stop at a token of ``stop_ids``; the loop ends when every
    row has stopped or reached ``max_new_tokens``. ``empty_cache``: the step keeps the cache itself
    (OpenVINO's stateful IR); called before the prefill, and the loop feeds no cache, only the attention
    mask of the slots filled so far and the step's.
    """
    sampling = sampling or Sampling()
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    ids, positions, mask = left_padded(prompts, layout.slots, pad_id)
    keys = values = None
    if empty_cache is None:
        keys, values = layout.empty(len(prompts)), layout.empty(len(prompts))
    else:
        empty_cache()
    out = Generated([list(map(int, p)) for p in prompts], [[] for _ in prompts], ["length"] * len(prompts))
    stops = {int(s) for s in stop_ids}
    slot, width = 0, ids.shape[1]
    for index in range(max_new_tokens):
        started = time.perf_counter()
        if keys is not None and values is not None:
            feeds = {"input_ids": ids, "position_ids": positions, "cache_position": torch.arange(slot, slot + width),
                     "attention_mask": mask, "past_keys": keys, "past_values": values}  # fmt: skip
        else:
            feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask[:, : slot + width]}
        result = step(feeds)
        logits = result["logits"].detach().cpu()
        if keys is not None and values is not None:
            keys[:, :, :, slot : slot + width] = result["present_keys"].detach().cpu()
            values[:, :, :, slot : slot + width] = result["present_values"].detach().cpu()
        next_tokens = choose(logits, sampling, generator)
        out.step_seconds.append(time.perf_counter() - started)
        if keep_logits:
            out.logits.append(logits.float().numpy().copy())
        emitted = _record(out, next_tokens.tolist(), stops)
        if on_tokens is not None:
            on_tokens(index, emitted)
        if all(f == "stop" for f in out.finish):
            break
        slot += width
        mask[:, slot] = 1
        positions = positions[:, -1:] + 1
        ids, width = next_tokens[:, None].to(torch.int64), 1
    return out


def left_padded(
    prompts: Sequence[Sequence[int]], slots: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefill's ``input_ids`` and ``position_ids`` (batch, longest prompt), each prompt at the right end,
    and the attention mask over the cache's ``slots`` with the prompts' slots set."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, longest), pad_id, dtype=torch.int64)
    positions = torch.zeros((batch, longest), dtype=torch.int64)
    mask = torch.zeros((batch, slots), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        start = longest - len(prompt)
        ids[row, start:] = torch.as_tensor(list(prompt), dtype=torch.int64)
        positions[row, start:] = torch.arange(len(prompt))
        mask[row, start:longest] = 1
    return ids, positions, mask


def _record(out: Generated, tokens: list[int], stops: set[int]) -> list[int | None]:
    """Each row's new token appended to ``out`` (a row that has stopped gets None); a stop token stops its row."""
    emitted: list[int | None] = []
    for row, token in enumerate(tokens):
        if out.finish[row] == "stop":
            emitted.append(None)
            continue
        out.tokens[row].append(token)
        emitted.append(token)
        if token in stops:
            out.finish[row] = "stop"
    return emitted


def generate_with_engine(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] | None = None,
    on_tokens: Callable[[int, list[int | None]], None] | None = None,
    keep_logits: bool = False,
) -> Generated:
    """``generate`` on an opened engine (``tk.runtime.Engine``) of a decoder artifact, in batches of at most
    the artifact's largest batch; ``stop_ids`` default to the model's end-of-sequence token."""
    generation = engine.manifest.generation
    if not generation:
        raise UsageError(
            f"{engine.root}: expected a decoder artifact (a manifest with generation entry points), found a "
            f"model with one entry point ({engine.manifest.model.get('name')}); export a decoder to generate"
        )
    layout = CacheLayout.from_generation(generation)
    check_prompts(prompts, int(generation["vocab_size"]), layout.slots, max_new_tokens)
    if stop_ids is None:
        eos = generation.get("eos_token_id")
        stop_ids = () if eos is None else (eos,)
    largest = engine.dims["batch"].max if "batch" in engine.dims else 1
    if keep_logits and len(prompts) > largest:
        raise UsageError(f"keep_logits: expected at most {largest} prompts (one batch), got {len(prompts)}")
    step, empty_cache = _engine_step(engine)
    parts = []
    for start in range(0, len(prompts), largest):
        chunk = prompts[start : start + largest]
        offset = start

        def relay(index: int, tokens: list[int | None], offset: int = offset) -> None:
            if on_tokens is not None:
                on_tokens(index, [None] * offset + tokens + [None] * (len(prompts) - offset - len(tokens)))

        parts.append(
            generate(
                step,
                layout,
                chunk,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop_ids=stop_ids,
                pad_id=generation.get("pad_token_id") or 0,
                on_tokens=relay if on_tokens is not None else None,
                keep_logits=keep_logits,
                empty_cache=empty_cache,
            )
        )
    return _joined(parts)


def _engine_step(engine: Any) -> tuple[Step, Callable[[], None] | None]:
    """The loop's ``step`` on ``engine`` and, where the engine keeps the cache, what empties it. The artifact's
    step checks its feeds once per kind of step (prefill, decode); a kept cache's step takes the tokens, their
    positions and the mask only (the prompts were checked before)."""
    if engine.keeps_cache:
        kept = engine.kept_cache()

        def kept_step(feeds: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
            return {"logits": torch.from_numpy(kept.step({k: v.numpy() for k, v in feeds.items()}))}

        return kept_step, kept.empty
    checked: set[bool] = set()

    def step(feeds: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        width = int(feeds["input_ids"].shape[1])
        first = (width == 1) not in checked
        checked.add(width == 1)
        return engine.run(feeds, check=first)

    return step, None


def _joined(parts: list[Generated]) -> Generated:
    if len(parts) == 1:
        return parts[0]
    out = Generated([], [], [])
    for part in parts:
        out.prompts += part.prompts
        out.tokens += part.tokens
        out.finish += part.finish
        out.step_seconds += part.step_seconds
    return out
