"""The ``openvino`` format: the exported program converted by ``openvino.convert_model`` into an IR
(``model.xml`` + ``model.bin``), int8 through NNCF.

The IR is converted from the float32 program (captured again from the float32 model under
``--precision bf16``: OpenVINO's CPU plugin picks bf16 kernels itself from the compile-time
``INFERENCE_PRECISION_HINT``, which the engine takes from the manifest's precision, so the IR
keeps float32 weights and no casts). It is saved with ``compress_to_fp16=False``: OpenVINO's
default would round every weight to float16 on disk. The inputs are bounded by the artifact's
dimension ranges (``Dimension(min, max)``), and the outputs carry the signature's names.

bf16 is written only on a CPU with bfloat16 dot products (avx512_bf16 or amx_bf16): elsewhere
OpenVINO does not emulate bfloat16, it silently compiles f32, so the export check could not test
what the artifact claims. int8: ``nncf.quantize`` (``ModelType.TRANSFORMER`` for models with
attention, which keeps attention's softmax inputs float and adds SmoothQuant) calibrated on tk's
calibration batches, then judged, as the other int8 writers are, by the SQNR of its outputs
against the float32 IR on the calibration and held-out batches; while below the floor plus
``MARGIN_DB``, the costliest units (``quantized_units``: the weight products, the embedding tables
NNCF stored in int8 and the attention products whose inputs it quantized; ``one_at_a_time_sqnr_db``:
the graph's SQNR with only that unit int8) are left float32 through NNCF's ``IgnoredScope``, a few
more per round.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tk.errors import ConversionError, UsageError, first_line
from tk.export.context import ExportContext, ExportOptions, Int8Share
from tk.export.writer import NoOptions, Writer
from tk.formats.openvino import BIN, PRECISION_HINTS, ROLE, WEIGHTS_ROLE, XML, bounded_shapes, missing_reason

log = logging.getLogger("tk.export")

MAX_ROUNDS = 8  # int8 exclusion rounds before giving up (the check then reports the SQNR)


class OpenVinoWriter(Writer):
    """``model.xml`` + ``model.bin``: the IR ``openvino.convert_model`` makes of the float32 program,
    quantized by NNCF under int8. It takes no options of its own: NNCF chooses the int8 ranges."""

    name = "openvino"
    Options = NoOptions
    precisions = tuple(PRECISION_HINTS)  # fp32, bf16, int8
    int8_rank = 2  # NNCF's int8 lost to both others on the AVX2 EPYC (benchmarks/history.md)

    def unavailable_reason(self, device: str, precision: str) -> str | None:
        if device != "cpu":
            return f"OpenVINO IRs are written for the CPU; export --device cpu (got {device})"
        reason = missing_reason()
        if reason:
            return reason
        if precision == "int8":
            import importlib.util

            if importlib.util.find_spec("nncf") is None:
                return "int8 OpenVINO IRs are quantized by NNCF, which is not installed (pip install 'tk[openvino]')"
        if precision == "bf16":
            from tk.formats.aoti import NATIVE_FLAGS, runs_natively

            if not runs_natively("bf16"):
                return (
                    f"--precision bf16: this CPU has no {' or '.join(NATIVE_FLAGS['bf16'])}, and OpenVINO compiles "
                    "bf16 as f32 there, so the check could not test it; export it on such a CPU"
                )
        return None

    def validate(self, options: NoOptions, export: ExportOptions) -> None:
        if export.keep_fp32 and export.precision != "fp32":
            raise UsageError(
                f"--keep-fp32: the openvino format does not keep modules in float32 at --precision {export.precision}; "
                "export without it"
            )

    def write(self, ctx: ExportContext) -> None:
        import openvino as ov

        model, fallback = _float32_ir(ctx)
        quantization = None
        if ctx.options.precision == "int8":
            model, quantization = _int8_ir(model, ctx)
        xml = ctx.add_file(XML, ROLE)
        ctx.add_file(BIN, WEIGHTS_ROLE)
        ov.save_model(model, str(xml), compress_to_fp16=False)
        info: dict[str, Any] = {
            "file": XML,
            "weights": BIN,
            "inference_precision_hint": PRECISION_HINTS[ctx.options.precision],
            "compress_to_fp16": False,
        }
        if quantization is not None:
            info["quantization"] = quantization
        if fallback is not None:
            info["fallback"] = fallback
        ctx.formats[self.name] = info
        ctx.versions.setdefault("openvino", ov.__version__)


WRITER = OpenVinoWriter()


def _int8_ir(model: Any, ctx: ExportContext) -> tuple[Any, dict[str, Any]]:
    """``model`` quantized by NNCF on tk's calibration batches, judged at the int8 SQNR floor."""
    import nncf

    from tk.export.calibration import calibration_feeds, int8_floor_db, int8_gate, judge_feeds, require_int8_layers

    quantized, record = int8_ir_from_ir(
        model,
        calibration_feeds(ctx),
        judge_feeds(ctx),
        transformer=has_attention(model),
        min_sqnr_db=int8_floor_db(ctx),
        gate=int8_gate(ctx, "openvino"),
        share_gate=int8_gate(ctx, "openvino"),
    )
    layers = record["quantizable_nodes"]
    require_int8_layers(layers - len(record["automatic_exclusions"]), layers, "openvino")
    ctx.versions.setdefault("nncf", nncf.__version__)
    return quantized, record


