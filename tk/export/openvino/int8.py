"""int8 for the ``openvino`` format: ``nncf.quantize`` of the float32 IR, and the adapter through which the
int8 search (``tk.export.int8.search``) leaves units of it float32.

``nncf.quantize`` (``ModelType.TRANSFORMER`` for models with attention, which keeps attention's softmax
inputs float and adds SmoothQuant) is calibrated on tk's calibration batches, then judged, as the other
int8 writers are, by the SQNR of its outputs against the float32 IR on the calibration and held-out
batches. For a transformer under the floor plus ``MARGIN_DB``, SmoothQuant is tried off too and the better
kept; then the costliest units (``quantized_units``: the weight products, the embedding tables NNCF stored
in int8 and the attention products whose inputs it quantized; ranked by the graph's SQNR with only that
unit int8) are left float32 through NNCF's ``IgnoredScope``, a few more per round (``NncfUnits``). On a CPU
with bfloat16 products what stays float then runs in bf16 where the IR still holds the target so (OpenVINO's
precision hint), else in float32.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tk.errors import ConversionError, UsageError, first_line
from tk.export.context import Int8Share
from tk.export.int8.evaluator import Evaluator, FeedsRunner
from tk.export.int8.search import MARGIN_DB, RoundsPolicy, search_exclusions
from tk.formats.products import conv_weight_key, weight_rows

log = logging.getLogger("tk.export")

MAX_ROUNDS = 8  # int8 exclusion rounds before giving up (the check then reports the SQNR)
# each candidate is an nncf.quantize and a compile: the rounds judge a screen; the speed gate is asked
# after each round under the target only (the costs are a compile per unit, not a quantize)
POLICY = RoundsPolicy(max_rounds=MAX_ROUNDS, screened=True, asks_before_ranking=False)


WEIGHT_PRODUCTS = ("MatMul", "Convolution", "GroupConvolution")  # ops NNCF quantizes with their constant weight
SHAPE_OPS = ("Convert", "Transpose", "Reshape", "Squeeze", "Unsqueeze")


def weight_products(model: Any) -> list[str]:
    """Friendly names of the MatMuls and convolutions whose second input is a constant (a weight, possibly
    through a Convert)."""
    return [op.get_friendly_name() for op in model.get_ordered_ops() if _weight_constant(op) is not None]


def weight_shapes(model: Any, names: Sequence[str]) -> list[list[int]]:
    """``[in_features, out_features, count]`` of the weights of the products ``names`` of ``model`` (rank 2
    only), by shape: the manifest's record of what an int8 IR runs in int8 (``tk.measure.floor.LinearSplit``)."""
    wanted = set(names)
    keys = []
    for op in model.get_ordered_ops():
        if op.get_friendly_name() not in wanted or op.get_type_name() != "MatMul":
            continue
        shape = op.get_input_partial_shape(1)
        if not shape.is_static or len(shape) != 2:
            continue
        rows, cols = (int(d) for d in shape.to_shape())
        keys.append((cols, rows) if op.get_attributes().get("transpose_b") else (rows, cols))
    return weight_rows(keys)


def conv_shapes(model: Any, names: Sequence[str]) -> list[list[int]]:
    """``[*conv_weight_key, count]`` of the 1-D and 2-D (group) convolutions ``names`` of ``model``: the
    manifest's record of the convolutions an int8 IR runs in int8 (``tk.measure.floor.LinearSplit``)."""
    wanted = set(names)
    keys = []
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        shape = op.get_input_partial_shape(1) if kind in ("Convolution", "GroupConvolution") else None
        if op.get_friendly_name() not in wanted or shape is None or not shape.is_static:
            continue
        dims = [int(d) for d in shape.to_shape()]
        if kind == "GroupConvolution":  # [groups, out per group, in per group, *kernel]
            keys.append(conv_weight_key(dims[0] * dims[1], dims[2], dims[3:], dims[0]))
        else:  # [out, in, *kernel]
            keys.append(conv_weight_key(dims[0], dims[1], dims[2:], 1))
    return weight_rows(key for key in keys if key is not None)


