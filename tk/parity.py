"""Parity: how far a candidate's outputs are from the reference's, output by output.

``compare`` judges one pair of output sets; ``check_engines`` runs a reference and a candidate
engine on the same valid random inputs at several shapes (plus a batch-invariance probe) and
folds the results into one ``ParityReport``. ``tk check``, the export-time check and the parity
tests all call these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tk.errors import CaptureError, EngineError, first_line
from tk.spec import fitted_samples, random_feeds

INVARIANCE_SAMPLES = 2  # samples of a batch re-run alone to check batch invariance


@dataclass
class OutputParity:
    name: str
    shape: tuple[int, ...] | None
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |candidate - reference| / max |reference|
    cosine: float = 1.0  # worst cosine similarity over the runs
    sqnr_db: float = math.inf  # signal-to-noise ratio of reference to error
    nan: int = 0  # NaN in the candidate
    inf: int = 0  # Inf in the candidate
    passed: bool = True
    problem: str | None = None  # a mismatch of names, shapes or dtypes, or a tolerance miss
    top1_agree: int | None = None  # (batch, classes) outputs: samples whose argmax matches the reference's
    top1_total: int | None = None
    padding_skipped: int = 0  # values at padding positions (the attention mask's zeros), not compared

    @property
    def top1_rate(self) -> float | None:
        return None if not self.top1_total else (self.top1_agree or 0) / self.top1_total

    def merge(self, other: OutputParity) -> None:
        """Keep the worst of both runs (top-1 agreement adds up)."""
        if other.top1_total is not None:
            self.top1_agree = (self.top1_agree or 0) + (other.top1_agree or 0)
            self.top1_total = (self.top1_total or 0) + other.top1_total
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)
        self.cosine = min(self.cosine, other.cosine)
        self.sqnr_db = min(self.sqnr_db, other.sqnr_db)
        self.nan += other.nan
        self.inf += other.inf
        self.padding_skipped += other.padding_skipped
        if not other.passed and self.passed:
            self.passed, self.problem = False, other.problem
        self.shape = other.shape


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
        }


# the problems compare_output states after measuring every figure (tolerance misses); any other problem (a
# shape, NaN or Inf where the reference has none) stopped it before, leaving the figures at their defaults
TOLERANCE_MISSES = ("max abs error", "SQNR")


def figures_measured(out: OutputParity) -> bool:
    """Whether ``out``'s max abs, SQNR and cosine were measured (it passed, or missed only a tolerance)."""
    return out.passed or str(out.problem or "").startswith(TOLERANCE_MISSES)


