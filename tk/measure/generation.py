"""What a generation benchmark measures: per engine and batch, the time to first token and the decode steps
(``GenerationRun`` times one generation call), and the machine's copy bandwidth, a decode step's ceiling.
``tk.workflows.generation_bench`` runs them (``tk bench`` on a decoder artifact). The rival it times beside an
``hf:DIR`` artifact is transformers' own ``generate`` (``transformers_rival``)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tk.measure.load_guard import LoadMark
from tk.measure.timing import CallTime, Spread

BANDWIDTH_BYTES = 1 << 28  # bytes copied to measure this machine's memory bandwidth (far above any cache)


@dataclass
class GenerationRow:
    engine: str
    batch: int
    prompt_len: int
    new_tokens: int
    ttft: Spread  # seconds
    decode_step: Spread  # seconds per decode step (one token for every row)
    bytes_per_step: int  # weights and the cache a decode step reads
    cache_bytes: int
    load: LoadMark | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.decode_step.median if self.decode_step.median > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "ttft_s": self.ttft.to_json(),
            "decode_step_s": self.decode_step.to_json(),
            "decode_tokens_per_s": round(self.tokens_per_s, 2),
            "bytes_per_step": self.bytes_per_step,
            "cache_bytes": self.cache_bytes,
            "load": self.load.to_json() if self.load is not None else None,
        }


@dataclass
class GenerationBench:
    rows: list[GenerationRow] = field(default_factory=list)
    bandwidth_bytes_per_s: float | None = None
    machine: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [r.to_json() for r in self.rows],
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "settings": self.settings,
        }


def copy_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """This machine's memory bandwidth as a large copy measures it: bytes read and written per second (best of
    ``repeats``), the ceiling of a decode step that reads every weight once."""
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


@dataclass
class GenerationRun:
    """One engine's (or rival's) generation call, which returns its time to first token and its decode steps'
    times, and the samples of its timed calls."""

    call: Callable[[], tuple[float, list[float]]]
    samples: list[tuple[float, list[float]]] = field(default_factory=list)

    def timed(self) -> CallTime:
        started = time.perf_counter()
        self.samples.append(self.call())
        return CallTime(time.perf_counter() - started)

    def row(
        self, name: str, batch: int, prompt_len: int, new_tokens: int, weights: int, cache: int, mark: LoadMark
    ) -> GenerationRow:
        """The row of the samples: ``weights`` and ``cache`` are the bytes a decode step reads of each."""
        ttfts = [t for t, _ in self.samples]
        steps = [statistics.median(d) for _, d in self.samples]
        return GenerationRow(
            name, batch, prompt_len, new_tokens, Spread.of(ttfts), Spread.of(steps), weights + cache, cache, mark
        )


def transformers_rival(
    model: Any, pad: int, *, compiled: bool = False
) -> Callable[[list[list[int]], int], GenerationRun] | None:
    """transformers' ``generate`` on ``model`` (None where it is no transformers model: the rival is left out);
    ``compiled``: with its static cache and the forward under ``torch.compile`` (fullgraph), as transformers'
    documentation speeds up generation, compiled in the untimed warm-up calls."""
    if model is None or not hasattr(model, "generate"):
        return None
    from transformers import GenerationConfig

    from tk.models.hf_generation import transformers_attention

    forward = torch.compile(model.forward, fullgraph=True) if compiled else model.forward
    cache = {"cache_implementation": "static"} if compiled else {}

    def make(prompts: list[list[int]], new_tokens: int) -> GenerationRun:
        ids = torch.tensor(prompts, dtype=torch.int64)
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=pad, **cache)  # fmt: skip

        def call() -> tuple[float, list[float]]:
            clock = _TokenClock()
            original, model.forward = model.forward, forward  # the eager rival shares the model: swapped back after
            try:
                with torch.no_grad(), transformers_attention(model):
                    started = time.perf_counter()
                    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
            finally:
                model.forward = original
            ticks = clock.ticks[1:]  # the first put is the prompt, before the prefill
            return ticks[0] - started, [b - a for a, b in itertools.pairwise(ticks)]

        return GenerationRun(call)

    return make


class _TokenClock:
    """A transformers streamer that notes when each token was chosen: one ``generate`` call gives its time to
    first token and each decode step (two calls of different lengths would build two static caches)."""

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def put(self, value: Any) -> None:
        self.ticks.append(time.perf_counter())

    def end(self) -> None:
        pass
