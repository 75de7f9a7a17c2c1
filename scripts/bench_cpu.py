"""The CPU performance table of the Transformer, reproduced with tk's own engines in one run.

    .venv/bin/python -m scripts.bench_cpu                      # small and base, batch 1, 8, 32
    .venv/bin/python -m scripts.bench_cpu --sizes small --batch-sizes 1 --seconds 0.5 --rows eager,onnx,compile

For each size: export the model once at fp32 (ONNX + AOTInductor), once at bf16 (AOTInductor)
and once at int8 (ONNX) into a temporary directory, open every row's engine, measure its parity
with eager fp32 on one batch of 8, then time all rows interleaved with ``tk.workflows.bench.measure``.
Hand-built peers (a plain ``torch.compile`` with freezing, a plain onnxruntime session) give the
"best hand-tuned peer" the goals compare with; tk's call overhead is measured at batch 1 against
the same sessions called directly. The machine's fp32 and bf16 matmul rates at the model's own
linear shapes are sampled between the rows' calls (``tk.measure.roofline``), a load guard marks
rows timed on a busy machine (``--wait-quiet``), and ``tk.models.train.compare_training`` compares
an eager and a compiled training loop. The scenario lives in ``benchmarks.cpu_table``.

Prints the tables and writes ``<out>/<UTC stamp>-bench-cpu.json`` in the benchmarks' envelope
(``tk.measure.results``), plus one PNG per size.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from benchmarks.cpu_table.report import goals, goals_table, overhead_table, results_table, train_table
from benchmarks.cpu_table.rows import BF16_ROWS, ROWS, ordered_rows
from benchmarks.cpu_table.run import MODEL, PARITY_BATCH, TableSettings, bench_size, train_compare
from tk.measure.hardware import cpu_precision_reason
from tk.measure.load_guard import LoadGuard
from tk.measure.results import BenchRun, add_run_arguments, settings_of
from tk.models.transformer import SIZES

RECOMPILE_LIMIT = 64  # dynamo's per-function cache: several compiled copies of one model share it
TRAIN_SIZE = "small"
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "KMP_BLOCKTIME")
SPINNING_NOTE = (
    "onnxruntime sessions run with allow_spinning=0: after each run their worker threads otherwise spin on "
    "the 2 cores and slow the next engine of the interleaved round (eager about 3x slower at tiny, batch 8, "
    "right after one session's run)"
)
EXPORT_CHECK_NOTE = (
    "export-time parity check skipped (it runs every format at several shapes and costs minutes for base); "
    "parity below is measured by this script on identical feeds"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="small,base", help=f"comma-separated of {', '.join(SIZES)} (default small,base)"
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time budget per engine per batch size (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="torch and onnxruntime threads (default 2)")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join(ROWS)} (default all; eager always runs)"
    )
    add_run_arguments(parser)
    parser.add_argument("--no-train", action="store_true", help="skip the eager vs compiled training comparison")
    parser.add_argument("--train-steps", type=int, default=30, help="training steps per loop (default 30)")
    parser.add_argument("--train-batch-size", type=int, default=32, help="training batch size (default 32)")
    parser.add_argument("--export-check", action="store_true", help="also run tk's export-time check (slow for base)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: tk's, 20)")
    parser.add_argument(
        "--force-bf16", action="store_true", help="run the bf16 rows on a CPU without native bf16 (very slow)"
    )
    parser.add_argument(
        "--omp-passive",
        action="store_true",
        help="rerun under OMP_WAIT_POLICY=PASSIVE: torch's idle OpenMP threads sleep instead of spinning, "
        "so they do not slow the next engine of a round (or suffer as badly from other work on the cores)",
    )
    args = parser.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.sizes) - set(SIZES)) + sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown size or row: {', '.join(unknown)}")
    args.rows = ordered_rows(rows)
    args.overhead_size = "small" if "small" in args.sizes else args.sizes[0]
    return args


def left_out_rows(rows: list[str], force_bf16: bool) -> dict[str, str]:
    """The bf16 rows this CPU would run emulated (unless forced), with the reason."""
    reason = cpu_precision_reason("bf16")
    if reason is None or force_bf16:
        return {}
    why = f"{reason}: a base call at batch 32 would take minutes; --force-bf16 runs it anyway"
    return {key: why for key in BF16_ROWS if key in rows}


def quiet_logs() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("torch", "torch.utils.cpp_extension", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **settings_of(args, ("run", "guard")),
        "model": MODEL,
        "parity_batch": PARITY_BATCH,
        "export_check_note": None if args.export_check else EXPORT_CHECK_NOTE,
        "onnxruntime_spinning_note": SPINNING_NOTE,
        "environment": {name: os.environ.get(name) for name in THREAD_ENV},
        "rows": {k: dataclasses.asdict(ROWS[k]) for k in args.rows},
    }


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.omp_passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # OpenMP reads its settings when torch is imported: start again with the variable set.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    quiet_logs()
    torch.set_num_threads(args.threads)  # before any export: AOTInductor compiles its thread count in
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    console = Console(width=max(Console().width, 160))
    run = BenchRun("bench-cpu", argv=sys.argv if argv is None else argv)
    settings = TableSettings(
        args.batch_sizes, args.seq, args.seconds, args.threads, args.export_check, args.opset,
        LoadGuard(args.wait_quiet), console.log,
    )  # fmt: skip
    left_out = left_out_rows(args.rows, args.force_bf16)
    rows = [key for key in args.rows if key not in left_out]
    sizes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tk-bench-") as tmp:
        for size in args.sizes:
            sizes[size] = bench_size(
                size, rows, left_out, Path(tmp) / size, settings,
                overhead=size == args.overhead_size, plot_path=run.path(args.out, ".png", size),
            )  # fmt: skip
    training = None
    if not args.no_train:
        console.log(
            f"train {TRAIN_SIZE}: eager, then compiled, {args.train_steps} steps at batch {args.train_batch_size}"
        )
        training = train_compare(TRAIN_SIZE, args.train_steps, args.train_batch_size)
    goal_rows = goals(sizes, args.batch_sizes)
    run.settings = run_settings(args)
    overhead = sizes.get(args.overhead_size, {}).get("overhead")
    console.print(results_table(sizes, args.batch_sizes, run.machine, args.threads))
    if overhead:
        console.print(overhead_table(overhead, args.overhead_size))
    if training:
        console.print(train_table(training))
    console.print(goals_table(goal_rows))
    path = run.write({"sizes": sizes, "overhead": overhead, "train": training, "goals": goal_rows}, args.out)
    console.print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
