"""``tk serve --tune``: choose max batch, batch delay and replicas by a bounded load test on loopback;
its recommendation is written as the settings file that ``tk serve --config`` reads (``tk.serve.config``).

Each point's replicas share the machine's cores: unless ``--threads`` fixes the engine's threads, a
point with R replicas runs each engine on ``cpus // R`` threads (``engine_threads`` in the file), not
on every core each: two replicas of two threads on 2 cores fight over them, while two of one thread
let one replica's Python (HTTP, batching) run while the other computes (benchmarks/history.md, Serving).

The tune starts one local Ray instance, then for each point of the grid (replicas × max batch ×
max delay, replicas limited to what the machine's CPUs hold at ``cpus_per_replica``) deploys the
app and sends ``requests`` requests from ``clients`` concurrent ``tritonclient.http`` clients, each
checked for a 200. Requests hold one sample each, or (``samples``, ``(low, high)``) a count drawn
uniformly from that range, seeded, the same at every point: the traffic the server will see, since
batching that gains with single-sample requests can lose with larger ones (benchmarks/history.md,
"Serving: requests of several samples"). With requests of up to ``high`` samples, a max batch of 1
is the point with batching off (each request runs alone, a max batch of ``high``), and a max batch
between 1 and ``high`` cannot hold every request and is skipped. Sequences are the artifact's opt
length, or (``seq``) lengths drawn from a range, since requests of different lengths never share
an engine call (``tk.serve.model_server``). A point is judged by its samples/s, and fits when no request
failed and its p99 latency is within ``p99_ms``; the recommendation is the fitting point with the
most samples/s (none fitting: the one with the lowest p99, said so). The whole tune is bounded: at
most ``MAX_POINTS`` points, and no point starts after ``budget_s`` (points left are reported as
skipped). Numbers depend on what else the machine runs: tune on the machine that serves.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tk.errors import UsageError
from tk.limits import MAX_TUNE_REQUESTS, require_within_budget
from tk.manifest import verify_artifact
from tk.runtime.inputs import sample_dim
from tk.serve.config import ServeConfig, apply_settings, resolve
from tk.serve.ingress import free_ports
from tk.serve.lifecycle import redeploy, start, stop
from tk.serve.load.clients import send_requests
from tk.spec import Signature, feeds_nbytes, random_feeds

MAX_POINTS = 64
# what the tune keeps per request besides its inputs (a slot in the load, a latency and a reply by id):
# the memory --tune-requests asks for, budgeted before any is allocated
REQUEST_BOOKKEEPING_BYTES = 512


@dataclass(frozen=True)
class TuneGrid:
    max_batch: Sequence[int]
    max_delay_ms: Sequence[float]
    replicas: Sequence[int]


@dataclass
class TunePoint:
    replicas: int
    max_batch: int
    max_delay_ms: float
    requests: int = 0
    failed: int = 0
    samples_per_s: float = math.nan
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    skipped: str | None = None  # why it did not run
    fits: bool = False
    engine_threads: int | None = None  # each replica's engine threads (None: the engine's default)
    batching: bool = True  # False: each request runs alone (the max batch only bounds a request's samples)

    def settings(self) -> dict[str, Any]:
        chosen = {
            "replicas": self.replicas,
            "max_batch": self.max_batch,
            "max_delay_ms": self.max_delay_ms,
            "batching": self.batching,
        }
        return chosen | ({"engine_threads": self.engine_threads} if self.engine_threads is not None else {})


@dataclass
class TuneResult:
    points: list[TunePoint]
    best: TunePoint | None
    within_budget: bool  # best met the p99 budget (False: the lowest p99 was chosen instead)
    p99_ms: float
    cpus: int
    samples: tuple[int, int] = (1, 1)  # the fewest and most samples a request held
    seq: tuple[int, int] | None = None  # the shortest and longest sequence (None: the artifact's opt)


def parse_range(flag: str, text: str) -> tuple[int, int]:
    """``--tune-samples`` or ``--tune-seq``: ``N`` or ``A-B`` (1 <= A <= B) as ``(A, B)``; ``UsageError`` otherwise."""
    parts = text.strip().split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        raise UsageError(f"{flag}: expected N or A-B with 1 <= A <= B, got {text!r}")
    return low, high


def grid_points(
    grid: TuneGrid, cpus: int, cpus_per_replica: float, threads: int | None = None, largest: int = 1
) -> list[TunePoint]:
    """The grid's points, replicas first; those the CPUs cannot hold are skipped with the reason. Each
    replica's engine runs ``threads`` threads, or (None) its share of the CPUs: ``cpus // replicas``.
    ``largest``: the most samples a request holds (a max batch of 1 is then batching off; see the module)."""
    points = []
    for replicas, batch, delay in itertools.product(grid.replicas, grid.max_batch, grid.max_delay_ms):
        if replicas < 1 or batch < 1 or not (math.isfinite(delay) and delay >= 0):
            raise UsageError(
                f"--tune grid: expected replicas and batches of 1 or more and delays of 0 or more ms, got {replicas}, {batch}, {delay}"
            )
        if batch == 1 and delay != min(grid.max_delay_ms):
            continue  # a batch of one never waits for another request: its other delays are the same point
        point = TunePoint(replicas, batch, float(delay), engine_threads=threads or max(1, cpus // replicas))
        if batch == 1 and largest > 1:
            point.max_batch, point.batching = largest, False
        elif batch < largest:
            point.skipped = f"below the largest request ({largest} samples)"
        if replicas * cpus_per_replica > cpus:
            point.skipped = f"{replicas} x {cpus_per_replica:g} CPUs > {cpus}"
        points.append(point)
    if len(points) > MAX_POINTS:
        raise UsageError(f"--tune grid: expected at most {MAX_POINTS} points, got {len(points)}")
    return points


def recommend(points: list[TunePoint], p99_ms: float) -> tuple[TunePoint | None, bool]:
    """The fitting point with the most samples/s, or (none fits) the run one with the lowest p99."""
    ran = [p for p in points if p.skipped is None and p.requests and p.failed == 0]
    for p in ran:
        p.fits = p.p99_ms <= p99_ms
    fitting = [p for p in ran if p.fits]
    if fitting:
        return max(fitting, key=lambda p: p.samples_per_s), True
    if ran:
        return min(ran, key=lambda p: p.p99_ms), False
    return None, False


def tune(
    base: ServeConfig,
    grid: TuneGrid,
    *,
    p99_ms: float,
    requests: int = 200,
    clients: int = 16,
    samples: tuple[int, int] = (1, 1),
    seq: tuple[int, int] | None = None,
    budget_s: float = 300.0,
    cpus: int | None = None,
    on_point: Callable[[TunePoint], None] | None = None,
) -> TuneResult:
    """Load-test ``base`` at each grid point on a local Ray instance; see the module."""
    _check_bounds(p99_ms, requests, clients, budget_s)
    cpus = cpus or os.cpu_count() or 1
    sig = verify_artifact(base.artifact).signature
    points = _points(base, grid, sig, cpus, samples, requests, seq)
    runnable = [p for p in points if p.skipped is None]
    resolved = resolve(
        replace(base, host="127.0.0.1", port=free_ports(1)[0], max_batch=max(p.max_batch for p in runnable))
    )

    def settings_of(point: TunePoint) -> ServeConfig:
        # what a point's max batch implies (requests held, the largest body) follows it, as it will when served
        unresolved = replace(resolved, max_ongoing=base.max_ongoing, max_request_bytes=base.max_request_bytes)
        return resolve(apply_settings(unresolved, point.settings()))

    counts, load = _load(sig, samples, seq, requests)
    deadline = time.monotonic() + budget_s
    first = runnable[0]
    running = start(settings_of(first), num_cpus=cpus)
    try:
        for point in runnable:
            if time.monotonic() > deadline:
                point.skipped = f"time budget of {budget_s:g} s spent"
                continue
            config = settings_of(point)
            if point is not first:
                redeploy(config)
            _measure(point, config, load, counts, clients, deadline, budget_s)
            if point.skipped is None and on_point is not None:
                on_point(point)
    finally:
        stop(running)
    best, within = recommend(points, p99_ms)
    return TuneResult(points, best, within, p99_ms, cpus, samples, seq)


def _check_bounds(p99_ms: float, requests: int, clients: int, budget_s: float) -> None:
    """``UsageError`` for a p99 budget, request count, client count or time budget out of range."""
    if not (math.isfinite(p99_ms) and p99_ms > 0):
        raise UsageError(f"--p99-ms: expected a number of milliseconds above 0, got {p99_ms}")
    if requests < 1 or clients < 1 or not budget_s > 0:
        raise UsageError(
            f"--tune-requests/--tune-clients/--tune-budget-s: expected 1 or more, got {requests}/{clients}/{budget_s}"
        )
    if requests > MAX_TUNE_REQUESTS:
        raise UsageError(f"--tune-requests: expected at most {MAX_TUNE_REQUESTS} per point, got {requests}")


def _points(
    base: ServeConfig,
    grid: TuneGrid,
    sig: Signature,
    cpus: int,
    samples: tuple[int, int],
    requests: int,
    seq: tuple[int, int] | None,
) -> list[TunePoint]:
    """The grid's points for this artifact and machine (at least one runnable), once the load fits memory."""
    low, high = samples
    limit = sig.dims.get(sample_dim(sig.inputs))
    if limit is not None and high > limit.max:
        raise UsageError(
            f"--tune-samples {low}-{high}: this artifact's batch max is {limit.max}; use at most {limit.max}"
        )
    require_within_budget(load_bytes(sig, requests, high, seq), f"--tune-requests {requests} (the tune's load)")
    points = grid_points(grid, cpus, base.cpus_per_replica, base.engine.options.get("threads"), largest=high)
    for point in points:
        if point.skipped is None and limit is not None and point.max_batch > limit.max:
            point.skipped = f"above this artifact's batch max ({limit.max})"
    if all(p.skipped is not None for p in points):
        raise UsageError("--tune grid: no point fits this machine's CPUs and this artifact's batch max")
    return points


