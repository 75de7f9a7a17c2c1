"""CUDA graphs per input shape for the torch engines.

TF32 scoping lives in ``tk.formats.tf32`` (export compiles under it too).

**CUDA graphs.** ``GraphCache`` captures a function once per input signature (shapes and dtypes)
into a CUDA graph with static input and output buffers, all graphs sharing one memory pool, at
most ``max_graphs`` of them (further shapes run without a graph). The first replay of each
captured shape is compared with a normal call; a graph whose replay differs is dropped and that
shape runs normally. A call with another shape never replays a stale graph: the key is the shape.
``ShapeCache`` is the bookkeeping, free of CUDA, so it is tested on any machine.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class ShapeCache(Generic[T]):
    """Entries made once per key, at most ``capacity`` of them; keys past that get no entry.

    A key can be marked ``refused`` (its entry failed or misbehaved): it never gets one again.
    ``stats`` counts hits, entries made, keys past capacity and refusals, for ``settings()``.
    """

    capacity: int
    entries: dict[Hashable, T] = field(default_factory=dict)
    refused: dict[Hashable, str] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=lambda: {"hits": 0, "made": 0, "over_capacity": 0, "refused": 0})

    def get_or_make(self, key: Hashable, make: Callable[[], T]) -> T | None:
        """The entry of ``key``, made on first use; None when refused or past capacity."""
        if key in self.entries:
            self.stats["hits"] += 1
            return self.entries[key]
        if key in self.refused:
            return None
        if len(self.entries) >= self.capacity:
            self.stats["over_capacity"] += 1
            return None
        entry = make()
        self.entries[key] = entry
        self.stats["made"] += 1
        return entry

    def refuse(self, key: Hashable, reason: str) -> None:
        self.entries.pop(key, None)
        self.refused[key] = reason
        self.stats["refused"] += 1


def signature_of(args: tuple[torch.Tensor, ...]) -> tuple[Hashable, ...]:
    """What a captured graph depends on: each input's shape, dtype and device."""
    return tuple((tuple(a.shape), a.dtype, str(a.device)) for a in args)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    verified: bool = False


class GraphCache:
    """``fn`` on CUDA tensors, replayed from a CUDA graph per input signature (see the module doc)."""

    def __init__(
        self, fn: Callable[..., Any], *, max_graphs: int = 8, warmup: int = 2, rtol: float = 1e-5, atol: float = 1e-6
    ) -> None:
        self.fn = fn
        self.cache: ShapeCache[_Captured] = ShapeCache(max_graphs)
        self.warmup = warmup
        self.rtol, self.atol = rtol, atol
        self.pool = None  # one memory pool for every graph, made at the first capture

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key = signature_of(args)
        captured = self.cache.get_or_make(key, lambda: self._capture(args))
        if captured is None:
            return _as_tuple(self.fn(*args))
        for static, arg in zip(captured.inputs, args, strict=True):
            static.copy_(arg)
        captured.graph.replay()
        replayed = tuple(o.clone() for o in captured.outputs)  # the buffers are overwritten by the next replay
        if not captured.verified:
            expected = _as_tuple(self.fn(*args))
            same = len(expected) == len(replayed) and all(
                torch.allclose(r, e, rtol=self.rtol, atol=self.atol, equal_nan=True)
                for r, e in zip(replayed, expected, strict=True)
            )
            if not same:
                self.cache.refuse(key, "its first replay differed from a normal call")
                return expected
            captured.verified = True
        return replayed

    def _capture(self, args: tuple[torch.Tensor, ...]) -> _Captured:
        static = tuple(a.clone() for a in args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's docs require
            for _ in range(self.warmup):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = _as_tuple(self.fn(*static))
        return _Captured(graph, static, outputs)

    def stats(self) -> dict[str, Any]:
        return {**self.cache.stats, "graphs": len(self.cache.entries), "refused_shapes": len(self.cache.refused)}


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
