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
(``tk.serve.load.perf_analyzer``: HTTP, concurrency 1 and ``--clients``, the same single-sample
requests as ``--input-data``) instead of this script's threads; ``mixed`` stays on ``tritonclient``,
since only it checks every response against eager.

Before Ray starts, the engine alone is timed at batch 1 and at the max batch: the ratio of their
samples/s is the most that batching can gain on this machine, whatever the server does. Then one
1-thread engine per core runs side by side (``engine_split_bound``); the better of the two is the
engine's best, against which the served throughput is judged.

Each scenario runs under the load guard (``--wait-quiet``; rows on a busy machine are marked).
Prints a table and writes ``<out>/<UTC stamp>-serve-load.json`` in the benchmarks' envelope. The
scenarios live in ``tk.serve.load.scenarios`` (the clients in ``tk.serve.load.clients``, the goals
and table in ``tk.serve.load.report``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from tk.export import ExportOptions
from tk.manifest import read_manifest
from tk.measure.hardware import usable_cores
from tk.measure.load_guard import LoadGuard
from tk.measure.results import BenchRun, add_run_arguments, settings_of
from tk.models import build_model
from tk.runtime import load
from tk.serve.config import read_settings
from tk.serve.load.report import goals_line, render, serving_goals
from tk.serve.load.scenarios import (
    LoadTestSettings,
    engine_batch_bound,
    engine_split_bound,
    expected_outputs,
    make_requests,
    perf_analyzer_rows,
    run_scenarios,
)
from tk.tolerances import artifact_tolerance
from tk.workflows.export import export

__all__ = ["main", "perf_analyzer_rows"]  # tests/serve/test_triton_http.py imports perf_analyzer_rows from here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="Transformer size (tiny, small, base)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the model's opt)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per scenario and mode")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32, help="samples per engine call with batching on")
    parser.add_argument("--max-delay-ms", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2, help="engine intra-op threads")
    parser.add_argument("--one-client-requests", type=int, default=200)
    parser.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy", help="tk serve --ingress")
    parser.add_argument(
        "--client",
        choices=("tritonclient", "perf_analyzer"),
        default="tritonclient",
        help="what measures the single-sample scenario (perf_analyzer: Triton's load generator)",
    )
    parser.add_argument(
        "--pa-stability-percent", type=float, default=25.0, help="perf_analyzer: windows agree within this (default 25)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="serve with a settings file (tk serve --tune's): replicas, batch, delay",
    )
    add_run_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    logging.getLogger("ray").setLevel(logging.WARNING)
    console = Console(width=160)
    run = BenchRun("serve-load", settings_of(args), argv=sys.argv if argv is None else argv)
    settings = LoadTestSettings(
        args.clients, args.max_batch, args.max_delay_ms, args.threads, args.one_client_requests, args.ingress,
        args.client, LoadGuard(args.wait_quiet), args.pa_stability_percent,
        read_settings(args.config) if args.config else {},
    )  # fmt: skip
    # the bound: the engine alone at the larger of --max-batch and the served max batch
    max_batch = max(args.max_batch, int(settings.serve_settings.get("max_batch", 0)))
    with tempfile.TemporaryDirectory(prefix="tk-load-") as tmp:
        root = Path(tmp) / "artifact"
        started = time.perf_counter()
        export(build_model("transformer", size=args.size), root, ExportOptions(formats=("onnx",)))
        console.print(f"export {args.size}: {time.perf_counter() - started:.1f} s")
        manifest = read_manifest(root)
        sig = manifest.signature
        seq = args.seq or sig.dims["seq"].opt
        rtol, atol, _ = artifact_tolerance(manifest.precision, manifest.model)
        mixed, single = make_requests(sig.inputs, seq, args.requests)
        started = time.perf_counter()
        with load(root, "eager", threads=args.threads) as eager:
            expected = expected_outputs(eager, mixed, sig.dims["batch"].max)
        console.print(f"eager reference for {len(mixed)} requests: {time.perf_counter() - started:.1f} s")
        # what batching can gain at most here: the engine alone on every core, batch 1 against the max batch
        bound = engine_batch_bound(root, sig.inputs, seq, max_batch, usable_cores(), settings.guard)
        console.print(
            f"engine alone: {bound['batch1_samples_per_s']:.1f} samples/s at batch 1, "
            f"{bound['max_batch_samples_per_s']:.1f} at batch {max_batch}: at most {bound['gain']:.2f}x from batching"
        )
        best = bound["max_batch_samples_per_s"]
        if usable_cores() > 1:  # and as replicas that split the cores run it
            bound["split"] = engine_split_bound(root, seq, max_batch, usable_cores(), settings.guard)
            best = max(best, bound["split"]["samples_per_s"])
            console.print(
                f"engine alone in {usable_cores()} 1-thread processes at batch {max_batch}: "
                f"{bound['split']['samples_per_s']:.1f} samples/s together"
            )
        bound["best_samples_per_s"] = best
        rows, ingress = run_scenarios(root, mixed, expected, single, (rtol, atol), settings, console.print)
    what = f"transformer {args.size}, seq {seq}, onnx, {args.clients} clients, {ingress} ingress ({run.machine['cpu']})"
    console.print(render(rows, what))
    goals = serving_goals(rows, bound)
    console.print(goals_line(goals, max_batch))
    results = {
        "seq": seq,
        "ingress": ingress,
        "client": args.client,
        "engine_batching": bound,
        "tolerance": {"rtol": rtol, "atol": atol},
        "rows": rows,
        "goals": goals,
    }
    path = run.write(results, args.out)
    console.print(f"json: {path}")
    return path


if __name__ == "__main__":
    main()