def quantized_units(quantized: Any, model: Any) -> list[str]:
    """What the search can leave float32 in ``quantized`` (NNCF's int8 IR of ``model``): the weight
    products (linears, convolutions), the embedding tables NNCF stored in int8 (a Gather whose table is no
    longer a plain constant) and every other op of ``model`` whose activation inputs it quantized: the
    products of two activations (attention, fused or not) in a transformer; a CNN's pooling and residual
    adds, which NNCF quantizes too outside ``ModelType.TRANSFORMER``."""
    weights = set(weight_products(model))
    float_ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    units = []
    for op in quantized.get_ordered_ops():
        name = op.get_friendly_name()
        if name in weights or _int8_table(op, float_ops.get(name)) or (name in float_ops and _quantized_input(op)):
            units.append(name)
    return units


def _quantized_input(op: Any) -> bool:
    """Whether an op (not a FakeQuantize or a shape op) reads an activation through a FakeQuantize."""
    if op.get_type_name() in ("FakeQuantize", "Result", *SHAPE_OPS):
        return False
    for port in range(op.get_input_size()):
        source = _through_shape_ops(op.input_value(port).get_node())
        if source.get_type_name() == "FakeQuantize" and not _is_constant(source.input_value(0).get_node()):
            return True
    return False


def _is_constant(node: Any) -> bool:
    return _through_shape_ops(node).get_type_name() == "Constant"


def unit_macs(model: Any, units: Sequence[str], feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Multiply-adds of each of ``units`` (``quantized_units``) of ``model`` (the float32 IR) on ``feeds``:
    a product's output elements times its reduced dimension (both of attention's, fused); an embedding
    table's none (int8 there saves memory, not products)."""
    copy = model.clone()
    copy.reshape({port.get_any_name(): list(feeds[port.get_any_name()].shape) for port in copy.inputs})
    ops = {op.get_friendly_name(): op for op in copy.get_ordered_ops()}
    macs = {}
    for name in units:
        op = ops.get(name)
        kind = op.get_type_name() if op is not None else ""
        if kind not in (*WEIGHT_PRODUCTS, "ScaledDotProductAttention") or not op.get_output_partial_shape(0).is_static:
            macs[name] = 0
            continue
        out = list(op.get_output_partial_shape(0).to_shape())
        first = list(op.get_input_partial_shape(0).to_shape())
        if kind == "MatMul":
            reduced = first[-2] if op.get_attributes().get("transpose_a") else first[-1]
        elif kind == "Convolution":  # weights [out, in, *kernel]
            reduced = math.prod(list(op.get_input_partial_shape(1).to_shape())[1:])
        elif kind == "GroupConvolution":  # weights [groups, out per group, in per group, *kernel]
            reduced = math.prod(list(op.get_input_partial_shape(1).to_shape())[2:])
        else:  # softmax(q k^T) v: q's length x key length x (q's width + v's width) per head
            keys = list(op.get_input_partial_shape(1).to_shape())[-2]
            macs[name] = math.prod(first[:-1]) * keys * (first[-1] + out[-1])
            continue
        macs[name] = math.prod(out) * reduced
    return macs


def _int8_table(op: Any, float_op: Any) -> bool:
    return (
        op.get_type_name() == "Gather"
        and float_op is not None
        and float_op.input_value(0).get_node().get_type_name() == "Constant"
        and op.input_value(0).get_node().get_type_name() != "Constant"
    )


def _weight_constant(op: Any) -> Any:
    """The Constant a weight product's second input comes from (through Convert, Transpose, Reshape), or None."""
    if op.get_type_name() not in WEIGHT_PRODUCTS:
        return None
    source = _through_shape_ops(op.input_value(1).get_node())
    return source if source.get_type_name() == "Constant" else None


def _through_shape_ops(node: Any) -> Any:
    while node.get_type_name() in SHAPE_OPS and node.get_input_size():
        node = node.input_value(0).get_node()
    return node


class IrRunner(FeedsRunner):
    """The evaluator's runner for OpenVINO IRs: the float32 IR compiled for the CPU in float32 (once), each
    candidate at ``candidate_hint`` (the precision its unquantized layers run in: f32, or bf16)."""

    def __init__(self, model: Any, candidate_hint: str = "f32") -> None:
        super().__init__(model)
        self.candidate_hint = candidate_hint

    def open(self, model: Any) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        return functools.partial(_run, _compiled(model, "f32"))

    def candidate(self, model: Any) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        return functools.partial(_run, _compiled(model, self.candidate_hint))


def ir_evaluator(model: Any, batches: Sequence[dict[str, np.ndarray]]) -> Evaluator:
    """The int8 search's evaluator of IRs quantized from ``model`` (float32), on ``batches``."""
    return Evaluator.of(IrRunner(model), batches)


