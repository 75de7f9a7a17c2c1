"""Parity: how far a candidate's outputs are from the reference's, output by output.

``compare`` judges one pair of output sets; ``check_engines`` runs a reference and a candidate
engine on the same valid random inputs at several shapes (plus a batch-invariance probe) and
folds the results into one ``ParityReport``. ``tk check``, the export-time check and the parity
tests all call these.

At fp32 and tf32 a candidate is judged against the reference's own noise as well (``NoiseFloor``):
the PyTorch model run again in float64 is the truth, eager float32's distance from it the floor,
and an output passes within the table's tolerance plus ``NOISE_FLOOR_K`` floors. The check also
says when the reference carries no signal (``reference_signal``): a pass against a constant or
all-but-zero reference proves nothing.

The pieces live by job: ``tk.comparison`` (one output set against another), ``tk.reference`` (the
reference's runs, its noise floor and signal) and ``tk.batch_probe`` (the batch-invariance probe);
this module folds them into a report and names them all, as callers import them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tk.batch_probe import batch_dim_is_dynamic, batch_size, largest_run, probe_invariance, worst_of
from tk.comparison import (
    TOLERANCE_MISSES,
    OutputParity,
    compare,
    compare_output,
    figures_measured,
    is_class_scores,
    padding_positions,
    worst_sqnr_db,
)
from tk.reference import (
    CONSTANT,
    NEAR_ZERO,
    NoiseFloor,
    ReferenceRuns,
    measure_noise_floor,
    reference_runs,
    reference_signal,
)
from tk.tolerances import FLOOR_PRECISIONS, NOISE_FLOOR_K

__all__ = [
    "CONSTANT",
    "NEAR_ZERO",
    "TOLERANCE_MISSES",
    "NoiseFloor",
    "OutputParity",
    "ParityReport",
    "ReferenceRuns",
    "check_engines",
    "compare",
    "compare_output",
    "figures_measured",
    "is_class_scores",
    "mark_reference_signal",
    "measure_noise_floor",
    "padding_positions",
    "reference_runs",
    "reference_signal",
    "report_from_outputs",
    "worst_sqnr_db",
]


@dataclass
class ParityReport:
    engine: str
    reference: str
    precision: str
    rtol: float
    atol: float
    min_sqnr_db: float | None
    outputs: list[OutputParity] = field(default_factory=list)
    shapes: list[dict[str, int]] = field(default_factory=list)  # dimension sizes that were run
    batch_invariance: OutputParity | None = None
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)  # per-output (rtol, atol) overrides
    inputs: str = "random"  # what the shapes ran (ReferenceRuns.inputs): random inputs, the user's samples, ...
    noise_floor: NoiseFloor | None = None  # fp32/tf32: the reference's own noise, the outputs judged with it

    @property
    def passed(self) -> bool:
        ok = all(o.passed for o in self.outputs)
        return ok and (self.batch_invariance is None or self.batch_invariance.passed)

    def failures(self) -> list[str]:
        lines = [f"{o.name}: {o.problem}" for o in self.outputs if not o.passed]
        if self.batch_invariance is not None and not self.batch_invariance.passed:
            lines.append(f"batch invariance: {self.batch_invariance.problem}")
        return lines

    def to_json(self) -> dict[str, Any]:
        def clean(o: OutputParity) -> dict[str, Any]:
            d = asdict(o)
            d["shape"] = list(o.shape) if o.shape else None
            d["sqnr_db"] = None if math.isinf(o.sqnr_db) else round(o.sqnr_db, 2)
            if not o.padding_skipped:
                del d["padding_skipped"]
            for key in ("floor", "floor_ratio", "reference_signal"):
                if d[key] is None:
                    del d[key]
            if o.top1_total is None:
                del d["top1_agree"], d["top1_total"]
            else:
                d["top1_rate"] = o.top1_rate
            return d

        return {
            "engine": self.engine,
            "reference": self.reference,
            "precision": self.precision,
            "rtol": self.rtol,
            "atol": self.atol,
            "min_sqnr_db": self.min_sqnr_db,
            "passed": self.passed,
            "shapes": self.shapes,
            "inputs": self.inputs,
            "outputs": [clean(o) for o in self.outputs],
            "batch_invariance": clean(self.batch_invariance) if self.batch_invariance else None,
            **({"tolerances": {k: list(v) for k, v in self.tolerances.items()}} if self.tolerances else {}),
            **({"noise_floor": self.noise_floor.to_json()} if self.noise_floor is not None else {}),
        }


def check_engines(
    reference: Any,
    candidate: Any,
    shapes: Sequence[dict[str, int]],
    *,
    precision: str,
    rtol: float,
    atol: float,
    min_sqnr_db: float | None = None,
    seed: int = 0,
    runs: ReferenceRuns | None = None,
    batch_invariance: bool = True,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
) -> ParityReport:
    """Run both engines (``tk.runtime.Engine``s) on the same inputs and report the worst per output.

    Inputs are valid random inputs at each of ``shapes``, or ``runs`` (from ``reference_runs``),
    which spares re-running the reference for each candidate. At fp32/tf32 each output is judged
    with the reference's noise floor at each run (``runs.floor``; measured here when ``runs`` is
    None). The batch invariance probe re-runs the first samples of the largest batch alone through
    the candidate and compares them with the candidate's own batched outputs, allowing
    ``NOISE_FLOOR_K`` x the larger of eager's own batch variance and the floor at that run.
    """
    ref_name = reference if isinstance(reference, str) else reference.name  # a name: ``runs`` came from a golden file
    report = ParityReport(
        candidate.name, ref_name, precision, rtol, atol, min_sqnr_db, tolerances=dict(tolerances or {})
    )
    if runs is None:
        runs = reference_runs(reference, shapes, seed=seed)
        if precision in FLOOR_PRECISIONS:
            runs.floor = measure_noise_floor(reference, runs, batch=batch_invariance)
    report.inputs = runs.inputs
    report.noise_floor = runs.floor if precision in FLOOR_PRECISIONS else None
    batched = _compare_runs(report, candidate, runs)
    _fail_where_the_reference_is_nan(report.outputs, runs.outputs)
    mark_reference_signal(report, runs.outputs, candidate.outputs)
    if batch_invariance and batched is not None:
        report.batch_invariance = _probe_batch_invariance(report, candidate, runs, batched)
    return report


def _compare_runs(report: ParityReport, candidate: Any, runs: ReferenceRuns) -> Mapping[str, np.ndarray] | None:
    """Run ``candidate`` on each of ``runs`` and fill ``report``'s shapes and outputs (the worst of each
    output over the runs); return its outputs at the largest batch, which the batch-invariance probe reads."""
    floor = report.noise_floor if report.noise_floor is not None and report.noise_floor.applied else None
    merged: dict[str, OutputParity] = {}
    largest, batched = largest_run(runs.feeds), None
    for index, (run_feeds, ref_out) in enumerate(zip(runs.feeds, runs.outputs, strict=True)):
        cand_out = candidate.run(run_feeds)
        if index == largest:
            batched = cand_out  # what the batch-invariance probe compares samples run alone with
        report.shapes.append(candidate.check_feeds(run_feeds))
        valid = padding_positions(candidate.inputs, candidate.outputs, run_feeds, ref_out)
        floors = _floors_at(floor, index, report.tolerances)
        compared = compare(
            ref_out,
            cand_out,
            rtol=report.rtol,
            atol=report.atol,
            min_sqnr_db=report.min_sqnr_db,
            tolerances=report.tolerances,
            valid=valid,
            floors=floors,
        )
        for result in compared:
            if result.name in merged:
                merged[result.name].merge(result)
            else:
                merged[result.name] = result
    report.outputs = list(merged.values())
    return batched


def _probe_batch_invariance(
    report: ParityReport, candidate: Any, runs: ReferenceRuns, batched: Mapping[str, np.ndarray]
) -> OutputParity | None:
    """The worst of the batch-invariance probe over the candidate's batched outputs; None where there is
    no batch of two or more to probe, or the candidate's batch size is fixed."""
    largest = largest_run(runs.feeds)
    if largest is None or batch_size(runs.feeds[largest]) <= 1 or not batch_dim_is_dynamic(candidate):
        return None
    floor = report.noise_floor if report.noise_floor is not None and report.noise_floor.applied else None
    floors = _probe_floors(floor, largest)
    probe = probe_invariance(candidate, runs.feeds[largest], batched, rtol=report.rtol, atol=report.atol, floors=floors)
    return worst_of(probe.values())


