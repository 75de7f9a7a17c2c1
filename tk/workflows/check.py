"""Checking an artifact's engines against the PyTorch model, with the artifact's own tolerances.

``check_artifact`` is what ``tk check`` runs; ``run_export_check`` is the export-time check that
``tk.workflows.export.export`` hands to the writers. Both run the reference once per shape (or
once over the user's samples) and compare every engine with it.

At fp32/tf32 both measure the PyTorch model's own noise floor on the inputs they run (eager float32
against the same model in float64, ``tk.parity.measure_noise_floor``) and judge every engine with
it; ``tk check`` against another engine or a golden file uses the floor the export check recorded
at the same shapes. Both say when the reference's outputs are constant or near zero.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.errors import IntegrityError, ParityError, UsageError
from tk.export import writer
from tk.export.context import ExportContext
from tk.manifest import Manifest, verify_artifact
from tk.parity import (
    NEAR_ZERO,
    NoiseFloor,
    ParityReport,
    ReferenceRuns,
    check_engines,
    measure_noise_floor,
    padding_positions,
    reference_runs,
    report_from_outputs,
)
from tk.registries import ENGINES
from tk.runtime import EngineChoice, open_engine, unavailable_reason
from tk.runtime.batching import BatchRunner
from tk.runtime.inputs import random_inputs
from tk.signing import TrustPolicy
from tk.spec import count_nonfinite, shapes_to_check
from tk.tolerances import FLOOR_PRECISIONS, artifact_tolerance, checked_pair
from tk.workflows.engine_list import engines_to_check
from tk.workflows.generation_check import check_decoder, generation_passed, record_generation, record_reference
from tk.workflows.user_inputs import read_user_inputs

log = logging.getLogger("tk.export")


def run_export_check(root: Path, manifest: Manifest, formats: list[str], ctx: ExportContext) -> None:
    """Fill ``manifest.check`` with one parity report per format and set ``manifest.status``."""
    rtol, atol, min_sqnr = artifact_tolerance(
        manifest.precision, manifest.model, rtol=ctx.options.rtol, atol=ctx.options.atol
    )
    shapes = shapes_to_check(manifest.signature.dims)
    device = ctx.options.device
    choice = EngineChoice("eager", device, allow_failed=True)  # the check decides the artifact's status
    # the model was just built from the user's own command line, so its code is trusted here
    trusted = choice.replace(options={"trust_model_code": True})
    with open_engine(root, trusted, manifest=manifest) as reference:
        floor_wanted = manifest.precision in FLOOR_PRECISIONS
        runs = reference_runs(reference, shapes, samples=ctx.options.check_data, noise_floor=floor_wanted)
        if ctx.options.check_data is not None and runs.inputs != "samples":
            log.warning(
                "check  your samples fit %s: random inputs there (a dimension no mask input spans is not resized)",
                "no shape of the range" if runs.inputs == "random" else "only some shapes; " + runs.inputs,
            )
        given_tolerance(runs.floor, ctx.options.rtol, ctx.options.atol)
        log_noise_floor(runs.floor)
        for fmt in formats:
            fmt_device = device
            if device != "cpu" and writer(fmt).device_free and unavailable_reason(fmt, device):
                fmt_device = "cpu"  # the file runs on any device (ONNX): check it where its engine runs
            # the native code was compiled by this process a moment ago; the artifact is signed after the check
            built_here = choice.replace(device=fmt_device, trust=TrustPolicy(trust_artifact_code=True, warn=False))
            with open_engine(root, built_here, fmt, manifest=manifest) as candidate:
                report = check_engines(
                    reference,
                    candidate,
                    shapes,
                    precision=manifest.precision,
                    rtol=rtol,
                    atol=atol,
                    min_sqnr_db=min_sqnr,
                    runs=runs,
                )
                if manifest.generation:
                    record_generation(manifest, reference, candidate, fmt, rtol=rtol, atol=atol)
            manifest.check[fmt] = report.to_json()
            worst = max((o.max_abs for o in report.outputs), default=0.0)
            log.info(
                "check  %-6s %s max abs error %.2e over %d shapes%s",
                fmt,
                "ok" if report.passed else "FAILED",
                worst,
                len(shapes),
                floor_words(report),
            )
            if fmt == formats[0]:
                warn_reference_signal(report)
        if manifest.generation:
            record_reference(manifest, reference)
    passed = all(r["passed"] for r in manifest.check.values()) and generation_passed(manifest)
    manifest.status = "passed" if passed else "failed"


def given_tolerance(floor: NoiseFloor | None, rtol: float | None, atol: float | None) -> None:
    """With ``--rtol``/``--atol`` given, that tolerance is the whole rule: the floor is recorded, not added."""
    if floor is not None and (rtol is not None or atol is not None):
        floor.applied = False
        given = "the --rtol/--atol given apply alone; the floor is measured, not added"
        floor.note = f"{floor.note}; {given}" if floor.note else given


def log_noise_floor(floor: NoiseFloor | None) -> None:
    """One line: the floor per output and the rule it sets, or why there is none (fp32/tf32 only)."""
    if floor is None:
        return
    if floor.measured:
        per_output = ", ".join(f"{name} {value:.2e}" for name, value in floor.largest().items())
        rule = f"an output passes within atol + rtol x |reference| + {floor.k:g} x its floor"
        log.info(
            "check  noise floor (eager float32 vs float64, the largest over the runs): %s; %s",
            per_output or "no floating output",
            rule if floor.applied else floor.note,
        )
    else:
        log.info("check  note: no noise floor, %s; the table's tolerance applies alone", floor.note)


def floor_words(report: ParityReport) -> str:
    """``, 1.2x the noise floor 3.04e-05``: the output furthest from eager in floors, or nothing."""
    ratios = [(o.floor_ratio, o.floor) for o in report.outputs if o.floor_ratio is not None and o.floor]
    if not ratios:
        return ""
    ratio, floor = max(ratios)
    return f", {ratio:.1f}x the noise floor {floor:.2e}"


def warn_reference_signal(report: ParityReport) -> None:
    """A warning per output whose reference is constant or near zero: no check can fail against it."""
    for out in report.outputs:
        if out.reference_signal is None:
            continue
        why = (
            "its largest value is within the absolute tolerance, so an artifact returning zeros passes"
            if out.reference_signal == NEAR_ZERO
            else "it is the same for every input, so any artifact returning that constant passes"
        )
        log.warning(
            "check  warning: the reference's output %r is %s at the checked shapes (%s): the check proves little; "
            "check trained weights or real inputs",
            out.name,
            out.reference_signal,
            why,
        )


@dataclass
class CheckResult:
    """One parity report per engine, and the tolerances they were judged by."""

    reports: dict[str, ParityReport]
    rtol: float
    atol: float
    nonfinite_inputs: dict[str, int] = field(default_factory=dict)  # NaN/Inf per input of a user's file
    # formats whose export check ran the user's samples (tk optimize --data, tk export --check-inputs) where
    # this check ran random inputs, which can judge them differently
    exported_on_samples: list[str] = field(default_factory=list)
    # a decoder's greedy generation per engine (tk.workflows.generation_check.GenerationReport)
    generation: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports.values()) and all(g.passed for g in self.generation.values())

    def to_json(self) -> dict[str, Any]:
        return {name: report.to_json() for name, report in self.reports.items()}

    def raise_if_failed(self) -> None:
        failed = [name for name, r in self.reports.items() if not r.passed]
        failed += [f"{name} generation" for name, g in self.generation.items() if not g.passed]
        if failed:
            per_output = {k: v for r in self.reports.values() for k, v in r.tolerances.items()}
            extra = "".join(f"; {name} rtol {rt:g}, atol {at:g}" for name, (rt, at) in per_output.items())
            raise ParityError(f"parity failed for {', '.join(failed)} (rtol {self.rtol:g}, atol {self.atol:g}{extra})")


def check_artifact(
    root: str | Path,
    choice: EngineChoice,
    *,
    inputs: str | Path | None = None,
    samples: int | None = None,
    batch_size: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    on_report: Callable[[str, ParityReport], None] | None = None,
    reference: str = "eager",
    golden: str | Path | None = None,
    save_golden: str | Path | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
) -> CheckResult:
    """Compare each engine of the artifact at ``root`` with a reference: its PyTorch model (eager), another engine, or a golden file.

    ``choice.name``: the engines to compare (``all`` or comma-separated names); its device,
    options (each engine, the reference too, takes the ones it declares) and failure policy
    apply to every engine opened. Inputs: the samples of the file ``inputs``, ``samples`` random
    samples, or by default valid random inputs at the min, opt, max and an odd size of every
    dimension plus a batch-invariance probe (what the export check runs). Tolerances: the
    artifact's precision row and model overrides, then ``rtol``/``atol``; ``tolerances`` sets
    (rtol, atol) per output name.

    ``reference``: the engine the others are compared with (default eager, the PyTorch model).
    ``golden``: a file from ``save_golden``; its inputs and outputs are the reference, so the
    model is not rebuilt, and its tolerances apply when its precision is the artifact's (else the
    artifact's own). ``save_golden``: write the inputs, the reference's outputs and the
    tolerances there. Native-code engines (aoti, trt) load only as ``choice.trust`` allows; with
    ``all`` an untrusted one is skipped with a note. Raises nothing on a parity failure: see ``CheckResult.raise_if_failed``.
    """
    from tk.workflows.golden import load_golden

    _refuse_conflicts(inputs, samples, golden, save_golden, reference)
    manifest = verify_artifact(root)
    names = _candidates(root, choice, manifest, reference, golden is not None)
    choice = _as_recommended(choice, manifest, names)
    stored = load_golden(golden, manifest.signature) if golden is not None else None
    judge = _judge(manifest, stored, rtol, atol, tolerances)
    among = names if stored is not None else [reference, *names]  # the engines opened: what the options apply to
    with contextlib.ExitStack() as stack:
        if stored is not None:
            ref = _golden_reference(Path(golden).name, stored)
        else:
            engine = stack.enter_context(open_engine(root, choice, reference, manifest=manifest, among=among))
            ref = _run_reference(engine, manifest, inputs, samples, batch_size, seed)
        _set_noise_floor(
            ref, manifest, batch_size, (rtol, atol), lambda: trusted_artifact(root, manifest, choice.trust)
        )
        if save_golden is not None:
            _save_golden(save_golden, ref, manifest, judge, reference)
        result = _empty_result(ref, judge, manifest, names)
        for name in names:
            with open_engine(root, choice, name, manifest=manifest, among=among) as candidate:
                _compare_candidate(result, ref, candidate, judge, batch_size, generation=stored is None)
            if on_report is not None:
                on_report(name, result.reports[name])
    return result


def _compare_candidate(
    result: CheckResult, ref: _Reference, candidate: Any, judge: _Judge, batch_size: int | None, *, generation: bool
) -> None:
    """``candidate``'s report (and a decoder's generation, against a live reference) into ``result``."""
    result.reports[candidate.name] = report = ref.compare(candidate, judge, batch_size)
    if generation and candidate.manifest.generation:
        result.generation[candidate.name] = check_decoder(ref.reference, candidate, rtol=judge.rtol, atol=judge.atol)
    if len(result.reports) == 1:  # said once a candidate ran: a refused engine ends in its one line
        log_noise_floor(ref.runs.floor)
        warn_reference_signal(report)


def _golden_reference(name: str, stored: Any) -> _Reference:
    """A golden file (``tk.workflows.golden.Golden``) as the reference: its inputs and outputs, no model."""
    label = f"golden {name} ({stored.reference})"
    return _Reference(label, ReferenceRuns(stored.shapes, stored.feeds, stored.outputs, "golden"))


def _empty_result(ref: _Reference, judge: _Judge, manifest: Manifest, names: list[str]) -> CheckResult:
    """The result before any engine ran: the tolerances, the NaN/Inf in the user's file, and the engines whose
    export check ran the user's samples where this check runs random inputs."""
    result = CheckResult({}, judge.rtol, judge.atol, count_nonfinite(ref.runs.feeds[0]) if ref.samples else {})
    if ref.runs.inputs.startswith("random"):
        result.exported_on_samples = [
            n for n in names if str(manifest.check.get(n, {}).get("inputs", "random")).startswith("samples")
        ]
    return result


