"""Timing the candidates that kept the accuracy: interleaved in one process, beside eager float32,
at the user's batch and sequence (``tk.workflows.bench.measure``), with the load average read before
and after, and each one's share of the matrix-product peak of its precision where one is measured."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tk.manifest import Manifest
from tk.runtime import engine_options, load
from tk.workflows.bench import measure
from tk.workflows.optimize.candidates import Candidate

EAGER = "eager"
PEAK_PRECISIONS = ("fp32", "bf16", "fp16")  # int8: torch._int_mm is not the oneDNN path int8 packages run


@dataclass
class Timed:
    p50_ms: dict[str, float] = field(default_factory=dict)  # label -> p50 (eager included)
    speedup: dict[str, float | None] = field(default_factory=dict)
    peak_share: dict[str, float] = field(default_factory=dict)
    load_before: float | None = None
    load_after: float | None = None
    busy: bool = False  # the load average was above the usable cores before or after
    settings: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, Any] = field(default_factory=dict)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def time_candidates(
    entries: list[tuple[Candidate, Path, Manifest]],
    sizes: dict[str, int],
    *,
    device: str,
    seconds: float,
    progress: Callable[[str], None] | None = None,
    peaks: bool = True,
) -> Timed:
    """p50 of every candidate and of eager fp32 (the first entry's weights) at ``sizes`` (batch included)."""
    timed = Timed(load_before=load_average())
    batch = sizes.get("batch", 1)
    others = {k: v for k, v in sizes.items() if k != "batch"}
    with ExitStack() as stack:
        first_root, first_manifest = entries[0][1], entries[0][2]
        engines = {EAGER: stack.enter_context(
            load(first_root, EAGER, device=device, manifest=first_manifest, allow_failed=True, trust_model_code=True)
        )}  # fmt: skip
        for candidate, root, manifest in entries:
            opts = engine_options(candidate.engine, {"spinning": False})  # onnxruntime's spinning slows its neighbours
            engines[candidate.name] = stack.enter_context(
                load(root, candidate.engine, device=device, manifest=manifest, allow_failed=True, options=opts)
            )
        report = measure(engines, [batch], seconds=seconds, sizes=others, progress=progress)
        if peaks:
            _peak_shares(timed, report.rows, entries, engines[EAGER], batch, others)
    timed.load_after = load_average()
    timed.p50_ms = {r.engine: r.p50_ms for r in report.rows}
    timed.speedup = {r.engine: r.speedup for r in report.rows}
    cores = usable_cores()
    timed.busy = any(v is not None and v > cores for v in (timed.load_before, timed.load_after))
    timed.settings = {**report.settings, "load_before": timed.load_before, "load_after": timed.load_after,
                      "usable_cores": cores, "machine": report.machine}  # fmt: skip
    return timed


def _peak_shares(timed: Timed, rows: list[Any], entries: list[tuple[Candidate, Path, Manifest]], eager: Any,
                 batch: int, others: dict[str, int]) -> None:  # fmt: skip
    """Each row's model FLOPs per second as a share of its precision's measured matmul peak."""
    from tk.runtime.inputs import random_inputs
    from tk.workflows.roofline import matmul_peak, model_flops

    precision = {c.name: c.precision for c, _, _ in entries} | {EAGER: "fp32"}
    wanted = sorted({p for p in precision.values() if p in PEAK_PRECISIONS})
    feeds = random_inputs(eager.inputs, eager.dims, 1, seed=0, sizes=others)
    module = getattr(eager, "module", None)  # loaded by the timing above
    if module is None:
        return
    flops = model_flops(module, tuple(torch.from_numpy(v) for v in feeds.values()))
    for p in wanted:
        timed.peaks[p] = matmul_peak(p).to_json()
    for row in rows:
        peak = timed.peaks.get(precision.get(row.engine, ""))
        if peak and row.p50_ms > 0:
            timed.peak_share[row.engine] = flops * batch / (row.p50_ms / 1e3) / 1e9 / peak["gflops"]
    timed.settings["flops_per_sample"] = flops
