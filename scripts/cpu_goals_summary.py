"""Read what scripts/cpu_goals.sh left in WORK, print one summary table, write OUT/cpu_goals.json.

Usage: python scripts/cpu_goals_summary.py WORK OUT. The goals are issue 22's for the small
Transformer at 32 x 128, read from this one run: the pick against eager float32 (issue 47's 3.3x on a CPU
with AVX512-BF16 and no AMX, 4x with AMX) at >= 35 dB and never slower than a passing candidate a user could pick by
hand; tk optimize in 5 minutes; the bf16 package at >= 70% of the bf16 rate at its own shapes; the
int8 package >= 1.2x the bf16 package with AMX (both timed in optimize's rounds). A ratio whose goal
names another kind of CPU is shown with no verdict.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.goals.transformer import BF16_PEAK_GOAL
from tk.measure.hardware import machine_description
from tk.tolerances import MIN_SQNR_DB
from tk.workflows.optimize.table import TIE  # within it the more accurate candidate wins

OPTIMIZE_SECONDS = 300.0
NO_BF16 = "skipped (no bf16)"  # cpu_goals.sh's bf16 step on a CPU without bf16 products: the run is complete
INT8_OVER_BF16_AMX = 1.2


def load(path: Path | None) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def number(value: Any) -> float | None:
    """A number of optimize.json, where an infinite or NaN one is the text "inf", "-inf" or "nan"."""
    return float(value) if isinstance(value, str) else value


def cpu_class(flags: list[str]) -> str:
    """amx, avx512_bf16 or other: which of the issue's speed goals this CPU is held to."""
    if any(f in flags for f in ("amx_bf16", "amx_int8")):
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "other"


def candidate(table: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in table.get("candidates", []) if c["candidate"] == name), None)


def goal(value: float | None, op: str, target: float | None, why: str = "") -> dict[str, Any]:
    """A goal's verdict: None where not measured (``why`` says why) or where no target applies here."""
    met = None
    if value is not None and target is not None:
        met = value <= target if op == "<=" else value >= target
    return {"value": value, "target": target and f"{op} {target:g}", "met": met, "why": why}


def not_timed(row: dict[str, Any] | None, name: str) -> str:
    if row is None:
        return f"{name}: not a candidate in this run"
    return f"{name}: {row['status']}" + (f" ({row['reason']})" if row.get("reason") else "")


def goals_of(table: dict[str, Any] | None, bf16_row: dict[str, Any] | None, kind: str,
             optimize_s: float | None, no_bf16: str = "") -> dict[str, dict[str, Any]]:  # fmt: skip
    """The goals' values, targets and verdicts; ``no_bf16``: why the bf16 step did not run on this CPU."""
    table = table or {}
    winner = next((c for c in table.get("candidates", []) if c.get("winner")), None)
    speedup_target = {"amx": 4.0, "avx512_bf16": 3.3}.get(kind)
    why = "" if speedup_target else "the goal names CPUs with AVX512-BF16 or AMX"
    if winner and winner.get("busy"):
        why = "timed on a busy machine"
    goals = {
        f"pick >= {speedup_target or 3.3:g}x eager fp32": goal(
            winner and winner.get("speedup"), ">=", speedup_target, why
        )
    }
    sqnr = None
    if winner:
        found = [number(winner.get(k, {}).get("sqnr")) for k in ("accuracy", "shape_range")]
        sqnr = min((v for v in found if v is not None), default=None)
    goals["pick held out and across the range >= 35 dB"] = goal(sqnr, ">=", MIN_SQNR_DB["int8"])
    timed = [c["p50_ms"] for c in table.get("candidates", []) if c.get("status") == "passed" and c.get("p50_ms")]
    ratio = winner["p50_ms"] / min(timed) if winner and timed and winner.get("p50_ms") else None
    goals["pick p50 / fastest passed p50"] = goal(ratio, "<=", 1 + TIE, "within the tie margin the more accurate wins")
    goals["tk optimize seconds"] = goal(optimize_s, "<=", OPTIMIZE_SECONDS)
    share = bf16_row.get("peak_share") if bf16_row else None
    why = (no_bf16 or "no bf16 row") if not bf16_row else "timed on a busy machine" if bf16_row.get("busy") else ""
    goals["bf16 package, share of the bf16 rate"] = goal(share, ">=", BF16_PEAK_GOAL, why)
    int8, bf16 = candidate(table, "aoti int8 static"), candidate(table, "aoti bf16")
    both = all(c is not None and c.get("status") == "passed" and c.get("p50_ms") for c in (int8, bf16))
    why = "" if both else "; ".join(not_timed(c, n) for c, n in ((int8, "aoti int8 static"), (bf16, "aoti bf16")))
    if both and kind != "amx":
        why = "the goal names CPUs with AMX"
    goals["aoti int8 over aoti bf16, same rounds"] = goal(
        bf16["p50_ms"] / int8["p50_ms"] if both else None, ">=", INT8_OVER_BF16_AMX if kind == "amx" else None, why
    )
    return goals