@dataclass(frozen=True)
class _Judge:
    """The tolerances a check judges by."""

    precision: str
    rtol: float
    atol: float
    min_sqnr_db: float | None
    per_output: dict[str, tuple[float, float]]


@dataclass
class _Reference:
    """What each candidate is compared with: the reference (an engine, or a golden file's name) and
    its runs: random inputs per shape, or one run over the user's samples (``samples``)."""

    reference: Any
    runs: ReferenceRuns
    samples: bool = False

    def compare(self, candidate: Any, judge: _Judge, batch_size: int | None) -> ParityReport:
        tolerances = {"rtol": judge.rtol, "atol": judge.atol, "min_sqnr_db": judge.min_sqnr_db}
        if not self.samples:
            return check_engines(
                self.reference,
                candidate,
                self.runs.shapes,
                precision=judge.precision,
                runs=self.runs,
                tolerances=judge.per_output,
                **tolerances,
            )
        feeds = self.runs.feeds[0]
        outputs = BatchRunner(candidate, batch_size).run(feeds)
        report = report_from_outputs(
            candidate.name,
            self.runs.outputs[0],
            outputs,
            precision=judge.precision,
            shapes=self.runs.shapes,
            reference_name=self.reference.name,
            tolerances=judge.per_output,
            valid=padding_positions(candidate.inputs, candidate.outputs, feeds, outputs),
            noise_floor=self.runs.floor,
            specs=candidate.outputs,
            **tolerances,
        )
        report.inputs = self.runs.inputs
        return report


