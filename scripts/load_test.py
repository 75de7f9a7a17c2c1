"""Load test of ``tk serve``: dynamic batching on and off, through ``tritonclient.http``.

    .venv/bin/python -m scripts.load_test                         # small Transformer, 16 clients x 2,000 requests
    .venv/bin/python -m scripts.load_test --size tiny --requests 400 --seq 16

Exports the Transformer (ONNX, fp32) once into a temporary directory, starts one local Ray
instance and one Serve replica (the onnx engine, ``--threads`` intra-op threads), then runs, with
batching on (``--max-batch``, ``--max-delay-ms``) and off (max batch 1):

- ``mixed``: ``--clients`` concurrent clients send ``--requests`` requests of 1-4 samples; every
  response is compared with the eager model on the same samples (the artifact's tolerance), and
  lost, duplicated or mismatched responses are counted;
- ``single``: the same clients, one sample per request (the issue's throughput goal);
- ``one client``: one client, batch 1, against the engine's own batch-1 latency in this process
  (the serving overhead).

Prints a table and writes ``<out>/<stamp>-serve-load.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tk.export import ExportOptions
from tk.fileio import atomic_write_json
from tk.models import build_model
from tk.runtime import load
from tk.serve.app import ServeConfig, deployment, resolve, start, stop
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance
from tk.workflows.bench import machine_description
from tk.workflows.export import export


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=160)
    machine = machine_description()
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
            expected = [eager.run(r)["logits"] for r in mixed]
        console.print(f"eager reference for {len(mixed)} requests: {time.perf_counter() - started:.1f} s")
        # the engine's own batch-1 latency, in this process, before Ray takes the cores
        one = single[: args.one_client_requests]
        with load(root, "onnx", threads=args.threads) as engine:
            for r in one[:10]:
                engine.run(r)
            engine_ms = []
            for r in one:
                t0 = time.perf_counter()
                engine.run(r)
                engine_ms.append((time.perf_counter() - t0) * 1e3)
        import ray
        from ray import serve

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        base = ServeConfig(
            str(root),
            engine="onnx",
            port=free_port(),
            max_batch=args.max_batch,
            max_delay_ms=args.max_delay_ms,
            max_queue=-1,
            cpus_per_replica=1,
            options={"threads": args.threads},
        )
        rows = []
        try:
            config = start(base)
            for batching in (True, False):
                cfg = config if batching else resolve(ServeConfig(**{**base.__dict__, "batching": False}))
                serve.run(deployment(cfg), name="tk-serve", route_prefix="/")
                run_clients(cfg.port, single[:32], args.clients)  # warm the connections
                for name, reqs, exp in (("mixed 1-4", mixed, expected), ("single", single, None)):
                    result = run_clients(cfg.port, reqs, args.clients)
                    rows.append(summarize(name, batching, reqs, result, exp, rtol, atol))
                    console.print(
                        f"{name} batching {'on' if batching else 'off'}: {rows[-1]['samples_per_s']:.1f} samples/s"
                    )
                if not batching:
                    result = run_clients(cfg.port, one, 1)
                    row = summarize("one client", False, one, result, None, rtol, atol)
                    row["engine_p50_ms"] = statistics.median(engine_ms)
                    row["health_p50_ms"] = health_latency_ms(cfg.port, len(one))
                    rows.append(row)
        finally:
            stop()
    table = Table(
        title=f"tk serve load test: transformer {args.size}, seq {seq}, onnx, {args.clients} clients ({machine['cpu']})"
    )
    for column in ("scenario", "batching", "requests", "lost", "dup", "mismatch", "samples/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column in ("scenario", "batching") else "right")
    for r in rows:
        table.add_row(
            r["scenario"],
            "on" if r["batching"] else "off",
            str(r["requests"]),
            str(r["lost"]),
            str(r["duplicated"]),
            "-" if r["mismatched"] is None else str(r["mismatched"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
        )
    console.print(table)
    on = next(r for r in rows if r["scenario"] == "single" and r["batching"])
    off = next(r for r in rows if r["scenario"] == "single" and not r["batching"])
    one_row = next(r for r in rows if r["scenario"] == "one client")
    goals = {
        "single_throughput_ratio": on["samples_per_s"] / off["samples_per_s"],
        "single_p99_on_over_p50_off": on["p99_ms"] / off["p50_ms"],
        "one_client_p50_ms": one_row["p50_ms"],
        "engine_batch1_p50_ms": one_row["engine_p50_ms"],
        "overhead_ms": one_row["p50_ms"] - one_row["engine_p50_ms"],
        "health_p50_ms": one_row["health_p50_ms"],
    }
    console.print(
        f"batching on/off throughput (single-sample clients): {goals['single_throughput_ratio']:.2f}x (goal >= 3x); "
        f"p99 on / p50 off: {goals['single_p99_on_over_p50_off']:.2f} (goal < 4); "
        f"one client p50 {goals['one_client_p50_ms']:.2f} ms vs engine batch-1 p50 {goals['engine_batch1_p50_ms']:.2f} ms: "
        f"overhead {goals['overhead_ms']:.2f} ms (goal <= 2 ms); GET /v2/health/live p50 {goals['health_p50_ms']:.2f} ms"
    )
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"{stamp}-serve-load.json"
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        path,
        {
            "machine": machine,
            "args": {k: str(v) for k, v in vars(args).items()},
            "seq": seq,
            "tolerance": {"rtol": rtol, "atol": atol},
            "rows": rows,
            "goals": goals,
        },
    )
    console.print(f"json: {path}")


if __name__ == "__main__":
    main()
