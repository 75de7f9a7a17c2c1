"""Load test of ``tk serve``: dynamic batching on and off, through ``tritonclient.http``.

    .venv/bin/python -m scripts.load_test                         # small Transformer, 16 clients x 2,000 requests
    .venv/bin/python -m scripts.load_test --size tiny --requests 400 --seq 16 --ingress proxy
    .venv/bin/python -m scripts.load_test --client perf_analyzer     # Triton's load generator for "single"

Exports the Transformer (ONNX, fp32) once into a temporary directory, then, on a local Ray
instance that tk starts (2 CPUs) with one Serve replica (the onnx engine, ``--threads`` intra-op
threads) behind ``--ingress`` (Ray Serve's HAProxy ingress by default, or its Python proxy), runs
with batching on (``--max-batch``, ``--max-delay-ms``) and off:

- ``mixed``: ``--clients`` concurrent clients send ``--requests`` requests of 1-4 samples; every
  response is compared with the eager model on the same samples (the artifact's tolerance), and
  lost, duplicated or mismatched responses are counted;
- ``single``: the same clients, one sample per request (the issue's throughput goal);
- ``one client``: one client, batch 1, each served request followed by the same call on the
  engine in this process (interleaved, so both see the same machine): the serving overhead.

With ``--client perf_analyzer`` the ``single`` scenario is measured by Triton's ``perf_analyzer``
(``tk.serve.perf_analyzer``: HTTP, concurrency 1 and ``--clients``, the same single-sample requests as
``--input-data``) instead of this script's threads; ``mixed`` stays on ``tritonclient``, since only it
checks every response against eager.

Before Ray starts, the engine alone is timed at batch 1 and at the max batch: the ratio of their
samples/s is the most that batching can gain on this machine, whatever the server does.

Each scenario runs under the load guard (``--wait-quiet``; rows on a busy machine are marked).
Prints a table and writes ``<out>/<UTC stamp>-serve-load.json`` in the benchmarks' envelope.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from ray import serve
from rich.console import Console
from rich.table import Table

from tk.export import ExportOptions
from tk.models import build_model
from tk.runtime import EngineChoice, load
from tk.serve.app import APP_NAME, ServeConfig, deployment, resolve, start, stop
from tk.serve.ingress import free_ports
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance
from tk.workflows.export import export
from tk.workflows.load_guard import LoadGuard, quiet_or_marked
from tk.workflows.results import BenchRun, add_run_arguments, settings_of
from tk.workflows.timing import interleave, timed


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run_clients(port: int, requests: list[dict[str, np.ndarray]], clients: int) -> dict[str, Any]:
    """Send ``requests`` from ``clients`` threads (request i from thread i % clients); per-request results."""
    import tritonclient.http as http

    replies: dict[int, Any] = {}
    latencies: dict[int, float] = {}
    failures: dict[int, str] = {}
    duplicates = 0
    lock = threading.Lock()

    def work(c: int) -> None:
        nonlocal duplicates
        client = http.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=60, network_timeout=60)
        for i in range(c, len(requests), clients):
            inputs = []
            for name, array in requests[i].items():
                entry = http.InferInput(name, list(array.shape), "INT64")
                entry.set_data_from_numpy(array)
                inputs.append(entry)
            started = time.perf_counter()
            try:
                reply = client.infer("transformer", inputs, request_id=str(i))
                seconds = time.perf_counter() - started
                rid = int(reply.get_response()["id"])
                with lock:
                    duplicates += rid in replies
                    replies[rid] = reply.as_numpy("logits")
                    latencies[i] = seconds
            except Exception as exc:  # counted as lost
                with lock:
                    failures[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"replies": replies, "latencies": latencies, "failures": failures, "duplicates": duplicates, "wall": wall}


def health_latency_ms(port: int, count: int) -> float:
    """Median latency of ``GET /v2/health/live`` (HTTP proxy and replica, no engine) over one connection."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        connection.request("GET", "/v2/health/live")
        connection.getresponse().read()
        times.append((time.perf_counter() - t0) * 1e3)
    connection.close()
    return statistics.median(times)


