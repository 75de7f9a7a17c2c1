"""Checking an artifact's engines against the PyTorch model, with the artifact's own tolerances.

``check_artifact`` is what ``tk check`` runs; ``run_export_check`` is the export-time check that
``tk.workflows.export.export`` hands to the writers. Both run the reference once per shape (or
once over the user's samples) and compare every engine with it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import ParityError, UsageError
from tk.export.context import ExportContext
from tk.manifest import Manifest, verify_artifact
from tk.parity import ParityReport, ReferenceRuns, check_engines, reference_runs, report_from_outputs
from tk.registries import ENGINES
from tk.runtime import available_engines, engine_options, load, trusted_engines, unavailable_reason
from tk.runtime.batching import BatchRunner
from tk.runtime.inputs import count_nonfinite, random_inputs, read_inputs
from tk.signing import TrustPolicy
from tk.spec import shapes_to_check
from tk.tolerances import artifact_tolerance, checked_pair

log = logging.getLogger("tk.export")


def run_export_check(root: Path, manifest: Manifest, formats: list[str], ctx: ExportContext) -> None:
    """Fill ``manifest.check`` with one parity report per format and set ``manifest.status``."""
    rtol, atol, min_sqnr = artifact_tolerance(
        manifest.precision, manifest.model, rtol=ctx.options.rtol, atol=ctx.options.atol
    )
    shapes = shapes_to_check(manifest.signature.dims)
    device = ctx.options.device
    # the model was just built from the user's own command line, so its code is trusted here
    with load(root, "eager", device=device, manifest=manifest, allow_failed=True, trust_model_code=True) as reference:
        runs = reference_runs(reference, shapes)
        for fmt in formats:
            fmt_device = device
            if fmt == "onnx" and device == "cuda" and unavailable_reason("onnx", "cuda"):
                fmt_device = "cpu"  # the ONNX file is device-free; check it where onnxruntime runs
            # the native code was compiled by this process a moment ago; the artifact is signed after the check
            built_here = TrustPolicy(trust_artifact_code=True, warn=False)
            with load(
                root, fmt, device=fmt_device, manifest=manifest, allow_failed=True, trust=built_here
            ) as candidate:
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
            manifest.check[fmt] = report.to_json()
            worst = max((o.max_abs for o in report.outputs), default=0.0)
            log.info(
                "check  %-6s %s max abs error %.2e over %d shapes",
                fmt,
                "ok" if report.passed else "FAILED",
                worst,
                len(shapes),
            )
    manifest.status = "passed" if all(r["passed"] for r in manifest.check.values()) else "failed"


@dataclass
class CheckResult:
    """One parity report per engine, and the tolerances they were judged by."""

    reports: dict[str, ParityReport]
    rtol: float
    atol: float
    nonfinite_inputs: dict[str, int] = field(default_factory=dict)  # NaN/Inf per input of a user's file

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports.values())

    def to_json(self) -> dict[str, Any]:
        return {name: report.to_json() for name, report in self.reports.items()}

    def raise_if_failed(self) -> None:
        failed = [name for name, r in self.reports.items() if not r.passed]
        if failed:
            per_output = {k: v for r in self.reports.values() for k, v in r.tolerances.items()}
            extra = "".join(f"; {name} rtol {rt:g}, atol {at:g}" for name, (rt, at) in per_output.items())
            raise ParityError(f"parity failed for {', '.join(failed)} (rtol {self.rtol:g}, atol {self.atol:g}{extra})")


def engines_to_check(
    text: str,
    manifest: Manifest,
    device: str,
    *,
    baselines: tuple[str, ...] = (),
    keep_eager: bool = False,
    root: str | Path | None = None,
    trust: TrustPolicy | None = None,
) -> list[str]:
    """``all`` (every engine this machine runs for the artifact) or a comma-separated list.

    With ``all``/``auto`` and ``root``, engines that would run native code ``trust`` does not
    allow are left out with a note (a named one is refused when it loads). ``baselines`` come first. Eager (the reference of a check) is left out unless ``keep_eager``
    or it is a baseline; an empty list is an error.
    """
    if text in ("all", "auto"):
        names = available_engines(manifest, device)
        if root is not None:
            names = trusted_engines(root, manifest, names, trust)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in ENGINES]
        if unknown:
            raise UsageError(
                f"--engine: unknown {', '.join(unknown)}; expected names from {', '.join(ENGINES)}, or all"
            )
    names = [b for b in baselines if b not in names] + names
    if not (keep_eager or "eager" in baselines):
        names = [n for n in names if n != "eager"]
    if not names:
        raise UsageError(f"no engine to compare: the artifact holds {', '.join(e.role for e in manifest.files)}")
    return names


def check_artifact(
    root: str | Path,
    engines: str | list[str] = "all",
    *,
    inputs: str | Path | None = None,
    samples: int | None = None,
    batch_size: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    device: str = "cpu",
    options: Mapping[str, Any] | None = None,
    allow_failed: bool = False,
    on_report: Callable[[str, ParityReport], None] | None = None,
    reference: str = "eager",
    golden: str | Path | None = None,
    save_golden: str | Path | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    trust: TrustPolicy | None = None,
) -> CheckResult:
    """Compare each engine of the artifact at ``root`` with a reference: its PyTorch model (eager), another engine, or a golden file.

    Inputs: the samples of the file ``inputs``, ``samples`` random samples, or by default valid
    random inputs at the min, opt, max and an odd size of every dimension plus a batch-invariance
    probe (what the export check runs). Tolerances: the artifact's precision row and model
    overrides, then ``rtol``/``atol``; ``tolerances`` sets (rtol, atol) per output name.
    ``options`` holds engine options by name (each engine takes the ones it declares).

    ``reference``: the engine the others are compared with (default eager, the PyTorch model).
    ``golden``: a file from ``save_golden``; its inputs and outputs are the reference, so the
    model is not rebuilt, and its tolerances apply when its precision is the artifact's (else the
    artifact's own). ``save_golden``: write the inputs, the reference's outputs and the
    tolerances there. ``trust``: whose signatures let aoti/trt load (with ``all``, an untrusted
    one is skipped with a note). Raises nothing on a parity failure: see ``CheckResult.raise_if_failed``.
    """
    from tk.workflows.golden import Golden, load_golden
    from tk.workflows.golden import save_golden as write_golden

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
    manifest = verify_artifact(root)
    names = (
        engines if isinstance(engines, list) else engines_to_check(engines, manifest, device, root=root, trust=trust)
    )
    names = [n for n in names if n != reference]
    if golden is not None and engines in ("all", "auto"):
        names = [n for n in names if n not in ("eager", "compile")]  # both rebuild the model the golden file replaces
    if not names:
        raise UsageError(f"no engine to compare with the reference {reference}")
    per_output = {name: checked_pair(*pair, f"--tol {name}") for name, pair in (tolerances or {}).items()}
    stored = load_golden(golden, manifest.signature) if golden is not None else None
    if stored is not None and stored.precision == manifest.precision:
        per_output = {**stored.tolerances, **per_output}
        rtol = stored.rtol if rtol is None else rtol
        atol = stored.atol if atol is None else atol
    unknown = sorted(set(per_output) - {s.name for s in manifest.signature.outputs})
    if unknown:
        have = ", ".join(s.name for s in manifest.signature.outputs)
        raise UsageError(f"--tol: no output named {', '.join(unknown)}; the outputs are {have}")
    rtol, atol, min_sqnr = artifact_tolerance(manifest.precision, manifest.model, rtol=rtol, atol=atol)
    values = dict(options or {})

    def open_engine(name: str) -> Any:
        opts = engine_options(name, values)
        return load(root, name, device=device, allow_failed=allow_failed, manifest=manifest, options=opts, trust=trust)

    result = CheckResult({}, rtol, atol)
    with contextlib.ExitStack() as stack:
        ref_engine = stack.enter_context(open_engine(reference)) if stored is None else None
        feeds: dict[str, np.ndarray] | None = None
        runs: ReferenceRuns | None = None
        if stored is not None:
            runs = ReferenceRuns(stored.shapes, stored.feeds, stored.outputs)
        elif inputs is not None:
            feeds = read_inputs(inputs, ref_engine.inputs)
        elif samples is not None:
            feeds = random_inputs(ref_engine.inputs, ref_engine.dims, samples, seed=seed)
        if feeds is not None:
            result.nonfinite_inputs = count_nonfinite(feeds)
            ref_out = BatchRunner(ref_engine, batch_size).run(feeds)
            runs = ReferenceRuns([{"samples": int(next(iter(feeds.values())).shape[0])}], [feeds], [ref_out])
        elif runs is None:  # random inputs across the ranges; the reference runs once for every engine
            runs = reference_runs(ref_engine, shapes_to_check(manifest.signature.dims), seed=seed)
        if save_golden is not None:
            golden_file = Golden(
                runs.feeds,
                runs.outputs,
                runs.shapes,
                manifest.precision,
                rtol,
                atol,
                min_sqnr,
                reference,
                {k: manifest.model.get(k) for k in ("name", "size", "config")},
                per_output,
                manifest.signature.to_json(),
            )
            write_golden(save_golden, golden_file)
        ref_name = f"golden {Path(golden).name} ({stored.reference})" if stored is not None else reference
        for name in names:
            with open_engine(name) as candidate:
                if feeds is None:
                    report = check_engines(
                        ref_engine if ref_engine is not None else ref_name,
                        candidate,
                        runs.shapes,
                        precision=manifest.precision,
                        rtol=rtol,
                        atol=atol,
                        min_sqnr_db=min_sqnr,
                        runs=runs,
                        tolerances=per_output,
                    )
                else:
                    cand_out = BatchRunner(candidate, batch_size).run(feeds)
                    report = report_from_outputs(
                        name,
                        runs.outputs[0],
                        cand_out,
                        precision=manifest.precision,
                        rtol=rtol,
                        atol=atol,
                        min_sqnr_db=min_sqnr,
                        shapes=runs.shapes,
                        reference_name=ref_name,
                        tolerances=per_output,
                    )
            result.reports[name] = report
            if on_report is not None:
                on_report(name, report)
    return result