def _float32_program(ctx: ExportContext) -> Any:
    """The captured program, or under bf16 (where it holds tk's casts) the float32 model captured again."""
    assert ctx.program is not None
    if ctx.options.precision != "bf16":
        return ctx.program
    from tk.export.torch_program import exported_program_from_module

    return exported_program_from_module(ctx.spec.module, ctx.example_inputs, ctx.spec.signature, ctx.dims)


def _float32_ir(ctx: ExportContext) -> tuple[Any, str | None]:
    """The float32 IR: converted from the exported program, else (fp32 and int8) from tk's ONNX of the same
    program, which OpenVINO's ONNX frontend reads where its PyTorch frontend fails (GPT-2's cache ``cat`` of an
    empty tensor); the second is the fallback's record, or None."""
    try:
        return ir_from_exported_program(_float32_program(ctx), ctx), None
    except ConversionError as exc:
        if ctx.options.precision == "bf16" or "onnx-plain" not in ctx.providers:
            raise  # under bf16 tk's ONNX holds the program's bf16 casts: no float32 graph to convert
        failed = first_line(exc)
        try:
            onnx_file = ctx.require("onnx-plain")
        except ConversionError:
            raise ConversionError(f"{failed}; nor is there an ONNX graph of the program to convert (torch.onnx failed)") from exc
        try:
            model = named_and_bounded(_converted(str(onnx_file.path), "tk's ONNX of the program"), ctx)
        except ConversionError as second:
            raise ConversionError(f"{failed}; converting tk's ONNX of the program failed too ({second})") from exc
    log.warning("export openvino: the PyTorch frontend failed (%s); converted tk's ONNX of the same program", failed)
    return model, f"converted from tk's ONNX of the program (the PyTorch frontend failed: {failed})"


def has_attention(model: Any) -> bool:
    """Whether the OpenVINO model computes attention (a softmax over scores, fused or not)."""
    return any(op.get_type_name() in ("ScaledDotProductAttention", "Softmax") for op in model.get_ordered_ops())


def ir_from_exported_program(program: Any, ctx: ExportContext) -> Any:
    """``program`` as an ``openvino.Model``: inputs bounded by the dims, outputs named as the signature."""
    return named_and_bounded(_converted(program, "the exported program"), ctx)


