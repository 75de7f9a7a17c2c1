"""int8 for the ``aoti`` format: PT2E quantization with torchao's X86 Inductor quantizer, compiled by AOTInductor.

The captured float32 program is annotated by ``X86InductorQuantizer`` (int8 weights per output
channel, uint8 activations per tensor, for every linear and convolution), calibrated on the same
batches as static ONNX int8, converted to quantize/dequantize pairs, captured again with the
artifact's dynamic dimensions and compiled with Inductor's freezing. Freezing is what makes it
fast: Inductor's x86 patterns (registered by torchao) fold each dequantize -> linear -> bias
(-> GELU, -> residual add) chain into one oneDNN ``qlinear_pointwise`` on weights packed once for
this CPU, so the package runs int8 products with float32 outputs and nothing dequantized at run time.

Why a second int8 path beside onnxruntime's static QDQ graph: both quantize the same linears and
leave the same few out of int8 for the SQNR floor, but the package runs those in bfloat16 and
everything else (attention, LayerNorm, GELU, residual adds) in Inductor's fused kernels, where the
ONNX graph runs them in float32 operators that take most of its time. The int8 products of both
run near the machine's int8 matrix-product peak (``torch._int_mm``).

Layers whose quantization costs the most signal are left out automatically: while the outputs'
SQNR (the quantized program run by PyTorch against the float32 one, on the calibration batches and
held-out batches at the shapes the export check uses) is below the floor plus a margin, the
costliest are excluded, a few more per round, by the search every int8 writer runs
(``tk.export.int8.search``; ``ProgramUnits`` is this format's adapter). A layer's cost is the program's
SQNR on the calibration batches with that layer alone in int8 (``one_at_a_time_sqnr_db``), a failing
round stops at its first batch under the target, and the rounds are judged on a screen (the calibration batches and every 4th held-out one; the set they keep is
then judged on every batch, and a batch under the target there joins the screen for another search). Where
the CPU's bfloat16 products outrun its float32 ones (``tk.formats.products.bf16_outruns_fp32``: measured,
since an AVX512-BF16 flag alone does not make them faster) the excluded modules run in bfloat16 (casts
around the linear; the weight cast is folded by freezing), which costs the signal little (bfloat16
keeps 8 bits of mantissa whatever the range, where per-tensor int8 loses its bits to an outlier) and
runs faster than float32 at the same SQNR; elsewhere they run in float32. Speed alone does not
decide it: on a batch where the program with every module in bfloat16 is itself under the target (a
model whose outputs bfloat16 already moves that much, such as a classifier whose synthetic inputs sit
near its decision boundary), no exclusion could reach the target, so the search starts again with the
float part in float32 (``float32_program``: the program without the bfloat16 attention) and the
manifest says why (``float_part``).
``--keep-fp32 MODULE`` keeps a module in float32. The package's numbers come from oneDNN's kernels,
not from the program the judge runs; the export check measures the package itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tk.errors import CannotWinError, ConversionError, UsageError, first_line
from tk.export.aoti.pt2e import (
    Quantizer,
    conv_weight_shapes,
    linear_weight_shapes,
    program_evaluator,
    quantizable_modules,
    unit_macs,
)
from tk.export.aoti.smoothing import SmoothingPlan, input_channel_maxima, plan_smoothing
from tk.export.context import Int8Share
from tk.export.int8.evaluator import Evaluator
from tk.export.int8.search import MARGIN_DB, RoundsPolicy, search_exclusions
from tk.formats.products import saturating_int8_products
from tk.spec import Dim, Signature

log = logging.getLogger("tk.export")

METHODS = ("histogram", "minmax")  # activation observers: torchao's x86 default (HistogramObserver), or MinMaxObserver
DEFAULT_METHOD = "histogram"
MAX_ROUNDS = 6  # exclusion rounds (1, 2, 4, ... layers more each) before the check reports the SQNR
# its judge runs each candidate program in PyTorch: the rounds judge a screen; the speed gate is asked before
# the costs and, with what the search kept, before the package is compiled
POLICY = RoundsPolicy(max_rounds=MAX_ROUNDS, screened=True, asks_before_ranking=True, asks_after_search=True)
# tried in turn when the program with every layer int8 is under the floor; the best one (or none) is kept:
# SmoothQuant's default and a stronger one, which suits encoders with larger outlier channels
SMOOTHING_ALPHAS = (0.5, 0.8)


def unavailable_reason(device: str) -> str | None:
    if device != "cpu":
        return "--precision int8 --format aoti is for the CPU (torchao's x86 Inductor quantizer); on a GPU use trt"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"--precision int8 --format aoti needs an x86-64 CPU (oneDNN's int8 kernels); this one is {platform.machine()}"
    if importlib.util.find_spec("torchao") is None:
        return "--precision int8 --format aoti uses torchao's PT2E quantizer: pip install 'tk[int8]'"
    return None


ACTIVATIONS_7BIT = "uint8 in 0-127 (this CPU has no VNNI/AMX: full-range products saturate)"


@dataclass
class AotiInt8Result:
    sqnr_db: float  # worst over outputs and judged batches, of the quantized program run by PyTorch
    excluded: list[str] = field(default_factory=list)  # modules not quantized (--keep-fp32 + automatic)
    automatic: list[str] = field(default_factory=list)  # the automatically excluded ones, costliest first
    excluded_dtype: str = "fp32"  # what excluded linears run in (bf16 where the CPU has it); convolutions stay fp32
    layer_sqnr_db: dict[str, float] = field(default_factory=dict)  # module -> SQNR with it alone in int8
    quantizable: int = 0  # linear/conv modules in the program
    int8_modules: int = 0  # of those, the ones that run in int8
    int8_linear_shapes: list[list[int]] = field(default_factory=list)  # [in, out, count] of its int8 linears
    int8_conv_shapes: list[list[int]] = field(default_factory=list)  # [*conv_weight_key, count] of its int8 convs
    method: str = DEFAULT_METHOD
    # a try ("none": as captured; "0.8", "0.8 not after a unary": SmoothingPlan.name) -> all-int8 SQNR, the
    # worst over every judged batch
    smoothing: dict[str, float] = field(default_factory=dict)
    smoothing_alpha: float | None = None  # the one kept
    smoothing_after_unary: bool = True  # whether the kept smoothing divides the inputs a GELU or ReLU gives
    float_part: str | None = None  # why the float part runs in float32 where bf16 outruns it (None: it does not)
    # where the search's time went, by phase (``_phase``): the bf16 check, the all-int8 tries, the gate, the
    # costs, the exclusion rounds, and a search started again in float32 (its first attempt's time). Keys:
    # bf16_check, all_int8, gate, costs, rounds, bf16_attempt
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": "static",
            "quantizer": "torchao X86InductorQuantizer (PT2E)",
            "method": self.method,
            "per_channel": True,
            "sqnr_db_export": round(self.sqnr_db, 2),
            "quantizable_modules": self.quantizable,
            "int8_modules": self.int8_modules,
            "int8_linear_shapes": self.int8_linear_shapes,
            "int8_conv_shapes": self.int8_conv_shapes,
            "excluded": self.excluded,
            "automatic_exclusions": self.automatic,
            "automatic_exclusions_run_in": self.excluded_dtype,
            "excluded_convolutions_run_in": "fp32",  # run_linears_in_bf16: the linears only
            **({"float_part": self.float_part} if self.float_part else {}),
            "activations": ACTIVATIONS_7BIT if saturating_int8_products() else "uint8",
            "smoothing": {
                "alpha": self.smoothing_alpha,
                **({} if self.smoothing_after_unary else {"after_unary": False}),
                "all_int8_sqnr_db": {a: round(v, 2) for a, v in self.smoothing.items()},
            },
            "seconds": {phase: round(s, 2) for phase, s in self.seconds.items()},
        }


@contextlib.contextmanager
def _phase(result: AotiInt8Result, name: str) -> Iterator[None]:
    """Add the block's wall time to ``result.seconds[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        result.seconds[name] = result.seconds.get(name, 0.0) + time.perf_counter() - start


