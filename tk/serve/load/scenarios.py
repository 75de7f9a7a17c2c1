"""The load test of ``tk serve`` (``scripts/load_test.py``): one Serve replica of an ONNX artifact on
a local Ray instance, dynamic batching on and off, the scenarios as rows.

- ``mixed``: concurrent clients send requests of 1-4 samples; every reply is compared with the
  eager model on the same samples (the artifact's tolerance); lost, duplicated and mismatched
  replies are counted;
- ``single``: the same clients, one sample per request (through this module's clients, or through
  Triton's ``perf_analyzer`` at concurrency 1 and ``clients``);
- ``one client``: one client, batch 1, each served request followed by the same call on the
  engine in this process (interleaved, so both see the same machine): the serving overhead.

``engine_batch_bound`` times the engine alone at batch 1 and at the max batch: the most that
batching can gain on this machine, whatever the server does. Every scenario runs under the load
guard, and its row carries the load mark.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tk.measure.load_guard import LoadGuard, quiet_or_marked
from tk.measure.timing import interleave_calls
from tk.runtime import EngineChoice, load
from tk.serve.config import ServeConfig, apply_settings, resolve
from tk.serve.ingress import free_ports
from tk.serve.lifecycle import redeploy, start, stop
from tk.serve.load.clients import LoadResult, client, health_latency_ms, infer_inputs, send_requests
from tk.serve.load.perf_analyzer import find_perf_analyzer, run_perf_analyzer
from tk.spec import TensorSpec, random_feeds

Feeds = dict[str, np.ndarray]
OUTPUT = "logits"
WARM_CALLS = 10  # one-client calls left out before the timed ones


@dataclass
class LoadTestSettings:
    """The script's options."""

    clients: int = 16
    max_batch: int = 32  # samples per engine call with batching on
    max_delay_ms: float = 0.0
    threads: int = 2  # engine intra-op threads
    one_client_requests: int = 200
    ingress: str = "haproxy"
    client: str = "tritonclient"  # or perf_analyzer: what measures the single-sample scenario
    guard: LoadGuard = field(default_factory=LoadGuard)
    # perf_analyzer's windows must agree within this; its default 10 % can fail ("Failed to obtain stable
    # measurement") when the server and its clients share the machine's cores (benchmarks/history.md#serving)
    pa_stability_percent: float = 25.0
    # a settings file's values (tk serve --tune wrote it): they win over the fields above
    serve_settings: dict[str, Any] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def make_requests(inputs: Sequence[TensorSpec], seq: int, count: int) -> tuple[list[Feeds], list[Feeds]]:
    """``count`` mixed requests (1-4 samples each) and ``count`` single-sample ones, valid random data."""
    rng = np.random.default_rng(0)
    mixed = [random_feeds(inputs, {"batch": int(rng.integers(1, 5)), "seq": seq}, seed=i) for i in range(count)]
    single = [random_feeds(inputs, {"batch": 1, "seq": seq}, seed=10**6 + i) for i in range(count)]
    return mixed, single


def expected_outputs(engine: Any, requests: Sequence[Feeds], max_batch: int) -> list[np.ndarray]:
    """Each request's ``logits`` from ``engine``, computed in batches of up to ``max_batch`` samples
    (every request has the same sequence length) and split back per request."""
    expected: list[np.ndarray] = []
    start = 0
    while start < len(requests):
        stop, samples = start, 0
        while stop < len(requests) and samples + len(requests[stop]["input_ids"]) <= max_batch:
            samples += len(requests[stop]["input_ids"])
            stop += 1
        chunk = requests[start:stop]
        logits = engine.run({name: np.concatenate([r[name] for r in chunk]) for name in chunk[0]})[OUTPUT]
        for r in chunk:
            expected.append(logits[: len(r["input_ids"])])
            logits = logits[len(r["input_ids"]) :]
        start = stop
    return expected


def mismatches(result: LoadResult, expected: Sequence[np.ndarray], rtol: float, atol: float) -> tuple[int, float]:
    """How many replies differ from ``expected`` beyond the tolerance, and the worst absolute error."""
    mismatched, worst = 0, 0.0
    for i, want in enumerate(expected):
        got = result.replies.get(i)
        if got is None:
            continue
        if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
            mismatched += 1
        if got.shape == want.shape:
            worst = max(worst, float(np.abs(got - want).max()))
    return mismatched, worst


