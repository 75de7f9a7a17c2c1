"""Static int8's inputs (the calibration batches, and the held-out batches that judge a quantized
graph) and the loop that leaves the costliest layers out until the graph keeps its SQNR floor.

Shared by the int8 writers: onnxruntime's static QDQ graph (``tk.export.static_int8``), the
PT2E-quantized AOTInductor package (``tk.export.aoti_int8``) and NNCF's OpenVINO IR (``tk.export.openvino``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tk.errors import CannotWinError, ConversionError, UsageError
from tk.export.context import ExportContext
from tk.spec import batch_dim, count_nonfinite, fitted_samples, random_feeds, shapes_to_check

CALIBRATION_BATCH = 8  # samples per calibration run
# a quantized graph's judged batches must clear the floor by this much: the check runs other batches (fresh
# random ones, or the check's samples where the search judged the calibration samples)
MARGIN_DB = 2.0
SCREEN_EVERY = 4  # screened_exclusion's rounds judge the calibration batches and every 4th held-out one
DEFAULT_CALIBRATION = "random:32"

log = logging.getLogger("tk.export")


def require_finite(arrays: Mapping[str, Any], source: str, purpose: str = "int8 calibration") -> None:
    """Refuse samples holding NaN or infinity (``source``: the flag and file they came from): calibration
    ranges would leave no layer int8, and no accuracy can be judged against a NaN reference."""
    for name, bad in count_nonfinite(arrays).items():
        if bad:
            raise UsageError(
                f"{source}: input {name!r}: expected finite values ({purpose} needs them), found {bad} NaN or "
                "infinite value(s)"
            )


def int8_floor_db(ctx: ExportContext) -> float:
    """The SQNR floor of the int8 exclusion search: ``--min-sqnr``, else int8's row of ``MIN_SQNR_DB``."""
    from tk.tolerances import MIN_SQNR_DB

    return ctx.options.min_sqnr_db if ctx.options.min_sqnr_db is not None else MIN_SQNR_DB["int8"]


def int8_gate(ctx: ExportContext, fmt: str) -> Callable[[Any], None] | None:
    """What format ``fmt``'s int8 writer calls with its all-int8 model before an exclusion search:
    ``ctx.options.int8_gate`` asked for ``fmt``, raising ``CannotWinError`` with its reason."""
    gate = ctx.options.int8_gate
    if gate is None:
        return None

    def ask(model: Any) -> None:
        reason = gate(fmt, model)
        if reason:
            raise CannotWinError(f"{fmt} int8: {reason}")

    return ask


def require_int8_layers(int8: int, quantizable: int, fmt: str) -> None:
    """Fail an int8 export in which no layer stayed int8 (it would be a float32 artifact called int8);
    log how many did otherwise."""
    if quantizable and int8 == 0:
        from tk.formats.aoti import runs_natively

        other = "--precision bf16" if runs_natively("bf16") else "float32 (this CPU has no bf16 dot products)"
        raise ConversionError(
            f"--precision int8 --format {fmt}: no layer stayed int8 (all {quantizable} were left out, below the "
            "SQNR floor or by --keep-fp32), so the artifact would not be int8; calibrate with real inputs "
            "(--calibrate FILE; tk optimize: --data FILE), train the model, accept a lower floor (--min-sqnr DB; "
            f"tk optimize: a lower --accuracy) or export {other}"
        )
    log.info("export int8   %d of %d layers int8", int8, quantizable)