def compare_output(
    name: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    rtol: float,
    atol: float,
    min_sqnr_db: float | None = None,
    valid: np.ndarray | None = None,
) -> OutputParity:
    """Shapes first, then values; every number is computed in float64. ``valid`` (a boolean array
    of the outputs' shape, from ``padding_positions``): only those values are measured against the
    tolerances, SQNR and cosine; NaN and Inf are judged everywhere (a NaN at a padding position makes a
    masked sum of the vectors NaN: ``NaN * 0`` is NaN)."""
    result = OutputParity(name, tuple(candidate.shape))
    if reference.shape != candidate.shape:
        result.passed = False
        result.problem = f"shape {tuple(candidate.shape)}, reference has {tuple(reference.shape)}"
        return result
    if is_class_scores(reference):
        result.top1_agree = int((np.argmax(reference, axis=1) == np.argmax(candidate, axis=1)).sum())
        result.top1_total = int(reference.shape[0])
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    result.nan = int(np.isnan(cand).sum())
    result.inf = int(np.isinf(cand).sum())
    ref_bad = int((~np.isfinite(ref)).sum())
    if result.nan or result.inf or ref_bad:
        same_nan = np.array_equal(np.isnan(cand), np.isnan(ref))
        same_inf = np.array_equal(np.where(np.isinf(cand), np.sign(cand), 0), np.where(np.isinf(ref), np.sign(ref), 0))
        if not (same_nan and same_inf):
            result.passed = False
            result.problem = (
                f"{result.nan} NaN and {result.inf} Inf where the reference has {ref_bad} non-finite values "
                "(not at the same positions or signs)"
            )
            return result
    if valid is not None and valid.shape == ref.shape:
        result.padding_skipped = int(valid.size - np.count_nonzero(valid))
        ref, cand = ref[valid], cand[valid]
    finite = np.isfinite(ref) & np.isfinite(cand)
    ref, cand = ref[finite], cand[finite]
    if ref.size == 0:
        return result
    diff = np.abs(cand - ref)
    result.max_abs = float(diff.max())
    scale = float(np.abs(ref).max())
    result.max_rel = result.max_abs / scale if scale > 0 else (0.0 if result.max_abs == 0 else math.inf)
    ref_norm, cand_norm = float(np.linalg.norm(ref)), float(np.linalg.norm(cand))
    if ref_norm > 0 and cand_norm > 0:
        result.cosine = float(np.dot(ref, cand) / (ref_norm * cand_norm))
    elif ref_norm != cand_norm:
        result.cosine = 0.0
    noise = float(np.sum((cand - ref) ** 2))
    result.sqnr_db = math.inf if noise == 0 else 10 * math.log10(max(float(np.sum(ref**2)), 1e-300) / noise)
    excess = diff - (atol + rtol * np.abs(ref))
    if (excess > 0).any():
        worst = int(np.argmax(excess))
        result.passed = False
        result.problem = (
            f"max abs error {result.max_abs:.3g} exceeds atol {atol:g} + rtol {rtol:g} x |reference| "
            f"({int((excess > 0).sum())} of {ref.size} values; worst {cand[worst]:.6g} vs {ref[worst]:.6g})"
        )
    elif min_sqnr_db is not None and result.sqnr_db < min_sqnr_db:
        result.passed = False
        result.problem = f"SQNR {result.sqnr_db:.1f} dB is below {min_sqnr_db:g} dB"
    return result


def worst_sqnr_db(references: Sequence[Sequence[np.ndarray]], candidates: Sequence[Sequence[np.ndarray]]) -> float:
    """The worst SQNR (10·log10(signal / noise), in float64) over batches and outputs; -inf where a
    candidate has NaN or Inf, inf where every output matches exactly. This is how int8 is judged."""
    worst = math.inf
    for ref_outputs, cand_outputs in zip(references, candidates, strict=True):
        for r, c in zip(ref_outputs, cand_outputs, strict=True):
            r64 = np.asarray(r, dtype=np.float64)
            noise = float(np.sum((r64 - np.asarray(c, dtype=np.float64)) ** 2))
            if not math.isfinite(noise):
                return -math.inf
            if noise > 0:
                worst = min(worst, 10 * math.log10(max(float(np.sum(r64**2)), 1e-300) / noise))
    return worst


def is_class_scores(array: np.ndarray) -> bool:
    """A (batch, classes) floating array, classes >= 2: a classifier's scores, judged by top-1 agreement too."""
    return array.ndim == 2 and array.shape[1] >= 2 and array.shape[0] >= 1 and np.issubdtype(array.dtype, np.floating)