def _converted(source: Any, what: str) -> Any:
    """``openvino.convert_model(source)``; a failure is one ``ConversionError`` line that keeps OpenVINO's cause
    (its first line names only the C++ file that threw)."""
    import openvino as ov

    try:
        return ov.convert_model(source)
    except Exception as exc:  # the frontends raise OpConversionFailure, GeneralFailure and others
        raise ConversionError(
            f"openvino.convert_model could not convert {what} ({type(exc).__name__}: {openvino_cause(exc)}); "
            "export --format onnx or aoti instead"
        ) from exc


def openvino_cause(exc: BaseException) -> str:
    """The informative part of an OpenVINO error: its summary lines (``-- No conversion rule found for
    operations: ...``) where it has them, else its lines past the ``Check ... failed at FILE:LINE:`` header."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    summary = [ln.removeprefix("-- ") for ln in lines if ln.startswith("-- ")]
    useful = summary or [ln for ln in lines if not ln.startswith(("Check '", "Exception from "))]
    return "; ".join(useful[:3])[:400] if useful else first_line(exc)


def named_and_bounded(model: Any, ctx: ExportContext) -> Any:
    """``model`` with the signature's input and output names and its inputs bounded by the dims."""
    signature = ctx.spec.signature
    if len(model.inputs) != len(signature.inputs) or len(model.outputs) != len(signature.outputs):
        raise ConversionError(
            f"the OpenVINO model has {len(model.inputs)} inputs and {len(model.outputs)} outputs; the model's "
            f"signature expects {len(signature.inputs)} and {len(signature.outputs)} (does forward take inputs the "
            "model ignores, or return extra values?)"
        )
    # the program's inputs come in the signature's order under forward's argument names; name them as tk does
    for port, spec in [
        *zip(model.inputs, signature.inputs, strict=True),
        *zip(model.outputs, signature.outputs, strict=True),
    ]:
        port.get_tensor().set_names({spec.name})
    for port, spec in zip(model.inputs, signature.inputs, strict=True):
        port.get_node().set_friendly_name(spec.name)
    model.reshape(bounded_shapes(signature, ctx.dims))
    return model


# -- int8 through NNCF ----------------------------------------------------------------------------
ACTIVATION_PRODUCTS = ("MatMul", "ScaledDotProductAttention")  # ops NNCF may quantize with no weight
SHAPE_OPS = ("Convert", "Transpose", "Reshape", "Squeeze", "Unsqueeze")


def weight_products(model: Any) -> list[str]:
    """Friendly names of the MatMuls whose second input is a constant (a weight, possibly through a Convert)."""
    return [op.get_friendly_name() for op in model.get_ordered_ops() if _weight_constant(op) is not None]


def quantized_units(quantized: Any, model: Any) -> list[str]:
    """What the search can leave float32 in ``quantized`` (NNCF's int8 IR of ``model``): the weight
    products, the embedding tables NNCF stored in int8 (a Gather whose table is no longer a plain
    constant) and the products of two activations (attention, fused or not) whose inputs it quantized."""
    weights = set(weight_products(model))
    float_ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    units = []
    for op in quantized.get_ordered_ops():
        name = op.get_friendly_name()
        if (
            name in weights
            or _int8_table(op, float_ops.get(name))
            or (op.get_type_name() in ACTIVATION_PRODUCTS and _input_fake_quantizes(op))
        ):
            units.append(name)
    return units


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
        if (
            kind not in ("MatMul", "Convolution", "ScaledDotProductAttention")
            or not op.get_output_partial_shape(0).is_static
        ):
            macs[name] = 0
            continue
        out = list(op.get_output_partial_shape(0).to_shape())
        first = list(op.get_input_partial_shape(0).to_shape())
        if kind == "MatMul":
            reduced = first[-2] if op.get_attributes().get("transpose_a") else first[-1]
        elif kind == "Convolution":
            reduced = math.prod(list(op.get_input_partial_shape(1).to_shape())[1:])
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
    """The Constant a MatMul's second input comes from (through Convert, Transpose, Reshape), or None."""
    if op.get_type_name() != "MatMul":
        return None
    source = _through_shape_ops(op.input_value(1).get_node())
    return source if source.get_type_name() == "Constant" else None


