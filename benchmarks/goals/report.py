"""The goals table of ``scripts/bench_goals.py`` for people (rich)."""

from __future__ import annotations

from rich.table import Table


def of_peak(r: dict) -> str:
    """The share of the median rate at the model's shapes, in the row's precision."""
    if "peak_share" in r:
        return "— (no bf16 rate)" if r["peak_share"] is None else f"{100 * r['peak_share']:.0f}% bf16"
    if "int8_peak_share" in r:
        return f"{100 * r['int8_peak_share']:.0f}% int8"
    if "fp32_peak_share" in r:
        other = f" (optimum {100 * r['optimum_fp32_peak_share']:.0f}%)" if "optimum_fp32_peak_share" in r else ""
        return f"{100 * r['fp32_peak_share']:.0f}% fp32{other}"
    return "—"


def vs_optimum(r: dict) -> str:
    if "speedup_vs_optimum" not in r:
        return "—"
    return (
        f"{r['speedup_vs_optimum']:.2f}× (paired {r['paired_speedup_vs_optimum']:.2f}×, "
        f"CPU time {r['cpu_time_ratio_vs_optimum']:.2f}×)"
    )


def render(rows: list[dict], machine: dict) -> Table:
    """One line per goal row; rows timed on a busy machine say so."""
    table = Table(title=f"issue 13 goals, {machine.get('cpu')}, {machine.get('torch_threads')} threads")
    for header in ("goal", "shape", "ms", "vs eager fp32", "vs optimum", "SQNR dB", "of peak", "max abs", "met"):
        table.add_column(header, justify="left" if header in ("goal", "met") else "right")
    for r in rows:
        table.add_row(
            r["goal"] + (" (busy machine)" if r.get("busy") else ""),
            r["shape"],
            f"{r['ms']:.1f}",
            f"{r['speedup_vs_eager']:.2f}×" if "speedup_vs_eager" in r else "—",
            vs_optimum(r),
            f"{r['sqnr_db']:.1f}" if "sqnr_db" in r else "—",
            of_peak(r),
            f"{r['max_abs_vs_transformers']:.1e}" if "max_abs_vs_transformers" in r else "—",
            ("yes" if r.get("met") else "no") + f" ({r['goal_text']})",
        )
    return table


def render_pick(results: list[dict], machine: dict) -> list[Table]:
    """Issue 47's pick goals: one table per shape (``benchmarks.goals.pick``, in ``benchmarks.peers``' harness)."""
    from benchmarks.peers import render_peers

    tables = []
    for r in results:
        table = render_peers(r, f"tk optimize's pick vs its rivals at {r['shape']}, {machine.get('cpu')}, "
                                f"{machine.get('torch_threads')} threads: goal {'met' if r['met'] else 'not met'} "
                                f"({r['goal_text']})")  # fmt: skip
        checks = "; ".join(
            f"{c['check']}: {'-' if c['value'] is None else c['value']} ({'met' if c['met'] else 'not met'})"
            for c in r.get("goal_checks", [])
        )
        table.caption = "\n".join(part for part in (table.caption, checks) if part)
        tables.append(table)
    return tables
