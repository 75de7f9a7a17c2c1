"""A Hugging Face model exported by tk (ONNX, fused) against Optimum's ONNX of the same directory.

Both run in onnxruntime with the same session options (``tk.workflows.ort_session``, torch's
thread count), interleaved call by call, on the same padded random batch, under the load
guard: wall-time ratio (of medians, and the median of per-round ratios), process CPU-time ratio
(CPU seconds per call barely move when other processes take the cores, where wall time does), the
max abs error of both against transformers' own forward, and the rate of both (FLOPs of
transformers' forward / p50) as a share of the median fp32 rate at the model's linear shapes.
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.errors import UsageError
from tk.export import ExportOptions
from tk.measure.load_guard import LoadGuard
from tk.measure.roofline import Roofline
from tk.measure.timing import CallTime, interleave_calls, ms
from tk.models import build_model
from tk.spec import random_feeds
from tk.workflows.export import export
from tk.workflows.ort_session import plain_session

HF_SPEEDUP_GOAL = 1.1
HF_ABS_GOAL = 1e-4
TK, OPTIMUM = "tk onnx", "optimum onnx"


@dataclass
class HfSettings:
    shapes: list[tuple[int, int]] = field(default_factory=lambda: [(8, 128), (1, 128)])  # batch x seq
    iters: int = 30  # interleaved rounds at batch 8 (x 8 / batch below)
    optimum_cli: Path | None = None  # optimum-cli to export with when no Optimum ONNX is given
    guard: LoadGuard = field(default_factory=LoadGuard)


class KeywordCall(torch.nn.Module):
    """``model`` called with keyword inputs, for FlopCounterMode's positional call."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, args, strict=True)))


def optimum_export(cli: Path, directory: Path, out: Path) -> Path:
    """Optimum's ONNX export of ``directory`` (``optimum-cli export onnx``, in its own venv) at ``out``."""
    cmd = [str(cli), "export", "onnx", "--model", str(directory), "--task", "feature-extraction", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise UsageError(
            f"{' '.join(cmd)}: expected exit 0 and {out / 'model.onnx'}, got exit {done.returncode}: {last}"
        )
    logging.getLogger("tk").info("optimum export ok %.1f s", time.perf_counter() - start)
    return out


def bench_hf(
    directory: Path,
    optimum_onnx: Path | None,
    s: HfSettings,
    work: Path,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """tk's fused ONNX against Optimum's ONNX, one row per batch x seq of ``s.shapes``."""
    from transformers import AutoModel

    spec = build_model(f"hf:{directory}")
    root = work / "hf"
    result = export(spec, root, ExportOptions(formats=("onnx",), check=False))
    fusions = result.manifest.formats["onnx"].get("fusions", {})
    if optimum_onnx is None and s.optimum_cli is not None:
        optimum_onnx = optimum_export(s.optimum_cli, directory, work / "optimum")
    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    threads = torch.get_num_threads()
    sessions = {TK: plain_session(root / "model.onnx", threads)}
    if optimum_onnx is not None:
        sessions[OPTIMUM] = plain_session(optimum_onnx / "model.onnx", threads)
    goal = "hf all-MiniLM-L6-v2" if "minilm" in str(directory).lower() else f"hf {directory.name}"
    rows: list[dict] = []
    for batch, seq in s.shapes:
        feeds = random_feeds(spec.signature.inputs, {"batch": batch, "seq": seq}, seed=7)  # padded masks
        rows.append({"goal": goal} | hf_row(model, sessions, feeds, s, fusions))
        if on_row is not None:
            on_row(rows)
    return rows


def hf_row(
    model: torch.nn.Module, sessions: dict[str, Any], feeds: dict[str, np.ndarray], s: HfSettings, fusions: dict
) -> dict[str, Any]:
    """One shape: errors against transformers, then both sessions timed interleaved with the fp32
    rate at the model's shapes sampled between their calls."""
    batch, seq = next(iter(feeds.values())).shape[:2]
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()

    def run(sess: Any) -> np.ndarray:
        return sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})[0]

    errors = {name: float(np.abs(run(sess) - want).max()) for name, sess in sessions.items()}
    iters = s.iters * max(1, 8 // batch)  # small batches: more rounds, same order of total time
    calls = {name: (lambda sess=sess: run(sess)) for name, sess in sessions.items()}
    roofline = Roofline(KeywordCall(model, list(feeds)), tuple(torch.from_numpy(v) for v in feeds.values()), ["fp32"])
    times, mark = interleave_calls(calls, iters=iters, guard=s.guard, between=roofline.between(1))
    flops, peak = roofline.flops, roofline.median("fp32")
    tk_wall = [t.total_s for t in times[TK]]
    row: dict[str, Any] = {
        "shape": f"{batch}x{seq}",
        "iters": iters,
        "ms": round(ms(tk_wall), 2),
        "cpu_ms": round(ms(_cpu(times[TK])), 2),
        "max_abs_vs_transformers": errors[TK],
        "fused_ops": fusions.get("fused_ops"),
        "cpu_rewrites": fusions.get("cpu_rewrites"),
        "gflop": round(flops / 1e9, 2),
        "fp32_peak_gflops": round(peak, 1),
        "fp32_peak_share": round(flops / statistics.median(tk_wall) / 1e9 / peak, 3),
        "goal_text": f">= {HF_SPEEDUP_GOAL:g}x Optimum's ONNX, max abs <= {HF_ABS_GOAL:g}",
    } | roofline.to_json() | mark.to_json()  # fmt: skip
    if OPTIMUM in times:
        row |= versus_optimum(times[TK], times[OPTIMUM], errors, flops, peak)
    return row


def _cpu(times: list[CallTime]) -> list[float]:
    return [t.cpu_s or 0.0 for t in times]


def versus_optimum(
    tk_t: list[CallTime], opt_t: list[CallTime], errors: dict[str, float], flops: int, peak: float
) -> dict[str, Any]:
    """Optimum's columns of a row and the ratios of tk's times to them."""
    tk_wall, opt_wall = [t.total_s for t in tk_t], [t.total_s for t in opt_t]
    speedup = round(ms(opt_wall) / ms(tk_wall), 3)
    return {
        "optimum_ms": round(ms(opt_wall), 2),
        "optimum_cpu_ms": round(ms(_cpu(opt_t)), 2),
        "optimum_max_abs_vs_transformers": errors[OPTIMUM],
        "optimum_fp32_peak_share": round(flops / statistics.median(opt_wall) / 1e9 / peak, 3),
        "speedup_vs_optimum": speedup,
        "paired_speedup_vs_optimum": round(statistics.median(o / t for o, t in zip(opt_wall, tk_wall, strict=True)), 3),
        "min_ratio_vs_optimum": round(min(opt_wall) / min(tk_wall), 3),
        "cpu_time_ratio_vs_optimum": round(ms(_cpu(opt_t)) / ms(_cpu(tk_t)), 3),
        "met": bool(speedup >= HF_SPEEDUP_GOAL and errors[TK] <= HF_ABS_GOAL),
    }
