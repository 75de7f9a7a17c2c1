"""Timing the candidates that kept the accuracy: interleaved in one process, beside eager float32,
at the user's batch and sequence (``tk.workflows.bench.measure``), under the load guard (rows timed
on a busy machine are marked), and each one's share of its precision's matrix-product rate at the
model's own linear shapes and of the model's floor (its products timed alone in its precision), sampled
between the calls (``tk.measure.roofline``).

An engine with settings worth trying at this batch on these cores (``Engine.tuned_options``: OpenVINO's
streams) is then timed with each against its defaults in blocks of consecutive calls
(``tk.measure.timing.time_in_blocks``), as a served model runs: in the rounds above every call follows
another engine's, which hid the 5% that two streams gave MiniLM in blocks (benchmarks/history.md). The
candidate keeps the fastest unless its defaults ran within ``TIE`` of it, its numbers scaled by the ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.manifest import Manifest
from tk.measure.hardware import usable_cores
from tk.measure.load_guard import LoadGuard, quiet_or_marked
from tk.measure.roofline import Roofline
from tk.measure.timing import ms, time_in_blocks
from tk.runtime import EngineChoice, open_engine
from tk.runtime.inputs import random_inputs
from tk.runtime.registry import engine_class
from tk.workflows.bench import measure
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.judge import BuiltModel
from tk.workflows.optimize.table import TIE, tuned_label

EAGER = "eager"
BLOCK = 5  # consecutive calls of one setting


@dataclass
class Timed:
    p50_ms: dict[str, float] = field(default_factory=dict)  # label -> p50 (eager included)
    speedup: dict[str, float | None] = field(default_factory=dict)
    peak_share: dict[str, float] = field(default_factory=dict)
    floor_share: dict[str, float] = field(default_factory=dict)
    busy: bool = False  # other work competed for the cores during the rounds (the load guard's mark)
    settings: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> the settings it keeps
    tuned: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> each setting timed, defaults first


def time_candidates(
    entries: list[tuple[Candidate, Path, Manifest]],
    sizes: dict[str, int],
    *,
    model: nn.Module,
    device: str,
    seconds: float,
    wait_quiet_s: float = 0.0,
    progress: Callable[[str], None] | None = None,
    peaks: bool = True,
) -> Timed:
    """p50 of every candidate and of eager fp32 (``model``, the one optimize built: ``BuiltModel``) at ``sizes``
    (batch included)."""
    batch = sizes.get("batch", 1)
    others = {k: v for k, v in sizes.items() if k != "batch"}
    precision_of = {c.name: c.precision for c, _, _ in entries} | {EAGER: "fp32"}
    with ExitStack() as stack:
        choice = EngineChoice(EAGER, device, allow_failed=True)
        eager = stack.enter_context(BuiltModel(model, entries[0][2], device))
        engines = {EAGER: eager}
        for candidate, root, manifest in entries:
            quiet = choice.with_defaults({"spinning": False}, [candidate.engine])  # spinning slows its neighbours
            engines[candidate.name] = stack.enter_context(open_engine(root, quiet, candidate.engine, manifest=manifest))
        roofline = eager_roofline(eager, others, set(precision_of.values())) if peaks and device == "cpu" else None
        report = measure(
            engines, [batch], seconds=seconds, sizes=others, progress=progress, guard=LoadGuard(wait_quiet_s),
            between=roofline.between if roofline else None,
        )  # fmt: skip
        settings = dict(report.settings)
        if roofline is not None:
            settings["roofline"] = roofline.fill(report, lambda label: precision_of.get(label, "fp32"))
        timed = Timed(settings={**settings, "machine": report.machine})
        for row in report.rows:
            timed.p50_ms[row.engine], timed.speedup[row.engine] = row.p50_ms, row.speedup
            if row.peak_share is not None:
                timed.peak_share[row.engine] = row.peak_share
            if row.floor_share is not None:
                timed.floor_share[row.engine] = row.floor_share
            timed.busy = timed.busy or row.busy
        if device == "cpu":
            for candidate, root, manifest in entries:
                tried = engine_class(candidate.engine).tuned_options(batch, usable_cores())
                if tried and candidate.name in timed.p50_ms:
                    if progress is not None:
                        progress(f"{candidate.name}: engine settings")
                    tuned, busy = time_settings(stack, engines[candidate.name], root, manifest, candidate, tried,
                                                batch=batch, sizes=others, seconds=seconds)  # fmt: skip
                    timed.busy = timed.busy or busy
                    keep_fastest(timed, candidate.name, tuned)
    timed.settings["load"] = [
        {"load_before": r.load_before, "load_after": r.load_after, "others_cores": r.others_cores}
        for r in report.rows[:1]
    ]
    return timed


def time_settings(stack: ExitStack, defaults: Any, root: Path, manifest: Manifest, candidate: Candidate,
                  tried: list[dict[str, Any]], *, batch: int, sizes: dict[str, int],
                  seconds: float) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """The median of ``candidate``'s defaults (the engine ``defaults``) and of each setting of ``tried``, timed
    in blocks of ``BLOCK`` consecutive calls, about ``seconds`` of calls each (2 to 8 blocks), on one batch;
    and whether other work competed for the cores meanwhile (the load guard's mark)."""
    quiet = EngineChoice(candidate.engine, "cpu", allow_failed=True).with_defaults(
        {"spinning": False}, [candidate.engine]
    )
    engines = {tuned_label(candidate.name, {}): defaults}
    for options in tried:
        opened = quiet.replace(options={**quiet.options, **options})
        engines[tuned_label(candidate.name, options)] = stack.enter_context(
            open_engine(root, opened, candidate.engine, manifest=manifest)
        )
    feeds = random_inputs(defaults.inputs, defaults.dims, batch, seed=0, sizes=sizes)
    calls = {label: (lambda e=engine: e.run(feeds, check=False)) for label, engine in engines.items()}
    for call in calls.values():
        call()  # compiled, and its requests made, before any block
    started = time.perf_counter()
    calls[tuned_label(candidate.name, {})]()
    rounds = max(2, min(8, round(seconds / (BLOCK * max(time.perf_counter() - started, 1e-6)))))
    times, mark = quiet_or_marked(lambda: time_in_blocks(calls, rounds=rounds, block=BLOCK, order=list(calls)))
    tuned = [{"options": o, "block_ms": ms(times[tuned_label(candidate.name, o)])} for o in [{}, *tried]]
    return tuned, mark.busy


def eager_roofline(eager: Any, others: dict[str, int], precisions: set[str]) -> Roofline:
    """The model's FLOPs and linear shapes at batch 1 (``measure`` scales them to the batch)."""
    eager.load()
    feeds = random_inputs(eager.inputs, eager.dims, 1, seed=0, sizes=others)
    args = tuple(torch.from_numpy(feeds[s.name]) for s in eager.inputs)
    return Roofline(eager.module, args, precisions)


def keep_fastest(timed: Timed, name: str, tuned: list[dict[str, Any]]) -> None:
    """Candidate ``name`` keeps the fastest engine setting of ``tuned`` (options and block median, the defaults
    first) unless its defaults ran within ``TIE`` of it (a gain that size is not worth leaving the defaults a
    user opening the artifact gets); its p50, speed-up and shares are then scaled by the two blocks' ratio."""
    timed.tuned[name] = tuned
    best = min(tuned, key=lambda t: t["block_ms"])
    defaults_ms = tuned[0]["block_ms"]
    if not best["options"] or best["block_ms"] * (1 + TIE) >= defaults_ms:
        return
    ratio = best["block_ms"] / defaults_ms
    timed.engine_options[name] = best["options"]
    timed.p50_ms[name] *= ratio
    for column in (timed.speedup, timed.peak_share, timed.floor_share):
        if column.get(name) is not None:
            column[name] /= ratio
