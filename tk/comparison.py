"""One set of outputs against another: names, then shapes, then values, every figure in float64.

``compare`` judges a candidate's outputs against a reference's, output by output (``compare_output``:
max abs and relative error, cosine, SQNR, NaN and Inf, top-1 agreement for class scores), within
the table's tolerance plus the reference's noise floor where one is given; ``padding_positions``
leaves out what no consumer reads. ``tk.parity`` runs engines and folds these into a report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tk.tolerances import NOISE_FLOOR_K


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
    result.problem = _nonfinite_problem(result, ref, cand)
    if result.problem is not None:
        result.passed = False
        return result
    if valid is not None and valid.shape == ref.shape:
        result.padding_skipped = int(valid.size - np.count_nonzero(valid))
        ref, cand = ref[valid], cand[valid]
    finite = np.isfinite(ref) & np.isfinite(cand)
    ref, cand = ref[finite], cand[finite]
    if ref.size == 0:
        return result
    diff = _measure_figures(result, ref, cand)
    result.problem = _tolerance_problem(result, ref, cand, diff, rtol, atol, min_sqnr_db, floor)
    result.passed = result.problem is None
    return result


def _nonfinite_problem(result: OutputParity, ref: np.ndarray, cand: np.ndarray) -> str | None:
    """Count the candidate's NaN and Inf into ``result``; the problem when they (or the reference's
    non-finite values) are not at the same positions with the same signs, else None."""
    result.nan = int(np.isnan(cand).sum())
    result.inf = int(np.isinf(cand).sum())
    ref_bad = int((~np.isfinite(ref)).sum())
    if not (result.nan or result.inf or ref_bad):
        return None
    same_nan = np.array_equal(np.isnan(cand), np.isnan(ref))
    same_inf = np.array_equal(np.where(np.isinf(cand), np.sign(cand), 0), np.where(np.isinf(ref), np.sign(ref), 0))
    if same_nan and same_inf:
        return None
    return (
        f"{result.nan} NaN and {result.inf} Inf where the reference has {ref_bad} non-finite values "
        "(not at the same positions or signs)"
    )


def _measure_figures(result: OutputParity, ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Fill ``result``'s max abs and relative error, cosine and SQNR; return |cand - ref|."""
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
    return diff


def _tolerance_problem(
    result: OutputParity,
    ref: np.ndarray,
    cand: np.ndarray,
    diff: np.ndarray,
    rtol: float,
    atol: float,
    min_sqnr_db: float | None,
    floor: float | None,
) -> str | None:
    """The tolerance the measured figures miss (elementwise first, then SQNR), else None; records the
    floor and the error's ratio to it in ``result``."""
    allowance = atol
    if floor is not None:
        result.floor = floor
        result.floor_ratio = result.max_abs / floor if floor > 0 else None
        allowance += NOISE_FLOOR_K * floor
    excess = diff - (allowance + rtol * np.abs(ref))
    if (excess > 0).any():
        worst = int(np.argmax(excess))
        noise = f" + {NOISE_FLOOR_K:g} x noise floor {floor:.3g}" if floor is not None else ""
        return (
            f"max abs error {result.max_abs:.3g} exceeds atol {atol:g} + rtol {rtol:g} x |reference|{noise} "
            f"({int((excess > 0).sum())} of {ref.size} values; worst {cand[worst]:.6g} vs {ref[worst]:.6g})"
        )
    if min_sqnr_db is not None and result.sqnr_db < min_sqnr_db:
        return f"SQNR {result.sqnr_db:.1f} dB is below {min_sqnr_db:g} dB"
    return None


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
