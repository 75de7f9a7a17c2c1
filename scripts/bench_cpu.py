"""The CPU performance table of the Transformer, reproduced with tk's own engines in one run.

    .venv/bin/python -m scripts.bench_cpu                      # small and base, batch 1, 8, 32
    .venv/bin/python -m scripts.bench_cpu --sizes small --batch-sizes 1 --seconds 0.5 --rows eager,onnx,compile

For each size: export the model once at fp32 (ONNX + AOTInductor), once at bf16 (AOTInductor)
and once at int8 (ONNX) into a temporary directory, open every row's engine, measure its parity
with eager fp32 on one batch of 8, then time all rows interleaved with ``tk.bench.measure``.
Hand-built peers (a plain ``torch.compile`` with freezing, a plain onnxruntime session) give the
"best hand-tuned peer" the goals compare with; tk's call overhead is measured at batch 1 against
the same sessions called directly. The machine's fp32 and bf16 matmul rates at the model's own
linear shapes are sampled between the rows' calls (``tk.workflows.roofline``), a load guard marks
rows timed on a busy machine (``--wait-quiet``), and ``tk.models.train.train`` compares an eager
and a compiled training loop.

Prints the tables and writes ``<out>/<UTC stamp>-bench-cpu.json`` in the benchmarks' envelope
(``tk.workflows.results``), plus one PNG per size.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tk.errors import TkError
from tk.export import ExportOptions
from tk.export.onnx import OnnxOptions
from tk.models import ModelSpec, build_model
from tk.models.train import CompileOptions, train
from tk.models.transformer import SIZES
from tk.parity import compare_output
from tk.runtime import load
from tk.runtime.base import Engine
from tk.runtime.eager import module_from_manifest
from tk.runtime.inputs import random_inputs
from tk.tolerances import MIN_SQNR_DB, tolerance_for
from tk.workflows.bench import BenchReport, measure, save_plot
from tk.workflows.export import export
from tk.workflows.hardware import cpu_precision_reason
from tk.workflows.load_guard import LoadGuard
from tk.workflows.results import BenchRun, add_run_arguments, settings_of
from tk.workflows.roofline import Roofline

MODEL = "transformer"
PARITY_BATCH = 8  # parity is measured on one batch of this size at the benchmark's sequence length
RECOMPILE_LIMIT = 64  # dynamo's per-function cache: several compiled copies of one model share it
TRAIN_SIZE = "small"
OVERHEAD_GOAL = 1.03  # tk's engine call may take at most 3% longer than the bare backend call
ORT_SPINNING = "session.intra_op.allow_spinning"
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


@dataclass(frozen=True)
class Row:
    """One line of the table: which artifact, which engine, with which options."""

    label: str  # what the table prints
    precision: str  # fp32 | bf16 | int8: the tolerance the parity is judged by
    artifact: str  # fp32 | bf16 | int8: which export it loads
    engine: str  # a tk engine name, or peer-compile / peer-onnx for the hand-built peers
    options: dict[str, Any] = field(default_factory=dict)


ROWS: dict[str, Row] = {
    "eager": Row("PyTorch eager fp32", "fp32", "fp32", "eager"),
    "compile": Row("torch.compile+freezing fp32", "fp32", "fp32", "compile"),
    "onnx": Row("onnxruntime fp32", "fp32", "fp32", "onnx"),
    "aoti": Row("AOTInductor fp32", "fp32", "fp32", "aoti"),
    "compile-bf16": Row("torch.compile+freezing bf16 autocast", "bf16", "fp32", "compile", {"precision": "bf16"}),
    "aoti-bf16": Row("AOTInductor bf16", "bf16", "bf16", "aoti"),
    "onnx-int8": Row("onnxruntime dynamic int8", "int8", "int8", "onnx"),
    "peer-compile": Row("peer: torch.compile by hand, static", "fp32", "fp32", "peer-compile"),
    "peer-onnx": Row("peer: onnxruntime session by hand", "fp32", "fp32", "peer-onnx"),
}
FP32_ROWS = ("eager", "compile", "onnx", "aoti")  # tk's own float32 engines
PEER_ROWS = ("peer-compile", "peer-onnx")
BF16_ROWS = ("compile-bf16", "aoti-bf16")
OVERHEAD_ROWS = ("onnx", "compile", "aoti")  # engines whose bare backend call can be reached
FORMAT_OF = {"onnx": "onnx", "aoti": "aoti", "peer-onnx": "onnx"}  # engines that need an exported format


# ------------------------------------------------------------------------------------ direct calls
class DirectEngine(Engine):
    """A backend called directly: ``run`` is the bare call, without tk's checks or conversions.

    It borrows the specs of an artifact so that ``tk.bench.measure`` can time it beside tk's
    engines on the same feeds. ``make_call`` runs on ``load`` and returns the call.
    """

    name = "direct"

    def __init__(self, like: Engine, make_call: Callable[[], Callable[[Mapping[str, np.ndarray]], Any]]) -> None:
        super().__init__(like.root, like.manifest)
        self._make_call = make_call
        self._call: Callable[[Mapping[str, np.ndarray]], Any] | None = None

    def _load(self) -> None:
        self._call = self._make_call()

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        return self.run(feeds)

    def run(self, feeds: Mapping[str, Any], *, check: bool = True) -> Any:  # measure() loads every engine first
        assert self._call is not None, "load() first"
        return self._call(feeds)

    def _close(self) -> None:
        self._call = None


def torch_call(fn: Callable[..., Any], order: list[str]) -> Callable[[Mapping[str, np.ndarray]], Any]:
    """``fn(*tensors)`` under inference mode, the NumPy feeds wrapped (not copied) on every call.

    That is what a caller holding NumPy arrays does; tk's engines are timed from the same NumPy feeds.
    """

    def call(feeds: Mapping[str, np.ndarray]) -> Any:
        args = [torch.from_numpy(feeds[n]) for n in order]
        with torch.inference_mode():
            return fn(*args)

    return call


def peer_compile(like: Engine) -> DirectEngine:
    """torch.compile as the field notes tune it by hand: Inductor's freezing, static shapes (one graph per batch size)."""

    def make() -> Callable[[Mapping[str, np.ndarray]], Any]:
        module = module_from_manifest(like.root, like.manifest)
        compiled = torch.compile(module, dynamic=False, options={"freezing": True})
        return torch_call(compiled, [s.name for s in like.inputs])

    return DirectEngine(like, make)


