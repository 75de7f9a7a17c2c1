"""The reference's side of a parity check: its outputs, its own noise, and whether they carry signal.

``reference_runs`` runs the reference once per shape (the user's samples fitted to it, or valid
random inputs) so every candidate is compared on the same data. At fp32 and tf32 a candidate is
judged against the reference's own noise as well (``NoiseFloor``): the PyTorch model run again in
float64 is the truth, eager float32's distance from it the floor. ``reference_signal`` says when
the reference carries no signal: a pass against a constant or all-but-zero reference proves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tk.batch_probe import batch_dim_is_dynamic, batch_size, largest_run, probe_invariance
from tk.comparison import padding_positions
from tk.errors import CaptureError, EngineError, IntegrityError, TkError, first_line
from tk.spec import fitted_samples, random_feeds
from tk.tolerances import NOISE_FLOOR_K


@dataclass
class NoiseFloor:
    """The reference's own numerical noise where the check runs (``measure_noise_floor``).

    ``per_run``: for each run of a ``ReferenceRuns`` (one shape, or the user's samples), each floating
    output's max |eager float32 - eager float64| (the positions compared: padding left out); empty
    when the model could not run in float64, with ``note`` saying why (the table's tolerance then
    applies alone). ``batch``: each batched output's max |alone - in the batch| of eager itself, on
    the samples the batch-invariance probe re-runs. ``applied``: False where the user gave the
    tolerance (``--rtol``/``--atol``), which is then the whole rule: the floor is recorded, not added.
    """

    per_run: list[dict[str, float]] = field(default_factory=list)
    batch: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    k: float = NOISE_FLOOR_K
    applied: bool = True

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
        applied = {} if self.applied else {"applied": False}
        return {"k": self.k, **measured, "batch": self.batch, **applied, **({"note": self.note} if self.note else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NoiseFloor:
        """The floor a report recorded; ``IntegrityError`` (one line) unless its values are finite and 0 or more,
        and its K is tk's own (a recorded floor widens the tolerance: it must be the one tk measured)."""
        try:
            per_run = [{str(k): _floor_value(v) for k, v in run.items()} for run in data.get("per_run", [])]
            batch = {str(k): _floor_value(v) for k, v in data.get("batch", {}).items()}
            k = float(data.get("k", NOISE_FLOOR_K))
        except (TypeError, ValueError, AttributeError) as exc:
            raise IntegrityError(f"manifest.json: a noise floor that is not the record tk writes ({exc})") from exc
        if k != NOISE_FLOOR_K:
            raise IntegrityError(f"manifest.json: a noise floor with K {k:g}; tk judges with {NOISE_FLOOR_K:g}")
        return cls(per_run, batch, data.get("note"), k)  # applied or not is each check's own choice (given_tolerance)


def _floor_value(value: Any) -> float:
    number = float(value)
    if isinstance(value, bool) or not (math.isfinite(number) and number >= 0):
        raise ValueError(f"expected a finite floor of 0 or more, found {value!r}")
    return number


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


def _batch_variance(reference: Any, runs: ReferenceRuns) -> dict[str, float]:
    """Per batched output, how far ``reference`` itself is from its batched outputs when the probe's samples
    run alone (``probe_invariance``, judged against itself)."""
    index = largest_run(runs.feeds)
    if index is None or batch_size(runs.feeds[index]) < 2 or not batch_dim_is_dynamic(reference):
        return {}
    probe = probe_invariance(reference, runs.feeds[index], runs.outputs[index], rtol=0.0, atol=0.0)
    return {name: result.max_abs for name, result in probe.items()}


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
