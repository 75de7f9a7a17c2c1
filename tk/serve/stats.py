"""Triton's statistics extension for ``tk serve``: per-replica counters, and their sum over replicas.

Each replica keeps an ``InferenceStats`` (cumulative, in nanoseconds, as Triton counts them: one
entry per request for success, fail, queue and the three compute phases; the compute phases of
a batch are charged in full to each of its requests; ``batch_stats`` once per engine call by its
batch size). ``triton_stats`` sums replicas' snapshots into the JSON that Triton's
``GET /v2/models/NAME/stats`` answers (``model_stats[]``), which ``tritonclient``'s
``get_inference_statistics`` and ``perf_analyzer`` read.

Under Ray Serve each replica pushes its snapshot to one named actor (``StatsBoard``) from a
background thread, at most every ``PUSH_INTERVAL_S`` and only after a change (nothing on the
request path waits for Ray); the replica that answers a stats request pushes its own snapshot
first, waits two push intervals for the others' last pushes to land, then reads every replica's
(on a loaded machine a push can take longer: the counts are then briefly behind, never lost). A replica that was replaced keeps its last snapshot on the
board, so the counts are cumulative for the model, as Triton's are.

Each replica's Prometheus text (``tk.serve.metrics``) goes with a push at most every
``METRICS_INTERVAL_S`` (and always with the answering replica's own push): writing it (``prometheus_client.generate_latest``) takes about a
millisecond of the replica's interpreter, which a push after every request took from the next
request's parsing. So ``/metrics`` shows other replicas' counts up to that interval late; the
statistics, whose snapshot is a dict copy, are not delayed.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
# Each push is a Ray actor call (CPU in the replica's core worker and in the board): at 0.05 s, two
# replicas under load kept the board at ~5% of a core and each replica's pusher at ~1%, on a 2-core machine
# where every share of a core is taken from the engines; at 0.2 s the board took ~2.5% (1.6% at 0.5 s).
# The price is a stats read's wait (two intervals: 0.4 s). benchmarks/history.md, Serving.
PUSH_INTERVAL_S = 0.2
METRICS_INTERVAL_S = 1.0
BOARD_NAME = "tk-serve-stats"
BOARD_NAMESPACE = "serve"


def _zero() -> dict[str, int]:
    return {"count": 0, "ns": 0}


class InferenceStats:
    """One replica's cumulative counters (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change: the pusher sends only new snapshots
        self.inference_count = 0  # samples inferred
        self.execution_count = 0  # engine calls
        self.last_inference_ms = 0  # wall clock of the last answered request, ms since the epoch
        self.phases = {phase: _zero() for phase in PHASES}
        self.batches: dict[int, dict[str, dict[str, int]]] = {}  # batch size -> compute phases

    def executed(self, batch_size: int, input_ns: int, infer_ns: int, samples: int | None = None) -> None:
        """One engine call over ``batch_size`` samples, of which ``samples`` (default all) came from
        clients: the rest pad a batch below the engine's minimum, and are not inferences (Triton's count)."""
        with self._lock:
            self.execution_count += 1
            self.inference_count += batch_size if samples is None else samples
            entry = self.batches.setdefault(
                batch_size, {p: _zero() for p in ("compute_input", "compute_infer", "compute_output")}
            )
            for phase, ns in (("compute_input", input_ns), ("compute_infer", infer_ns)):
                entry[phase]["count"] += 1
                entry[phase]["ns"] += ns
            self.version += 1

    def request(
        self, *, ok: bool, total_ns: int, queue_ns: int = 0, input_ns: int = 0, infer_ns: int = 0, output_ns: int = 0
    ) -> None:
        """One answered request: its time from arrival to reply, and (when it ran) its phases."""
        with self._lock:
            outcome = self.phases["success" if ok else "fail"]
            outcome["count"] += 1
            outcome["ns"] += total_ns
            if ok:
                for phase, ns in (
                    ("queue", queue_ns),
                    ("compute_input", input_ns),
                    ("compute_infer", infer_ns),
                    ("compute_output", output_ns),
                ):
                    self.phases[phase]["count"] += 1
                    self.phases[phase]["ns"] += ns
                self.last_inference_ms = int(time.time() * 1000)
            self.version += 1

    def snapshot(self) -> dict[str, Any]:
        """A plain, picklable copy."""
        with self._lock:
            return {
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "last_inference": self.last_inference_ms,
                "inference_stats": {p: dict(v) for p, v in self.phases.items()},
                "batch_stats": {size: {p: dict(v) for p, v in e.items()} for size, e in self.batches.items()},
            }