def excluded_run_in_bf16() -> bool:
    """Whether the modules left out of int8 (and attention) run in bfloat16 rather than float32: where
    this CPU's bfloat16 products outrun its float32 ones (measured once a process)."""
    from tk.formats.products import bf16_outruns_fp32

    return bf16_outruns_fp32()


@dataclass
class ProgramUnits:
    """The search's adapter for a PT2E program: its units are the quantizable modules not kept in float32; a
    candidate is the program quantized without some (in bfloat16 where ``excluded_in_bf16``)."""

    quantizer: Quantizer
    units: list[str]
    args: tuple[torch.Tensor, ...] = ()  # the first calibration batch: what the multiply-adds are counted on
    noun: str = "modules"

    @property
    def excluded_dtype(self) -> str:
        return "bf16" if self.quantizer.excluded_in_bf16 else "fp32"

    def without(self, excluded: Sequence[str]) -> torch.fx.GraphModule:
        return self.quantizer.quantize(exclude=excluded)

    def only(self, unit: str) -> torch.fx.GraphModule:
        return self.quantizer.quantize(only=[unit])

    def unit_macs(self) -> dict[str, int]:
        return unit_macs(self.quantizer.float_module, self.args)


class _Bf16BelowTarget(Exception):
    """The program with every module in bfloat16 is under the search's target on a judged batch."""

    def __init__(self, sqnr_db: float, shape: tuple[int, ...], target_db: float) -> None:
        super().__init__(f"every module in bf16: {sqnr_db:.1f} dB at {'x'.join(map(str, shape))}")
        self.sqnr_db, self.shape, self.target_db = sqnr_db, shape, target_db


