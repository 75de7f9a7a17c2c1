"""The load test's goals as ratios of its rows, and its table for people (rich)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def serving_goals(rows: list[dict[str, Any]], bound: dict[str, Any]) -> dict[str, float]:
    """The issue's serving goals as ratios of this run's rows (``bound``: ``engine_batch_bound``'s)."""
    on = next(r for r in rows if r["scenario"] == "single" and r["batching"])
    off = next(r for r in rows if r["scenario"] == "single" and not r["batching"])
    one_row = next(r for r in rows if r["scenario"] == "one client")
    # Triton's own client at concurrency 1, where it ran: its average latency less the server's engine
    # call, over the same requests. The Python client's row also counts tritonclient's own work per
    # request (building the request, gevent's HTTP, decoding the reply), which is the client's, not
    # the server's; both are reported, and perf_analyzer's goal figure is the larger of batching on and off.
    pa_one = [r for r in rows if r.get("client") == "perf_analyzer" and r.get("concurrency") == 1]
    pa_overhead = {("on" if r["batching"] else "off"): r["overhead_avg_ms"] for r in pa_one if "overhead_avg_ms" in r}
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
        **(
            {
                "perf_analyzer_overhead_ms": max(pa_overhead.values()),
                "perf_analyzer_overhead_by_batching": pa_overhead,
            }
            if pa_overhead
            else {}
        ),
    }


def goals_line(goals: dict[str, float], max_batch: int) -> str:
    return (
        f"batching on/off throughput (single-sample clients): {goals['single_throughput_ratio']:.2f}x "
        f"(the engine alone gains {goals['engine_batching_bound']:.2f}x from batch 1 to {max_batch}); "
        f"served with batching / the engine alone at its best: {goals['served_over_engine_best']:.2f} (goal >= 0.9); "
        f"p99 on / p50 off: {goals['single_p99_on_over_p50_off']:.2f} (goal < 4); "
        f"one client p50 {goals['one_client_p50_ms']:.2f} ms vs engine batch-1 p50 {goals['engine_batch1_p50_ms']:.2f} ms, "
        f"interleaved: overhead p50 {goals['overhead_ms']:.2f} ms through tritonclient's Python client"
        + (
            f", {goals['perf_analyzer_overhead_ms']:.2f} ms through perf_analyzer at concurrency 1 (its average "
            f"latency less the server's engine call; batching "
            + ", ".join(f"{k} {v:.2f}" for k, v in goals["perf_analyzer_overhead_by_batching"].items())
            + ")"
            if "perf_analyzer_overhead_ms" in goals
            else ""
        )
        + f" (goal <= 2 ms); GET /v2/health/live p50 {goals['health_p50_ms']:.2f} ms"
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
