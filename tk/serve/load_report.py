"""The load test's goals as ratios of its rows, and its table for people (rich)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def serving_goals(rows: list[dict[str, Any]], bound: dict[str, Any]) -> dict[str, float]:
    """The issue's serving goals as ratios of this run's rows (``bound``: ``engine_batch_bound``'s)."""
    on = next(r for r in rows if r["scenario"] == "single" and r["batching"])
    off = next(r for r in rows if r["scenario"] == "single" and not r["batching"])
    one_row = next(r for r in rows if r["scenario"] == "one client")
    return {
        "single_throughput_ratio": on["samples_per_s"] / off["samples_per_s"],
        "engine_batching_bound": bound["gain"],
        # the goal: served samples/s with batching >= 90% of the engine's own best: at its largest
        # batch on every core, or (``best_samples_per_s``, where measured) in 1-thread processes side by side
        "served_over_engine_best": on["samples_per_s"]
        / bound.get("best_samples_per_s", bound["max_batch_samples_per_s"]),
        "single_p99_on_over_p50_off": on["p99_ms"] / off["p50_ms"],
        "one_client_p50_ms": one_row["p50_ms"],
        "engine_batch1_p50_ms": one_row["engine_p50_ms"],
        "overhead_ms": one_row["overhead_p50_ms"],
        "health_p50_ms": one_row["health_p50_ms"],
    }


def goals_line(goals: dict[str, float], max_batch: int) -> str:
    return (
        f"batching on/off throughput (single-sample clients): {goals['single_throughput_ratio']:.2f}x "
        f"(the engine alone gains {goals['engine_batching_bound']:.2f}x from batch 1 to {max_batch}); "
        f"served with batching / the engine alone at its best: {goals['served_over_engine_best']:.2f} (goal >= 0.9); "
        f"p99 on / p50 off: {goals['single_p99_on_over_p50_off']:.2f} (goal < 4); "
        f"one client p50 {goals['one_client_p50_ms']:.2f} ms vs engine batch-1 p50 {goals['engine_batch1_p50_ms']:.2f} ms, "
        f"interleaved: overhead p50 {goals['overhead_ms']:.2f} ms (goal <= 2 ms); "
        f"GET /v2/health/live p50 {goals['health_p50_ms']:.2f} ms"
    )


def render(rows: list[dict[str, Any]], what: str) -> Table:
    """The scenarios' table; rows timed on a busy machine say so in the load column."""
    table = Table(title=f"tk serve load test: {what}")
    columns = ("scenario", "batching", "requests", "lost", "dup", "mismatch", "samples/s", "p50 ms", "p99 ms", "load")
    for column in columns:
        table.add_column(column, justify="left" if column in ("scenario", "batching") else "right")
    for r in rows:
        table.add_row(
            r["scenario"],
            "on" if r["batching"] else "off",
            "-" if r["requests"] is None else str(r["requests"]),
            str(r["lost"]),
            str(r["duplicated"]),
            "-" if r["mismatched"] is None else str(r["mismatched"]),
            f"{r['samples_per_s']:.1f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            f"{r['load_before']}→{r['load_after']}" + (" busy" if r["busy"] else ""),
        )
    return table