def int8_program(
    program: torch.export.ExportedProgram,
    signature: Signature,
    dims: dict[str, Dim],
    example_inputs: tuple[torch.Tensor, ...],
    calibration: Sequence[dict[str, np.ndarray]],
    *,
    method: str = DEFAULT_METHOD,
    keep_fp32: Sequence[str] = (),
    min_sqnr_db: float | None = None,
    judge: Sequence[dict[str, np.ndarray]] = (),
    excluded_in_bf16: bool | None = None,
    float32_program: torch.export.ExportedProgram | None = None,
    gate: Callable[[Any], None] | None = None,
    share_gate: Callable[[Int8Share], None] | None = None,
) -> tuple[torch.export.ExportedProgram, AotiInt8Result]:
    """``program`` (float32, CPU) quantized to int8 and captured again with the ranges of ``dims``.

    With ``min_sqnr_db``, modules are excluded automatically (costliest first: ``one_at_a_time_sqnr_db``
    on the calibration batches) until the SQNR on the calibration and
    ``judge`` batches reaches ``min_sqnr_db + MARGIN_DB``; ``keep_fp32`` modules are never quantized and stay float32. The
    automatically excluded linears run in bfloat16 where ``excluded_in_bf16`` (default:
    ``excluded_run_in_bf16()``), in float32 elsewhere; where every module in bfloat16 is itself under that
    target on a judged batch, the search starts again from ``float32_program`` (default ``program``: the
    caller's program without its bfloat16 passes) with them in float32. ``gate`` is asked before the search, with a
    function that captures the all-int8 program (the writer's wrapper of ``int8_gate`` compiles it), and
    ``share_gate`` during it (after each round under the target, with the most it can still keep) and
    after it, with the ``Int8Share`` it kept; either may end the export.
    """
    if method not in METHODS:
        raise UsageError(
            f"--calibration-method: int8 aoti packages calibrate with {' or '.join(METHODS)}, got {method!r}"
        )
    if not calibration:
        raise UsageError("--calibrate: expected at least one calibration sample, got none")
    in_bf16 = excluded_run_in_bf16() if excluded_in_bf16 is None else excluded_in_bf16
    settings = (signature, dims, example_inputs, calibration, method, keep_fp32, min_sqnr_db, judge, gate, share_gate)
    started = time.perf_counter()
    try:
        return _int8_program_once(program, in_bf16, *settings)
    except _Bf16BelowTarget as short:
        first_attempt = time.perf_counter() - started
        reason = f"{short}, under the target {short.target_db:.1f} dB"
        log.info("export int8   left-out modules and attention in float32: %s", reason)
        quantized, result = _int8_program_once(
            program if float32_program is None else float32_program, False, *settings
        )
        result.float_part = f"float32 where bf16 outruns it: {reason}"
        result.seconds = {"bf16_attempt": first_attempt, **result.seconds}
        return quantized, result