def _set_noise_floor(ref: _Reference, manifest: Manifest, batch_size: int | None,
                     given: tuple[float | None, float | None], trusted: Callable[[], bool]) -> None:  # fmt: skip
    """The floor the candidates are judged with (``_noise_floor``; ``trusted`` asked only where the floor would
    come from the manifest), recorded but not added where the user gave a tolerance (``given_tolerance``)."""
    eager = not isinstance(ref.reference, str) and ref.reference.name == "eager"
    ref.runs.floor = _noise_floor(ref, manifest, batch_size, trusted=eager or trusted())
    given_tolerance(ref.runs.floor, *given)


def trusted_artifact(root: str | Path, manifest: Manifest, trust: TrustPolicy | None) -> bool:
    """Whether a key the user trusts signed the artifact (what lets its recorded figures judge it)."""
    from tk.signing import check_signature

    return check_signature(root, manifest, trust).trusted


def _noise_floor(ref: _Reference, manifest: Manifest, batch_size: int | None, trusted: bool) -> NoiseFloor | None:
    """At fp32/tf32 (else None): measured again on this check's own inputs where the reference is the PyTorch
    model (eager); against another engine or a golden file, the floor the export check recorded at the same shapes,
    where a key the user trusts signed the artifact (``trusted``)."""
    if manifest.precision not in FLOOR_PRECISIONS:
        return None
    if not isinstance(ref.reference, str) and ref.reference.name == "eager":
        run = BatchRunner(ref.reference, batch_size).run if ref.samples else None
        return measure_noise_floor(ref.reference, ref.runs, run=run, batch=not ref.samples)
    if not trusted:  # a manifest anyone can rewrite must not widen the tolerance it is judged by
        return NoiseFloor(note="the export check's recorded floor is used only from an artifact a trusted key "
                               "signed; the table's tolerance applies alone")  # fmt: skip
    recorded = recorded_floor(manifest, ref.runs.shapes)
    if recorded is not None:
        return recorded
    return NoiseFloor(note="the reference is not the PyTorch model and the export check recorded none at these shapes")