def _compiled(model: Any, hint: str) -> Any:
    """An infer request of ``model`` compiled for the CPU at precision hint ``hint`` (its outputs as ``_run``
    reads them)."""
    import openvino as ov

    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint}).create_infer_request()


def _run(request: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    result = request.infer(feeds)
    return [np.array(result[port]) for port in request.model_outputs]


@dataclass
class NncfUnits:
    """The search's adapter for NNCF's int8 IR: its units (``quantized_units``), a candidate without some of
    them (NNCF again, with them in its ``IgnoredScope``) and one with a unit alone in int8 (``only``)."""

    model: Any  # the float32 IR
    quantized: Any  # NNCF's IR of it, every unit int8
    units: list[str]
    quantize: Callable[[Sequence[str]], Any] | None = None  # NNCF with those names ignored
    feeds: dict[str, np.ndarray] = field(default_factory=dict)  # the first calibration batch (multiply-adds)
    noun: str = "units"
    excluded_dtype: str = "float32"

    def without(self, excluded: Sequence[str]) -> Any:
        assert self.quantize is not None  # the costs need none; a search does
        return self.quantize(excluded)

    def unit_macs(self) -> dict[str, int]:
        return unit_macs(self.model, self.units, self.feeds)

    @functools.cached_property
    def _float_weights(self) -> dict[str, tuple[int, np.ndarray]]:
        """Each unit's float32 weight (and the port it enters by), the same in every variant."""
        float_ops = {op.get_friendly_name(): op for op in self.model.get_ordered_ops()}
        quantized_ops = {op.get_friendly_name(): op for op in self.quantized.get_ordered_ops()}
        return {
            name: weight
            for name in self.units
            if name in float_ops
            and (weight := _float_weight(float_ops[name], quantized_ops[name], float_ops)) is not None
        }

    def only(self, unit: str) -> Any:
        """A variant of ``quantized`` in which only ``unit`` is int8: every activation quantizer removed but the
        ones on its inputs, every other unit's weight or table back in float32 (a weight times NNCF's
        SmoothQuant scale on its input, so the product is unchanged). Products that read one quantized
        activation (q, k and v) share its quantizer, so each one's variant quantizes the others' input too.

        Why variants of the one quantized IR: quantizing each product alone took one ``nncf.quantize`` per
        product (36 on MiniLM, each calibrating anew); these need one compile each and ranked MiniLM's
        products nearly as that did (6 of its 7 costliest, 14 of its 15)."""
        import openvino as ov

        variant = self.quantized.clone()
        ops = {op.get_friendly_name(): op for op in variant.get_ordered_ops()}
        kept = _input_fake_quantizes(ops[unit], weight=unit in self._float_weights)
        for op in variant.get_ordered_ops():
            if op.get_type_name() == "FakeQuantize" and op.get_friendly_name() not in kept:
                op.output(0).replace(op.input_value(0))
        for other, (port, weight) in self._float_weights.items():
            if other != unit:
                ops[other].input(port).replace_source_output(ov.op.Constant(weight).output(0))
        variant.validate_nodes_and_infer_types()
        return variant


def _input_fake_quantizes(op: Any, *, weight: bool = False) -> set[str]:
    """The friendly names of the FakeQuantizes on an op's activation inputs (through shape ops): a
    weight product's first input (``weight``), every input otherwise; empty where NNCF left them float."""
    ports = range(1) if weight else range(op.get_input_size())
    sources = (_through_shape_ops(op.input_value(port).get_node()) for port in ports)
    return {source.get_friendly_name() for source in sources if source.get_type_name() == "FakeQuantize"}


def _float_weight(float_op: Any, quantized_op: Any, float_ops: dict[str, Any]) -> tuple[int, np.ndarray] | None:
    """The input port and float32 value of a unit's weight: a weight product's (times its SmoothQuant
    scale) or an embedding's table; None for units without one (attention), or where the weight comes
    through other nodes (it then stays int8 in every variant)."""
    if _int8_table(quantized_op, float_op):
        return 0, np.asarray(float_op.input_value(0).get_node().get_data(), dtype=np.float32)
    if _weight_constant(float_op) is None:
        return None
    weight = _scaled_weight(float_op, _smoothing_scale(quantized_op, float_ops))
    return None if weight is None else (1, weight)


def _smoothing_scale(op: Any, float_ops: dict[str, Any]) -> np.ndarray | None:
    """The per-input-channel scale NNCF's SmoothQuant moved into a MatMul's weight: the inverse of the
    constant of the Multiply it inserted (a node the float model does not have) before the input's
    FakeQuantize; None where there is none."""
    fake_quantize = op.input_value(0).get_node()
    if fake_quantize.get_type_name() != "FakeQuantize":
        return None
    multiply = fake_quantize.input_value(0).get_node()
    if multiply.get_type_name() != "Multiply" or multiply.get_friendly_name() in float_ops:
        return None
    for port in range(2):
        source = multiply.input_value(port).get_node()
        if source.get_type_name() == "Constant":
            return 1.0 / np.asarray(source.get_data(), dtype=np.float32).reshape(-1)
    return None


def _scaled_weight(float_op: Any, scale: np.ndarray | None) -> np.ndarray | None:
    """A float MatMul's weight (a Constant feeding it directly), its input channels times ``scale``;
    None where the weight comes through other nodes (that product's weight then stays int8)."""
    source = float_op.input_value(1).get_node()
    if source.get_type_name() != "Constant":
        return None
    weight = np.asarray(source.get_data(), dtype=np.float32)
    if scale is None:
        return weight
    # the input channels are the weight's last axis when MatMul transposes it (torch's linear), else its first
    channels_last = bool(float_op.get_attributes().get("transpose_b", False))
    if weight.ndim != 2 or weight.shape[1 if channels_last else 0] != scale.size:
        return None
    return weight * (scale[None, :] if channels_last else scale[:, None])


@dataclass
class _Nncf:
    """``nncf.quantize`` of one IR on the calibration batches; ``smooth_quant`` is NNCF's default or off."""

    model: Any
    calibration: list[dict[str, np.ndarray]]
    transformer: bool
    smooth_quant: str = ""

    def __post_init__(self) -> None:
        self.smooth_quant = self.smooth_quant or ("nncf default" if self.transformer else "off")

    def quantize(self, ignored: Sequence[str] = ()) -> Any:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

        no_smoothing = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))
        scope = nncf.IgnoredScope(names=list(ignored), validate=False) if ignored else None
        level = nncf.nncf_logger.level
        nncf.set_log_level(logging.WARNING)  # NNCF logs a line per operation it leaves unquantized
        try:
            return nncf.quantize(
                self.model,
                nncf.Dataset(self.calibration),
                model_type=nncf.ModelType.TRANSFORMER if self.transformer else None,
                subset_size=len(self.calibration),
                ignored_scope=scope,
                advanced_parameters=no_smoothing if self.smooth_quant == "off" else None,
            )
        except Exception as exc:  # NNCF raises many types; each is a conversion failure
            raise ConversionError(f"NNCF could not quantize the OpenVINO model to int8: {first_line(exc)}") from exc
        finally:
            nncf.set_log_level(level)