def _floors_at(
    floor: NoiseFloor | None, index: int, tolerances: Mapping[str, tuple[float, float]] | None
) -> dict[str, float] | None:
    """Each output's floor at run ``index``, but for outputs with a tolerance of their own (``--tol``): a
    tolerance the user gives is the whole rule."""
    if floor is None or not floor.measured:
        return None
    return {name: value for name, value in floor.per_run[index].items() if name not in (tolerances or {})}


def _probe_floors(floor: NoiseFloor | None, index: int) -> dict[str, float] | None:
    """The batch-invariance probe's floor per output: the larger of eager's own batch variance and eager
    float32's noise at that run, since either is how far a sum computed in another order may move."""
    if floor is None:
        return None
    at_run = floor.per_run[index] if floor.measured else {}
    return {name: max(floor.batch.get(name, 0.0), at_run.get(name, 0.0)) for name in {*floor.batch, *at_run}}


def mark_reference_signal(report: ParityReport, references: Sequence[Mapping[str, Any]], specs: Sequence[Any]) -> None:
    """Set each output's ``reference_signal`` from the reference's outputs over every run."""
    batched = {s.name for s in specs if s.shape and s.shape[0] == "batch"}
    for out in report.outputs:
        arrays = [ref[out.name] for ref in references if out.name in ref]
        _, atol = report.tolerances.get(out.name, (report.rtol, report.atol))
        allowance = atol + (NOISE_FLOOR_K * out.floor if out.floor is not None else 0.0)
        out.reference_signal = reference_signal(arrays, allowance, batched=out.name in batched)


