"""``tk optimize``: the fastest artifact that keeps the user's accuracy, chosen on this machine.

Capture once per precision and setting, write every candidate format (cached), judge each with the
accuracy spec across its shape range and on held-out samples, time the ones that pass interleaved
beside eager float32 at the user's batch and sequence, and write the fastest as an ordinary
artifact whose manifest names the recommended engine and holds the whole candidates table.

The stages, in order: sizes and ranges (here), the candidates (``candidates``), the export groups and
their order (``groups``), the precision race's skips (``precision_race``, scheduled here), export and
judge (``artifacts``, ``judge``; the int8 ``gate``), timing (``timing``), the winner (``winner``) and
the winner's artifact with the record of the run (``artifacts.write_winner``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.accuracy import AccuracySpec, parse_accuracy, unmeasurable
from tk.errors import BackendUnavailableError, ParityError, TkError, UsageError, first_line
from tk.export import ExportOptions, resolve_dims
from tk.fileio import sha256_file
from tk.limits import require_within_budget
from tk.manifest import Manifest
from tk.models import ModelSpec
from tk.models.checkpoint import require_checkpoint_fits
from tk.spec import Dim, dim_flag, feeds_nbytes
from tk.workflows.optimize.artifacts import CACHE, model_digest, refuse_foreign_out, write_group, write_winner
from tk.workflows.optimize.candidates import (
    Candidate,
    enumerate_candidates,
    int8_layers,
    layers_text,
    nothing_to_try,
    writer_of,
)
from tk.workflows.optimize.data import OptimizeData, optimize_data
from tk.workflows.optimize.gate import SpeedGate
from tk.workflows.optimize.groups import REDUCED_FLOATS, compiled_probes, export_groups, int8_before_fp32
from tk.workflows.optimize.judge import Reference, headline, judge_candidate
from tk.workflows.optimize.precision_race import (
    PrecisionRace,
    int8_probe_reason,
    int8_skip_reason,
    linear_int8_share,
    no_gain_reason,
    run_race,
    skip_reason,
)
from tk.workflows.optimize.table import Row, plot_bytes
from tk.workflows.optimize.timing import time_candidates
from tk.workflows.optimize.winner import no_winner_reason, pick_winner

log = logging.getLogger("tk.optimize")
KEEP = ("best", "all")
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class OptimizeOptions:
    """How to optimize. ``None`` means the default."""

    accuracy: str | None = None  # tk.accuracy spec; default sqnr>=35
    data: Path | None = None  # inputs file: half calibrates int8, half judges; default synthetic
    sizes: dict[str, int] = field(default_factory=dict)  # where candidates are timed: batch, seq...; default opt
    # the artifacts' ranges (tk export's --batch/--seq); default: the model's, widened to hold ``sizes``, opt there
    dims: dict[str, Dim] = field(default_factory=dict)
    checkpoint: Path | None = None
    device: str = "cpu"
    formats: tuple[str, ...] | None = None  # only these formats (--formats); default every one
    precisions: tuple[str, ...] | None = None  # only these precisions (--precisions); default every one
    candidates: tuple[str, ...] | None = None  # only these candidates by name (--candidates "onnx fp32,...")
    time_budget_min: float | None = None  # no new candidate group starts after this many minutes
    keep: str = "best"  # best: the winner only; all: the others' artifacts too, under DIR/candidates
    cache_dir: Path | None = None  # default: DIR/.candidates
    seconds: float = 2.0  # timing budget per candidate
    peaks: bool = True  # sample the matmul rates at the model's shapes for the share-of-peak column
    wait_quiet_s: float = 0.0  # wait up to this long for the load to drop to the cores before timing
    force: bool = False  # replace an --out artifact that holds other files too, deleting them (tk.outdir)


@dataclass
class OptimizeResult:
    out: Path
    rows: list[Row]
    winner: Row | None
    record: dict[str, Any]
    cache_hits: int = 0  # candidate groups reused from the cache
    exports: int = 0  # candidate groups exported in this run


def optimize(spec: ModelSpec, out: str | Path, options: OptimizeOptions | None = None,
             progress: Progress | None = None) -> OptimizeResult:  # fmt: skip
    """Write the fastest candidate that keeps ``options.accuracy`` to ``out``; see the module docstring.

    Raises ``ParityError`` (with the table in ``err.result``) when no candidate keeps the spec.
    """
    options = options or OptimizeOptions()
    out = Path(out)
    say = progress or (lambda *_: None)
    if spec.generation:  # judged by greedy tokens and timed generating: not one call's outputs and latency
        raise UsageError(
            f"optimize: expected an encoder or another one-call model, found the decoder {spec.name}; decoders are "
            "judged by their tokens: tk.workflows.optimize.decoder.optimize_decoder (what tk optimize runs for them)"
        )
    accuracy = parse_accuracy(options.accuracy)
    if (why := unmeasurable(accuracy, spec.signature.outputs)) is not None:
        raise UsageError(why)
    if options.keep not in KEEP:
        raise UsageError(f"--keep: expected best or all, got {options.keep!r}")
    refuse_foreign_out(out, options.cache_dir, force=options.force)
    if options.cache_dir is not None and options.cache_dir.exists() and not options.cache_dir.is_dir():
        raise UsageError(f"--cache-dir: expected a directory, found a file at {options.cache_dir}")
    if options.checkpoint is not None:  # before any candidate: every export would fail on it alike
        require_checkpoint_fits(spec.module, options.checkpoint)
    dims = resolve_dims(spec, ranges_for_sizes(spec.signature.dims, options.dims, options.sizes), True)
    sizes = timing_sizes(dims, options.sizes)
    for name, dim in dims.items():  # what each export's check runs: every dimension at its max
        at_max = {**{n: d.opt for n, d in dims.items()}, name: dim.max}
        require_within_budget(feeds_nbytes(spec.signature.inputs, at_max), f"inputs at sizes {at_max}")
    data = optimize_data(spec, dims, sizes, options.data)
    found = enumerate_candidates(
        options.device, formats=options.formats, precisions=options.precisions, names=options.candidates
    )
    if not found.tried:
        raise UsageError(nothing_to_try(found.skipped))
    rows = [_row(s.candidate, "skipped", s.reason) for s in found.skipped]
    state = _Run(spec, out, options, accuracy, data, sizes, say)
    state.base = _export_options(options, accuracy, dims, data, state.gate)
    entries = state.write_and_judge(found.tried, rows)
    winner = state.time_and_pick(entries, rows)
    record = _record(state, rows, winner)
    result = OptimizeResult(out, rows, winner, record, state.cache_hits, state.exports)
    if winner is None:
        error = ParityError(no_winner_reason(rows, accuracy, {c.name for c in found.tried}))
        error.result = result  # type: ignore[attr-defined]
        raise error
    say("write", 0, 1)
    state.write(winner, record, rows)
    say("write", 1, 1)
    return result


def ranges_for_sizes(model_dims: dict[str, Dim], dims: dict[str, Dim], sizes: dict[str, int]) -> dict[str, Dim]:
    """The artifacts' ranges: ``dims`` where given, else the model's widened to hold the timing size, with
    that size as the opt (where torch.export traces; an opt of 1 stays the model's, which it would specialize)."""
    ranges = dict(dims)
    for name, size in sizes.items():
        default = model_dims.get(name)
        if name in ranges or default is None or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            continue
        low = min(default.min, size)
        ranges[name] = Dim(name, low, max(low, size if size >= 2 else default.opt), max(default.max, size))
    return ranges


def timing_sizes(dims: dict[str, Dim], sizes: dict[str, int]) -> dict[str, int]:
    """Where candidates are timed: ``sizes``, each other dimension at its opt; each inside its range."""
    unknown = sorted(set(sizes) - set(dims))
    if unknown:
        raise UsageError(
            f"{dim_flag(unknown[0])}: this model has no dimension {unknown[0]!r}; it has {', '.join(dims)}"
        )
    chosen = {n: d.opt for n, d in dims.items()} | sizes
    for name, size in chosen.items():
        dim = dims[name]
        if not dim.min <= size <= dim.max:
            raise UsageError(f"{dim_flag(name)} {size}: outside the artifact's range {dim.min}:{dim.opt}:{dim.max}")
    return chosen


def _export_options(
    options: OptimizeOptions, accuracy: AccuracySpec, dims: dict[str, Dim], data: OptimizeData, gate: SpeedGate | None
) -> ExportOptions:
    # with --data, the held-out half is what each export's check runs across the shape range, fitted to each
    # shape (the int8 searches judge samples of the calibration half held aside so): random token ids can sit
    # where a classifier's logits are near zero, which no input of the user's does (benchmarks/history.md)
    check_data = data.held_out if data.calibration is not None else None
    return ExportOptions(dims=dims, device=options.device, checkpoint=options.checkpoint,
                         calibration_data=data.calibration, check_data=check_data,
                         min_sqnr_db=accuracy.sqnr_floor_db, int8_gate=gate)  # fmt: skip


def _row(candidate: Candidate, status: str, reason: str = "") -> Row:
    return Row(candidate.name, candidate.format, candidate.precision, candidate.engine, candidate.export_options,
               status, reason)  # fmt: skip


class _Run:
    """One optimize run's state, stage by stage."""

    def __init__(self, spec: ModelSpec, out: Path, options: OptimizeOptions, accuracy: AccuracySpec,
                 data: OptimizeData, sizes: dict[str, int], say: Progress) -> None:  # fmt: skip
        self.spec, self.out, self.options, self.accuracy = spec, out, options, accuracy
        self.data, self.sizes, self.say = data, sizes, say
        self.cache = options.cache_dir or out / CACHE
        self.reference = Reference(spec.module, data, sizes.get("batch", 1), options.device)
        self.checkpoint_sha = sha256_file(options.checkpoint) if options.checkpoint else None
        # the model as built is pinned by its digest: hf:DIR's weights and a user model's code and weights by
        # nothing else, and a built-in model's initial weights follow its build seed (tk.models.build_model)
        self.model_sha = model_digest(spec.module)
        if options.checkpoint is not None:  # the reference runs the weights every candidate holds, cached or not
            from tk.models.checkpoint import load_weights

            load_weights(spec.module, options.checkpoint)
        self.started = time.monotonic()
        self.cache_hits = self.exports = 0
        self.base = ExportOptions()
        self.judged: dict[str, tuple[Candidate, Path, Manifest, dict[str, Any]]] = {}
        self.timing: dict[str, Any] = {}
        # --keep all asks for every candidate's artifact: then every int8 search runs
        self.gate = None if options.keep == "all" else SpeedGate(sizes, options.device, options.wait_quiet_s)
        # the precision race's skips: not for named candidates (the user asked for those) nor --keep all
        self.race_skips = options.keep == "best" and options.candidates is None and options.device == "cpu"
        self.race: PrecisionRace | None = None  # measured once, before the first group
        self.fp32_tried = True  # whether a float32 candidate is among those tried (set with the race)
        self.race_skipped: list[str] = []  # the precisions whose groups the race skipped
        self.stages: list[dict[str, Any]] = []  # where the run's time went, stage by stage (optimize.json)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Record how long the block took as stage ``name``; the block may add facts to the yielded record."""
        record: dict[str, Any] = {"stage": name}
        start = time.monotonic()
        try:
            yield record
        finally:
            record["seconds"] = round(time.monotonic() - start, 2)
            self.stages.append(record)

    def over_budget(self) -> bool:
        budget = self.options.time_budget_min
        return budget is not None and time.monotonic() - self.started > budget * 60

    def write_and_judge(self, tried: list[Candidate], rows: list[Row]) -> list[tuple[Candidate, Path, Manifest]]:
        """Export each group (or take it from the cache), then judge each of its candidates."""
        from tk.workflows.optimize.artifacts import group_dir

        groups = export_groups(tried, reduced_first=self.race_skips)
        total = len(groups)
        self._run_race(tried)
        if self.race is not None and self.race_skips and self.race.int8_leads():
            groups = int8_before_fp32(groups)
        passed: list[tuple[Candidate, Path, Manifest]] = []
        for done in range(total):
            groups = self._drop_failed_floats(groups, rows)
            members = groups.pop(next(iter(groups)))
            names = ", ".join(c.name for c in members)
            if self.over_budget():
                rows.extend(_row(c, "skipped", "budget: --time-budget spent") for c in members)
                continue
            cannot_win = self._race_skip(members[0].precision, passed)
            if cannot_win:
                rows.extend(_row(c, "skipped", cannot_win) for c in members)
                continue
            self.say(f"export {names}", done, total)
            root = group_dir(self.cache, members, self.base, self.checkpoint_sha, self.spec, self.model_sha)
            with self.stage(f"export {names}") as record:
                written = write_group(self.spec, root, members, self.base)
                record["cached"] = written.cache_hits > 0
            self.cache_hits += written.cache_hits
            self.exports += written.exports
            for candidate in members:
                if candidate in written.skipped:
                    rows.append(_row(candidate, "skipped", written.skipped[candidate]))
                    continue
                if candidate in written.errors:
                    rows.append(_row(candidate, "failed", written.errors[candidate]))
                    continue
                where, manifest = written.artifacts[candidate]
                self.say(f"judge {candidate.name}", done, total)
                with self.stage(f"judge {candidate.name}"):
                    row = self._judge(candidate, where, manifest, cached=written.cache_hits > 0)
                rows.append(row)
                if row.status == "passed":
                    passed.append((candidate, where, manifest))
                    if self.gate is not None:
                        self.gate.add(candidate, where, manifest)
        self.say("judge", total, total)
        return passed

    def _drop_failed_floats(self, groups: dict[Any, list[Candidate]], rows: list[Row]) -> dict[Any, list[Candidate]]:
        """The groups still to write, after taking out of the race (``PrecisionRace.without``) each reduced
        float precision none of whose candidates passed (they missed the accuracy, or could not be written
        or run) and none of whose groups is left to write: where int8 then leads, the aoti int8 group moves
        before the float32 ones, and the gate does not compile its probe."""
        race = self.race
        if race is None or self.options.device != "cpu":
            return groups
        left = {c.precision for members in groups.values() for c in members}
        tried = {r.precision for r in rows if r.precision in race.rates and r.status != "skipped"}
        done = {p for p in tried & set(REDUCED_FLOATS) if p not in left and p not in race.out}
        for precision in sorted(done):
            if any(r.precision == precision and r.status == "passed" for r in rows):
                continue
            race = race.without(precision)
            log.info("optimize race: no %s candidate passed %s; %s is out of the race", precision,
                     self.accuracy, precision)  # fmt: skip
        if race is self.race:
            return groups
        self.race = race
        if self.gate is not None and race.int8_ahead():
            for fmt in compiled_probes([c for members in groups.values() for c in members]):  # still to write
                self.gate.no_probe.setdefault(fmt, int8_probe_reason(race))
        return int8_before_fp32(groups) if self.race_skips and race.int8_leads() else groups

    def _run_race(self, tried: list[Candidate]) -> None:
        """Measure the precisions' product rates once, before the first group (``precision_race``): where
        its skips apply, or where an aoti int8 candidate is to come (the gate's all-int8 probe)."""
        # a reduced float is skipped for float32's sake only where a float32 candidate runs (--precisions bf16 has none)
        self.fp32_tried = any(c.precision == "fp32" for c in tried)
        int8 = self.gate is not None and bool(compiled_probes(tried))
        if self.options.device != "cpu" or not (self.race_skips or int8):
            return
        reduced = {c.precision for c in tried if c.precision in REDUCED_FLOATS}
        precisions = {"fp32", *reduced, *(["int8"] * int8)}
        if precisions == {"fp32"}:
            return
        self.say(f"race {', '.join(sorted(precisions))}", 0, 1)
        with self.stage("race"):
            race = self._race(precisions)
        if race is None:
            return
        self.race = race
        if int8 and self.gate is not None and race.int8_ahead():
            for fmt in compiled_probes(tried):
                self.gate.no_probe[fmt] = int8_probe_reason(race)
        if self.gate is not None and race.decides():
            self.gate.products_gap_ms = race.products_gap_ms()
        log.info("optimize race %s", race.to_json())

    def _race_skip(self, precision: str, passed: list[tuple[Candidate, Path, Manifest]]) -> str | None:
        """Why ``precision``'s next group cannot win, by the race (``precision_race``); None: it may."""
        race = self.race
        if race is None or not self.race_skips:
            return None
        reason = None
        if precision in REDUCED_FLOATS and race.no_gain(precision) and self.fp32_tried:
            reason = no_gain_reason(race, precision)
        elif precision == "fp32":
            faster = [c for c, _, _ in passed if c.precision in REDUCED_FLOATS and race.fp32_cannot_win(c.precision)]
            int8 = [(share, c) for c, _, m in passed if (share := self._int8_share(c, m)) is not None]
            most_int8 = max(int8, key=lambda pair: pair[0], default=None)
            if faster:
                best = max(faster, key=lambda c: race.rates[c.precision])
                reason = skip_reason(race, best.name, best.precision)
            elif most_int8 is not None and race.fp32_loses_to_int8(most_int8[0]):
                reason = int8_skip_reason(race, most_int8[1].name, most_int8[0])
        if reason and precision not in self.race_skipped:
            self.race_skipped.append(precision)
        return reason

    def _int8_share(self, candidate: Candidate, manifest: Manifest) -> float | None:
        """The share of the model's linear multiply-adds a passed int8 candidate kept in int8, where its
        manifest names the modules it left out by path (``Writer.int8_excludes_modules``); else None."""
        if candidate.precision != "int8" or not writer_of(candidate.format).int8_excludes_modules:
            return None
        quant = manifest.formats.get(candidate.format, {}).get("quantization")
        if not isinstance(quant, dict):
            return None
        return linear_int8_share(self.spec.module, quant.get("excluded", []))

    def _race(self, precisions: set[str]) -> PrecisionRace | None:
        from tk.measure.roofline import Roofline

        # counted at batch 1 on the user's own model (as the reference is), scaled to the timing batch
        example = self.spec.example_inputs({**self.sizes, "batch": 1})
        roofline = Roofline(self.spec.module, example, precisions)
        return run_race(roofline, self.sizes.get("batch", 1))

    def _judge(self, candidate: Candidate, root: Path, manifest: Manifest, *, cached: bool) -> Row:
        try:
            judgement = judge_candidate(root, manifest, candidate, self.accuracy, self.reference)
        except TkError as exc:  # the engine cannot open or run this artifact here: that candidate's failure
            row = _row(candidate, "failed", f"cannot run: {first_line(exc)}")
            row.cached, row.artifact = cached, str(root)
            return row
        verdict = judgement.verdict
        row = _row(candidate, "passed" if verdict.passed else "failed", "; ".join(verdict.failures))
        layers = int8_layers(manifest.formats.get(candidate.format, {})) if candidate.precision == "int8" else None
        if layers is not None and layers[0] == 0:  # every layer left in float32: the fp32 graph under another name
            row.status, row.reason = "failed", f"no layer stayed int8 (0 of {layers[1]}); it is the fp32 graph"
        elif layers is not None:
            row.reason = "; ".join(filter(None, [layers_text(manifest.formats[candidate.format]), row.reason]))
        row.accuracy = {k: v for k, v in verdict.values.items() if v is not None}
        row.accuracy_text = headline(verdict, self.accuracy)
        row.shape_range = judgement.shape_range
        row.cached, row.artifact = cached, str(root)
        self.judged[candidate.name] = (
            candidate,
            root,
            manifest,
            {**verdict.to_json(), "shape_range": judgement.shape_range},
        )
        log.info("optimize %-24s %s %s", candidate.name, row.status, row.accuracy_text)
        return row

    def time_and_pick(self, entries: list[tuple[Candidate, Path, Manifest]], rows: list[Row]) -> Row | None:
        """Time the passing candidates beside eager fp32 and pick the winner (``pick_winner``)."""
        if not entries:
            return None
        self.say(f"time {len(entries)} candidates", 0, 1)
        with self.stage(f"time {len(entries)} candidates"):
            timed = time_candidates(entries, self.sizes, model=self.spec.module, device=self.options.device,
                                    seconds=self.options.seconds, wait_quiet_s=self.options.wait_quiet_s,
                                    peaks=self.options.peaks,
                                    progress=lambda text: self.say(f"time: {text}", 0, 1))  # fmt: skip
        self.say("time", 1, 1)
        self.timing = {**timed.settings, "eager_p50_ms": timed.p50_ms.get("eager"),
                       "eager_rounds_p50_ms": timed.rounds_p50_ms.get("eager")}  # fmt: skip
        by_name = {r.candidate: r for r in rows}
        for candidate, _, _ in entries:
            row = by_name[candidate.name]
            row.p50_ms = timed.p50_ms.get(candidate.name)
            row.speedup = timed.speedup.get(candidate.name)
            row.peak_share = timed.peak_share.get(candidate.name)
            row.floor_share = timed.floor_share.get(candidate.name)
            row.rounds_p50_ms = timed.rounds_p50_ms.get(candidate.name)
            row.engine_options = timed.engine_options.get(candidate.name, {})
            row.tuned = timed.tuned.get(candidate.name, [])
            row.busy = timed.busy
        timed_rows = [by_name[c.name] for c, _, _ in entries if by_name[c.name].p50_ms is not None]
        if not timed_rows:
            return None
        return pick_winner(timed_rows, self.accuracy.criteria[0].metric)

    def write(self, winner: Row, record: dict[str, Any], rows: list[Row]) -> None:
        import json

        candidate, root, manifest, judged = self.judged[winner.candidate]
        title = f"{self.spec.name} {self.spec.size or ''}: {self.accuracy} at {self.sizes}"
        extras = {"optimize.json": (json.dumps(record, indent=2) + "\n").encode()}
        try:
            extras["optimize.png"] = plot_bytes(rows, self.accuracy.criteria[0].metric, title)
        except BackendUnavailableError as exc:  # the plot is optional; the run's results are not
            log.warning("optimize: no optimize.png: %s", first_line(exc))
        others = []
        if self.options.keep == "all":
            others = sorted({Path(r.artifact) for r in rows if r.status == "passed" and r.artifact and not r.winner})
        write_winner(
            self.out, root, manifest, candidate, judged, record, extras, others, self.cache, force=self.options.force
        )


def _record(state: _Run, rows: list[Row], winner: Row | None) -> dict[str, Any]:
    """What the manifest and optimize.json hold: the recommendation and the whole table."""
    recommended = None
    if winner is not None:
        recommended = {
            "candidate": winner.candidate, "format": winner.format, "precision": winner.precision,
            "engine": winner.engine, "options": winner.options, "engine_options": winner.engine_options,
            "p50_ms": winner.p50_ms, "speedup": winner.speedup,
            "busy": winner.busy, "cpu": state.timing.get("machine", {}).get("cpu"),
        }  # fmt: skip
    order = {"passed": 0, "failed": 1, "skipped": 2}
    rows.sort(key=lambda r: (not r.winner, order[r.status], r.p50_ms if r.p50_ms is not None else float("inf")))
    return {
        "accuracy": str(state.accuracy),
        "sizes": state.sizes,
        "data": state.data.source,
        "held_out_samples": state.data.samples,
        "recommended": recommended,
        "candidates": [r.to_json() for r in rows],
        "timing": state.timing,
        "cache": {"dir": str(state.cache), "hits": state.cache_hits, "exports": state.exports},
        "speed_gate": state.gate.verdicts if state.gate is not None else None,
        "stages": state.stages,
        "seconds": round(time.monotonic() - state.started, 1),
        "precision_race": None if state.race is None else state.race.to_json() | {"skipped": state.race_skipped},
    }
