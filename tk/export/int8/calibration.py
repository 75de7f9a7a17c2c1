"""Static int8's inputs: the calibration batches, and the held-out batches that judge a quantized graph.

Shared by the int8 writers: onnxruntime's static QDQ graph (``tk.export.onnx.static_int8``), the
PT2E-quantized AOTInductor package (``tk.export.aoti.int8``) and NNCF's OpenVINO IR (``tk.export.openvino.writer``);
the search that judges their graphs on these batches is ``tk.export.int8.search``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from tk.errors import UsageError
from tk.export.context import ExportContext
from tk.spec import batch_dim, count_nonfinite, fitted_samples, random_feeds, shapes_to_check

CALIBRATION_BATCH = 8  # samples per calibration run
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


def calibration_feeds(ctx: ExportContext, *, one_shape: bool = False) -> list[dict[str, np.ndarray]]:
    """Static int8 calibration batches: ``options.calibration_data`` split into batches (less the samples
    held aside for the search's judge: ``split_calibration_samples``), else ``random:N``.

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
        fitted, _ = split_calibration_samples(ctx)
        batches = calibration_batches(fitted, batch=per_batch)
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


def split_calibration_samples(ctx: ExportContext) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """The user's calibration samples as (the samples the ranges are fitted to, the samples the search
    judges): every other sample is held aside for the judge where the check runs the user's samples too
    (``options.check_data``) and the rest still fill a batch; else all calibrate and none are held aside.

    Ranges fitted to the very samples judged read high on them: the small Transformer's int8 package
    cleared a search judged on its calibration samples and failed its check on the held-out half
    (benchmarks/history.md, 2026-12-06)."""
    samples = dict(ctx.options.calibration_data or {})
    count = int(next(iter(samples.values())).shape[0]) if samples else 0
    batch = batch_dim(ctx.spec.signature.inputs)
    smallest = ctx.dims[batch].min if batch in ctx.dims else 1
    if ctx.options.check_data is None or count < 2 or -(-count // 2) < smallest:
        return samples, None
    fitted = {k: np.ascontiguousarray(v[0::2]) for k, v in samples.items()}
    return fitted, {k: np.ascontiguousarray(v[1::2]) for k, v in samples.items()}


def judge_feeds(ctx: ExportContext) -> list[dict[str, np.ndarray]]:
    """Batches at the shapes the export check uses (all min, all opt, an odd size of each, each at its
    max), a few seeds each, to judge the int8 graph's SQNR: the user's samples fitted to each shape
    where they fit (as many batches as they fill, up to ``JUDGE_SEEDS``), else random inputs.

    The samples: where the check runs the user's (``options.check_data``), the calibration samples held
    aside for the judge when the calibration samples are the user's too (``split_calibration_samples``), so
    that the check (``tk optimize --data``'s held-out half) judges samples the search never saw and the
    search judges samples the ranges were not fitted to; else the check's own."""
    inputs, samples = ctx.spec.signature.inputs, ctx.options.check_data
    if samples is not None and ctx.options.calibration_data is not None:
        fitted, aside = split_calibration_samples(ctx)
        samples = aside if aside is not None else fitted
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