def padding_positions(
    inputs: Sequence[Any], outputs: Sequence[Any], feeds: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The values worth comparing in each token-level output: where the attention mask is 1.

    With one input of kind ``mask`` shaped ``[batch, seq]`` (``tk.spec.TensorSpec``), an output declared
    ``[batch, seq, ...]`` holds one vector per token, and the vectors at padding positions (the mask's
    zeros) are what no consumer reads: the model computes them from nothing, so engines disagree there
    by more than on the tokens (MiniLM on three sentences of different lengths: 7.6e-05 at a padding
    position, 2.7e-06 at most on the tokens). Outputs of other shapes, and feeds without padding, are
    compared whole (no entry)."""
    masks = [s for s in inputs if getattr(s, "kind", None) == "mask" and len(s.shape) == 2]
    if len(masks) != 1 or masks[0].name not in feeds:
        return {}
    spec, mask = masks[0], np.asarray(feeds[masks[0].name])
    if mask.ndim != 2 or mask.all():
        return {}
    valid: dict[str, np.ndarray] = {}
    for out in outputs:
        array = arrays.get(out.name)
        if array is None or len(out.shape) < 3 or list(out.shape[:2]) != list(spec.shape):
            continue
        if array.ndim >= 3 and array.shape[:2] == mask.shape:
            valid[out.name] = np.broadcast_to((mask != 0).reshape(mask.shape + (1,) * (array.ndim - 2)), array.shape)
    return valid


def compare(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float,
    min_sqnr_db: float | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    valid: Mapping[str, np.ndarray] | None = None,
) -> list[OutputParity]:
    """Names first: a missing or extra output is a failure of its own; then each output.

    ``tolerances``: (rtol, atol) for the outputs it names; the others use ``rtol``/``atol``.
    ``valid``: for the outputs it names, the positions to compare (``padding_positions``).
    """
    results = []
    for name in reference:
        if name not in candidate:
            results.append(
                OutputParity(name, None, passed=False, problem=f"missing; the candidate gave {list(candidate)}")
            )
            continue
        out_rtol, out_atol = (tolerances or {}).get(name, (rtol, atol))
        results.append(
            compare_output(
                name, reference[name], candidate[name], out_rtol, out_atol, min_sqnr_db, (valid or {}).get(name)
            )
        )
    for name in candidate:
        if name not in reference:
            results.append(
                OutputParity(
                    name, None, passed=False, problem=f"unexpected output; the reference gave {list(reference)}"
                )
            )
    return results


@dataclass
class ReferenceRuns:
    """The inputs at each shape (the user's samples fitted to it, or valid random ones) and the
    reference's outputs on them, computed once."""

    shapes: list[dict[str, int]]
    feeds: list[dict[str, np.ndarray]]
    outputs: list[dict[str, np.ndarray]]
    inputs: str = "random"  # where the inputs came from, as a check report records it


def reference_runs(
    reference: Any,
    shapes: Sequence[dict[str, int]],
    *,
    seed: int = 0,
    samples: Mapping[str, np.ndarray] | None = None,
) -> ReferenceRuns:
    """Run ``reference`` once per shape (seed ``seed + i``) so every candidate is compared on the same data:
    ``samples`` fitted to each shape (``tk.spec.fitted_samples``) where given and they fit, else valid
    random inputs.

    A model that fails at a size inside the artifact's ranges is reported as the user's range
    (``CaptureError``), not as a crash.
    """
    feeds, random_at = [], []
    for i, sizes in enumerate(shapes):
        fitted = None if samples is None else fitted_samples(samples, reference.inputs, sizes, seed=seed + i)
        if fitted is None:
            random_at.append(sizes)
        feeds.append(fitted if fitted is not None else random_feeds(reference.inputs, sizes, seed=seed + i))
    if samples is None or len(random_at) == len(shapes):
        source = "random"
    else:
        source = "samples" + "".join(f"; random at {sizes}" for sizes in random_at)
    outputs = []
    for sizes, run_feeds in zip(shapes, feeds, strict=True):
        try:
            outputs.append(reference.run(run_feeds))
        except EngineError as exc:  # the model itself fails (an embedding too short for the sequence, say)
            cause = exc.__cause__ or exc
            raise CaptureError(
                f"the PyTorch model fails at sizes {sizes} inside the requested ranges "
                f"({type(cause).__name__}: {first_line(cause)}); narrow --batch/--seq/--dim to what the model supports"
            ) from exc
    return ReferenceRuns(list(shapes), feeds, outputs, source)


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
    which spares re-running the reference for each candidate. The batch
    invariance probe re-runs the first samples of the largest batch alone through the candidate
    and compares them with the candidate's own batched outputs.
    """
    ref_name = reference if isinstance(reference, str) else reference.name  # a name: ``runs`` came from a golden file
    report = ParityReport(
        candidate.name, ref_name, precision, rtol, atol, min_sqnr_db, tolerances=dict(tolerances or {})
    )
    merged: dict[str, OutputParity] = {}
    if runs is None:
        runs = reference_runs(reference, shapes, seed=seed)
    report.inputs = runs.inputs
    largest: tuple[Mapping[str, np.ndarray], dict[str, np.ndarray]] | None = None
    for run_feeds, ref_out in zip(runs.feeds, runs.outputs, strict=True):
        cand_out = candidate.run(run_feeds)
        report.shapes.append(candidate.check_feeds(run_feeds))
        valid = padding_positions(candidate.inputs, candidate.outputs, run_feeds, ref_out)
        compared = compare(
            ref_out, cand_out, rtol=rtol, atol=atol, min_sqnr_db=min_sqnr_db, tolerances=tolerances, valid=valid
        )
        for result in compared:
            if result.name in merged:
                merged[result.name].merge(result)
            else:
                merged[result.name] = result
        batch = _batch_size(run_feeds)
        if largest is None or batch > _batch_size(largest[0]):
            largest = (run_feeds, cand_out)
    report.outputs = list(merged.values())
    _fail_where_the_reference_is_nan(report.outputs, runs.outputs)
    if batch_invariance and largest is not None and _batch_size(largest[0]) > 1 and _batch_dim_is_dynamic(candidate):
        report.batch_invariance = _batch_invariance(candidate, *largest, rtol=rtol, atol=atol)
    return report


def _batch_size(feeds: Mapping[str, np.ndarray]) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


def _batch_dim_is_dynamic(engine: Any) -> bool:
    dim = engine.dims.get("batch")
    return dim is not None and dim.min <= 1 and all(s.shape and s.shape[0] == "batch" for s in engine.inputs)


def _batch_invariance(
    engine: Any, feeds: Mapping[str, np.ndarray], batched: Mapping[str, np.ndarray], *, rtol: float, atol: float
) -> OutputParity:
    """A sample's output must not depend on the other samples in its batch."""
    worst = OutputParity("batch invariance", None)
    for i in range(min(INVARIANCE_SAMPLES, _batch_size(feeds))):
        sample = {name: value[i : i + 1] for name, value in feeds.items()}
        alone = engine.run(sample)
        valid = padding_positions(engine.inputs, engine.outputs, sample, alone)
        for name, value in alone.items():
            out_spec = next((s for s in engine.outputs if s.name == name), None)
            if out_spec is None or not out_spec.shape or out_spec.shape[0] != "batch":
                continue
            result = compare_output(name, batched[name][i : i + 1], value, rtol, atol, valid=valid.get(name))
            if not result.passed:
                result.problem = (
                    f"sample {i} of output {name!r} alone vs in a batch of {_batch_size(feeds)}: {result.problem}"
                )
            worst.merge(result)
    worst.name = "batch invariance"
    return worst


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
) -> ParityReport:
    """A ``ParityReport`` for outputs already computed (a whole input file run through both engines);
    ``valid`` as for ``compare`` (``padding_positions`` of the file's inputs)."""
    report = ParityReport(
        engine,
        reference_name,
        precision,
        rtol,
        atol,
        min_sqnr_db,
        shapes=shapes or [],
        tolerances=dict(tolerances or {}),
    )
    report.outputs = compare(
        reference, candidate, rtol=rtol, atol=atol, min_sqnr_db=min_sqnr_db, tolerances=tolerances, valid=valid
    )
    _fail_where_the_reference_is_nan(report.outputs, [reference])
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