def recorded_floor(manifest: Manifest, shapes: list[dict[str, int]]) -> NoiseFloor | None:
    """The noise floor a format's export check recorded in the manifest, where it ran ``shapes`` (one run per
    shape); ``IntegrityError`` (one line) for a record that is not the one tk writes."""
    for report in manifest.check.values():
        floor = report.get("noise_floor") if isinstance(report, dict) else None
        if floor and floor.get("per_run") and report.get("shapes") == shapes:
            recorded = NoiseFloor.from_json(floor)
            if len(recorded.per_run) != len(shapes):
                raise IntegrityError(
                    f"manifest.json: a noise floor of {len(recorded.per_run)} runs for {len(shapes)} shapes; re-export it"
                )
            return recorded
    return None


def _refuse_conflicts(
    inputs: str | Path | None,
    samples: int | None,
    golden: str | Path | None,
    save_golden: str | Path | None,
    reference: str,
) -> None:
    if inputs is not None and samples is not None:
        raise UsageError("expected at most one of --inputs FILE and --samples N")
    if golden is not None and (inputs is not None or samples is not None or save_golden is not None):
        raise UsageError("--golden brings its own inputs: expected no --inputs, --samples or --save-golden with it")
    if golden is not None and reference != "eager":
        raise UsageError("expected one reference: --golden FILE or --reference ENGINE, not both")
    if samples is not None and samples < 1:
        raise UsageError(f"--samples: expected 1 or more, got {samples}")
    if reference not in ENGINES:
        raise UsageError(f"--reference: unknown engine {reference!r}; expected one of {', '.join(ENGINES)}")