def _load(
    sig: Signature, samples: tuple[int, int], seq: tuple[int, int] | None, requests: int
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Each distinct request's sample count (at most 256, seeded) and the ``requests`` requests, which
    repeat the distinct ones."""
    low, high = samples
    distinct = min(requests, 256)
    counts = np.random.default_rng(0).integers(low, high + 1, size=distinct)
    sizes = [{**sig.opt_sizes(), sample_dim(sig.inputs): int(count)} for count in counts]
    if seq is not None:
        for size, length in zip(sizes, _lengths(sig, seq, distinct), strict=True):
            size["seq"] = length
    feeds = [random_feeds(sig.inputs, size, seed=i) for i, size in enumerate(sizes)]
    return counts, [feeds[i % len(feeds)] for i in range(requests)]


def _measure(
    point: TunePoint,
    config: ServeConfig,
    load: list[dict[str, np.ndarray]],
    counts: np.ndarray,
    clients: int,
    deadline: float,
    budget_s: float,
) -> None:
    """Warm the deployed ``point`` up, then send it ``load`` and keep its numbers (or why it was cut short)."""
    model = str(config.name)
    send_requests(config.port, model, load[: min(len(load), 2 * clients)], clients, deadline=deadline)  # warm
    result = send_requests(config.port, model, load, clients, deadline=deadline)
    sent = len(result.latencies) + len(result.failures)
    if sent < len(load):  # the deadline came during this point: its numbers are not the others'
        point.skipped = f"time budget of {budget_s:g} s spent during this point ({sent} of {len(load)} requests)"
        return
    latencies = sorted(result.latencies.values())
    point.requests = len(latencies) + len(result.failures)
    point.failed = len(result.failures)
    if latencies:
        answered = sum(int(counts[i % len(counts)]) for i in result.latencies)
        point.samples_per_s = answered / result.wall_s
        point.p50_ms = float(np.percentile(latencies, 50)) * 1e3
        point.p99_ms = float(np.percentile(latencies, 99)) * 1e3


def load_bytes(sig: Signature, requests: int, samples: int, seq: tuple[int, int] | None) -> int:
    """Bytes the tune holds for ``requests`` requests of up to ``samples`` samples (and ``seq`` tokens):
    its distinct inputs (at most 256, at the largest sizes) and each request's bookkeeping."""
    sizes = {**sig.opt_sizes(), sample_dim(sig.inputs): samples}
    if seq is not None and "seq" in sig.dims:
        sizes["seq"] = seq[1]
    return min(requests, 256) * feeds_nbytes(sig.inputs, sizes) + requests * REQUEST_BOOKKEEPING_BYTES


def _lengths(sig: Signature, seq: tuple[int, int], count: int) -> list[int]:
    """``count`` sequence lengths drawn from ``seq`` (seeded); ``UsageError`` where the artifact has no
    ``seq`` dimension or takes no such lengths."""
    dim = sig.dims.get("seq")
    if dim is None:
        raise UsageError(
            f"--tune-seq: this artifact has no seq dimension (its dimensions: {', '.join(sig.dims) or 'none'})"
        )
    low, high = seq
    if low < dim.min or high > dim.max:
        raise UsageError(f"--tune-seq {low}-{high}: this artifact takes sequences of {dim.min} to {dim.max}")
    return [int(n) for n in np.random.default_rng(1).integers(low, high + 1, size=count)]


def recommended_settings(result: TuneResult, base: ServeConfig) -> dict[str, Any]:
    """What ``--tune`` writes: the best point's settings with the base's CPUs per replica."""
    if result.best is None:
        raise UsageError("--tune: expected at least one grid point to run without failures, none did")
    return {**result.best.settings(), "cpus_per_replica": float(base.cpus_per_replica)}