def summarize(
    name: str,
    batching: bool,
    requests: list[dict[str, np.ndarray]],
    result: dict[str, Any],
    expected: list[np.ndarray] | None,
    rtol: float,
    atol: float,
) -> dict[str, Any]:
    latencies = list(result["latencies"].values())
    samples = sum(len(r["input_ids"]) for r in requests)
    mismatched = 0
    worst = 0.0
    if expected is not None:
        for i, want in enumerate(expected):
            got = result["replies"].get(i)
            if got is None:
                continue
            if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
                mismatched += 1
            if got.shape == want.shape:
                worst = max(worst, float(np.abs(got - want).max()))
    return {
        "scenario": name,
        "batching": batching,
        "requests": len(requests),
        "samples": samples,
        "lost": len(requests) - len(result["replies"]),
        "duplicated": result["duplicates"],
        "mismatched": mismatched if expected is not None else None,
        "max_abs_error": worst if expected is not None else None,
        "seconds": result["wall"],
        "requests_per_s": len(result["replies"]) / result["wall"],
        "samples_per_s": samples / result["wall"],
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "first_failure": next(iter(result["failures"].values()), None),
    }


def eager_reference(eager: Any, requests: list[dict[str, np.ndarray]], max_batch: int) -> list[np.ndarray]:
    """Each request's eager logits, computed in batches of up to ``max_batch`` samples (every request
    has the same sequence length) and split back per request."""
    expected: list[np.ndarray] = []
    start = 0
    while start < len(requests):
        stop, samples = start, 0
        while stop < len(requests) and samples + len(requests[stop]["input_ids"]) <= max_batch:
            samples += len(requests[stop]["input_ids"])
            stop += 1
        chunk = requests[start:stop]
        logits = eager.run({name: np.concatenate([r[name] for r in chunk]) for name in chunk[0]})["logits"]
        for r in chunk:
            expected.append(logits[: len(r["input_ids"])])
            logits = logits[len(r["input_ids"]) :]
        start = stop
    return expected


def engine_batch_bound(
    root: Path, sig: Any, seq: int, max_batch: int, threads: int, guard: LoadGuard, rounds: int = 5
) -> dict:
    """The onnx engine alone, in this process: samples/s at batch 1 and at ``max_batch``, interleaved."""
    feeds = {b: random_feeds(sig.inputs, {"batch": b, "seq": seq}, seed=b) for b in (1, max_batch)}
    with load(root, "onnx", threads=threads, spinning=False) as engine:  # as tk serve runs it
        for f in feeds.values():
            engine.run(f)

        def samples(f: dict[str, np.ndarray], calls: int) -> None:
            for _ in range(calls):
                engine.run(f, check=False)

        calls = {b: max(1, max_batch // b) for b in feeds}  # the same number of samples at each size
        timers = {b: timed(lambda b=b: samples(feeds[b], calls[b])) for b in feeds}
        times, mark = quiet_or_marked(lambda: interleave(timers, iters=rounds), guard)
    one, many = (calls[b] * b / statistics.median(t.total_s for t in times[b]) for b in (1, max_batch))
    return {
        "batch1_samples_per_s": one, "max_batch": max_batch, "max_batch_samples_per_s": many, "gain": many / one,
    } | mark.to_json()  # fmt: skip


def one_client(port: int, root: Path, requests: list[dict[str, np.ndarray]], threads: int) -> dict[str, Any]:
    """One client, batch 1: each request served, then the same call on the engine in this process."""
    import tritonclient.http as http

    client = http.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=60, network_timeout=60)
    served, alone = [], []
    with load(root, "onnx", threads=threads, spinning=False) as engine:  # as tk serve runs it
        for feeds in requests[:10] + requests:
            inputs = []
            for name, array in feeds.items():
                entry = http.InferInput(name, list(array.shape), "INT64")
                entry.set_data_from_numpy(array)
                inputs.append(entry)
            t0 = time.perf_counter()
            client.infer("transformer", inputs)
            t1 = time.perf_counter()
            engine.run(feeds)
            t2 = time.perf_counter()
            served.append((t1 - t0) * 1e3)
            alone.append((t2 - t1) * 1e3)
    served, alone = served[10:], alone[10:]
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
    port: int, requests: list[dict[str, np.ndarray]], clients: int, batching: bool, **options: Any
) -> list[dict]:
    """The ``single`` scenario through Triton's perf_analyzer, at concurrency 1 and ``clients``
    (``options``: ``run_perf_analyzer``'s measurement settings)."""
    from tk.serve.perf_analyzer import find_perf_analyzer, run_perf_analyzer

    tool = find_perf_analyzer()
    samples = [{name: a[0] for name, a in r.items()} for r in requests[:64]]
    with tempfile.TemporaryDirectory(prefix="tk-pa-") as tmp:
        measured, _ = run_perf_analyzer(
            tool, f"127.0.0.1:{port}", "transformer", samples, sorted({1, clients}), out_dir=Path(tmp), **options
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
        }
        for row in measured
    ]


