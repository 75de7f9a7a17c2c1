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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tk.errors import CaptureError, EngineError, TkError, first_line
from tk.spec import fitted_samples, random_feeds
from tk.tolerances import FLOOR_PRECISIONS, NOISE_FLOOR_K

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
    floor: float | None = None  # the reference's noise floor (max |eager float32 - float64|), largest over the runs
    floor_ratio: float | None = None  # max abs error over the floor at the same run, the worst run
    reference_signal: str | None = None  # "constant" or "near zero": the reference says little (reference_signal)

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
        self.floor = _max_known(self.floor, other.floor)
        self.floor_ratio = _max_known(self.floor_ratio, other.floor_ratio)
        if not other.passed and self.passed:
            self.passed, self.problem = False, other.problem
        self.shape = other.shape


def _max_known(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass
class NoiseFloor:
    """The reference's own numerical noise where the check runs (``measure_noise_floor``).

    ``per_run``: for each run of a ``ReferenceRuns`` (one shape, or the user's samples), each floating
    output's max |eager float32 - eager float64| (the positions compared: padding left out); empty
    when the model could not run in float64, with ``note`` saying why (the table's tolerance then
    applies alone). ``batch``: each batched output's max |alone - in the batch| of eager itself, on
    the samples the batch-invariance probe re-runs.
    """

    per_run: list[dict[str, float]] = field(default_factory=list)
    batch: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    k: float = NOISE_FLOOR_K

    @property
    def measured(self) -> bool:
        return bool(self.per_run)

    def largest(self) -> dict[str, float]:
        """Each output's floor, the largest over the runs."""
        out: dict[str, float] = {}
        for run in self.per_run:
            for name, value in run.items():
                out[name] = max(out.get(name, 0.0), value)
        return out

    def to_json(self) -> dict[str, Any]:
        measured = {"measured": "eager float32 vs float64", "per_run": self.per_run} if self.measured else {}
        return {"k": self.k, **measured, "batch": self.batch, **({"note": self.note} if self.note else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NoiseFloor:
        per_run = [{str(k): float(v) for k, v in run.items()} for run in data.get("per_run", [])]
        batch = {str(k): float(v) for k, v in data.get("batch", {}).items()}
        return cls(per_run, batch, data.get("note"), float(data.get("k", NOISE_FLOOR_K)))


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
    floor: float | None = None,
) -> OutputParity:
    """Shapes first, then values; every number is computed in float64. ``valid`` (a boolean array
    of the outputs' shape, from ``padding_positions``): only those values are measured against the
    tolerances, SQNR and cosine; NaN and Inf are judged everywhere (a NaN at a padding position makes a
    masked sum of the vectors NaN: ``NaN * 0`` is NaN). ``floor``: the reference's noise floor at this
    run (``NoiseFloor``); the values then pass within atol + rtol x |reference| + ``NOISE_FLOOR_K`` x floor."""
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
    allowance = atol
    if floor is not None:
        result.floor = floor
        result.floor_ratio = result.max_abs / floor if floor > 0 else None
        allowance += NOISE_FLOOR_K * floor
    excess = diff - (allowance + rtol * np.abs(ref))
    if (excess > 0).any():
        worst = int(np.argmax(excess))
        noise = f" + {NOISE_FLOOR_K:g} x noise floor {floor:.3g}" if floor is not None else ""
        result.passed = False
        result.problem = (
            f"max abs error {result.max_abs:.3g} exceeds atol {atol:g} + rtol {rtol:g} x |reference|{noise} "
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
    floors: Mapping[str, float] | None = None,
) -> list[OutputParity]:
    """Names first: a missing or extra output is a failure of its own; then each output.

    ``tolerances``: (rtol, atol) for the outputs it names; the others use ``rtol``/``atol``.
    ``valid``: for the outputs it names, the positions to compare (``padding_positions``).
    ``floors``: for the outputs it names, the reference's noise floor (``compare_output``).
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
                name,
                reference[name],
                candidate[name],
                out_rtol,
                out_atol,
                min_sqnr_db,
                (valid or {}).get(name),
                (floors or {}).get(name),
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
    reference's outputs on them, computed once; ``floor``: the reference's own noise on them."""

    shapes: list[dict[str, int]]
    feeds: list[dict[str, np.ndarray]]
    outputs: list[dict[str, np.ndarray]]
    inputs: str = "random"  # where the inputs came from, as a check report records it
    floor: NoiseFloor | None = None


def reference_runs(
    reference: Any,
    shapes: Sequence[dict[str, int]],
    *,
    seed: int = 0,
    samples: Mapping[str, np.ndarray] | None = None,
    noise_floor: bool = False,
) -> ReferenceRuns:
    """Run ``reference`` once per shape (seed ``seed + i``) so every candidate is compared on the same data:
    ``samples`` fitted to each shape (``tk.spec.fitted_samples``) where given and they fit, else valid
    random inputs. ``noise_floor``: measure the reference's own noise on them too (``measure_noise_floor``).

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
    runs = ReferenceRuns(list(shapes), feeds, outputs, source)
    if noise_floor:
        runs.floor = measure_noise_floor(reference, runs)
    return runs


Run = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def measure_noise_floor(
    reference: Any, runs: ReferenceRuns, *, run: Run | None = None, batch: bool = True
) -> NoiseFloor:
    """How far the reference's float32 outputs in ``runs`` are from the same model run in float64.

    ``reference`` offers ``in_float64()`` (``tk.runtime.eager.EagerEngine``): a context within which
    ``run`` (default ``reference.run``; a ``BatchRunner``'s over the user's samples) computes in
    float64. Where it offers none, or the model cannot run in float64 (a module that refuses the cast,
    an op without a float64 kernel), the floor is left unmeasured with a note, and the table's
    tolerance applies alone. Eager's own batch variance (``NoiseFloor.batch``) is measured in float32
    on the runs the batch-invariance probe uses (``batch``; a check over the user's samples has no probe).
    """
    floor = NoiseFloor(batch=_batch_variance(reference, runs) if batch else {})
    in_float64 = getattr(reference, "in_float64", None)
    if in_float64 is None:
        floor.note = f"the reference ({getattr(reference, 'name', reference)}) cannot run the model in float64"
        return floor
    try:
        with in_float64():
            truths = [(run or reference.run)(feeds) for feeds in runs.feeds]
    except TkError as exc:
        floor.note = f"the model cannot run in float64 ({first_line(exc)})"
        return floor
    per_run = []
    for feeds, outputs, truth in zip(runs.feeds, runs.outputs, truths, strict=True):
        valid = padding_positions(reference.inputs, reference.outputs, feeds, outputs)
        per_run.append({n: _max_diff(outputs[n], truth[n], valid.get(n)) for n in outputs if _floating(outputs[n])})
    if not all(math.isfinite(value) for run_floors in per_run for value in run_floors.values()):
        floor.note = "the model's float64 run gives NaN or Inf where its float32 run does not"
        return floor
    floor.per_run = per_run
    return floor


def _floating(array: Any) -> bool:
    return np.issubdtype(np.asarray(array).dtype, np.floating)


def _max_diff(a: np.ndarray, b: np.ndarray, valid: np.ndarray | None = None) -> float:
    """max |a - b| in float64 over ``valid`` (or everywhere) where ``a`` is finite; NaN where ``b`` is not."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    keep = np.isfinite(np.asarray(a, dtype=np.float64))
    if valid is not None and valid.shape == keep.shape:
        keep &= valid
    return float(np.abs(diff[keep]).max()) if keep.any() else 0.0


def _largest_run(feeds: Sequence[Mapping[str, np.ndarray]]) -> int | None:
    """The index of the first run with the largest batch: where the batch-invariance probe looks."""
    return max(range(len(feeds)), key=lambda i: _batch_size(feeds[i])) if feeds else None


def _batch_variance(reference: Any, runs: ReferenceRuns) -> dict[str, float]:
    """Per batched output, how far ``reference`` itself is from its batched outputs when the probe's samples
    run alone (``_batch_invariance``, judged against itself)."""
    index = _largest_run(runs.feeds)
    if index is None or _batch_size(runs.feeds[index]) < 2 or not _batch_dim_is_dynamic(reference):
        return {}
    probe = _batch_invariance(reference, runs.feeds[index], runs.outputs[index], rtol=0.0, atol=0.0)
    return {name: result.max_abs for name, result in probe.items()}


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
    floor = runs.floor if precision in FLOOR_PRECISIONS else None
    report.noise_floor = floor
    merged: dict[str, OutputParity] = {}
    largest, batched = _largest_run(runs.feeds), None
    for index, (run_feeds, ref_out) in enumerate(zip(runs.feeds, runs.outputs, strict=True)):
        cand_out = candidate.run(run_feeds)
        if index == largest:
            batched = cand_out  # what the batch-invariance probe compares samples run alone with
        report.shapes.append(candidate.check_feeds(run_feeds))
        valid = padding_positions(candidate.inputs, candidate.outputs, run_feeds, ref_out)
        floors = floor.per_run[index] if floor is not None and floor.measured else None
        compared = compare(
            ref_out,
            cand_out,
            rtol=rtol,
            atol=atol,
            min_sqnr_db=min_sqnr_db,
            tolerances=tolerances,
            valid=valid,
            floors=floors,
        )
        for result in compared:
            if result.name in merged:
                merged[result.name].merge(result)
            else:
                merged[result.name] = result
    report.outputs = list(merged.values())
    _fail_where_the_reference_is_nan(report.outputs, runs.outputs)
    mark_reference_signal(report, runs.outputs, candidate.outputs)
    if batch_invariance and batched is not None and largest is not None and _batch_size(runs.feeds[largest]) > 1:
        if _batch_dim_is_dynamic(candidate):
            floors = _probe_floors(floor, largest)
            probe = _batch_invariance(candidate, runs.feeds[largest], batched, rtol=rtol, atol=atol, floors=floors)
            report.batch_invariance = _worst_of(probe.values())
    return report


def _probe_floors(floor: NoiseFloor | None, index: int) -> dict[str, float] | None:
    """The batch-invariance probe's floor per output: the larger of eager's own batch variance and eager
    float32's noise at that run, since either is how far a sum computed in another order may move."""
    if floor is None:
        return None
    at_run = floor.per_run[index] if floor.measured else {}
    return {name: max(floor.batch.get(name, 0.0), at_run.get(name, 0.0)) for name in {*floor.batch, *at_run}}


def _worst_of(results: Iterable[OutputParity]) -> OutputParity:
    worst = OutputParity("batch invariance", None)
    for result in results:
        worst.merge(result)
    worst.name = "batch invariance"
    return worst


def _batch_size(feeds: Mapping[str, np.ndarray]) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


def _batch_dim_is_dynamic(engine: Any) -> bool:
    dim = engine.dims.get("batch")
    return dim is not None and dim.min <= 1 and all(s.shape and s.shape[0] == "batch" for s in engine.inputs)


def _batch_invariance(
    engine: Any,
    feeds: Mapping[str, np.ndarray],
    batched: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float,
    floors: Mapping[str, float] | None = None,
) -> dict[str, OutputParity]:
    """A sample's output must not depend on the other samples in its batch: per batched output, the worst
    of the first ``INVARIANCE_SAMPLES`` samples run alone against their rows of ``batched``."""
    worst: dict[str, OutputParity] = {}
    for i in range(min(INVARIANCE_SAMPLES, _batch_size(feeds))):
        sample = {name: value[i : i + 1] for name, value in feeds.items()}
        alone = engine.run(sample)
        valid = padding_positions(engine.inputs, engine.outputs, sample, alone)
        for name, value in alone.items():
            out_spec = next((s for s in engine.outputs if s.name == name), None)
            if out_spec is None or not out_spec.shape or out_spec.shape[0] != "batch":
                continue
            floor = (floors or {}).get(name)
            result = compare_output(
                name, batched[name][i : i + 1], value, rtol, atol, valid=valid.get(name), floor=floor
            )
            if not result.passed:
                result.problem = (
                    f"sample {i} of output {name!r} alone vs in a batch of {_batch_size(feeds)}: {result.problem}"
                )
            if name in worst:
                worst[name].merge(result)
            else:
                worst[name] = result
    return worst


NEAR_ZERO = "near zero"
CONSTANT = "constant"


def reference_signal(arrays: Sequence[np.ndarray], allowance: float, *, batched: bool) -> str | None:
    """``"near zero"`` when the reference's largest value is within ``allowance`` (the output's atol plus
    its noise allowance: an artifact that returns zeros passes elementwise), ``"constant"`` when its
    values do not depend on the input (every sample of every batch of two or more equal to the first;
    without such a batch, every value the same), else None: a pass against either proves nothing."""
    values = [np.asarray(a, dtype=np.float64) for a in arrays if np.asarray(a).size and _floating(a)]
    if not values or not all(np.isfinite(v).all() for v in values):
        return None  # no floating output, or NaN/Inf: judged elsewhere
    if max(float(np.abs(v).max()) for v in values) <= allowance:
        return NEAR_ZERO
    many = [v for v in values if batched and v.ndim and v.shape[0] >= 2]
    if many:
        return CONSTANT if all((v == v[:1]).all() for v in many) else None
    return CONSTANT if all((v == v.flat[0]).all() for v in values) else None


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
        floors=floor.per_run[0] if floor is not None and floor.measured else None,
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
