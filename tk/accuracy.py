"""The user's accuracy goal (``tk optimize --accuracy``): parse it, and judge outputs by it.

A spec is one or more comma-separated criteria, all of which must hold:

- ``sqnr>=DB``: signal-to-quantization-noise ratio of every output against the float32 model, in dB
  (outputs shaped batch x seq x ... of a model with an attention mask: at its real tokens; so ``max_abs``)
- ``cosine>=X``: the worst cosine similarity of one sample's output with the float model's; for
  outputs shaped batch x seq x hidden of a model with an attention mask, of the mask-pooled
  (mean over real tokens) vectors, which is what an embedding model's users compare
- ``top1>=PCT``: percent of argmax (last axis) agreement with the float model, or, given labels,
  the candidate's accuracy against them
- ``max_abs<=X``: the largest absolute difference from the float model

The elementwise numbers (SQNR, max abs) come from ``tk.parity``'s comparison; only the per-sample
cosine and the top-1 rates are counted here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tk.errors import UsageError
from tk.parity import TOLERANCE_MISSES, compare

DEFAULT_ACCURACY = "sqnr>=35"
METRICS: dict[str, str] = {"sqnr": ">=", "cosine": ">=", "top1": ">=", "max_abs": "<="}  # metric -> its bound
UNITS = {"sqnr": " dB", "cosine": "", "top1": "%", "max_abs": ""}
_CRITERION = re.compile(r"^\s*([a-z_0-9]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Criterion:
    metric: str  # sqnr | cosine | top1 | max_abs
    bound: float

    @property
    def op(self) -> str:
        return METRICS[self.metric]

    def holds(self, value: float | None) -> bool:
        if value is None or math.isnan(value):
            return False
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"


@dataclass(frozen=True)
class AccuracySpec:
    criteria: tuple[Criterion, ...]

    def __str__(self) -> str:
        return ",".join(str(c) for c in self.criteria)

    @property
    def metrics(self) -> list[str]:
        return [c.metric for c in self.criteria]

    @property
    def sqnr_floor_db(self) -> float | None:
        """The SQNR an export should hold to meet this spec: the ``sqnr`` bound, or the SQNR at which
        noise uncorrelated with the signal keeps the ``cosine`` bound (the stricter of the two); None
        when neither is given. Per element, so stricter than a cosine of pooled vectors needs."""
        floors = [c.bound for c in self.criteria if c.metric == "sqnr"]
        floors += [sqnr_for_cosine_db(c.bound) for c in self.criteria if c.metric == "cosine" and 0 < c.bound < 1]
        return max(floors) if floors else None


def sqnr_for_cosine_db(cosine: float) -> float:
    """The SQNR whose uncorrelated noise leaves ``cosine`` between signal and signal + noise:
    cos = 1 / sqrt(1 + 10^(-SQNR/10)), so 0.99 is 16.9 dB and 0.9999 is 37.0 dB."""
    return -10.0 * math.log10(1.0 / cosine**2 - 1.0)


def unmeasurable(spec: AccuracySpec, outputs: Sequence[Any]) -> str | None:
    """Why ``spec`` cannot be judged on outputs of these specs (``tk.spec.TensorSpec``), or None: ``top1``
    takes the argmax over an output's last axis, so it needs a float output of batch x classes (2 or more)."""
    if "top1" not in spec.metrics:
        return None
    for out in outputs:
        last = out.shape[-1] if len(out.shape) >= 2 else None
        if out.dtype.startswith(("float", "bfloat")) and last is not None and (not isinstance(last, int) or last >= 2):
            return None
    shapes = ", ".join(f"{o.name} ({' x '.join(map(str, o.shape))})" for o in outputs)
    return f"--accuracy top1: expected an output of batch x classes (its argmax is compared), found {shapes}"


