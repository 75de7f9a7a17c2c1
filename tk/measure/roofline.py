"""Peaks that mean something: the matrix-product rate at the model's own linear shapes, per precision,
measured in the same rounds as the model's calls, reported as a median with its spread.

A CPU's rate depends on the shape (narrow products with few rows run far below wide ones) and,
on a shared machine, on the minute (reduced-precision rates swing by a factor of two or more with
nothing else running; see benchmarks/), so one best-of-a-few product at a fixed shape makes a
share of "peak" meaningless. Here:

- ``linear_shapes`` records the linear products of one call (``tk.measure.floor.model_products``) for the
  M x K x N of each at the benchmark's shape (M = every leading dimension: batch x seq);
- ``ShapePeak`` runs each distinct shape once per call, the way the packages run them
  (``tk.formats.products.packed_linear``: oneDNN's packed linear, what Inductor's freezing emits
  for fp32, bf16 and fp16, and for int8 oneDNN's quantized linear, fp32 out, what PT2E/x86 int8
  packages run; not ``torch._int_mm``). One call gives one rate sample: the shapes' FLOPs
  (each weighted by how often the model calls it) over their time;
- the samples are taken between the model's calls (``tk.measure.timing.interleave``'s
  ``between``), and the rate an artifact is judged against is their median (with quartiles and
  range beside it).

The model's work is counted by ``torch.utils.flop_counter.FlopCounterMode`` on the eager model
at batch 1 and scaled by the batch size (exact for models whose samples are independent, which
the export check's batch-invariance probe verifies). An artifact's share of peak is its FLOPs /
its p50 time over the median rate of its precision at its batch size.

Beside it, the model's floor (``tk.measure.floor``): its linear, convolution and attention products timed
alone at their shapes in the artifact's precision, sampled in the same rounds (for a model without an
linear product too, which has no peak); an artifact's share of the floor
is the floor's median over its p50. An int8 artifact that runs some linears in another precision
(``LinearSplit``) is judged against the floor and the rate of that mix (its linear FLOPs over their
time at each precision's median rate), which need that precision's samples too (``Roofline(...,
precisions)`` must name it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tk.formats.products import PRECISION_DTYPES, packed_linear
from tk.measure.floor import (
    LinearSplit,
    ModelFloor,
    Product,
    at_real_tokens,
    attention_unfused,
    mixed_floor_seconds,
    model_products,
    products_seconds,
)
from tk.measure.hardware import cpu_precision_reason
from tk.measure.timing import Spread

# Below this many FLOPs a call, a product's time is its call overhead, not a rate: the tiny Transformer's
# linears (32 wide) "ran" at 0-52 GFLOP/s and its packages at 44x that "peak"
MIN_PEAK_GFLOP = 0.05
FLOOR_COVERS = 0.8  # of the model's FLOPs: below, its products alone are no floor (3-D convolutions)
# of the model's FLOPs its linears must do for a share of their rate to describe it: a wav2vec2 whose
# convolutions did 92% read 215% of peak (its FLOPs over the linears' rate); its floor, convolutions timed, has one
PEAK_COVERS = 0.5


@dataclass(frozen=True)
class LinearShape:
    m: int  # rows: every leading dimension of the input (batch x seq for a Transformer)
    k: int  # in_features
    n: int  # out_features
    count: int = 1  # how many of the model's linears have this shape

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n * self.count

    def at_batch(self, batch: int) -> LinearShape:
        return LinearShape(self.m * batch, self.k, self.n, self.count)


def linear_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> list[LinearShape]:
    """The M x K x N of every linear product that one call of ``module(*args, **kwargs)`` runs, by shape
    (``tk.measure.floor.model_products``' linears)."""
    return _linears(model_products(lambda: module(*args, **(kwargs or {}))))


def _linears(products: list[Product]) -> list[LinearShape]:
    return [LinearShape(p.m, p.k, p.n, p.count) for p in products if p.kind == "linear"]


def peak_unavailable_reason(precision: str) -> str | None:
    """Why this machine cannot measure ``precision``'s rate the packages' way, or None."""
    if precision == "int8":
        if not hasattr(torch.ops.onednn, "qlinear_pointwise") or not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN quantized linear (onednn.qlinear_pointwise)"
        return None
    if precision == "bf16":
        return cpu_precision_reason("bf16")
    if precision not in PRECISION_DTYPES:
        return f"no matrix-product peak for precision {precision!r}"
    return None


class ShapePeak:
    """The matrix-product rate of ``precision`` at ``shapes``: each call runs every shape once and
    keeps one sample, in GFLOP/s (GOP/s for int8). Made once (operands packed, one warm-up call)."""

    def __init__(self, precision: str, shapes: list[LinearShape], seed: int = 0) -> None:
        reason = peak_unavailable_reason(precision)
        if reason is not None:
            raise ValueError(reason)
        if not shapes:
            raise ValueError("ShapePeak: expected at least one linear shape")
        gen = torch.Generator().manual_seed(seed)
        self.precision, self.shapes = precision, shapes
        self.flops = sum(s.flops for s in shapes)
        self._products = [(s, packed_linear(precision, s.m, s.k, s.n, gen)) for s in shapes]
        self.samples: list[float] = []
        with torch.inference_mode():
            for _, product in self._products:
                product()

    def __call__(self) -> None:
        with torch.inference_mode():
            seconds = products_seconds([(shape.count, product) for shape, product in self._products])
        self.samples.append(self.flops / seconds / 1e9)

    def release(self) -> None:
        """Free the operands; the samples stay."""
        self._products = []

    def spread(self) -> Spread:
        return Spread.of(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "shapes_mknc": [[s.m, s.k, s.n, s.count] for s in self.shapes],
            "gflops": self.spread().to_json(),
        }


def model_flops(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    """Floating-point operations of one forward of ``module`` on ``args`` (FlopCounterMode's count)."""
    from torch.utils.flop_counter import FlopCounterMode

    # torch's counter has formulas for the CUDA attention kernels only: scaled_dot_product_attention on the
    # CPU (its flash kernel) counted 0 FLOPs, a BERT's attention missing from its work
    cpu_attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    counter = FlopCounterMode(display=False, custom_mapping=cpu_attention)
    # no_grad, not inference_mode: the counter's module tracker reads each module input's grad_fn, and under
    # inference_mode a parametrized weight (wav2vec2's weight-normed positional convolution) has none, which
    # surfaced as "'ParametrizedConv1d' object has no attribute 'weight'" and stopped tk optimize
    with torch.no_grad(), attention_unfused(), counter:
        module(*args)
    return int(counter.get_total_flops())


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any) -> int:
    """FlopCounterMode's formula for an attention kernel, given its operands' shapes."""
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def engine_precision(engine: str, artifact_precision: str) -> str:
    """The precision an engine's matrix products run in: eager is the float32 reference; compile
    follows a bf16/fp16 artifact (its autocast), and the artifact's own engines its precision."""
    if engine == "eager":
        return "fp32"
    if engine == "compile":
        return artifact_precision if artifact_precision in ("bf16", "fp16") else "fp32"
    return artifact_precision


def mask_input(specs: Iterable[Any]) -> str | None:
    """The name of the one input of ``specs`` (``TensorSpec``) that is an attention mask, or None."""
    masks = [s.name for s in specs if s.kind == "mask"]
    return masks[0] if len(masks) == 1 else None


class Roofline:
    """A model's FLOPs and linear shapes on ``example`` args, and a ``ShapePeak`` and a ``ModelFloor`` per
    precision and batch factor whose calls a timing loop runs between the model's (``between``); no floor
    where the model's linear, convolution and attention products are under ``FLOOR_COVERS`` of its FLOPs
    (``floor_skipped``), no peak where it runs no linear product.

    ``tk bench --roofline`` counts at batch 1 and asks ``between(batch_size)``; a script that
    counts at its own batch asks ``between(1)``. A precision this machine cannot measure the
    packages' way is listed in ``skipped`` with the reason.
    """

    def __init__(
        self, module: nn.Module, example: tuple[Any, ...], precisions: Iterable[str], mask_input: str | None = None
    ) -> None:
        self.mask_input = mask_input  # the feed whose mask says which tokens are real (the floor's work)
        self.flops = model_flops(module, example)
        self.products = model_products(lambda: module(*example))
        self.shapes = _linears(self.products)
        # of the model's FLOPs, its linears' (the share their rate describes)
        self.linear_share = min(1.0, sum(s.flops for s in self.shapes) / self.flops) if self.flops else 0.0
        covered = sum(p.flops for p in self.products)
        self.floor_skipped = None if self.products and covered >= FLOOR_COVERS * self.flops else (
            f"its linear, 1-D and 2-D convolution and attention products are {covered / max(self.flops, 1):.0%} of its "
            "FLOPs (other work is not timed as a floor)"
        )  # fmt: skip
        wanted = sorted(set(precisions))
        self.skipped = {p: why for p in wanted if (why := peak_unavailable_reason(p))}
        self.floor_precisions = [p for p in wanted if p not in self.skipped]
        if not self.shapes:
            self.skipped |= {p: "the model runs no linear product" for p in wanted}
        self.precisions = [p for p in wanted if p not in self.skipped]  # the peaks
        self.peaks: dict[tuple[str, int], ShapePeak] = {}
        self.floors: dict[tuple[str, int], ModelFloor] = {}

    def between(
        self, batch: int = 1, floors: bool = True, feeds: Mapping[str, Any] | None = None
    ) -> list[ShapePeak | ModelFloor]:
        """One ``ShapePeak`` (and with ``floors`` one ``ModelFloor``) per precision at the shapes scaled to
        ``batch``; earlier operands are freed. With the timed ``feeds`` the floor is their real tokens' work
        (``at_real_tokens`` on ``mask_input``'s mask): a package that removes the padding runs under the
        padded products' time."""
        for measured in [*self.peaks.values(), *self.floors.values()]:
            measured.release()
        made = [ShapePeak(p, [s.at_batch(batch) for s in self.shapes]) for p in self.precisions]
        floors = floors and self.floor_skipped is None
        products = [q.at_batch(batch) for q in self.products]
        if feeds is not None and self.mask_input in feeds:
            products = at_real_tokens(products, torch.as_tensor(feeds[self.mask_input]))
        timed = [ModelFloor(p, products) for p in self.floor_precisions] if floors else []
        self.peaks |= {(p.precision, batch): p for p in made}
        self.floors |= {(f.precision, batch): f for f in timed}
        return [*made, *timed]

    def median(self, precision: str, batch: int = 1) -> float | None:
        """The median rate sampled for ``precision`` at ``batch``, or None where none was."""
        peak = self.peaks.get((precision, batch))
        return peak.spread().median if peak is not None and peak.samples else None

    def mixed_median(self, split: LinearSplit, batch: int = 1) -> float | None:
        """The rate of an int8 artifact that runs ``split``'s linears in int8 and the others in its fallback
        precision: the linear FLOPs over their time at the two precisions' median rates, or None where a rate
        was not sampled or the split is not recorded."""
        r8, rf = self.median("int8", batch), self.median(split.fallback, batch)
        if not split.priced or r8 is None or rf is None:
            return None
        counts = split.int8_counts([(shape.k, shape.n, shape.count) for shape in self.shapes])
        in_int8 = sum(n8 * (shape.flops // shape.count) for shape, n8 in zip(self.shapes, counts, strict=True))
        total = sum(shape.flops for shape in self.shapes)
        return total / (in_int8 / r8 + (total - in_int8) / rf) if total else None

    def floor_median(self, precision: str, batch: int = 1, split: LinearSplit | None = None) -> float | None:
        """The median floor in seconds of an engine running ``precision`` (int8 with ``split``: that mix of
        int8 and its fallback precision) at ``batch``, or None where it was not sampled or cannot be priced."""
        floor = self.floors.get((precision, batch))
        if floor is None or not floor.samples:
            return None
        if split is None or precision != "int8":
            return floor.spread().median
        if split.every_linear and (split.convs == "int8" or not any(p.kind == "conv" for p in floor.products)):
            return floor.spread().median  # every product in int8: the int8 floor as it is
        if not split.priced:
            return None
        sampled = {p: f.product_samples for (p, b), f in self.floors.items() if b == batch and f.samples}
        try:
            samples = mixed_floor_seconds(floor.products, sampled, split)
        except ValueError:  # a precision it runs layers in was not sampled
            return None
        return Spread.of(samples).median

    def fill(
        self,
        report: Any,
        precision_of: Callable[[str], str],
        split_of: Callable[[str], LinearSplit | None] | None = None,
    ) -> dict[str, Any]:
        """Fill each row's ``gflops`` and ``peak_share`` (``precision_of(row.engine)``'s median at
        its batch size) and ``floor_share`` (with ``split_of(row.engine)``, the rate and the floor of an int8
        engine's own mix of precisions); the roofline settings for the JSON. No share where the products at a batch
        size are too small to have a rate (``MIN_PEAK_GFLOP``): their time is the calls' overhead (a CNN's
        linear head alone has no peak share; its floor, the convolutions too, has a share); none at all where the
        linears do under ``PEAK_COVERS`` of the model's FLOPs."""
        small: set[int] = set()
        splits: dict[str, dict[str, Any]] = {}
        for row in report.rows:
            rate = self.flops * row.batch_size / (row.p50_ms / 1e3) / 1e9
            row.gflops = float(f"{rate:.4g}")  # 4 significant digits: tiny models run at a fraction of a GFLOP/s
            peak = self.peaks.get((precision_of(row.engine), row.batch_size))
            split = split_of(row.engine) if split_of is not None else None
            if self.linear_share < PEAK_COVERS:
                median = None
            elif peak is not None and peak.flops < MIN_PEAK_GFLOP * 1e9:
                small.add(row.batch_size)
                median = None
            elif split is not None and precision_of(row.engine) == "int8":
                median = self.mixed_median(split, row.batch_size)
            else:
                median = self.median(precision_of(row.engine), row.batch_size)
            if median is not None:
                row.peak_share = float(f"{rate / median:.4g}")
            floor = self.floors.get((precision_of(row.engine), row.batch_size))
            if floor is None or sum(p.flops for p in floor.products) < MIN_PEAK_GFLOP * 1e9:
                continue
            floor_s = self.floor_median(precision_of(row.engine), row.batch_size, split)
            if split is not None:
                splits[row.engine] = split.to_json() | {"floor_s": floor_s}
            if floor_s is not None and row.p50_ms > 0:
                row.floor_share = float(f"{floor_s / (row.p50_ms / 1e3):.4g}")
        settings = {"flops_per_sample": self.flops} | self.to_json() | ({"floor_splits": splits} if splits else {})
        if self.linear_share < PEAK_COVERS:
            settings["no_share"] = (
                f"any batch: the model's linear products are {self.linear_share:.0%} of its FLOPs, so their rate does not "
                "describe it (its floor times its convolutions too)"
            )
        elif small:
            settings["no_share"] = (
                f"batch {', '.join(map(str, sorted(small)))}: the model's linear products are under "
                f"{MIN_PEAK_GFLOP:g} GFLOP a call, too small to have a rate (their time is the calls' overhead)"
            )
        return settings

    def to_json(self) -> dict[str, Any]:
        peaks: dict[str, dict[str, Any]] = {}
        for (precision, batch), peak in self.peaks.items():
            if peak.samples:
                peaks.setdefault(precision, {})[str(batch)] = peak.to_json()
        floors: dict[str, dict[str, Any]] = {}
        for (precision, batch), floor in self.floors.items():
            if floor.samples:
                floors.setdefault(precision, {})[str(batch)] = floor.to_json()
        return {"peaks": peaks, "floors": floors, "floor_skipped": self.floor_skipped, "skipped": self.skipped,
                "torch_threads": torch.get_num_threads()}  # fmt: skip