def _as_recommended(choice: EngineChoice, manifest: Manifest, names: list[str]) -> EngineChoice:
    """``auto`` checking tk optimize's pick: with the engine settings it was timed at (streams), under the user's."""
    if choice.name == "auto" and names == [manifest.recommended_engine]:
        return choice.with_defaults(manifest.recommended_engine_options, names)
    return choice


def _candidates(root: str | Path, choice: EngineChoice, manifest: Manifest, reference: str, golden: bool) -> list[str]:
    """The engines compared with ``reference``: ``choice.name`` without the reference (and, with all/auto,
    without native-code engines ``choice.trust`` does not allow); ``auto`` is the engine ``tk optimize``
    recommended where the manifest names one this machine runs, else all."""
    found = engines_to_check(choice.name, manifest, choice.device, root=root, trust=choice.trust)
    if choice.name == "auto" and manifest.recommended_engine in found and manifest.recommended_engine != reference:
        found = [manifest.recommended_engine]  # the engine --engine auto opens elsewhere: tk optimize's pick
    names = [n for n in found if n != reference]
    if golden and choice.name in ("all", "auto"):
        names = [n for n in names if n not in ("eager", "compile")]  # both rebuild the model the golden file replaces
    if not names:
        raise UsageError(f"no engine to compare with the reference {reference}")
    return names


def _judge(
    manifest: Manifest,
    stored: Any,
    rtol: float | None,
    atol: float | None,
    tolerances: Mapping[str, tuple[float, float]] | None,
) -> _Judge:
    """The artifact's tolerances, a golden file's where it was made at the artifact's precision, then the user's."""
    per_output = {name: checked_pair(*pair, f"--tol {name}") for name, pair in (tolerances or {}).items()}
    if stored is not None and stored.precision == manifest.precision:
        per_output = {**stored.tolerances, **per_output}
        rtol = stored.rtol if rtol is None else rtol
        atol = stored.atol if atol is None else atol
    unknown = sorted(set(per_output) - {s.name for s in manifest.signature.outputs})
    if unknown:
        have = ", ".join(s.name for s in manifest.signature.outputs)
        raise UsageError(f"--tol: no output named {', '.join(unknown)}; the outputs are {have}")
    rtol, atol, min_sqnr = artifact_tolerance(manifest.precision, manifest.model, rtol=rtol, atol=atol)
    return _Judge(manifest.precision, rtol, atol, min_sqnr, per_output)


def _run_reference(
    engine: Any,
    manifest: Manifest,
    inputs: str | Path | None,
    samples: int | None,
    batch_size: int | None,
    seed: int,
) -> _Reference:
    """The reference engine run once: over the file ``inputs``, ``samples`` random samples, or random inputs per shape."""
    if inputs is None and samples is None:  # random inputs across the ranges
        return _Reference(engine, reference_runs(engine, shapes_to_check(manifest.signature.dims), seed=seed))
    if inputs is not None:
        feeds = read_user_inputs(inputs, manifest.model["name"], engine.inputs, engine.dims)
    else:
        feeds = random_inputs(engine.inputs, engine.dims, samples, seed=seed)
    outputs = BatchRunner(engine, batch_size).run(feeds)
    shapes = [{"samples": int(next(iter(feeds.values())).shape[0])}]
    source = "samples" if inputs is not None else "random samples"
    return _Reference(engine, ReferenceRuns(shapes, [feeds], [outputs], source), samples=True)


def _save_golden(path: str | Path, ref: _Reference, manifest: Manifest, judge: _Judge, reference: str) -> None:
    from tk.workflows.golden import Golden, save_golden

    golden = Golden(
        ref.runs.feeds,
        ref.runs.outputs,
        ref.runs.shapes,
        manifest.precision,
        judge.rtol,
        judge.atol,
        judge.min_sqnr_db,
        reference,
        {k: manifest.model.get(k) for k in ("name", "size", "config")},
        judge.per_output,
        manifest.signature.to_json(),
    )
    save_golden(path, golden)