def parse_accuracy(text: str | None) -> AccuracySpec:
    """``sqnr>=35,top1>=99`` -> an ``AccuracySpec``; ``None`` or empty gives ``sqnr>=35``."""
    text = DEFAULT_ACCURACY if text is None or not text.strip() else text
    expected = "expected comma-separated sqnr>=DB, cosine>=X, top1>=PCT or max_abs<=X such as sqnr>=35,top1>=99"
    criteria = []
    for part in text.split(","):
        match = _CRITERION.match(part)
        if not match:
            raise UsageError(f"--accuracy: {expected}; got {part.strip()!r}")
        metric, op, number = match.groups()
        if metric not in METRICS:
            raise UsageError(f"--accuracy: unknown metric {metric!r}; {expected}")
        if op != METRICS[metric]:
            raise UsageError(f"--accuracy: {metric} is bounded with {METRICS[metric]}, got {part.strip()!r}")
        try:
            bound = float(number)
        except ValueError:
            raise UsageError(f"--accuracy: expected a number after {metric}{op}, got {number!r}") from None
        if not math.isfinite(bound):
            raise UsageError(f"--accuracy: expected a finite bound for {metric}, got {number!r}")
        if metric == "cosine" and not -1 <= bound <= 1:
            raise UsageError(f"--accuracy: cosine is between -1 and 1, got {bound:g}")
        if metric == "top1" and not 0 <= bound <= 100:
            raise UsageError(f"--accuracy: top1 is a percentage from 0 to 100, got {bound:g}")
        if metric == "max_abs" and bound < 0:
            raise UsageError(f"--accuracy: max_abs is 0 or more, got {bound:g}")
        if any(c.metric == metric for c in criteria):
            raise UsageError(f"--accuracy: {metric} is given twice in {text!r}")
        criteria.append(Criterion(metric, bound))
    return AccuracySpec(tuple(criteria))


@dataclass
class Verdict:
    """The worst value of each metric over outputs and runs, and whether the spec holds."""

    spec: str
    values: dict[str, float | None] = field(default_factory=dict)  # metric -> worst value (None: not measurable)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        values = {k: (None if v is None else _finite_or_text(v)) for k, v in self.values.items()}
        return {"spec": self.spec, "passed": self.passed, "values": values, "failures": self.failures}


def _finite_or_text(value: float) -> float | str:
    # significant digits, not decimals: a max_abs of 4.5e-08 is no 0.0 (a cosine keeps its 9s to 1e-9)
    if math.isnan(value):
        return "nan"
    return float(f"{value:.10g}") if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def judge(
    spec: AccuracySpec, values: Mapping[str, float | None], problems: Sequence[str] = (), where: str = ""
) -> Verdict:
    """A ``Verdict`` of ``spec`` on measured worst ``values``; ``problems`` (NaN, shapes) fail it whatever the values."""
    verdict = Verdict(str(spec), dict(values), [f"{where}{p}" for p in problems])
    for criterion in spec.criteria:
        value = values.get(criterion.metric)
        if value is None:
            verdict.failures.append(f"{where}{criterion.metric} cannot be measured on these outputs")
        elif not criterion.holds(value):
            verdict.failures.append(
                f"{where}{criterion.metric} {value:.6g}{UNITS[criterion.metric]}, needs {criterion}"
            )
    return verdict


def measure_outputs(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    mask: np.ndarray | None = None,
    labels: np.ndarray | None = None,
) -> tuple[dict[str, float | None], list[str]]:
    """Worst sqnr, cosine, top1 and max_abs over the outputs of one run, and the problems (NaN, shapes).

    With an attention ``mask``, outputs shaped batch x seq x ... are measured at the real tokens only
    (the padding positions' vectors are read by no one; ``tk.parity.padding_positions``)."""
    valid = _token_positions(reference, mask)
    # no tolerance: only names, shapes, NaN fail
    results = compare(reference, candidate, rtol=0.0, atol=math.inf, valid=valid)
    problems = [f"{r.name}: {r.problem}" for r in results if not r.passed]
    sqnr = min((r.sqnr_db for r in results), default=math.inf)
    max_abs = max((r.max_abs for r in results), default=0.0)
    cosines, top1s = [], []
    for name, ref in reference.items():
        cand = candidate.get(name)
        if cand is None or cand.shape != ref.shape or not np.issubdtype(ref.dtype, np.floating) or ref.ndim < 1:
            continue
        cosines.append(_worst_sample_cosine(ref, cand, mask))
        if ref.ndim >= 2 and ref.shape[-1] >= 2:
            top1s.append(_top1_percent(ref, cand, mask, labels))
    values: dict[str, float | None] = {
        "sqnr": sqnr,
        "cosine": min(cosines) if cosines else None,
        "top1": min(top1s) if top1s else None,
        "max_abs": max_abs,
    }
    return values, problems