def _through_shape_ops(node: Any) -> Any:
    while node.get_type_name() in SHAPE_OPS and node.get_input_size():
        node = node.input_value(0).get_node()
    return node


def one_at_a_time_sqnr_db(
    quantized: Any, model: Any, units: Sequence[str], batches: Sequence[dict[str, np.ndarray]]
) -> dict[str, float]:
    """Each unit's cost in int8 (``units``: from ``quantized_units``): the SQNR of the outputs (against
    ``model``, float32, on ``batches``) of a variant of ``quantized`` in which only that unit is int8:
    every activation quantizer removed but the ones on its inputs, every other unit's weight or table
    back in float32 (a weight times NNCF's SmoothQuant scale on its input, so the product is unchanged).
    Products that read one quantized activation (q, k and v) share its quantizer, so each one's variant
    quantizes the others' input too.

    Why variants of the one quantized IR: quantizing each product alone took one ``nncf.quantize`` per
    product (36 on MiniLM, each calibrating anew); these need one compile each and ranked MiniLM's
    products nearly as that did (6 of its 7 costliest, 14 of its 15)."""
    import openvino as ov

    judge = _Judge(model, batches)
    float_ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    quantized_ops = {op.get_friendly_name(): op for op in quantized.get_ordered_ops()}
    # each unit's float32 weight (and the port it enters by), the same in every variant
    float_weights = {
        name: weight
        for name in units
        if name in float_ops and (weight := _float_weight(float_ops[name], quantized_ops[name], float_ops)) is not None
    }
    costs = {}
    for name in units:
        variant = quantized.clone()
        ops = {op.get_friendly_name(): op for op in variant.get_ordered_ops()}
        kept = _input_fake_quantizes(ops[name], weight=name in float_weights)
        for op in variant.get_ordered_ops():
            if op.get_type_name() == "FakeQuantize" and op.get_friendly_name() not in kept:
                op.output(0).replace(op.input_value(0))
        for other, (port, weight) in float_weights.items():
            if other != name:
                ops[other].input(port).replace_source_output(ov.op.Constant(weight).output(0))
        variant.validate_nodes_and_infer_types()
        costs[name] = judge.sqnr_db(variant)
    return costs


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