def render(rows: list[dict[str, Any]], what: str) -> Table:
    """The scenarios' table; rows timed on a busy machine say so in the load column."""
    table = Table(title=f"tk serve load test: {what}")
    columns = ("scenario", "batching", "requests", "lost", "dup", "mismatch", "samples/s", "p50 ms", "p99 ms", "load")
    for column in columns:
        table.add_column(column, justify="left" if column in ("scenario", "batching") else "right")
    for r in rows:
        table.add_row(
            r["scenario"],
            "on" if r["batching"] else "off",
            "-" if r["requests"] is None else str(r["requests"]),
            str(r["lost"]),
            str(r["duplicated"]),
            "-" if r["mismatched"] is None else str(r["mismatched"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['load_before']}→{r['load_after']}" + (" busy" if r["busy"] else ""),
        )
    return table


def goals_of(rows: list[dict[str, Any]], bound: dict[str, Any]) -> dict[str, float]:
    """The issue's serving goals as ratios of this run's rows."""
    on = next(r for r in rows if r["scenario"] == "single" and r["batching"])
    off = next(r for r in rows if r["scenario"] == "single" and not r["batching"])
    one_row = next(r for r in rows if r["scenario"] == "one client")
    return {
        "single_throughput_ratio": on["samples_per_s"] / off["samples_per_s"],
        "engine_batching_bound": bound["gain"],
        "single_p99_on_over_p50_off": on["p99_ms"] / off["p50_ms"],
        "one_client_p50_ms": one_row["p50_ms"],
        "engine_batch1_p50_ms": one_row["engine_p50_ms"],
        "overhead_ms": one_row["overhead_p50_ms"],
        "health_p50_ms": one_row["health_p50_ms"],
    }


def goals_line(goals: dict[str, float], max_batch: int) -> str:
    return (
        f"batching on/off throughput (single-sample clients): {goals['single_throughput_ratio']:.2f}x (goal >= 3x; "
        f"the engine alone gains {goals['engine_batching_bound']:.2f}x from batch 1 to {max_batch}); "
        f"p99 on / p50 off: {goals['single_p99_on_over_p50_off']:.2f} (goal < 4); "
        f"one client p50 {goals['one_client_p50_ms']:.2f} ms vs engine batch-1 p50 {goals['engine_batch1_p50_ms']:.2f} ms, "
        f"interleaved: overhead p50 {goals['overhead_ms']:.2f} ms (goal <= 2 ms); "
        f"GET /v2/health/live p50 {goals['health_p50_ms']:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="Transformer size (tiny, small, base)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's opt)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per scenario and mode")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32, help="samples per engine call with batching on")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2, help="engine intra-op threads")
    parser.add_argument("--one-client-requests", type=int, default=200)
    parser.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy", help="tk serve --ingress")
    parser.add_argument(
        "--client",
        choices=("tritonclient", "perf_analyzer"),
        default="tritonclient",
        help="what measures the single-sample scenario (perf_analyzer: Triton's load generator)",
    )
    add_run_arguments(parser)
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=160)
    run = BenchRun("serve-load", settings_of(args))
    guard, machine = LoadGuard(args.wait_quiet), run.machine
    with tempfile.TemporaryDirectory(prefix="tk-load-") as tmp:
        spec = build_model("transformer", size=args.size)
        root = Path(tmp) / "artifact"
        started = time.perf_counter()
        export(spec, root, ExportOptions(formats=("onnx",)))
        console.print(f"export {args.size}: {time.perf_counter() - started:.1f} s")
        from tk.manifest import read_manifest

        manifest = read_manifest(root)
        sig = manifest.signature
        seq = args.seq or sig.dims["seq"].opt
        rtol, atol, _ = artifact_tolerance(manifest.precision, manifest.model)
        rng = np.random.default_rng(0)
        mixed = [
            random_feeds(sig.inputs, {"batch": int(rng.integers(1, 5)), "seq": seq}, seed=i)
            for i in range(args.requests)
        ]
        single = [random_feeds(sig.inputs, {"batch": 1, "seq": seq}, seed=10**6 + i) for i in range(args.requests)]
        started = time.perf_counter()
        with load(root, "eager", threads=args.threads) as eager:
            expected = eager_reference(eager, mixed, sig.dims["batch"].max)
        console.print(f"eager reference for {len(mixed)} requests: {time.perf_counter() - started:.1f} s")
        # what batching can gain at most here: the engine alone, batch 1 against the max batch
        bound = engine_batch_bound(root, sig, seq, args.max_batch, args.threads, guard)
        console.print(
            f"engine alone: {bound['batch1_samples_per_s']:.1f} samples/s at batch 1, "
            f"{bound['max_batch_samples_per_s']:.1f} at batch {args.max_batch}: at most {bound['gain']:.2f}x from batching"
        )
        one = single[: args.one_client_requests]
        base = ServeConfig(
            str(root),
            engine=EngineChoice("onnx", options={"threads": args.threads}),
            port=free_ports(1)[0],
            max_batch=args.max_batch,
            max_delay_ms=args.max_delay_ms,
            max_queue=-1,
            cpus_per_replica=1,
            ingress=args.ingress,
        )
        rows = []
        running = start(base, num_cpus=2)
        try:
            for batching in (True, False):
                cfg = resolve(ServeConfig(**{**running.config.__dict__, "batching": batching}))
                if not batching:
                    serve.delete(APP_NAME)
                    serve.run(deployment(cfg), name=APP_NAME, route_prefix="/")
                run_clients(cfg.port, single[:32], args.clients)  # warm the connections
                scenarios = [("mixed 1-4", mixed, expected)]
                if args.client == "tritonclient":
                    scenarios.append(("single", single, None))
                for name, reqs, exp in scenarios:
                    result, mark = quiet_or_marked(lambda r=reqs, p=cfg.port: run_clients(p, r, args.clients), guard)
                    rows.append(summarize(name, batching, reqs, result, exp, rtol, atol) | mark.to_json())
                    console.print(
                        f"{name} batching {'on' if batching else 'off'}: {rows[-1]['samples_per_s']:.1f} samples/s"
                    )
                if args.client == "perf_analyzer":
                    measured, mark = quiet_or_marked(
                        lambda p=cfg.port, b=batching: perf_analyzer_rows(p, single, args.clients, b), guard
                    )
                    rows.extend(row | mark.to_json() for row in measured)
                if not batching:
                    row, mark = quiet_or_marked(lambda c=cfg: one_client(c.port, root, one, args.threads), guard)
                    rows.append(row | mark.to_json())
        finally:
            stop(running)
    console.print(
        render(
            rows,
            f"transformer {args.size}, seq {seq}, onnx, {args.clients} clients, "
            f"{running.config.ingress} ingress ({machine['cpu']})",
        )
    )
    goals = goals_of(rows, bound)
    console.print(goals_line(goals, args.max_batch))
    path = run.write(
        {
            "seq": seq,
            "ingress": running.config.ingress,
            "client": args.client,
            "engine_batching": bound,
            "tolerance": {"rtol": rtol, "atol": atol},
            "rows": rows,
            "goals": goals,
        },
        args.out,
    )
    console.print(f"json: {path}")


if __name__ == "__main__":
    main()