def _token_positions(reference: Mapping[str, np.ndarray], mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """For each batch x seq x ... output, where ``mask`` (batch x seq) is 1; none without padding."""
    if mask is None or np.asarray(mask).ndim != 2 or np.asarray(mask).all():
        return {}
    keep = np.asarray(mask) != 0
    return {
        name: np.broadcast_to(keep.reshape(keep.shape + (1,) * (ref.ndim - 2)), ref.shape)
        for name, ref in reference.items()
        if ref.ndim >= 3 and ref.shape[:2] == keep.shape
    }


def worst_of(runs: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """The worst value of each metric over several runs (lowest, or highest for max_abs)."""
    worst: dict[str, float | None] = {}
    for metric in METRICS:
        found = [r[metric] for r in runs if r.get(metric) is not None]
        pick = max if METRICS[metric] == "<=" else min
        worst[metric] = pick(found) if found else None  # type: ignore[type-var]
    return worst


def _pooled(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """One vector per sample: batch x seq x hidden mean-pooled over the mask's real tokens, else flattened."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 3 and mask is not None and mask.shape == values.shape[:2]:
        weights = mask.astype(np.float64)[..., None]
        return (values * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
    return values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(1, -1)


def _worst_sample_cosine(ref: np.ndarray, cand: np.ndarray, mask: np.ndarray | None) -> float:
    a, b = _pooled(ref, mask), _pooled(cand, mask)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return -1.0
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, (a * b).sum(axis=1) / np.maximum(na * nb, 1e-300))
    return float(cos.min())


def _top1_percent(ref: np.ndarray, cand: np.ndarray, mask: np.ndarray | None, labels: np.ndarray | None) -> float:
    """Argmax over the last axis: agreement with ``ref``, or accuracy against ``labels`` (where given);
    for batch x seq x classes outputs only the mask's real tokens count."""
    predicted = np.argmax(cand, axis=-1)
    target = np.argmax(ref, axis=-1) if labels is None or labels.shape != predicted.shape else labels
    keep = np.ones(predicted.shape, dtype=bool)
    if mask is not None and mask.shape == predicted.shape:
        keep = mask.astype(bool)
    total = int(keep.sum())
    return 100.0 * float(((predicted == target) & keep).sum()) / total if total else 100.0


def values_from_report(report: Mapping[str, Any]) -> tuple[dict[str, float | None], list[str]]:
    """Worst sqnr, cosine, top1 and max_abs of a stored ``ParityReport`` (``to_json``), e.g. the export
    check's over the artifact's shape range, and its problems other than tolerance misses.

    Its cosine is of each output as a whole (the report keeps no per-sample numbers)."""
    outputs = list(report.get("outputs", []))
    if report.get("batch_invariance"):
        outputs.append(report["batch_invariance"])
    runs, problems = [], []
    for out in outputs:
        sqnr = out.get("sqnr_db")
        top1 = out.get("top1_rate")
        runs.append({
            "sqnr": math.inf if sqnr is None else float(sqnr),
            "cosine": float(out.get("cosine", 1.0)),
            "top1": None if top1 is None else 100.0 * float(top1),
            "max_abs": float(out.get("max_abs", 0.0)),
        })  # fmt: skip
        problem = out.get("problem")
        if out.get("nan") or out.get("inf"):
            problems.append(f"{out['name']}: {out.get('nan', 0)} NaN and {out.get('inf', 0)} Inf")
        # a tolerance miss is the user's spec's to judge; every other problem (shapes, NaN) stays one
        elif not out.get("passed", True) and problem and not str(problem).startswith(TOLERANCE_MISSES):
            problems.append(f"{out['name']}: {problem}")
    return worst_of(runs), problems