class _Judge:
    """The float32 IR's outputs on some batches, and the SQNR of a candidate IR against them (both compiled f32).

    A batch's reference is computed when it is first judged: a judge that stops at its first batch under
    the target (the speed gate's question) never runs the float32 IR on the rest."""

    def __init__(self, reference: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self.batches = list(batches)
        self._float = reference  # the float32 IR, compiled at the first reference asked
        self._request: Any = None
        self._outputs_of: dict[int, list[np.ndarray]] = {}  # batch index -> the float32 IR's outputs
        self._indices = list(range(len(self.batches)))  # this judge's batches, as indices of the first judge's
        self._root = self
        self.stopped_at = -1  # the batch the last call stopped at (under its target), or -1
        self.first_worst = float("inf")  # the last call's worst SQNR over its first ``judge_first`` batches

    def subset(self, indices: Sequence[int]) -> _Judge:
        """A judge of some of the batches (the same references, computed once for both)."""
        judge = _Judge(None, [self.batches[i] for i in indices])
        judge._indices = [self._indices[i] for i in indices]
        judge._root = self._root
        return judge

    def reference(self, i: int) -> list[np.ndarray]:
        """The float32 IR's outputs on this judge's batch ``i``."""
        root, index = self._root, self._indices[i]
        if index not in root._outputs_of:
            if root._request is None:
                root._request = _compiled_f32(root._float)
            root._outputs_of[index] = _run(root._request, root.batches[index])
        return root._outputs_of[index]

    def _outputs(self, model: Any) -> Iterator[list[np.ndarray]]:
        request = _compiled_f32(model)
        for feeds in self.batches:
            yield _run(request, feeds)

    def sqnr_db(self, model: Any, *, target_db: float | None = None, judge_first: int = 0) -> float:
        """The worst SQNR over the batches; with ``target_db``, the first batch under it ends the judging
        once the first ``judge_first`` are judged (their worst is kept in ``first_worst``)."""
        from tk.parity import worst_sqnr_db

        worst, self.stopped_at, self.first_worst = float("inf"), -1, float("inf")
        for i, outputs in enumerate(self._outputs(model)):
            worst = min(worst, worst_sqnr_db([self.reference(i)], [outputs]))
            if i < judge_first:
                self.first_worst = worst
            if target_db is not None and worst < target_db and i + 1 >= judge_first:
                self.stopped_at = i
                break
        return worst


def _compiled_f32(model: Any) -> Any:
    """An infer request of ``model`` compiled for the CPU in float32 (its outputs as ``_run`` reads them)."""
    import openvino as ov

    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()


def _run(request: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    result = request.infer(feeds)
    return [np.array(result[port]) for port in request.model_outputs]


def int8_ir_from_ir(
    model: Any,
    calibration: Sequence[dict[str, np.ndarray]],
    judge: Sequence[dict[str, np.ndarray]] = (),
    *,
    transformer: bool = False,
    min_sqnr_db: float | None = None,
    gate: Callable[[Any], None] | None = None,
    share_gate: Callable[[Int8Share], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``model`` quantized to int8 by ``nncf.quantize`` on ``calibration``, and what was done.

    With ``min_sqnr_db``, while the SQNR on the calibration and ``judge`` batches is below
    ``min_sqnr_db + MARGIN_DB``: for a transformer, NNCF's SmoothQuant is tried off too (its default
    migrates most of each input's range into the weight, which can cost more than it saves) and the
    better kept; then units (``quantized_units``) are left float32, costliest first by
    ``one_at_a_time_sqnr_db``, until it is reached. ``gate`` (``tk.export.calibration.int8_gate``) sees
    the all-int8 model before it is judged (with a floor), and may end the export; ``share_gate`` is
    asked after each round of the search that stays under the target, with the most the search can still
    keep int8 (``Int8Share`` by the units' multiply-adds on the first calibration batch, ``bound``), and
    may end it too.
    """
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    from tk.export.calibration import MARGIN_DB, exclude_costliest, screened_exclusion

    if not calibration:
        raise UsageError("--calibrate: expected at least one calibration sample, got none")
    dataset = nncf.Dataset(list(calibration))
    model_type = nncf.ModelType.TRANSFORMER if transformer else None
    no_smoothing = AdvancedQuantizationParameters(smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))
    settings = {"smooth_quant": "nncf default" if transformer else "off"}

    def quantize(ignored: Sequence[str]) -> Any:
        scope = nncf.IgnoredScope(names=list(ignored), validate=False) if ignored else None
        level = nncf.nncf_logger.level
        nncf.set_log_level(logging.WARNING)  # NNCF logs a line per operation it leaves unquantized
        try:
            return nncf.quantize(
                model,
                dataset,
                model_type=model_type,
                subset_size=len(calibration),
                ignored_scope=scope,
                advanced_parameters=no_smoothing if settings["smooth_quant"] == "off" else None,
            )
        except Exception as exc:  # NNCF raises many types; each is a conversion failure
            raise ConversionError(f"NNCF could not quantize the OpenVINO model to int8: {first_line(exc)}") from exc
        finally:
            nncf.set_log_level(level)

    target = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
    judged = _Judge(model, [*calibration, *judge])
    quantized = quantize(())
    if target is not None and gate is not None:
        gate(quantized)  # before the judge: a model that cannot win needs no verdict
    # under a target, a model is judged on the calibration batches, then up to its first batch under the
    # target; models under it are compared on the calibration batches, which each is judged on whole
    first = len(calibration)
    sqnr = judged.sqnr_db(quantized, target_db=target, judge_first=first)
    log.info(
        "export int8   OpenVINO SQNR %.1f dB on %s, SmoothQuant %s",
        sqnr,
        f"{len(judged.batches)} batches" if judged.stopped_at < 0 else f"the first {judged.stopped_at + 1} batches",
        settings["smooth_quant"],
    )
    if target is not None and sqnr < target and transformer:
        score = judged.first_worst
        settings["smooth_quant"] = "off"
        plain = quantize(())
        plain_sqnr = judged.sqnr_db(plain, target_db=target, judge_first=first)
        log.info("export int8   OpenVINO SQNR %.1f dB, SmoothQuant off", plain_sqnr)
        if plain_sqnr >= target or judged.first_worst > score:
            quantized, sqnr = plain, plain_sqnr
        else:
            settings["smooth_quant"] = "nncf default"
    units = quantized_units(quantized, model)
    record: dict[str, Any] = {
        "mode": "static",
        "quantizer": "nncf.quantize",
        "model_type": "transformer" if transformer else None,
        "smooth_quant": settings["smooth_quant"],
        "calibration_batches": len(calibration),
        "quantizable_nodes": len(units),
        "excluded": [],
        "automatic_exclusions": [],
    }
    if target is not None and sqnr < target and units:
        costs = one_at_a_time_sqnr_db(quantized, model, units, calibration)
        best: dict[str, Any] = {}
        passed: dict[frozenset[str], tuple[Any, float]] = {}  # the bisection ends by asking again for the one it keeps
        failed: set[frozenset[str]] = set()  # the sets under the target on some screen: on any larger one too

        def judge_on(judge: _Judge) -> Callable[[list[str]], float]:
            passed.clear()

            def judge_without(excluded: list[str]) -> float:
                if frozenset(excluded) in passed:
                    best["model"], value = passed[frozenset(excluded)]
                    return value
                best["model"] = quantize(excluded)
                value = judge.sqnr_db(best["model"], target_db=target)
                stopped = "" if value >= target else " (a batch under the target: the rest not run)"
                log.info(
                    "export int8   %d of %d units float32: SQNR %.1f dB on %d batches%s",
                    len(excluded), len(units), value, len(judge.batches), stopped,
                )  # fmt: skip
                if value >= target:
                    passed[frozenset(excluded)] = best["model"], value
                return value

            return judge_without

        def judge_all(excluded: list[str]) -> tuple[float, int | None]:
            value = judged.sqnr_db(best["model"], target_db=target)
            failed = judged.stopped_at
            log.info(
                "export int8   %d of %d units float32: SQNR %.1f dB on all %d batches%s",
                len(excluded), len(units), value, len(judged.batches),
                "" if failed < 0 else f": batch {failed} under the target joins the screen and the rounds run again",
            )  # fmt: skip
            return value, None if failed < 0 else failed

        macs: dict[str, int] = {}  # counted at the gate's first question

        def at_least(excluded: list[str]) -> None:
            assert share_gate is not None  # handed to the search only where there is one
            if not macs:
                macs.update(unit_macs(model, units, calibration[0]))
            total = sum(macs.values())
            kept = total - sum(macs[name] for name in excluded)
            share_gate(Int8Share(len(units) - len(excluded), len(units), kept / total if total else 0.0, bound=True))

        def search(screen: list[int]) -> tuple[list[str], float | None]:
            return exclude_costliest(
                costs, judge_on(judged.subset(screen)), target, MAX_ROUNDS, failed_before=failed,
                at_least=None if share_gate is None else at_least,
            )  # fmt: skip

        excluded, last, _ = screened_exclusion(len(judged.batches), len(calibration), search, judge_all, target)
        if last is not None:
            quantized, sqnr = best["model"], last
        record["automatic_exclusions"] = record["excluded"] = excluded
        record["layer_sqnr_db"] = {name: round(value, 2) for name, value in costs.items()}
    record["sqnr_db_export"] = round(sqnr, 2)
    return quantized, record