def merge(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts and times summed over replicas; ``last_inference`` is the latest."""
    total: dict[str, Any] = {
        "inference_count": 0,
        "execution_count": 0,
        "last_inference": 0,
        "inference_stats": {p: _zero() for p in PHASES},
        "batch_stats": {},
    }
    for snap in snapshots:
        total["inference_count"] += snap["inference_count"]
        total["execution_count"] += snap["execution_count"]
        total["last_inference"] = max(total["last_inference"], snap["last_inference"])
        for phase, value in snap["inference_stats"].items():
            for key in ("count", "ns"):
                total["inference_stats"][phase][key] += value[key]
        for size, entry in snap["batch_stats"].items():
            into = total["batch_stats"].setdefault(int(size), {p: _zero() for p in entry})
            for phase, value in entry.items():
                for key in ("count", "ns"):
                    into[phase][key] += value[key]
    return total


def triton_stats(name: str, merged: Mapping[str, Any], version: str = "1") -> dict[str, Any]:
    """Triton's ``/v2/models/NAME/stats`` reply for one model."""
    inference = {phase: dict(merged["inference_stats"][phase]) for phase in PHASES}
    inference |= {"cache_hit": _zero(), "cache_miss": _zero()}
    batches = [
        {"batch_size": size, **{p: dict(v) for p, v in entry.items()}}
        for size, entry in sorted(merged["batch_stats"].items())
    ]
    model = {
        "name": name,
        "version": version,
        "last_inference": merged["last_inference"],
        "inference_count": merged["inference_count"],
        "execution_count": merged["execution_count"],
        "inference_stats": inference,
        "batch_stats": batches,
        "memory_usage": [],
    }
    return {"model_stats": [model]}


class StatsBoard:
    """The Ray actor (``board``) holding every replica's latest snapshot, and its metrics text."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, Any]] = {}
        self.metrics: dict[str, bytes] = {}

    def report(self, replica: str, stats: dict[str, Any], metrics: bytes | None) -> None:
        """A replica's snapshot, and its metrics text when it sent one (None: keep the last)."""
        self.stats[replica] = stats
        if metrics is not None:
            self.metrics[replica] = metrics

    def read(self) -> tuple[list[dict[str, Any]], list[bytes]]:
        return list(self.stats.values()), list(self.metrics.values())


def board() -> Any:
    """The named ``StatsBoard`` actor of this Serve instance, created by the first replica that asks.

    Detached, so a replica that dies does not take every replica's counts with it; ``stop`` removes it."""
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=4)(StatsBoard)
    return actor.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached").remote()


def remove_board() -> None:
    """Kill the board (``tk serve`` stopping); nothing when there is none."""
    import ray

    try:
        ray.kill(ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE))
    except ValueError:
        pass


class Pusher:
    """A replica's background thread that sends its snapshot (and metrics text) to the board after each change."""

    def __init__(self, replica: str, stats: InferenceStats, metrics_text: Any) -> None:
        self.replica = replica
        self.stats = stats
        self.metrics_text = metrics_text  # () -> bytes
        self.board = board()
        self._sent = -1
        self._metrics_sent = -1  # the stats version the last metrics text went with
        self._metrics_at = -math.inf  # when (time.monotonic)
        self._wake = threading.Event()
        self._closed = False
        self._push_lock = threading.Lock()
        threading.Thread(target=self._loop, name="tk-stats-push", daemon=True).start()

    def changed(self) -> None:
        self._wake.set()

    def push(self, wait: bool = False) -> None:
        """Send the snapshot if it changed since the last, with the metrics text when it is due
        (``METRICS_INTERVAL_S``); ``wait``: both, now, and until the board has them."""
        import ray

        with self._push_lock:
            version = self.stats.version
            now = time.monotonic()
            metrics_due = wait or (self._metrics_sent != version and now - self._metrics_at >= METRICS_INTERVAL_S)
            if version == self._sent and not metrics_due:
                return
            metrics = self.metrics_text() if metrics_due else None
            ref = self.board.report.remote(self.replica, self.stats.snapshot(), metrics)
            self._sent = version
            if metrics_due:
                self._metrics_sent, self._metrics_at = version, now
        if wait:
            ray.get(ref, timeout=10)

    def read(self) -> tuple[list[dict[str, Any]], list[bytes]]:
        """Every replica's snapshot: this one's fresh, the others' after their next push could land
        (a replica pushes at once after a change, or at most ``PUSH_INTERVAL_S`` after its last push)."""
        import ray

        self.push(wait=True)
        time.sleep(2 * PUSH_INTERVAL_S)
        return ray.get(self.board.read.remote(), timeout=10)

    def _loop(self) -> None:
        while not self._closed:
            behind = self._metrics_sent != self.stats.version  # a change whose metrics text is not sent yet
            self._wake.wait(timeout=METRICS_INTERVAL_S if behind else None)
            self._wake.clear()
            try:
                self.push()
            except Exception:  # Ray shutting down: the next change tries again
                pass
            time.sleep(PUSH_INTERVAL_S)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
