"""One model size of the CPU table: export, open and check every row, then time them all
interleaved (``tk.workflows.bench.measure``) with the matrix-product rates at the model's own
linear shapes sampled between their calls (``tk.measure.roofline``); tk's call overhead against
the same backends called directly; eager against compiled training."""

from __future__ import annotations

import dataclasses
import gc
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_table.direct import bare
from benchmarks.cpu_table.exports import export_artifacts, one_line
from benchmarks.cpu_table.parity import open_and_check
from benchmarks.cpu_table.rows import OVERHEAD_ROWS, ROWS
from tk.errors import TkError
from tk.measure.load_guard import LoadGuard
from tk.measure.roofline import Roofline
from tk.models import build_model
from tk.models.train import CompileOptions, compare_training
from tk.models.transformer import SIZES
from tk.runtime import load
from tk.runtime.base import Engine
from tk.runtime.inputs import random_inputs
from tk.workflows.bench import BenchReport, measure, save_plot

MODEL = "transformer"
PARITY_BATCH = 8  # parity is measured on one batch of this size at the benchmark's sequence length
OVERHEAD_GOAL = 1.03  # tk's engine call may take at most 3% longer than the bare backend call


def _quiet(_: str) -> None:
    pass


@dataclass
class TableSettings:
    """How one size is measured (the script's options)."""

    batch_sizes: list[int]
    seq: int = 128
    seconds: float = 2.0  # time budget per engine per batch size
    threads: int = 2  # onnxruntime intra-op threads
    export_check: bool = False  # tk's export-time check too (slow for base)
    opset: int | None = None
    guard: LoadGuard = field(default_factory=LoadGuard)
    say: Callable[[str], None] = _quiet


def bench_size(
    size: str,
    rows: list[str],
    left_out: dict[str, str],
    workdir: Path,
    settings: TableSettings,
    *,
    overhead: bool = False,
    plot_path: Path | None = None,
) -> dict[str, Any]:
    """Export, open, check and time every row for one model size; what was measured (an ``error``
    beside it where the size stopped early). The exports under ``workdir`` are removed after."""
    torch.manual_seed(0)
    spec = build_model(MODEL, size=size)
    seq = min(settings.seq, spec.signature.dims["seq"].max)
    if seq != settings.seq:
        settings.say(f"{size}: sequence length {settings.seq} is beyond the model's {seq} positions; using {seq}")
    artifacts, exports = export_artifacts(
        spec, rows, workdir, check=settings.export_check, opset=settings.opset, say=settings.say
    )
    del spec
    gc.collect()
    result: dict[str, Any] = {"config": dataclasses.asdict(SIZES[size]), "seq": seq, "exports": exports}
    engines: dict[str, Engine] = {}
    try:
        if "fp32" not in artifacts:
            raise RuntimeError(f"the fp32 export failed: {'; '.join(exports['fp32'].get('errors', []))}")
        like = load(artifacts["fp32"], "eager")  # for its specs; nothing is loaded yet
        feeds = random_inputs(like.inputs, like.dims, PARITY_BATCH, seed=1, sizes={"seq": seq})
        engines, result["parity"], failed = open_and_check(rows, artifacts, feeds, settings.threads, settings.say)
        result["unavailable"] = left_out | failed
        if "eager" not in engines:
            raise RuntimeError(f"eager fp32, the reference, could not run: {result['unavailable'].get('eager')}")
        report = _time_rows(engines, seq, settings, result)
        if overhead:
            result["overhead"] = measure_overhead(engines, seq, settings)
        if plot_path is not None:
            plot(report, plot_path, settings.say)
    except Exception as exc:  # keep what was measured; the other sizes still run
        result["error"] = one_line(exc)
        settings.say(f"{size} failed: {result['error']}")
    finally:
        for engine in engines.values():
            engine.close()
        engines.clear()
        gc.collect()
        torch._dynamo.reset()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _time_rows(engines: dict[str, Engine], seq: int, settings: TableSettings, result: dict[str, Any]) -> BenchReport:
    """Every row interleaved, each precision's rate at the model's shapes sampled between the calls;
    fills ``result``'s peaks, bench, fp32_peak and flop."""
    example = (torch.zeros(1, seq, dtype=torch.long), torch.ones(1, seq, dtype=torch.long))
    peaks = Roofline(engines["eager"].module, example, {ROWS[key].precision for key in engines})
    report = measure(
        engines, settings.batch_sizes, seconds=settings.seconds, sizes={"seq": seq}, progress=settings.say,
        guard=settings.guard, between=peaks.between,
    )  # fmt: skip
    result["peaks"] = peaks.fill(report, lambda key: ROWS[key].precision)
    result["bench"] = report.results()
    result["fp32_peak"] = {b: peaks.median("fp32", b) for b in settings.batch_sizes}
    result["flop"] = {str(b): float(f"{peaks.flops * b / 1e9:.4g}") for b in settings.batch_sizes}
    return report


def measure_overhead(engines: dict[str, Engine], seq: int, settings: TableSettings) -> dict[str, Any]:
    """tk's engine call against the same backend called directly, interleaved pair by pair, at batch 1.

    Each pair is timed on its own: in one round of several backends, a tk engine would always follow
    the other backend's bare call (and pay for its threads going idle) while its bare twin followed it.
    """
    from torch._dynamo.utils import counters

    ratios: dict[str, Any] = {}
    reports: dict[str, Any] = {}
    graphs_before = int(counters["stats"]["unique_graphs"])
    for key in OVERHEAD_ROWS:
        if key not in engines:
            continue
        pair = {key: engines[key], f"{key} (bare)": bare(engines[key])}
        report = measure(
            pair, [1], seconds=settings.seconds, sizes={"seq": seq}, progress=settings.say, guard=settings.guard
        )
        p50 = {r.engine: r.p50_ms for r in report.rows}
        tk_ms, bare_ms = p50[key], p50[f"{key} (bare)"]
        ratios[key] = {"tk_p50_ms": tk_ms, "bare_p50_ms": bare_ms, "ratio": tk_ms / bare_ms}
        reports[key] = report.results()
    if not ratios:
        return {"error": f"none of {', '.join(OVERHEAD_ROWS)} could run"}
    return {
        "batch_size": 1,
        "goal_ratio": OVERHEAD_GOAL,
        "ratios": ratios,
        "new_graphs_while_timing": int(counters["stats"]["unique_graphs"]) - graphs_before,  # 0: no recompile
        "bench": reports,
    }


def plot(report: BenchReport, path: Path, say: Callable[[str], None] = _quiet) -> None:
    """The size's latency and throughput plot, where matplotlib is installed (the JSON is what matters)."""
    try:
        save_plot(report, path)
    except TkError as exc:
        say(f"no plot: {exc}")
        return
    say(f"wrote {path}")


def train_compare(size: str, steps: int, batch_size: int) -> dict[str, Any]:
    """Eager and compiled training from the same initial weights (``tk train --compare``), as the table's JSON."""
    torch.manual_seed(0)
    comparison = compare_training(
        lambda: build_model(MODEL, size=size), CompileOptions(), steps=steps, batch_size=batch_size
    )
    return {
        "size": size,
        "steps": steps,
        "batch_size": batch_size,
        "eager": comparison.eager.summary(),
        "compiled": comparison.compiled.summary(),
        "compiled_over_eager": comparison.speedup,
        "note": "run one after the other (not interleaved); steps/s leaves out the first 3 steps",
    }