def report_from_outputs(
    engine: str,
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    precision: str,
    rtol: float,
    atol: float,
    min_sqnr_db: float | None = None,
    shapes: list[dict[str, int]] | None = None,
    reference_name: str = "eager",
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    valid: Mapping[str, np.ndarray] | None = None,
    noise_floor: NoiseFloor | None = None,
    specs: Sequence[Any] = (),
) -> ParityReport:
    """A ``ParityReport`` for outputs already computed (a whole input file run through both engines);
    ``valid`` as for ``compare`` (``padding_positions`` of the file's inputs); ``noise_floor``: the
    reference's own noise on that one run (fp32/tf32); ``specs``: the outputs' specs (which are batched)."""
    floor = noise_floor if precision in FLOOR_PRECISIONS else None
    report = ParityReport(
        engine,
        reference_name,
        precision,
        rtol,
        atol,
        min_sqnr_db,
        shapes=shapes or [],
        tolerances=dict(tolerances or {}),
        noise_floor=floor,
    )
    report.outputs = compare(
        reference,
        candidate,
        rtol=rtol,
        atol=atol,
        min_sqnr_db=min_sqnr_db,
        tolerances=tolerances,
        valid=valid,
        floors=_floors_at(floor if floor is not None and floor.applied else None, 0, tolerances),
    )
    _fail_where_the_reference_is_nan(report.outputs, [reference])
    mark_reference_signal(report, [reference], specs)
    return report


def _fail_where_the_reference_is_nan(results: list[OutputParity], references: Sequence[Mapping[str, Any]]) -> None:
    """An artifact is never called equal to a reference that produces NaN: a NaN matching a NaN
    proves nothing (a diverged checkpoint would pass every check)."""
    for result in results:
        count = sum(
            int(np.isnan(np.asarray(ref[result.name], dtype=np.float64)).sum())
            for ref in references
            if result.name in ref
        )
        if count:
            result.passed = False
            result.problem = (
                f"the PyTorch reference itself produces {count} NaN values, so parity cannot be judged "
                "(a diverged or damaged checkpoint?)"
            )