def calibration_feeds(ctx: ExportContext, *, one_shape: bool = False) -> list[dict[str, np.ndarray]]:
    """Static int8 calibration batches: ``options.calibration_data`` split into batches, else ``random:N``.

    Random samples cycle through the sizes the export check uses (min, opt, max and an odd size of
    every dimension but the batch), so the activation ranges cover the whole dynamic range. The
    histogram methods of onnxruntime (entropy, percentile) are the exception: it stacks their
    activations across batches, so every batch must have one shape: one sample per batch, at the
    opt sizes (``one_shape``). (torchao's HistogramObserver, the aoti default, takes batches of any shape.)
    Batches hold as many samples as the batch dimension's range allows (a static batch of 32: 32).
    """
    inputs = ctx.spec.signature.inputs
    batch = batch_dim(inputs)
    smallest = ctx.dims[batch].min if batch in ctx.dims else 1
    per_batch = 1 if one_shape else CALIBRATION_BATCH
    if batch in ctx.dims:  # within the batch dimension's range (a static batch of 32 takes 32 a batch)
        per_batch = min(max(per_batch, smallest), ctx.dims[batch].max)
    if ctx.options.calibration_data is not None:
        batches = calibration_batches(dict(ctx.options.calibration_data), batch=per_batch)
        whole = [b for b in batches if next(iter(b.values())).shape[0] >= smallest]
        if not whole:
            raise UsageError(
                f"--calibrate: the batch dimension takes at least {smallest} samples; "
                f"the file holds {next(iter(batches[0].values())).shape[0] if batches else 0}"
            )
        return whole  # a static batch's short last batch is left out
    text = ctx.options.calibrate or DEFAULT_CALIBRATION
    count = text.removeprefix("random:")
    if not text.startswith("random:") or not count.isdigit() or int(count) < 1:
        raise UsageError(f"--calibrate: expected random:N (N >= 1) or an inputs file, got {text!r}")
    others = [d for n, d in ctx.dims.items() if n != batch]
    batches = []
    left = int(count)
    for i in range(-(-left // per_batch)):
        sizes = {n: d.opt for n, d in ctx.dims.items()}
        for d in others if not one_shape else ():
            options = d.sizes_to_check()
            sizes[d.name] = options[i % len(options)]
        if batch is not None:
            sizes[batch] = max(min(per_batch, left), smallest)
        left -= per_batch
        batches.append(random_feeds(inputs, sizes, seed=1234 + i))
    return batches


# random batches per shape that judge the int8 graph (at most 10: the seeds below must not collide).
# The SQNR of a classifier's logits has a long tail over batches: 3 seeds passed a graph that scored
# far under the floor on another batch and failed the export check; 8 seeds see that tail. The user's
# samples give as many distinct batches as they fill, up to this many.
JUDGE_SEEDS = 8


def judge_feeds(ctx: ExportContext) -> list[dict[str, np.ndarray]]:
    """Batches at the shapes the export check uses (all min, all opt, an odd size of each, each at its
    max), a few seeds each, to judge the int8 graph's SQNR: the user's samples fitted to each shape
    where they fit (as many batches as they fill, up to ``JUDGE_SEEDS``), else random inputs.

    The samples: where the check runs the user's (``options.check_data``), the calibration samples when
    they are the user's too, so that the check (``tk optimize --data``'s held-out half) judges samples
    the search never saw; else the check's own."""
    inputs, samples = ctx.spec.signature.inputs, ctx.options.check_data
    if samples is not None and ctx.options.calibration_data is not None:
        samples = ctx.options.calibration_data
    count = 0 if samples is None else int(next(iter(samples.values())).shape[0])
    batch = batch_dim(inputs)
    feeds = []
    for i, sizes in enumerate(shapes_to_check(ctx.dims)):
        first = None if samples is None else fitted_samples(samples, inputs, sizes, seed=0)
        if first is None:
            feeds += [random_feeds(inputs, sizes, seed=9000 + 10 * i + j) for j in range(JUDGE_SEEDS)]
            continue
        # seed j starts at sample j * batch: past the samples' end the batches would repeat
        distinct = min(JUDGE_SEEDS, -(-count // sizes[batch]) if batch in sizes else 1)
        feeds += [first, *(fitted_samples(samples, inputs, sizes, seed=j) for j in range(1, distinct))]
    return feeds


def calibration_batches(arrays: dict[str, np.ndarray], batch: int = CALIBRATION_BATCH) -> list[dict[str, np.ndarray]]:
    """Split samples (axis 0 of every array) into batches of at most ``batch``."""
    counts = {a.shape[0] for a in arrays.values()}
    if len(counts) != 1:
        raise UsageError(f"calibration inputs: expected one sample count for every input, got {sorted(counts)}")
    total = counts.pop()
    return [{k: np.ascontiguousarray(v[i : i + batch]) for k, v in arrays.items()} for i in range(0, total, batch)]


def exclude_costliest(
    costs: dict[str, float],
    judge: Callable[[list[str]], float],
    target_db: float,
    max_rounds: int,
    *,
    failed_before: set[frozenset[str]] | None = None,
    at_least: Callable[[list[str]], None] | None = None,
) -> tuple[list[str], float | None]:
    """Leave out the layers that cost the most signal, 1, 2, 4... more per round, until ``judge`` says
    the graph without them reaches ``target_db``. ``costs``: each layer's cost as an SQNR, lower is
    costlier (the graph's with only that layer quantized, in every int8 writer); ``judge(excluded)``
    quantizes everything else and returns the graph's SQNR, or any value under ``target_db`` when it fails.

    A round that reaches the target after leaving out several more layers is bisected back: the fewest
    of them that still reach it are kept out, so no layer leaves int8 that did not have to. The last
    ``judge`` call is always the returned set's (callers keep that call's graph).
    ``failed_before``: sets already found under the target by a judge of fewer batches (a screen's
    rounds, before a batch joined it: a set under the target on some batches is under it on more); they
    are not judged again but where the answer is returned, and the sets found under it are added.
    ``at_least(layers)``, after each round under the target with layers left to take: the fewest layers
    the search can still return (the returned set is always a longer prefix of the same ranking); it may
    end the search by raising (tk optimize's speed gate: the int8 left cannot win).
    Returns the excluded layers, costliest first, and the last SQNR (None when there was none to exclude)."""
    known = failed_before if failed_before is not None else set()

    def ask(layers: list[str], *, returned: bool = False) -> float:
        key = frozenset(layers)
        if key in known and not returned:
            return -math.inf
        value = judge(list(layers))
        if value < target_db:
            known.add(key)
        return value

    ranked = sorted(costs, key=costs.__getitem__)
    excluded: list[str] = []
    sqnr = None
    step = 1
    for round_ in range(max_rounds):
        if not ranked:
            break
        take, ranked = ranked[:step], ranked[step:]
        excluded.extend(take)
        sqnr = ask(excluded, returned=not ranked or round_ == max_rounds - 1)  # the last round's set is returned
        if sqnr >= target_db:
            return _fewest_that_pass(excluded, len(excluded) - len(take), sqnr, ask, target_db)
        if at_least is not None and ranked and round_ < max_rounds - 1:
            at_least([*excluded, ranked[0]])
        step *= 2
    return excluded, sqnr


def _fewest_that_pass(
    excluded: list[str], failed: int, sqnr: float, judge: Callable[[list[str]], float], target_db: float
) -> tuple[list[str], float]:
    """Bisect between ``failed`` layers out (under the target) and all of ``excluded`` (at it)."""
    passing, best = len(excluded), sqnr
    last_judged = passing
    while passing - failed > 1:
        middle = (failed + passing) // 2
        value = judge(excluded[:middle])
        last_judged = middle
        if value >= target_db:
            passing, best = middle, value
        else:
            failed = middle
    if last_judged != passing:
        best = judge(excluded[:passing])  # the caller keeps the last call's graph
    return excluded[:passing], best


def screened_exclusion(
    batches: int,
    calibration: int,
    search: Callable[[list[int]], tuple[list[str], float | None]],
    judge_all: Callable[[list[str]], tuple[float, int | None]],
    target_db: float,
) -> tuple[list[str], float | None, list[int]]:
    """``search(screen)`` (an ``exclude_costliest`` whose rounds judge only the batches ``screen`` indexes)
    on a screen of the ``batches`` judged ones: the first ``calibration`` (the calibration batches) and
    every ``SCREEN_EVERY``-th. The set it keeps is judged on every batch (``judge_all(excluded)``: the
    SQNR, and None where it holds, else the index of a batch under the target); a batch failing there
    joins the screen and the rounds run again. For writers whose judge is slow (the aoti package's runs
    the quantized program in PyTorch; OpenVINO's compiles each IR): a passing round runs every batch it
    is judged on. Returns the excluded layers, the last
    SQNR (None when there was none to exclude) and the batches it was judged on."""
    screen = [i for i in range(batches) if i < calibration or i % SCREEN_EVERY == 0]
    while True:
        excluded, last = search(screen)
        if last is None or last < target_db or len(screen) == batches:
            return excluded, last, screen
        value, failed = judge_all(excluded)
        if failed is None:
            return excluded, value, list(range(batches))
        screen = sorted({*screen, failed})