def peer_onnx(like: Engine, threads: int) -> DirectEngine:
    """An onnxruntime session built by hand on the same ONNX file: all graph optimizations, ``threads``."""

    def make() -> Callable[[Mapping[str, np.ndarray]], Any]:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.add_session_config_entry(ORT_SPINNING, "0")  # as tk's sessions here: see SPINNING_NOTE
        options.log_severity_level = 3
        path = like.root / like.manifest.file("onnx").path
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, feeds)

    return DirectEngine(like, make)


def bare(engine: Engine) -> DirectEngine:
    """The very session or compiled module inside a loaded tk engine, called directly."""

    def make() -> Callable[[Mapping[str, np.ndarray]], Any]:
        order = [s.name for s in engine.inputs]
        if engine.name == "onnx":
            session = engine._session  # OnnxRuntimeEngine keeps its InferenceSession private
            return lambda feeds: session.run(None, feeds)
        if engine.name == "compile":
            return torch_call(engine.compiled, order)
        if engine.name == "aoti":
            return torch_call(engine._model, order)
        raise ValueError(f"no bare call for engine {engine.name!r}")

    return DirectEngine(engine, make)


# ----------------------------------------------------------------------------------------- ceilings
# ------------------------------------------------------------------------------------------ exports
def export_artifacts(
    spec: ModelSpec, rows: list[str], workdir: Path, args: argparse.Namespace, console: Console
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Export every artifact the rows need; returns their paths and, per artifact, timings or the failure."""
    wanted: dict[str, set[str]] = {}
    for key in rows:
        row = ROWS[key]
        wanted.setdefault(row.artifact, set())
        if row.engine in FORMAT_OF:
            wanted[row.artifact].add(FORMAT_OF[row.engine])
    paths: dict[str, Path] = {}
    info: dict[str, Any] = {}
    for precision in ("fp32", "bf16", "int8"):
        if precision not in wanted:
            continue
        formats = tuple(sorted(wanted[precision])) or ("torch",)
        without_aoti = tuple(f for f in formats if f != "aoti")
        attempts = [formats, without_aoti] if without_aoti and without_aoti != formats else [formats]
        errors: list[str] = []
        for attempt in attempts:  # without AOTInductor (a C++ toolchain) the other formats still count
            console.log(f"export {spec.size} {precision} {', '.join(attempt)}")
            start = time.perf_counter()
            try:
                result = export(spec, workdir / precision, export_options(attempt, precision, args))
            except Exception as exc:  # a failed export costs its rows, not the run
                errors.append(f"{', '.join(attempt)}: {one_line(exc)}")
                console.log(f"export {spec.size} {precision} failed: {errors[-1]}")
                continue
            paths[precision] = result.out
            info[precision] = {
                "formats": list(attempt),
                "seconds": round(time.perf_counter() - start, 1),
                "timings": result.manifest.timings,
                "files": {e.path: e.size for e in result.manifest.files},
                "check": result.manifest.status,
            }
            break
        if errors:
            info.setdefault(precision, {"formats": []})["errors"] = errors
        gc.collect()
    return paths, info


def export_options(formats: tuple[str, ...], precision: str, args: argparse.Namespace) -> ExportOptions:
    return ExportOptions(
        formats=formats,
        precision=precision,
        check=args.export_check,
        settings={"onnx": OnnxOptions(opset=args.opset)},
    )


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------- engines
def open_engine(key: str, artifacts: dict[str, Path], args: argparse.Namespace) -> Engine:
    row = ROWS[key]
    if row.artifact not in artifacts:
        raise RuntimeError(f"its {row.artifact} export failed (see exports in the JSON)")
    root = artifacts[row.artifact]
    if row.engine == "peer-compile":
        return peer_compile(load(root, "eager"))
    if row.engine == "peer-onnx":
        return peer_onnx(load(root, "onnx"), args.threads)
    options = dict(row.options)
    if row.engine == "onnx":
        return load(root, "onnx", threads=args.threads, spinning=False, **options)
    return load(root, row.engine, **options)


def named_numpy(engine: Engine, out: Any) -> dict[str, np.ndarray]:
    """Any engine's outputs (a dict, a list, a tensor) as float NumPy arrays by output name."""
    if not isinstance(out, dict):
        values = list(out) if isinstance(out, (list, tuple)) else [out]
        out = dict(zip([s.name for s in engine.outputs], values, strict=True))
    result = {}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
            value = value.numpy()
        result[name] = np.asarray(value)
    return result


def engine_settings(engine: Engine) -> dict[str, Any]:
    """What an engine runs with, read back after loading (compile: freezing, precision; onnx: threads, spinning)."""
    settings = {
        k: v if isinstance(v, (bool, int, float, str, type(None), list)) else str(v)
        for k, v in engine.settings().items()
    }
    if engine.name == "compile":
        settings["dynamic"] = engine.options.get("dynamic", True)  # CompiledEngine's default
    if engine.name == "onnx":
        settings["allow_spinning"] = engine._session.get_session_options().get_session_config_entry(ORT_SPINNING)
    return settings


def open_and_check(
    rows: list[str],
    artifacts: dict[str, Path],
    feeds: dict[str, np.ndarray],
    args: argparse.Namespace,
    console: Console,
) -> tuple[dict[str, Engine], dict[str, Any], dict[str, str]]:
    """Open each row's engine and measure its parity with eager fp32 on ``feeds``.

    Returns the engines that ran, the parity per row, and why each other row could not run.
    """
    engines: dict[str, Engine] = {}
    parity: dict[str, Any] = {}
    failed: dict[str, str] = {}
    reference: dict[str, np.ndarray] | None = None
    for key in rows:  # eager comes first
        console.log(f"open {key} and run it at batch {PARITY_BATCH}")
        try:
            engine = open_engine(key, artifacts, args)
            engine.load()
            start = time.perf_counter()
            out = named_numpy(engine, engine.run(feeds))
            first_call_s = time.perf_counter() - start
        except Exception as exc:  # a row that cannot run is reported, the others still run
            failed[key] = one_line(exc)
            console.log(f"{key} unavailable: {failed[key]}")
            continue
        engines[key] = engine
        if reference is None:
            reference = out
        parity[key] = parity_of(key, reference, out) | {"first_call_s": round(first_call_s, 2)}
        if not isinstance(engine, DirectEngine):
            parity[key]["settings"] = engine_settings(engine)
    return engines, parity, failed


def parity_of(key: str, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, Any]:
    precision = ROWS[key].precision
    rtol, atol = tolerance_for(precision)
    min_sqnr = MIN_SQNR_DB.get(precision)
    outputs = {}
    for name, ref in reference.items():
        got = compare_output(name, ref, candidate[name], rtol, atol, min_sqnr)
        outputs[name] = {
            "max_rel": got.max_rel,
            "max_abs": got.max_abs,
            "sqnr_db": finite(got.sqnr_db),
            "passed": got.passed,
            "problem": got.problem,
        }
    return {
        "precision": precision,
        "rtol": rtol,
        "atol": atol,
        "min_sqnr_db": min_sqnr,
        "outputs": outputs,
        "max_rel": max(o["max_rel"] for o in outputs.values()),
        "sqnr_db": min((o["sqnr_db"] for o in outputs.values() if o["sqnr_db"] is not None), default=None),
        "passed": all(o["passed"] for o in outputs.values()),
    }


def finite(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else round(value, 2)


def close_all(engines: Mapping[str, Engine]) -> None:
    for engine in engines.values():
        engine.close()


# ---------------------------------------------------------------------------------------- one size
def bench_size(
    size: str, rows: list[str], left_out: dict[str, str], workdir: Path, args: argparse.Namespace, console: Console
) -> dict[str, Any]:
    """Export, open, check and time every row for one model size."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    spec = build_model(MODEL, size=size)
    seq = min(args.seq, spec.signature.dims["seq"].max)
    if seq != args.seq:
        console.log(f"{size}: sequence length {args.seq} is beyond the model's {seq} positions; using {seq}")
    artifacts, exports = export_artifacts(spec, rows, workdir, args, console)
    del spec
    gc.collect()
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg), "seq": seq, "exports": exports}
    engines: dict[str, Engine] = {}
    try:
        if "fp32" not in artifacts:
            raise RuntimeError(f"the fp32 export failed: {'; '.join(exports['fp32'].get('errors', []))}")
        like = load(artifacts["fp32"], "eager")  # for its specs; nothing is loaded yet
        feeds = random_inputs(like.inputs, like.dims, PARITY_BATCH, seed=1, sizes={"seq": seq})
        engines, result["parity"], failed = open_and_check(rows, artifacts, feeds, args, console)
        result["unavailable"] = left_out | failed
        if "eager" not in engines:
            raise RuntimeError(f"eager fp32, the reference, could not run: {result['unavailable'].get('eager')}")
        example = (torch.zeros(1, seq, dtype=torch.long), torch.ones(1, seq, dtype=torch.long))
        precisions = {
            ROWS[key].precision for key in engines
        }  # each row's rate at the model's shapes, between the calls
        peaks = Roofline(engines["eager"].module, example, precisions)
        report = measure(
            engines, args.batch_sizes, seconds=args.seconds, sizes={"seq": seq}, progress=console.log,
            guard=args.guard, between=peaks.between,
        )  # fmt: skip
        result["peaks"] = peaks.fill(report, lambda key: ROWS[key].precision)
        result["bench"] = report.results()
        result["fp32_peak"] = {b: peaks.median("fp32", b) for b in args.batch_sizes}
        result["flop"] = {str(b): float(f"{peaks.flops * b / 1e9:.4g}") for b in args.batch_sizes}
        if size == args.overhead_size:
            result["overhead"] = measure_overhead(engines, seq, args, console)
        plot(report, args, size, console)
    except Exception as exc:  # keep what was measured; the other sizes still run
        result["error"] = one_line(exc)
        console.log(f"{size} failed: {result['error']}")
    finally:
        close_all(engines)
        engines.clear()
        gc.collect()
        torch._dynamo.reset()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure_overhead(
    engines: dict[str, Engine], seq: int, args: argparse.Namespace, console: Console
) -> dict[str, Any]:
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
        report = measure(pair, [1], seconds=args.seconds, sizes={"seq": seq}, progress=console.log, guard=args.guard)
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


def plot(report: BenchReport, args: argparse.Namespace, size: str, console: Console) -> None:
    path = args.run.path(args.out, ".png", size)
    try:
        save_plot(report, path)
    except TkError as exc:  # matplotlib missing: the JSON is what matters
        console.log(f"no plot: {exc}")
        return
    console.log(f"wrote {path}")


# ------------------------------------------------------------------------------------------ training
def train_compare(size: str, steps: int, batch_size: int, console: Console) -> dict[str, Any]:
    """Eager and compiled training from the same initial weights (like ``tk train --compare``)."""
    torch.manual_seed(0)
    eager_spec = build_model(MODEL, size=size)
    compiled_spec = build_model(MODEL, size=size)
    compiled_spec.module.load_state_dict(eager_spec.module.state_dict())
    console.log(f"train {size} eager: {steps} steps at batch {batch_size}")
    eager = train(eager_spec, steps=steps, batch_size=batch_size)
    console.log(f"train {size} compiled: {steps} steps at batch {batch_size}")
    compiled = train(compiled_spec, steps=steps, batch_size=batch_size, compile_options=CompileOptions())
    return {
        "size": size,
        "steps": steps,
        "batch_size": batch_size,
        "eager": eager.summary(),
        "compiled": compiled.summary(),
        "compiled_over_eager": compiled.steps_per_s / eager.steps_per_s,
        "note": "run one after the other (not interleaved); steps/s leaves out the first 3 steps",
    }


# --------------------------------------------------------------------------------------------- goals
def p50_table(result: dict[str, Any]) -> dict[tuple[str, int], float]:
    return {(r["engine"], r["batch_size"]): r["p50_ms"] for r in result.get("bench", {}).get("rows", [])}


def fastest(p50: dict[tuple[str, int], float], keys: tuple[str, ...], batch: int) -> tuple[str, float] | None:
    found = [(p50[(k, batch)], k) for k in keys if (k, batch) in p50]
    return (min(found)[1], min(found)[0]) if found else None


def goals(sizes: dict[str, Any], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The issue's goals as ratios, for every size (the issue states them for base at 32 and small at 1)."""
    out: list[dict[str, Any]] = []
    largest, smallest = max(batch_sizes), min(batch_sizes)
    for size, result in sizes.items():
        p50 = p50_table(result)
        if not p50:
            continue
        for batch in batch_sizes:
            tk_best, peer_best = fastest(p50, FP32_ROWS, batch), fastest(p50, PEER_ROWS, batch)
            if tk_best and peer_best:
                out.append(
                    goal(
                        "best tk fp32 engine vs best hand-tuned peer (peer p50 / tk p50; >= 1 is as fast)",
                        size,
                        batch,
                        peer_best[1] / tk_best[1],
                        f"{tk_best[0]} {tk_best[1]:.2f} ms vs {peer_best[0]} {peer_best[1]:.2f} ms",
                    )
                )
        eager = p50.get(("eager", largest))
        tk_best = fastest(p50, FP32_ROWS, largest)
        fp32_rate = result.get("fp32_peak", {}).get(largest)
        if tk_best and fp32_rate:
            flop = result["flop"][str(largest)]
            floor_ms = flop / fp32_rate * 1e3
            out.append(
                goal(
                    "fraction of the fp32 floor (floor ms / best fp32 p50; median fp32 rate at the model's shapes)",
                    size,
                    largest,
                    floor_ms / tk_best[1],
                    f"{flop:.4g} GFLOP / {fp32_rate:.0f} GFLOP/s = {floor_ms:.3g} ms; {tk_best[0]} {tk_best[1]:.3g} ms",
                )
            )
        for key in (*BF16_ROWS, "onnx-int8"):
            if eager and (key, largest) in p50:
                sqnr = result.get("parity", {}).get(key, {}).get("sqnr_db")
                detail = f"{ROWS[key].label}, SQNR {sqnr} dB" if sqnr is not None else ROWS[key].label
                out.append(goal(f"{key} speed-up over eager fp32", size, largest, eager / p50[(key, largest)], detail))
        best_fp32 = fastest(p50, FP32_ROWS, smallest)
        best_any = fastest(p50, tuple(k for k in ROWS if k not in PEER_ROWS), smallest)
        if best_fp32 and best_any:
            out.append(
                goal(
                    "latency at the smallest batch (ms, best engine)",
                    size,
                    smallest,
                    best_any[1],
                    f"{best_any[0]}; best fp32: {best_fp32[0]} {best_fp32[1]:.3f} ms",
                )
            )
    return out


def goal(name: str, size: str, batch: int, value: float, detail: str) -> dict[str, Any]:
    return {"goal": name, "size": size, "batch_size": batch, "value": round(value, 4), "detail": detail}


# -------------------------------------------------------------------------------------------- tables
def results_table(sizes: dict[str, Any], batch_sizes: list[int], machine: dict[str, Any], threads: int) -> Table:
    table = Table(title=f"Transformer on {machine.get('cpu')}, {threads} threads (p50 per call)")
    table.add_column("model")
    table.add_column("engine")
    for b in batch_sizes:
        table.add_column(f"ms @{b}", justify="right")
    for b in batch_sizes:
        table.add_column(f"×eager @{b}", justify="right")
    table.add_column("max rel err", justify="right")
    table.add_column("SQNR dB", justify="right")
    notes = []
    for size, result in sizes.items():
        p50 = p50_table(result)
        eager = {b: p50.get(("eager", b)) for b in batch_sizes}
        for key, parity in result.get("parity", {}).items():
            times = [p50.get((key, b)) for b in batch_sizes]
            speedups = [eager[b] / t if eager[b] and t else None for b, t in zip(batch_sizes, times, strict=True)]
            sqnr = parity["sqnr_db"]
            table.add_row(
                size,
                ROWS[key].label,
                *(f"{t:.2f}" if t is not None else "—" for t in times),
                *(f"{s:.2f}×" if s is not None else "—" for s in speedups),
                f"{parity['max_rel']:.1e}" + ("" if parity["passed"] else " ✗"),
                "∞" if sqnr is None else f"{sqnr:.1f}",
            )
        table.add_section()
        notes += [f"{size} {key}: {why}" for key, why in result.get("unavailable", {}).items()]
        busy = sorted({r["batch_size"] for r in result.get("bench", {}).get("rows", []) if r["busy"]})
        if busy:
            notes.append(f"{size}: load above the cores while timing batch {busy}; expect noise (busy machine)")
        if "error" in result:
            notes.append(f"{size}: {result['error']}")
    notes.append(f"max rel err = max|diff| / max|eager fp32| at batch {PARITY_BATCH}; ✗ = outside the tolerance")
    table.caption = "\n".join(notes)
    return table


def goals_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="goals")
    for column in ("goal", "model", "batch", "value", "detail"):
        table.add_column(column, justify="right" if column in ("batch", "value") else "left")
    for g in rows:
        table.add_row(g["goal"], g["size"], str(g["batch_size"]), f"{g['value']:.3g}", g["detail"])
    return table


def overhead_table(overhead: dict[str, Any], size: str) -> Table:
    table = Table(title=f"tk's call overhead, {size} at batch 1 (goal: tk / bare <= {OVERHEAD_GOAL})")
    for column in ("backend", "tk p50 ms", "bare p50 ms", "tk / bare"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for key, r in overhead.get("ratios", {}).items():
        mark = "" if r["ratio"] <= OVERHEAD_GOAL else " ✗"
        table.add_row(key, f"{r['tk_p50_ms']:.3f}", f"{r['bare_p50_ms']:.3f}", f"{r['ratio']:.3f}{mark}")
    if overhead.get("new_graphs_while_timing"):
        table.caption = "torch.compile built new graphs while timing: the bare call may not match tk's"
    return table


def train_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"training {result['size']}: {result['steps']} steps at batch {result['batch_size']}")
    for column in ("loop", "steps/s", "first step s", "final loss", "recompiles"):
        table.add_column(column, justify="left" if column == "loop" else "right")
    for name in ("eager", "compiled"):
        r = result[name]
        table.add_row(
            name,
            f"{r['steps_per_s']:.2f}",
            f"{r['first_step_s']:.1f}",
            f"{r['final_loss']:.4f}",
            str(r["recompilations"]),
        )
    table.caption = f"compiled / eager after warm-up: {result['compiled_over_eager']:.2f}×"
    return table


# ---------------------------------------------------------------------------------------------- main
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
    args.rows = ["eager", *(r for r in ROWS if r in rows and r != "eager")]  # the reference first
    args.overhead_size = "small" if "small" in args.sizes else args.sizes[0]
    return args


def bf16_reason() -> str | None:
    reason = cpu_precision_reason("bf16")
    return (
        None if reason is None else f"{reason}: a base call at batch 32 would take minutes; --force-bf16 runs it anyway"
    )


def quiet_logs() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("torch", "torch.utils.cpp_extension", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.omp_passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # OpenMP reads its settings when torch is imported: start again with the variable set.
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})
    quiet_logs()
    torch.set_num_threads(args.threads)  # before any export: AOTInductor compiles its thread count in
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    console = Console(width=max(Console().width, 160))
    args.run = BenchRun("bench-cpu", argv=sys.argv if argv is None else argv)
    args.guard = LoadGuard(args.wait_quiet)
    rows, left_out = args.rows, {}
    if (reason := bf16_reason()) and not args.force_bf16:
        left_out = {key: reason for key in BF16_ROWS if key in rows}
        rows = [key for key in rows if key not in left_out]
    sizes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tk-bench-") as tmp:
        for size in args.sizes:
            sizes[size] = bench_size(size, rows, left_out, Path(tmp) / size, args, console)
    training = None if args.no_train else train_compare(TRAIN_SIZE, args.train_steps, args.train_batch_size, console)
    goal_rows = goals(sizes, args.batch_sizes)
    args.run.settings = {
        **settings_of(args, ("run", "guard")),
        "model": MODEL,
        "parity_batch": PARITY_BATCH,
        "export_check_note": None if args.export_check else EXPORT_CHECK_NOTE,
        "onnxruntime_spinning_note": SPINNING_NOTE,
        "environment": {name: os.environ.get(name) for name in THREAD_ENV},
        "rows": {k: dataclasses.asdict(ROWS[k]) for k in args.rows},
    }
    results = {
        "sizes": sizes,
        "overhead": sizes.get(args.overhead_size, {}).get("overhead"),
        "train": training,
        "goals": goal_rows,
    }
    console.print(results_table(sizes, args.batch_sizes, args.run.machine, args.threads))
    if results["overhead"]:
        console.print(overhead_table(results["overhead"], args.overhead_size))
    if training:
        console.print(train_table(training))
    console.print(goals_table(goal_rows))
    path = args.run.write(results, args.out)
    console.print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
