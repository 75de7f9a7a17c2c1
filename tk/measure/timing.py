"""One timed engine call, the way trtexec times one: with or without the copies to and from the GPU.

``--io device``: inputs already live on the engine's device and outputs stay there, so only the
engine is timed. ``--io host``: inputs start in host memory (pinned on CUDA, so copies can run
asynchronously) and outputs are copied back into pinned buffers; on CUDA, events split each call
into host-to-device copy, compute and device-to-host copy. On the CPU both modes time the engine
call; ``device`` hands it torch tensors, ``host`` NumPy arrays (the command line's and files' kind).

``interleave`` is the one timing loop of ``tk``: one call of each timed callable in turn, in a new
seeded random order each round, so machine noise hits all of them alike; ``timed`` turns any
callable into one it can time, ``interleave_calls`` does both for plain callables under the load
guard, and ``Spread`` summarizes the samples (median, quartiles, range). ``time_in_blocks`` times runs of
consecutive calls instead, each callable's block in turn: how a served model runs, where one call's
caches and threads are its next call's (what tells two settings of one engine apart).
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tk.measure.load_guard import LoadGuard, LoadMark, quiet_or_marked

IO_MODES = ("host", "device")


@dataclass
class CallTime:
    total_s: float  # wall clock of the whole call, device synchronized
    h2d_ms: float | None = None  # CUDA events; None on the CPU
    compute_ms: float | None = None
    d2h_ms: float | None = None
    cpu_s: float | None = None  # process CPU time of the call (every thread), where it was read


class CallTimer:
    """Times calls of ``engine`` on ``feeds`` (NumPy, as ``random_inputs`` makes them) in ``io`` mode.

    Buffers (device copies of the inputs, pinned input and output buffers) are made once here,
    not per call; the feeds are checked once, then every timed call skips the checks.
    """

    def __init__(self, engine: Any, feeds: dict[str, np.ndarray], io: str = "host") -> None:
        self.engine = engine
        self.io = io
        self.cuda = getattr(engine, "device", "cpu") == "cuda"
        engine.check_feeds(feeds)
        if self.cuda:  # made once: the timed calls allocate nothing of their own
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        if io == "device":
            self.feeds: dict[str, Any] = {
                k: torch.from_numpy(np.ascontiguousarray(v)).to(engine.device) for k, v in feeds.items()
            }
        elif self.cuda:
            self.host = {k: torch.from_numpy(np.ascontiguousarray(v)).pin_memory() for k, v in feeds.items()}
            self.feeds = {k: torch.empty_like(v, device=engine.device) for k, v in self.host.items()}
            self.outputs: dict[str, torch.Tensor] | None = None  # pinned, made at the first call
        else:
            self.feeds = feeds

    def __call__(self) -> CallTime:
        if not self.cuda:
            start = time.perf_counter()
            self.engine.run(self.feeds, check=False)
            return CallTime(time.perf_counter() - start)
        events = self.events
        torch.cuda.synchronize()
        start = time.perf_counter()
        events[0].record()
        if self.io == "host":
            for name, dev in self.feeds.items():
                dev.copy_(self.host[name], non_blocking=True)
        events[1].record()
        out = self.engine.run(self.feeds, check=False)
        events[2].record()
        if self.io == "host":
            if self.outputs is None:
                self.outputs = {k: torch.empty_like(v, device="cpu").pin_memory() for k, v in out.items()}
            for name, value in out.items():
                self.outputs[name].copy_(value, non_blocking=True)
        events[3].record()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        h2d, compute, d2h = (events[i].elapsed_time(events[i + 1]) for i in range(3))
        if self.io == "device":
            return CallTime(total, None, compute, None)
        return CallTime(total, h2d, compute, d2h)


def peak_gpu_memory_reset(cuda: bool) -> None:
    if cuda:
        torch.cuda.reset_peak_memory_stats()


def peak_gpu_memory_mb(cuda: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if cuda else None


def timed(fn: Callable[[], object]) -> Callable[[], CallTime]:
    """``fn`` as a timer: each call returns its wall time and the process CPU time it used."""

    def call() -> CallTime:
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        return CallTime(time.perf_counter() - start, cpu_s=time.process_time() - cpu)

    return call


def interleave(
    timers: Mapping[str, Callable[[], CallTime]],
    *,
    iters: int | None = None,
    seconds: float | None = None,
    min_rounds: int = 3,
    between: Sequence[Callable[[], object]] = (),
    seed: int = 0,
) -> dict[str, list[CallTime]]:
    """Each timer's call times, timed round-robin until ``iters`` rounds or the budget is reached.

    The budget is ``seconds`` per timer (so rounds stop after ``seconds * len(timers)`` of timed
    calls, but not before ``min_rounds``). ``between`` are untimed calls shuffled into every round
    (a peak measurement that keeps its own samples, so that it sees the same machine as the timers).
    The garbage collector is off while timing.
    """
    if iters is None and seconds is None:
        raise ValueError("interleave: expected iters or seconds")
    times: dict[str, list[CallTime]] = {label: [] for label in timers}
    order: list[tuple[str | None, Callable[[], Any]]] = [*timers.items(), *((None, c) for c in between)]
    shuffle = random.Random(seed).shuffle
    budget = None if seconds is None else seconds * len(timers)
    spent, rounds = 0.0, 0
    with _gc_off():
        while timers:
            if iters is not None and rounds >= iters:
                break
            if budget is not None and spent >= budget and rounds >= min(min_rounds, iters or min_rounds):
                break
            # A new order every round: a rotated fixed order keeps each timer behind the same
            # neighbour, and on few cores a call pays for its predecessor's threads going idle.
            shuffle(order)
            for label, call in order:
                result = call()
                if label is not None:
                    times[label].append(result)
                    spent += result.total_s
            rounds += 1
    return times


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    """The garbage collector off (after a collection) while timing: no call pays for another's garbage."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_in_blocks(calls: Mapping[str, Callable[[], object]], *, rounds: int, block: int, order: Sequence[str],
                   between: Sequence[Callable[[], object]] = ()) -> dict[str, list[float]]:  # fmt: skip
    """Each call's times in seconds: ``rounds`` rounds of ``block`` calls of each in turn (``order``, rotated by
    one every round and reversed every other round: a rotation alone keeps each call's predecessor), one
    untimed call before each block; ``between`` runs after every block. The garbage collector is off while
    timing."""
    times: dict[str, list[float]] = {name: [] for name in order}
    with _gc_off():
        for r in range(rounds):
            turn = [*order[r % len(order) :], *order[: r % len(order)]]
            turn = turn[::-1] if r % 2 else turn
            for name in turn:
                call = calls[name]
                call()  # the block's first call pays for the previous one's caches
                for _ in range(block):
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
                for other in between:
                    other()
    return times


def interleave_calls(
    calls: Mapping[str, Callable[[], object]],
    *,
    iters: int,
    guard: LoadGuard | None = None,
    between: Sequence[Callable[[], object]] = (),
    warmup: int = 2,
) -> tuple[dict[str, list[CallTime]], LoadMark]:
    """Each of ``calls`` warmed up ``warmup`` times, then timed (wall and process CPU time) in
    ``iters`` interleaved rounds under ``guard`` (``between``: untimed calls in every round); the
    times by name and the load mark of the rounds."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    timers = {name: timed(call) for name, call in calls.items()}
    return quiet_or_marked(lambda: interleave(timers, iters=iters, between=between), guard)


def ms(samples: Sequence[float]) -> float:
    """The median of ``samples`` seconds, in milliseconds."""
    return 1e3 * statistics.median(samples)


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and range of a sample."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of: expected at least one value")
        ordered = sorted(values)
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))

    def to_json(self, digits: int = 4) -> dict[str, float | int]:
        def r(v: float) -> float:
            return float(f"{v:.{digits}g}")

        return {
            "median": r(self.median),
            "q1": r(self.q1),
            "q3": r(self.q3),
            "min": r(self.min),
            "max": r(self.max),
            "n": self.n,
        }