def scenario_row(
    name: str,
    batching: bool,
    requests: Sequence[Feeds],
    result: LoadResult,
    expected: Sequence[np.ndarray] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> dict[str, Any]:
    """One scenario's row: throughput, latency percentiles, lost, duplicated and mismatched replies."""
    latencies = list(result.latencies.values())
    samples = sum(len(r["input_ids"]) for r in requests)
    mismatched, worst = mismatches(result, expected, rtol, atol) if expected is not None else (None, None)
    return {
        "scenario": name,
        "batching": batching,
        "requests": len(requests),
        "samples": samples,
        "lost": len(requests) - len(result.replies),
        "duplicated": result.duplicates,
        "mismatched": mismatched,
        "max_abs_error": worst,
        "seconds": result.wall_s,
        "requests_per_s": len(result.replies) / result.wall_s,
        "samples_per_s": samples / result.wall_s,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "first_failure": next(iter(result.failures.values()), None),
    }


def engine_batch_bound(
    root: Path, inputs: Sequence[TensorSpec], seq: int, max_batch: int, threads: int, guard: LoadGuard, rounds: int = 5
) -> dict[str, Any]:
    """The onnx engine alone, in this process: samples/s at batch 1 and at ``max_batch``, interleaved."""
    feeds = {b: random_feeds(inputs, {"batch": b, "seq": seq}, seed=b) for b in (1, max_batch)}
    calls = {b: max(1, max_batch // b) for b in feeds}  # the same number of samples at each size
    with load(root, "onnx", threads=threads, spinning=False) as engine:  # as tk serve runs it
        for f in feeds.values():
            engine.check_feeds(f)

        def samples(b: int) -> Callable[[], None]:
            return lambda: [engine.run(feeds[b], check=False) for _ in range(calls[b])]

        times, mark = interleave_calls({b: samples(b) for b in feeds}, iters=rounds, guard=guard, warmup=1)
    one, many = (calls[b] * b / statistics.median(t.total_s for t in times[b]) for b in (1, max_batch))
    return {
        "batch1_samples_per_s": one, "max_batch": max_batch, "max_batch_samples_per_s": many, "gain": many / one,
    } | mark.to_json()  # fmt: skip


def engine_split_bound(
    root: Path, seq: int, max_batch: int, processes: int, guard: LoadGuard, seconds: float = 5.0
) -> dict[str, Any]:
    """The onnx engine in ``processes`` processes of one thread each, all at ``max_batch`` at once: their
    samples/s together, as replicas that split the cores (``tk serve --tune``) run it.

    Where one engine on every core shares each product among its threads, engines of one thread each
    run whole products side by side: on the 2-core AVX2 EPYC two 1-thread engines ran 1.2-1.5x the
    samples/s of one 2-thread engine (small Transformer, seq 128; benchmarks/history.md), so the engine's
    best is the better of the two."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads of this process
    start, results = context.Barrier(processes + 1), context.Queue()
    workers = [
        context.Process(target=_split_worker, args=(str(root), seq, max_batch, seconds, start, results, i))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        with guard.row() as mark:
            try:
                start.wait(timeout=300)  # each has opened and warmed its engine
            except threading.BrokenBarrierError:  # a worker failed: its message is in the queue
                raise RuntimeError(f"an engine process failed: {results.get(timeout=30)}") from None
            counts = [results.get(timeout=seconds + 300) for _ in workers]
            for worker in workers:
                worker.join(timeout=60)  # reaped before the row ends: their CPU is this run's own
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    failed = [c for c in counts if isinstance(c, str)]
    if failed:
        raise RuntimeError(f"an engine process failed: {failed[0]}")
    return {
        "processes": processes, "threads_each": 1, "max_batch": max_batch,
        "samples_per_s": sum(samples / elapsed for samples, elapsed in counts),
    } | mark.to_json()  # fmt: skip


def _split_worker(root: str, seq: int, batch: int, seconds: float, start: Any, results: Any, seed: int) -> None:
    try:
        with load(root, "onnx", threads=1, spinning=False) as engine:
            feeds = random_feeds(engine.inputs, {"batch": batch, "seq": seq}, seed=seed)
            engine.check_feeds(feeds)
            for _ in range(2):
                engine.run(feeds, check=False)
            start.wait(timeout=300)
            samples, began = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - began) < seconds:
                engine.run(feeds, check=False)
                samples += batch
            results.put((samples, elapsed))
    except Exception as exc:  # said in the parent's error
        start.abort()
        results.put(f"{type(exc).__name__}: {exc}")


def one_client_row(port: int, model: str, root: Path, requests: Sequence[Feeds], threads: int) -> dict[str, Any]:
    """One client, batch 1: each request served, then the same call on the engine in this process."""
    connection = client(port)
    served, alone = [], []
    with load(root, "onnx", threads=threads, spinning=False) as engine:  # as tk serve runs it
        warm = requests[:WARM_CALLS]
        for feeds in [*warm, *requests]:
            inputs = infer_inputs(feeds)
            t0 = time.perf_counter()
            connection.infer(model, inputs)
            t1 = time.perf_counter()
            engine.run(feeds)
            t2 = time.perf_counter()
            served.append((t1 - t0) * 1e3)
            alone.append((t2 - t1) * 1e3)
    served, alone = served[len(warm) :], alone[len(warm) :]
    return {
        "scenario": "one client",
        "batching": False,
        "requests": len(requests),
        "samples": len(requests),
        "lost": 0,
        "duplicated": 0,
        "mismatched": None,
        "p50_ms": statistics.median(served),
        "p99_ms": percentile(served, 99),
        "samples_per_s": 1e3 / statistics.mean(served),
        "engine_p50_ms": statistics.median(alone),
        "overhead_p50_ms": statistics.median(s - a for s, a in zip(served, alone, strict=True)),
        "health_p50_ms": health_latency_ms(port, len(requests)),
    }


def perf_analyzer_rows(
    port: int, requests: Sequence[Mapping[str, np.ndarray]], clients: int, batching: bool, model: str = "transformer",
    **options: Any,
) -> list[dict]:  # fmt: skip
    """The ``single`` scenario through Triton's perf_analyzer, at concurrency 1 and ``clients``
    (``options``: ``run_perf_analyzer``'s measurement settings)."""
    tool = find_perf_analyzer()
    samples = [{name: a[0] for name, a in r.items()} for r in requests[:64]]
    with tempfile.TemporaryDirectory(prefix="tk-pa-") as tmp:
        measured, _ = run_perf_analyzer(
            tool, f"127.0.0.1:{port}", model, samples, sorted({1, clients}), out_dir=Path(tmp), **options
        )
    return [
        {
            "scenario": "single" if row.concurrency == clients else f"single c={row.concurrency}",
            "client": "perf_analyzer",
            "concurrency": row.concurrency,
            "batching": batching,
            "requests": None,
            "samples": None,
            "lost": 0,  # perf_analyzer ends with an error on a failed request
            "duplicated": 0,
            "mismatched": None,
            "samples_per_s": row.inferences_per_s,
            "p50_ms": row.p50_ms,
            "p99_ms": row.p99_ms,
            "server_queue_ms": row.server_queue_ms,
            "server_compute_ms": row.server_compute_ms,
            "server_infer_ms": row.server_infer_ms,
            "avg_ms": row.avg_ms,
            "overhead_avg_ms": row.overhead_ms,
        }
        for row in measured
    ]


def run_scenarios(
    root: Path,
    mixed: list[Feeds],
    expected: list[np.ndarray],
    single: list[Feeds],
    tolerance: tuple[float, float],
    s: LoadTestSettings,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict[str, Any]], str]:
    """Start ``tk serve`` on ``root`` (Ray on 2 CPUs, one replica), run every scenario with batching
    on, then off; the rows and the ingress that ran."""
    base = ServeConfig(
        str(root), engine=EngineChoice("onnx", options={"threads": s.threads}), port=free_ports(1)[0],
        max_batch=s.max_batch, max_delay_ms=s.max_delay_ms, max_queue=-1, cpus_per_replica=1, ingress=s.ingress,
    )  # fmt: skip
    base = apply_settings(base, {k: v for k, v in s.serve_settings.items() if k != "batching"})
    threads = base.engine.options.get("threads", s.threads)  # each replica's, as served
    rows: list[dict[str, Any]] = []
    one = single[: s.one_client_requests]
    running = start(base, num_cpus=2)
    try:
        for batching in (True, False):
            cfg = resolve(replace(running.config, batching=batching))
            if not batching:
                redeploy(cfg)
            rows += _scenarios(cfg.port, str(cfg.name), batching, mixed, expected, single, tolerance, s, say)
            if not batching:
                row, mark = quiet_or_marked(
                    lambda c=cfg: one_client_row(c.port, str(c.name), root, one, threads), s.guard
                )
                rows.append(row | mark.to_json())
    finally:
        stop(running)
    return rows, running.config.ingress


def _scenarios(
    port: int, model: str, batching: bool, mixed: list[Feeds], expected: list[np.ndarray], single: list[Feeds],
    tolerance: tuple[float, float], s: LoadTestSettings, say: Callable[[str], None],
) -> list[dict[str, Any]]:  # fmt: skip
    """``mixed`` and ``single`` at one batching setting, each under the load guard."""
    send_requests(port, model, single[:32], s.clients)  # warm the connections
    rows = []
    scenarios: list[tuple[str, list[Feeds], list[np.ndarray] | None]] = [("mixed 1-4", mixed, expected)]
    if s.client == "tritonclient":
        scenarios.append(("single", single, None))
    for name, requests, want in scenarios:
        result, mark = quiet_or_marked(
            lambda r=requests: send_requests(port, model, r, s.clients, keep=OUTPUT), s.guard
        )
        rows.append(scenario_row(name, batching, requests, result, want, *tolerance) | mark.to_json())
        say(f"{name} batching {'on' if batching else 'off'}: {rows[-1]['samples_per_s']:.1f} samples/s")
    if s.client == "perf_analyzer":
        measured, mark = quiet_or_marked(
            lambda: perf_analyzer_rows(
                port, single, s.clients, batching, model, stability_percent=s.pa_stability_percent, max_trials=20
            ),
            s.guard,
        )
        rows.extend(row | mark.to_json() for row in measured)
    return rows