def main(work: Path, out: Path) -> int:
    steps = [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines() if line]
    seconds = {name: float(s) for name, _, s in steps}
    ran = {name for name, outcome, _ in steps if outcome == "ok"}  # a step that did not: its files are not this run's
    table = load(work / "optimize" / "optimize.json") if "optimize" in ran else None
    bench = load(max((work / "bf16").glob("*-bench-goals.json"), default=None)) if "bf16" in ran else None
    bf16_row = next(
        (r for r in ((bench or {}).get("results") or {}).get("rows", []) if r["goal"].startswith("bf16")), None
    )
    machine = (bench or {}).get("machine")
    if machine is None:  # the bf16 step did not run: this machine, where the summary runs
        machine = machine_description()
    versions = (bench or {}).get("versions") or machine.get("versions") or {}
    kind = cpu_class(machine.get("cpu_flags", []))
    optimize_s = seconds.get("optimize") if table else None
    skipped = work / "bf16-skipped.txt"
    bf16_skipped = any(n == "bf16" and o == NO_BF16 for n, o, _ in steps) and skipped.exists()
    goals = goals_of(table, bf16_row, kind, optimize_s, skipped.read_text().strip() if bf16_skipped else "")

    cores = (work / "cores.txt").read_text().strip() if (work / "cores.txt").exists() else "cores: ?"
    amx = [f for f in machine.get("cpu_flags", []) if f.startswith("amx")]
    lines = [f"cpu_goals on {machine.get('cpu', '?')} ({kind}; {', '.join(amx) or 'no AMX'}; {cores}; "
             f"torch {versions.get('torch', '?')})"]  # fmt: skip
    lines.append(f"{'step':<10} {'outcome':<18} {'seconds':>7}")
    lines += [f"{name:<10} {outcome:<18} {s:>7}" for name, outcome, s in steps]
    if table:
        lines += ["", f"{'candidate':<24} {'status':<8} {'p50 ms':>8} {'x eager':>8}  accuracy / reason"]
        for c in table.get("candidates", []):
            if c.get("status") == "skipped":
                continue
            p50, speedup = c.get("p50_ms"), c.get("speedup")
            lines.append(
                f"{c['candidate']:<24} {'WINNER' if c.get('winner') else c['status']:<8} "
                f"{'-' if p50 is None else f'{p50:.1f}':>8} {'-' if speedup is None else f'{speedup:.2f}':>8}  "
                f"{c.get('accuracy_text') or ''} {c.get('reason') or ''}".rstrip()
            )
    lines.append("")
    for name, g in goals.items():
        shown = "not measured" if g["value"] is None else f"{g['value']:.3f}"
        verdict = {True: "met", False: "NOT met", None: ""}[g["met"]]
        lines.append(f"goal  {name:<44} {shown:>12} {g['target'] or '':>8}  {verdict} {g['why']}".rstrip())
    print("\n".join(lines))
    for g in goals.values():  # JSON has no infinity: as optimize.json writes it
        if g["value"] is not None and not math.isfinite(g["value"]):
            g["value"] = str(g["value"])
    summary = {"machine": machine, "cpu_class": kind, "cores": cores,
               "steps": [dict(zip(("step", "outcome", "seconds"), s, strict=True)) for s in steps],
               "candidates": (table or {}).get("candidates"), "bf16": bf16_row, "goals": goals}  # fmt: skip
    (out / "cpu_goals.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if all(outcome in ("ok", NO_BF16) for _, outcome, _ in steps) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
