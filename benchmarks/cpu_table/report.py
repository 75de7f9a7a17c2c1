"""The CPU table's goals as ratios of its rows, and its tables for people (rich)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from benchmarks.cpu_table.rows import BF16_ROWS, FP32_ROWS, PEER_ROWS, ROWS
from benchmarks.cpu_table.run import OVERHEAD_GOAL, PARITY_BATCH


def p50_table(result: dict[str, Any]) -> dict[tuple[str, int], float]:
    """One size's p50 by (row, batch size)."""
    return {(r["engine"], r["batch_size"]): r["p50_ms"] for r in result.get("bench", {}).get("rows", [])}


def fastest(p50: dict[tuple[str, int], float], keys: tuple[str, ...], batch: int) -> tuple[str, float] | None:
    """The fastest of ``keys`` at ``batch`` and its p50, or None where none ran."""
    found = [(p50[(k, batch)], k) for k in keys if (k, batch) in p50]
    return (min(found)[1], min(found)[0]) if found else None


def goal(name: str, size: str, batch: int, value: float, detail: str) -> dict[str, Any]:
    return {"goal": name, "size": size, "batch_size": batch, "value": round(value, 4), "detail": detail}


def goals(sizes: dict[str, Any], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The issue's goals as ratios, for every size (the issue states them for base at 32 and small at 1)."""
    out: list[dict[str, Any]] = []
    for size, result in sizes.items():
        p50 = p50_table(result)
        if p50:
            out += _peer_goals(size, p50, batch_sizes) + _size_goals(size, result, p50, batch_sizes)
    return out


def _peer_goals(size: str, p50: dict[tuple[str, int], float], batch_sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for batch in batch_sizes:
        tk_best, peer_best = fastest(p50, FP32_ROWS, batch), fastest(p50, PEER_ROWS, batch)
        if tk_best and peer_best:
            name = "best tk fp32 engine vs best hand-tuned peer (peer p50 / tk p50; >= 1 is as fast)"
            detail = f"{tk_best[0]} {tk_best[1]:.2f} ms vs {peer_best[0]} {peer_best[1]:.2f} ms"
            out.append(goal(name, size, batch, peer_best[1] / tk_best[1], detail))
    return out


def _size_goals(
    size: str, result: dict[str, Any], p50: dict[tuple[str, int], float], batch_sizes: list[int]
) -> list[dict[str, Any]]:
    """The fp32 floor, the reduced-precision speed-ups at the largest batch, the latency at the smallest."""
    out = []
    largest, smallest = max(batch_sizes), min(batch_sizes)
    eager = p50.get(("eager", largest))
    tk_best = fastest(p50, FP32_ROWS, largest)
    fp32_rate = result.get("fp32_peak", {}).get(largest)
    if tk_best and fp32_rate:
        flop = result["flop"][str(largest)]
        floor_ms = flop / fp32_rate * 1e3
        name = "fraction of the fp32 floor (floor ms / best fp32 p50; median fp32 rate at the model's shapes)"
        detail = f"{flop:.4g} GFLOP / {fp32_rate:.0f} GFLOP/s = {floor_ms:.3g} ms; {tk_best[0]} {tk_best[1]:.3g} ms"
        out.append(goal(name, size, largest, floor_ms / tk_best[1], detail))
    for key in (*BF16_ROWS, "onnx-int8"):
        if eager and (key, largest) in p50:
            sqnr = result.get("parity", {}).get(key, {}).get("sqnr_db")
            detail = f"{ROWS[key].label}, SQNR {sqnr} dB" if sqnr is not None else ROWS[key].label
            out.append(goal(f"{key} speed-up over eager fp32", size, largest, eager / p50[(key, largest)], detail))
    best_fp32 = fastest(p50, FP32_ROWS, smallest)
    best_any = fastest(p50, tuple(k for k in ROWS if k not in PEER_ROWS), smallest)
    if best_fp32 and best_any:
        detail = f"{best_any[0]}; best fp32: {best_fp32[0]} {best_fp32[1]:.3f} ms"
        out.append(goal("latency at the smallest batch (ms, best engine)", size, smallest, best_any[1], detail))
    return out


def results_table(sizes: dict[str, Any], batch_sizes: list[int], machine: dict[str, Any], threads: int) -> Table:
    """Every size's rows: p50 and speed-up over eager per batch size, parity; notes in the caption."""
    table = Table(title=f"Transformer on {machine.get('cpu')}, {threads} threads (p50 per call)")
    for column in ("model", "engine", *(f"ms @{b}" for b in batch_sizes), *(f"×eager @{b}" for b in batch_sizes)):
        table.add_column(column, justify="left" if column in ("model", "engine") else "right")
    table.add_column("max rel err", justify="right")
    table.add_column("SQNR dB", justify="right")
    notes = []
    for size, result in sizes.items():
        p50 = p50_table(result)
        for key, parity in result.get("parity", {}).items():
            table.add_row(size, ROWS[key].label, *_row_cells(p50, key, parity, batch_sizes))
        table.add_section()
        notes += _size_notes(size, result)
    notes.append(f"max rel err = max|diff| / max|eager fp32| at batch {PARITY_BATCH}; ✗ = outside the tolerance")
    table.caption = "\n".join(notes)
    return table


def _row_cells(
    p50: dict[tuple[str, int], float], key: str, parity: dict[str, Any], batch_sizes: list[int]
) -> list[str]:
    times = [p50.get((key, b)) for b in batch_sizes]
    eager = [p50.get(("eager", b)) for b in batch_sizes]
    speedups = [e / t if e and t else None for e, t in zip(eager, times, strict=True)]
    sqnr = parity["sqnr_db"]
    return [
        *(f"{t:.2f}" if t is not None else "—" for t in times),
        *(f"{s:.2f}×" if s is not None else "—" for s in speedups),
        f"{parity['max_rel']:.1e}" + ("" if parity["passed"] else " ✗"),
        "∞" if sqnr is None else f"{sqnr:.1f}",
    ]


def _size_notes(size: str, result: dict[str, Any]) -> list[str]:
    notes = [f"{size} {key}: {why}" for key, why in result.get("unavailable", {}).items()]
    busy = sorted({r["batch_size"] for r in result.get("bench", {}).get("rows", []) if r["busy"]})
    if busy:
        notes.append(f"{size}: load above the cores while timing batch {busy}; expect noise (busy machine)")
    if "error" in result:
        notes.append(f"{size}: {result['error']}")
    return notes


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
        cells = (
            f"{r['steps_per_s']:.2f}",
            f"{r['first_step_s']:.1f}",
            f"{r['final_loss']:.4f}",
            str(r["recompilations"]),
        )
        table.add_row(name, *cells)
    table.caption = f"compiled / eager after warm-up: {result['compiled_over_eager']:.2f}×"
    return table
