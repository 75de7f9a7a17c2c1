"""Timing the candidates that kept the accuracy: interleaved in one process, beside eager float32,
at the user's batch and sequence (``tk.workflows.bench.measure``), under the load guard (rows timed
on a busy machine are marked), and each one's share of its precision's matrix-product rate at the
model's own linear shapes and of the model's floor (its products timed alone in its precision), sampled
between the calls (``tk.measure.roofline``). An engine with settings worth trying at this batch on these
cores (``Engine.tuned_options``: OpenVINO's streams) is timed with each beside its defaults, in the same
rounds, and the candidate keeps the fastest unless the defaults ran within ``TIE`` of it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.manifest import Manifest
from tk.measure.hardware import usable_cores
from tk.measure.load_guard import LoadGuard
from tk.measure.roofline import Roofline
from tk.runtime import EngineChoice, open_engine
from tk.runtime.inputs import random_inputs
from tk.runtime.registry import engine_class
from tk.workflows.bench import measure
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.judge import BuiltModel
from tk.workflows.optimize.table import TIE, tuned_label

EAGER = "eager"


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
    settings_of: dict[str, list[tuple[str, dict[str, Any]]]] = {}  # name -> (label, options), defaults first
    cores = usable_cores()
    with ExitStack() as stack:
        choice = EngineChoice(EAGER, device, allow_failed=True)
        eager = stack.enter_context(BuiltModel(model, entries[0][2], device))
        engines = {EAGER: eager}
        for candidate, root, manifest in entries:
            quiet = choice.with_defaults({"spinning": False}, [candidate.engine])  # spinning slows its neighbours
            tried = [{}] + (engine_class(candidate.engine).tuned_options(batch, cores) if device == "cpu" else [])
            settings_of[candidate.name] = [(tuned_label(candidate.name, options), options) for options in tried]
            for label, options in settings_of[candidate.name]:
                opened = quiet.replace(options={**quiet.options, **options})
                engines[label] = stack.enter_context(open_engine(root, opened, candidate.engine, manifest=manifest))
                precision_of[label] = candidate.precision
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
    for name, tried in settings_of.items():
        keep_fastest(timed, name, tried)
    timed.settings["load"] = [
        {"load_before": r.load_before, "load_after": r.load_after, "others_cores": r.others_cores}
        for r in report.rows[:1]
    ]
    return timed


def eager_roofline(eager: Any, others: dict[str, int], precisions: set[str]) -> Roofline:
    """The model's FLOPs and linear shapes at batch 1 (``measure`` scales them to the batch)."""
    eager.load()
    feeds = random_inputs(eager.inputs, eager.dims, 1, seed=0, sizes=others)
    args = tuple(torch.from_numpy(feeds[s.name]) for s in eager.inputs)
    return Roofline(eager.module, args, precisions)


def keep_fastest(timed: Timed, name: str, tried: list[tuple[str, dict[str, Any]]]) -> None:
    """Candidate ``name``'s numbers become those of its fastest setting of ``tried`` (label, options; the defaults
    first), unless the defaults ran within ``TIE`` of it: a gain that size is the timing's noise here, and
    defaults are what a user opening the artifact would run. Each setting's p50 stays in ``timed.tuned``."""
    measured = [(label, options) for label, options in tried if label in timed.p50_ms]
    if len(tried) > 1:
        timed.tuned[name] = [
            {"options": options, "p50_ms": timed.p50_ms[label], "speedup": timed.speedup.get(label)}
            for label, options in measured
        ]
    if not measured or measured[0][0] != name:  # the defaults were not timed (refused the batch): nothing kept
        return
    label, options = min(measured, key=lambda item: timed.p50_ms[item[0]])
    if options and timed.p50_ms[label] * (1 + TIE) < timed.p50_ms[name]:
        timed.engine_options[name] = options
        for column in (timed.p50_ms, timed.speedup, timed.peak_share, timed.floor_share):
            if label in column:
                column[name] = column[label]
            else:
                column.pop(name, None)