def int8_ir_from_ir(
    model: Any,
    calibration: Sequence[dict[str, np.ndarray]],
    judge: Sequence[dict[str, np.ndarray]] = (),
    *,
    transformer: bool = False,
    min_sqnr_db: float | None = None,
    gate: Callable[[Any], None] | None = None,
    share_gate: Callable[[Int8Share], None] | None = None,
    float_part_bf16: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """``model`` quantized to int8 by ``nncf.quantize`` on ``calibration``, and what was done.

    ``float_part_bf16`` (a CPU with bfloat16 products): the int8 IR is judged again compiled at OpenVINO's bf16
    precision hint, under which what NNCF left float (the layers the search left out, and the non-linear
    ops) runs in bf16; where that holds the target too, the record says so (``automatic_exclusions_run_in``:
    bf16) and the artifact runs at that hint, else float32 (``float_part`` says why).

    With ``min_sqnr_db``, while the SQNR on the calibration and ``judge`` batches is below
    ``min_sqnr_db + MARGIN_DB``: for a transformer, NNCF's SmoothQuant is tried off too (its default
    migrates most of each input's range into the weight, which can cost more than it saves) and the
    better kept; then units (``quantized_units``) are left float32 by ``tk.export.int8.search``, costliest
    first, until it is reached. ``gate`` (``tk.export.int8.search.int8_gate``) sees the all-int8 model
    before it is judged (with a floor), and may end the export; ``share_gate`` is asked after each round of
    the search that stays under the target, with the most the search can still keep int8 (``Int8Share`` by
    the units' multiply-adds on the first calibration batch, ``bound``), and may end it too.
    """
    if not calibration:
        raise UsageError("--calibrate: expected at least one calibration sample, got none")
    nncf_ = _Nncf(model, list(calibration), transformer)
    target = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
    evaluator = ir_evaluator(model, [*calibration, *judge])
    quantized = nncf_.quantize()
    if target is not None and gate is not None:
        gate(quantized)  # before the judge: a model that cannot win needs no verdict
    quantized, sqnr = _smooth_quant_kept(nncf_, quantized, evaluator, target)
    units = quantized_units(quantized, model)
    record: dict[str, Any] = {
        "mode": "static",
        "quantizer": "nncf.quantize",
        "model_type": "transformer" if transformer else None,
        "smooth_quant": nncf_.smooth_quant,
        "calibration_batches": len(calibration),
        "quantizable_nodes": len(units),
        "excluded": [],
        "automatic_exclusions": [],
    }
    if min_sqnr_db is not None and target is not None and sqnr < target and units:
        adapter = NncfUnits(model, quantized, units, nncf_.quantize, calibration[0])
        found = search_exclusions(adapter, evaluator, min_sqnr_db, len(calibration), POLICY, share_gate=share_gate)
        if found.model is not None and found.sqnr_db is not None:
            quantized, sqnr = found.model, found.sqnr_db
        record["automatic_exclusions"] = record["excluded"] = found.excluded
        record["layer_sqnr_db"] = {name: round(value, 2) for name, value in found.costs.items()}
    record["sqnr_db_export"] = round(sqnr, 2)
    int8 = [u for u in units if u not in set(record["excluded"])]
    record["int8_linear_shapes"], record["int8_conv_shapes"] = weight_shapes(model, int8), conv_shapes(model, int8)
    record.update(_float_part(model, quantized, evaluator, target, float_part_bf16))
    return quantized, record


def _float_part(model: Any, quantized: Any, evaluator: Evaluator, target: float | None, bf16: bool) -> dict[str, Any]:
    """What NNCF left float in ``quantized`` runs in (the record's ``automatic_exclusions_run_in``): bf16 where
    ``bf16`` and the IR judged at OpenVINO's bf16 hint holds ``target`` (against the same float32 references),
    else float32, and why."""
    if not bf16:
        return {"automatic_exclusions_run_in": "fp32"}
    in_bf16 = Evaluator(IrRunner(model, "bf16"), evaluator.all_batches, evaluator.indices, evaluator.references)
    sqnr = in_bf16.sqnr_db(quantized, target_db=target)
    kept = target is None or sqnr >= target
    log.info("export int8   OpenVINO SQNR %.1f dB with its float part in bf16: %s", sqnr, "kept" if kept else "float32")
    part: dict[str, Any] = {
        "automatic_exclusions_run_in": "bf16" if kept else "fp32",
        "sqnr_db_float_part_bf16": round(sqnr, 2),
    }
    if not kept:
        part["float_part"] = f"float32: with it in bf16 the IR read {sqnr:.1f} dB, under the {target:.1f} dB target"
    return part


def _smooth_quant_kept(nncf_: _Nncf, quantized: Any, evaluator: Evaluator, target: float | None) -> tuple[Any, float]:
    """The all-int8 IR judged on every batch; for a transformer under the target, quantized again with
    SmoothQuant off, judged so too, and the better kept by its worst batch (not by the calibration batches
    alone, where the ranges were fitted: ``tk.export.aoti.int8._all_int8``). The IR kept and its SQNR."""
    sqnr = evaluator.sqnr_db(quantized)
    log.info("export int8   OpenVINO SQNR %.1f dB on %d batches, SmoothQuant %s", sqnr, len(evaluator.batches),
             nncf_.smooth_quant)  # fmt: skip
    if target is None or sqnr >= target or not nncf_.transformer:
        return quantized, sqnr
    nncf_.smooth_quant = "off"
    plain = nncf_.quantize()
    plain_sqnr = evaluator.sqnr_db(plain)
    log.info("export int8   OpenVINO SQNR %.1f dB, SmoothQuant off", plain_sqnr)
    if plain_sqnr >= target or plain_sqnr > sqnr:
        return plain, plain_sqnr
    nncf_.smooth_quant = "nncf default"
    return quantized, sqnr
