"""Timing the candidates that kept the accuracy, beside eager float32 at the user's batch and sequence.

First in rounds, one call of each in turn (``tk.workflows.bench.measure``), under the load guard (rows
timed on a busy machine are marked), with the matrix products of the model's own shapes sampled between
the calls (``tk.measure.roofline``): each candidate's share of its precision's rate and of the model's
floor. Then, on CPUs, the p50 the candidates are ranked by: blocks of ``BLOCK`` consecutive calls of each
in turn (``tk.measure.timing.time_in_blocks``), as a served model runs, its caches and threads warm from
its own previous call. In the rounds every call follows another runtime's, and the runtimes pay for it
unequally (an OpenVINO IR more than an aoti package, and most after eager PyTorch's calls: enough to
reorder the small Transformer's candidates, benchmarks/history.md). The shares are scaled to the blocks.

An engine with settings worth trying at this batch on these cores (``Engine.tuned_options``: OpenVINO's
streams) runs each in the blocks too, and the candidate keeps the fastest unless its defaults ran within
``TIE`` of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.errors import TkError, first_line
from tk.manifest import Manifest
from tk.measure.floor import LinearSplit
from tk.measure.hardware import usable_cores
from tk.measure.load_guard import LoadGuard, quiet_or_marked
from tk.measure.roofline import Roofline, mask_input
from tk.measure.timing import ms, time_in_blocks
from tk.runtime import EngineChoice, open_engine
from tk.runtime.inputs import random_inputs
from tk.runtime.registry import engine_class
from tk.workflows.bench import measure
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.judge import BuiltModel
from tk.workflows.optimize.table import TIE, tuned_label

log = logging.getLogger("tk.optimize")
EAGER = "eager"
BLOCK = 5  # consecutive calls of one engine


@dataclass
class Timed:
    p50_ms: dict[str, float] = field(default_factory=dict)  # label -> p50 (eager included): the blocks' on CPUs
    speedup: dict[str, float | None] = field(default_factory=dict)
    peak_share: dict[str, float] = field(default_factory=dict)
    floor_share: dict[str, float] = field(default_factory=dict)
    busy: bool = False  # other work competed for the cores during the timing (the load guard's mark)
    settings: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> the settings it keeps
    tuned: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> each setting timed, defaults first
    rounds_p50_ms: dict[str, float] = field(default_factory=dict)  # label -> p50 in the rounds, where blocks ran


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
    split_of = {c.name: LinearSplit.of_engine(manifest, c.engine) for c, _, manifest in entries}
    floor_precisions = set(precision_of.values()).union(*(s.float_floors for s in split_of.values() if s is not None))
    with ExitStack() as stack:
        eager = stack.enter_context(BuiltModel(model, entries[0][2], device))
        engines = {EAGER: eager}
        for candidate, root, manifest in entries:
            quiet = quiet_choice(candidate.engine, {}, device)
            engines[candidate.name] = stack.enter_context(open_engine(root, quiet, candidate.engine, manifest=manifest))
        roofline = eager_roofline(eager, others, floor_precisions) if peaks and device == "cpu" else None
        report = measure(
            engines, [batch], seconds=seconds, sizes=others, progress=progress, guard=LoadGuard(wait_quiet_s),
            between=roofline.between if roofline else None,
        )  # fmt: skip
        settings = dict(report.settings)
        if roofline is not None:
            settings["roofline"] = roofline.fill(
                report, lambda label: precision_of.get(label, "fp32"), lambda label: split_of.get(label)
            )
        timed = Timed(settings={**settings, "machine": report.machine})
        for row in report.rows:
            timed.p50_ms[row.engine], timed.speedup[row.engine] = row.p50_ms, row.speedup
            if row.peak_share is not None:
                timed.peak_share[row.engine] = row.peak_share
            if row.floor_share is not None:
                timed.floor_share[row.engine] = row.floor_share
            timed.busy = timed.busy or row.busy
        if device == "cpu" and EAGER in timed.p50_ms:
            if progress is not None:
                progress("in blocks")
            busy = time_in_turn(stack, timed, engines, entries, batch=batch, sizes=others, seconds=seconds)
            timed.busy = timed.busy or busy
    timed.settings["load"] = [
        {"load_before": r.load_before, "load_after": r.load_after, "others_cores": r.others_cores}
        for r in report.rows[:1]
    ]
    return timed


def time_in_turn(stack: ExitStack, timed: Timed, engines: dict[str, Any], entries: list[tuple[Candidate, Path, Manifest]],
                 *, batch: int, sizes: dict[str, int], seconds: float) -> bool:  # fmt: skip
    """The engines the rounds timed (eager and the candidates, each with its tuned settings opened beside) timed
    in blocks; ``timed``'s p50s, speed-ups and shares set from the blocks' medians and each candidate's setting
    kept (``keep_fastest``). Returns whether other work competed for the cores meanwhile."""
    timing = {label: engine for label, engine in engines.items() if label in timed.p50_ms}
    settings_of = {
        c.name: [{}, *engine_class(c.engine).tuned_options(batch, usable_cores())]
        for c, _, _ in entries
        if c.name in timing
    }
    first = engines[EAGER]
    feeds = random_inputs(first.inputs, first.dims, batch, seed=0, sizes=sizes)
    for candidate, root, manifest in entries:
        for options in list(settings_of.get(candidate.name, [])[1:]):
            label = tuned_label(candidate.name, options)
            try:  # a setting that fails to open, compile or run is left out, with a note
                opened = quiet_choice(candidate.engine, options)
                engine = stack.enter_context(open_engine(root, opened, candidate.engine, manifest=manifest))
                engine.run(feeds, check=False)
            except TkError as exc:
                log.warning("optimize: %s left out: %s", label, first_line(exc))
                settings_of[candidate.name].remove(options)
                continue
            timing[label] = engine
    calls = {label: (lambda e=engine: e.run(feeds, check=False)) for label, engine in timing.items()}
    for call in calls.values():
        call()  # compiled, and its requests made, before any block
    slowest_s = max(timed.p50_ms.values()) / 1e3
    rounds = max(2, min(6, round(seconds / (BLOCK * slowest_s))))  # about ``seconds`` of calls of the slowest
    times, mark = quiet_or_marked(lambda: time_in_blocks(calls, rounds=rounds, block=BLOCK, order=list(calls)))
    medians = {label: ms(samples) for label, samples in times.items()}
    timed.rounds_p50_ms = {label: timed.p50_ms[label] for label in (EAGER, *settings_of)}
    for label, rounds_ms in timed.rounds_p50_ms.items():
        timed.p50_ms[label] = medians[label]
        for column in (timed.peak_share, timed.floor_share):  # the products' time over the p50
            if column.get(label) is not None:
                column[label] *= rounds_ms / medians[label]
    for name, tried in settings_of.items():
        if len(tried) > 1:
            keep_fastest(timed, name, [{"options": o, "block_ms": medians[tuned_label(name, o)]} for o in tried])
        timed.speedup[name] = timed.p50_ms[EAGER] / timed.p50_ms[name]
    timed.settings["blocks"] = {"rounds": rounds, "block": BLOCK, "engines": list(calls)}
    return mark.busy


def quiet_choice(engine: str, options: dict[str, Any], device: str = "cpu") -> EngineChoice:
    """``engine`` on ``device`` with ``options``, onnxruntime's threads not spinning (spinning slows the engine
    timed next)."""
    quiet = EngineChoice(engine, device, allow_failed=True).with_defaults({"spinning": False}, [engine])
    return quiet.replace(options={**quiet.options, **options})


def eager_roofline(eager: Any, others: dict[str, int], precisions: set[str]) -> Roofline:
    """The model's FLOPs and linear shapes at batch 1 (``measure`` scales them to the batch)."""
    eager.load()
    feeds = random_inputs(eager.inputs, eager.dims, 1, seed=0, sizes=others)
    args = tuple(torch.from_numpy(feeds[s.name]) for s in eager.inputs)
    return Roofline(eager.module, args, precisions, mask_input(eager.inputs))


def keep_fastest(timed: Timed, name: str, tuned: list[dict[str, Any]]) -> None:
    """Candidate ``name`` keeps the fastest engine setting of ``tuned`` (options and block median, the defaults
    first: ``timed``'s p50 of it) unless its defaults ran within ``TIE`` of it (a gain that size is not worth
    leaving the defaults a user opening the artifact gets); its p50 and shares then become the setting's."""
    timed.tuned[name] = tuned
    best = min(tuned, key=lambda t: t["block_ms"])
    defaults_ms = tuned[0]["block_ms"]
    if not best["options"] or best["block_ms"] * (1 + TIE) >= defaults_ms:
        return
    timed.engine_options[name] = best["options"]
    timed.p50_ms[name] = best["block_ms"]
    for column in (timed.peak_share, timed.floor_share):
        if column.get(name) is not None:
            column[name] *= defaults_ms / best["block_ms"]
