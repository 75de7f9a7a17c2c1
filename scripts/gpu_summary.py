"""Read what scripts/gpu_check.sh left in WORK and print one summary table; write OUT/gpu_check.json.

Usage: python scripts/gpu_summary.py WORK OUT. The goals are issue #11's, read as ratios from
this one run: the best device-resident p50 of the small Transformer at batch 1 and 32, bf16 base
against eager float32 base at batch 32, compiled over eager training steps/s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(report: dict[str, Any] | None, label: str) -> list[dict[str, Any]]:
    results = (report or {}).get("results", {})  # tk bench --json: the benchmarks' envelope
    return [{**row, "run": label} for row in results.get("rows", [])]


def p50(table: list[dict[str, Any]], engine: str, batch: int) -> float | None:
    values = [r["p50_ms"] for r in table if r["engine"] == engine and r["batch_size"] == batch]
    return min(values) if values else None


def compile_notes(*reports: dict[str, Any] | None) -> list[str]:
    """What the compile engine did in each run: its mode, dynamic shapes, CUDA graphs used or skipped, recompilations."""
    notes = []
    for report in reports:
        engine = ((report or {}).get("settings") or {}).get("engines", {}).get("compile")
        if engine:
            keys = ("mode", "dynamic", "precision", "cuda_graphs", "recompilations")
            notes.append("compile  " + ", ".join(f"{k}={engine.get(k)}" for k in keys))
    return notes


def main(work: Path, out: Path) -> int:
    steps = [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines() if line]
    table = (
        rows(load(work / "bench_small.json"), "plain")
        + rows(load(work / "bench_small_graphs.json"), "cuda-graph")
        + rows(load(work / "bench_small_static.json"), "static")
        + rows(load(work / "bench_aoti.json"), "cuda-graph")
    )
    base32 = rows(load(work / "bench_base_fp32.json"), "fp32") + rows(load(work / "bench_base_bf16.json"), "bf16")
    train = load(work / "train.json")
    reports = [
        load(work / f)
        for f in ("bench_small.json", "bench_small_graphs.json", "bench_base_fp32.json", "bench_base_bf16.json")
    ]
    machine = next((r.get("machine", {}) for r in reports if r), {})
    versions = next((r.get("versions", {}) for r in reports if r), {})

    lines = [f"gpu_check on {machine.get('gpu') or machine.get('cpu', '?')} (torch {versions.get('torch')})"]
    lines.append(f"{'step':<20} {'outcome':<18} {'seconds':>7}")
    lines += [f"{name:<20} {outcome:<18} {seconds:>7}" for name, outcome, seconds in steps]
    lines.append("")
    lines.append(
        f"{'run':<11} {'engine':<8} {'batch':>5} {'p50 ms':>9} {'p99 ms':>9} {'cold ms':>9} {'compute ms':>10} {'peak MiB':>9} {'x eager':>8}"
    )
    for r in table + base32:
        cells = [
            r["run"],
            r["engine"],
            r["batch_size"],
            r["p50_ms"],
            r["p99_ms"],
            r.get("cold_ms"),
            r.get("compute_ms"),
            r.get("peak_gpu_mb"),
            r.get("speedup"),
        ]
        lines.append("{:<11} {:<8} {:>5} {:>9.3f} {:>9.3f} {:>9} {:>10} {:>9} {:>8}".format(
            *cells[:5], *(("-" if v is None else f"{v:.3f}" if i < 2 else f"{v:.0f}" if i == 2 else f"{v:.2f}") for i, v in enumerate(cells[5:]))
        ))  # fmt: skip

    best = {b: min((r["p50_ms"] for r in table if r["batch_size"] == b), default=None) for b in (1, 32)}
    eager1 = p50([r for r in table if r["run"] == "plain"], "eager", 1)  # eager as users call it: no graphs
    eager_fp32 = p50(base32, "eager", 32)
    bf16 = min((r["p50_ms"] for r in base32 if r["run"] == "bf16" and r["engine"] != "eager"), default=None)
    speedup_train = train.get("speedup") if train else None
    goals = {
        "small b1 best p50 <= 0.15 ms": best[1],
        "small b1 best >= 8x eager": (eager1 / best[1]) if eager1 and best[1] else None,
        "small b32 best p50 <= 0.3 ms": best[32],
        "base bf16 b32 >= 5x eager fp32": (eager_fp32 / bf16) if eager_fp32 and bf16 else None,
        "compiled training >= 1.3x eager": speedup_train,
    }
    targets = {"small b1 best p50 <= 0.15 ms": ("<=", 0.15), "small b1 best >= 8x eager": (">=", 8.0),
               "small b32 best p50 <= 0.3 ms": ("<=", 0.3), "base bf16 b32 >= 5x eager fp32": (">=", 5.0),
               "compiled training >= 1.3x eager": (">=", 1.3)}  # fmt: skip
    lines.append("")
    verdicts = {}
    for goal, value in goals.items():
        op, target = targets[goal]
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        verdicts[goal] = {"value": value, "met": met}
        shown = "not measured" if value is None else f"{value:.3f}"
        lines.append(f"goal  {goal:<34} {shown:>12}  {'met' if met else 'NOT met' if met is False else ''}")
    lines += compile_notes(
        *(load(work / f) for f in ("bench_small.json", "bench_small_static.json", "bench_base_bf16.json"))
    )
    print("\n".join(lines))
    summary = {"machine": machine, "steps": [dict(zip(("step", "outcome", "seconds"), s, strict=True)) for s in steps],
               "rows": table + base32, "train": train, "goals": verdicts}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(outcome == "ok" or outcome.startswith("skipped") for _, outcome, _ in steps) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