def _int8_program_once(
    program: torch.export.ExportedProgram,
    in_bf16: bool,
    signature: Signature,
    dims: dict[str, Dim],
    example_inputs: tuple[torch.Tensor, ...],
    calibration: Sequence[dict[str, np.ndarray]],
    method: str,
    keep_fp32: Sequence[str],
    min_sqnr_db: float | None,
    judge: Sequence[dict[str, np.ndarray]],
    gate: Callable[[Any], None] | None,
    share_gate: Callable[[Int8Share], None] | None,
) -> tuple[torch.export.ExportedProgram, AotiInt8Result]:
    names = [s.name for s in signature.inputs]

    def as_args(feeds: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names)

    def recaptured(module: torch.fx.GraphModule) -> torch.export.ExportedProgram:
        from tk.export.capture import exported_program_from_module

        return exported_program_from_module(module, example_inputs, signature, dims)

    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            batches = [as_args(f) for f in calibration]
            # keep_fp32: any module path; the quantizer leaves out every linear inside it
            quantizer = Quantizer(program, batches, method, list(keep_fp32), in_bf16)
            evaluator = program_evaluator(quantizer.float_module, [*batches, *(as_args(f) for f in judge)])
            candidates = quantizable_modules(quantizer.float_module)
            kept = quantizer.keep_fp32
            ranked = [n for n in candidates if not any(n == k or n.startswith(k + ".") for k in kept)]
            units = ProgramUnits(quantizer, ranked, batches[0])
            result = AotiInt8Result(-math.inf, list(kept), quantizable=len(candidates), method=method)
            result.excluded_dtype = units.excluded_dtype
            quantized = _searched(units, evaluator, result, min_sqnr_db, gate, share_gate, recaptured)
            return recaptured(quantized), result
    except (UsageError, ConversionError, CannotWinError, _Bf16BelowTarget):
        raise
    except Exception as exc:  # torchao and torch.export raise many types; each is a conversion failure
        raise ConversionError(f"torchao could not quantize the program to int8: {first_line(exc)}") from exc


def _searched(
    units: ProgramUnits,
    evaluator: Evaluator,
    result: AotiInt8Result,
    min_sqnr_db: float | None,
    gate: Callable[[Any], None] | None,
    share_gate: Callable[[Int8Share], None] | None,
    recaptured: Callable[[torch.fx.GraphModule], torch.export.ExportedProgram],
) -> torch.fx.GraphModule:
    """The program all-int8 (``_all_int8``) and, under the floor plus the margin, without the modules the
    int8 search leaves out (``result`` is filled in). ``gate`` is asked before the search with a function
    that captures the all-int8 program; ``share_gate`` by the search (``tk.export.int8.search``)."""
    quantizer, calibrated = units.quantizer, len(units.quantizer.calibration)
    target = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
    if quantizer.excluded_in_bf16 and target is not None:
        # before any int8 try: on a model bf16 already moves past the target, each would be wasted
        # (the small Transformer's smoothing tries, gate and costs: ~70 s of its export)
        with _phase(result, "bf16_check"):
            every_bf16 = quantizer.quantize(exclude=units.units)
            _require_bf16_reaches(every_bf16, evaluator.subset(range(calibrated)), target)
    with _phase(result, "all_int8"):
        quantized = _all_int8(quantizer, evaluator, min_sqnr_db, result)
    if min_sqnr_db is not None and target is not None and result.sqnr_db < target:
        if gate is not None:
            with _phase(result, "gate"):
                gate(lambda: recaptured(quantized))
        found = search_exclusions(
            units, evaluator, min_sqnr_db, calibrated, POLICY, share_gate=share_gate,
            held_to=_bf16_held_to(units, evaluator, target), phase=functools.partial(_phase, result),
        )  # fmt: skip
        result.layer_sqnr_db, result.automatic = found.costs, found.excluded
        if found.model is not None and found.sqnr_db is not None:
            quantized, result.sqnr_db = found.model, found.sqnr_db
    result.excluded = [*quantizer.keep_fp32, *result.automatic]
    result.int8_modules = len(units.units) - len(result.automatic)
    int8 = [n for n in units.units if n not in result.automatic]
    result.int8_linear_shapes = linear_weight_shapes(quantizer.float_module, int8)
    result.int8_conv_shapes = conv_weight_shapes(quantizer.float_module, int8)
    return quantized


def _bf16_held_to(units: ProgramUnits, evaluator: Evaluator, target: float) -> Callable[[int], float] | None:
    """Where left-out modules run in bfloat16: the lower target a batch under the target is held to, the
    target itself once the program with every module in bfloat16 is seen to reach it there. Where that
    stays under the target (a model whose outputs bfloat16 already moves that much), no exclusion can
    reach it, and ``_Bf16BelowTarget`` ends the search (``int8_program`` runs it again with the float part
    in float32). Only the batches some round is under are judged so (judging every batch first took
    ~15 s of the small Transformer's export)."""
    if not units.quantizer.excluded_in_bf16 or not units.units:
        return None
    every_bf16: list[torch.fx.GraphModule] = []

    def bf16_reaches(index: int) -> float:
        if not every_bf16:
            every_bf16.append(units.quantizer.quantize(exclude=units.units))
        _require_bf16_reaches(every_bf16[0], evaluator.subset([index]), target)
        return target

    return functools.cache(bf16_reaches)


def _require_bf16_reaches(every_bf16: torch.fx.GraphModule, judge: Evaluator, target: float) -> None:
    """Raise ``_Bf16BelowTarget`` where ``every_bf16`` (the program with every module in bfloat16) is under
    ``target`` on a batch of ``judge``."""
    for index in judge.indices:
        sqnr = judge.sqnr_on(every_bf16, index)
        if sqnr < target:
            raise _Bf16BelowTarget(sqnr, tuple(judge.all_batches[index][0].shape), target)


def _all_int8(
    quantizer: Quantizer, judged: Evaluator, min_sqnr_db: float | None, result: AotiInt8Result
) -> torch.fx.GraphModule:
    """Every module int8: as captured, then (while under the floor plus the margin) smoothed with each of
    ``SMOOTHING_ALPHAS``, first with a GELU's or ReLU's outputs left as captured (their ``mul`` would stop
    torchao's linear + unary + quantize fusion: ``tk.export.aoti.smoothing``), then every input; each judged
    on every batch, the first to reach the target is kept, else the best (``result`` is filled in)."""
    best: torch.fx.GraphModule | None = None
    target = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
    best_score, passed, kept_plan = -math.inf, False, None
    for plan in _smoothing_tries(quantizer):
        quantizer.smoothing = plan
        quantized = quantizer.quantize()
        # judged on every batch, and compared by the worst: not by the calibration batches alone, where the
        # ranges were fitted. MiniLM's package (cosine 0.99 on texts) built on the try best there read 0.990
        # on an unseen short sentence, built on the one best on every batch 0.997 (benchmarks/history.md)
        score = judged.sqnr_db(quantized)
        kept = target is None or score >= target
        result.smoothing["none" if plan is None else plan.name] = score
        smoothed = f"smoothed (alpha {plan.name})" if plan is not None else "as captured"
        log.info("export int8   SQNR %.1f dB on %d batches, %s", score, len(judged.batches), smoothed)
        if best is None or kept or score > best_score:
            best, best_score, passed, kept_plan = quantized, score, kept, plan
            result.sqnr_db = judged.worst_sqnr_db  # under the target where it is not kept
        if target is None or passed:
            break
    result.smoothing_alpha = None if kept_plan is None else kept_plan.alpha
    result.smoothing_after_unary = kept_plan is None or kept_plan.after_unary
    quantizer.smoothing = kept_plan  # the exclusion rounds quantize the kept program
    assert best is not None
    return best


def _smoothing_tries(quantizer: Quantizer) -> Iterator[SmoothingPlan | None]:
    """None (as captured), then each alpha's plan without the inputs a unary gives, then with them (where
    the model has such inputs); planned when reached, from one pass over the calibration batches."""
    yield None
    module, batches = quantizer.float_module, quantizer.calibration
    maxima = input_channel_maxima(module, batches)
    leaving: dict[float, int] = {}
    for alpha in SMOOTHING_ALPHAS:
        plan = plan_smoothing(module, batches, alpha, after_unary=False, maxima=maxima)
        leaving[alpha] = len(plan.inputs)
        yield plan
    for alpha in SMOOTHING_ALPHAS:
        plan = plan_smoothing(module, batches, alpha, maxima=maxima)
        if len(plan.inputs) > leaving[alpha]:
            yield plan
