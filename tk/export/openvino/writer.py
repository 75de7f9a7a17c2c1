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
what the artifact claims. int8: ``nncf.quantize`` calibrated on tk's calibration batches, judged and
searched as the other int8 writers' models are (``tk.export.openvino.int8``), its float part in bf16
where the CPU has bfloat16 products and the IR holds the judge's target so. A decoder's IR keeps its KV
cache in OpenVINO (``tk.export.openvino.stateful``), but under NNCF's calibrated int8, whose calibration
feeds are the static-cache step's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tk.errors import ConversionError, UsageError, first_line
from tk.export.base import Writer, option
from tk.export.context import ExportContext, ExportOptions
from tk.export.openvino.convert import converted
from tk.formats.openvino import (
    BIN,
    CACHE_IN_STATE,
    PRECISION_HINTS,
    ROLE,
    WEIGHTS_ROLE,
    XML,
    bounded_shapes,
    missing_reason,
)

log = logging.getLogger("tk.export")

INT8_MODES = ("static", "weights", "weights-int4")  # NNCF: calibrated quantization, or weight compression


@dataclass(frozen=True)
class OpenVinoOptions:
    """The ``openvino`` writer's settings; None means the default."""

    # static (NNCF's calibrated quantization, default) | weights | weights-int4 (nncf.compress_weights)
    int8_mode: str | None = option("--int8-mode")


class OpenVinoWriter(Writer):
    """``model.xml`` + ``model.bin``: the IR ``openvino.convert_model`` makes of the float32 program,
    quantized by NNCF under int8 (calibrated, or its weights compressed: ``--int8-mode weights``)."""

    name = "openvino"
    Options = OpenVinoOptions
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

    def int8_float_part(self) -> str:
        return int8_float_part()

    def variant_words(self, options: OpenVinoOptions, precision: str) -> list[str]:
        return [options.int8_mode or "static"] if precision == "int8" else []

    def validate(self, options: OpenVinoOptions, export: ExportOptions) -> None:
        if options.int8_mode is not None and export.precision != "int8":
            raise UsageError(f"--int8-mode: applies to --precision int8 only; this export is {export.precision}")
        if options.int8_mode is not None and options.int8_mode not in INT8_MODES:
            raise UsageError(
                f"--int8-mode {options.int8_mode}: openvino's int8 is one of {', '.join(INT8_MODES)}; export the "
                "other formats with it separately"
            )
        if export.keep_fp32 and export.precision != "fp32":
            raise UsageError(
                f"--keep-fp32: the openvino format does not keep modules in float32 at --precision {export.precision}; "
                "export without it"
            )

    def write(self, ctx: ExportContext) -> None:
        import openvino as ov

        mode = ctx.settings[self.name].int8_mode or "static"
        # a decoder keeps its cache in OpenVINO (tk.export.openvino.stateful), but where NNCF calibrates the
        # graph's activations: its calibration feeds are the static cache's
        stateful = bool(ctx.spec.generation) and not (ctx.options.precision == "int8" and mode == "static")
        if stateful:
            from tk.export.openvino.stateful import stateful_decoder_ir

            model, fallback = stateful_decoder_ir(ctx), None
        else:
            model, fallback = _float32_ir(ctx)
        quantization = None
        if ctx.options.precision == "int8" and mode != "static":
            model, quantization = _weight_only_ir(model, mode)
        elif ctx.options.precision == "int8":
            model, quantization = _int8_ir(model, ctx)
        xml = ctx.add_file(XML, ROLE)
        ctx.add_file(BIN, WEIGHTS_ROLE)
        ov.save_model(model, str(xml), compress_to_fp16=False)
        hint = PRECISION_HINTS[ctx.options.precision]
        if quantization is not None and quantization.get("automatic_exclusions_run_in") == "bf16":
            hint = "bf16"  # what NNCF left float runs in bf16 (tk.export.openvino.int8)
        info: dict[str, Any] = {
            "file": XML,
            "weights": BIN,
            "inference_precision_hint": hint,
            "compress_to_fp16": False,
        }
        if stateful:
            info["cache"] = CACHE_IN_STATE
        if quantization is not None:
            info["quantization"] = quantization
        if fallback is not None:
            info["fallback"] = fallback
        ctx.formats[self.name] = info
        ctx.versions.setdefault("openvino", ov.__version__)


WRITER = OpenVinoWriter()


def int8_float_part() -> str:
    """What an int8 IR's unquantized layers run in: bf16 on a CPU with bfloat16 products (where the judge still
    holds its target so: ``int8_ir_from_ir``), else float32."""
    from tk.formats.aoti import runs_natively

    return "bf16" if runs_natively("bf16") else "fp32"


def _int8_ir(model: Any, ctx: ExportContext) -> tuple[Any, dict[str, Any]]:
    """``model`` quantized by NNCF on tk's calibration batches, judged at the int8 SQNR floor."""
    import nncf

    from tk.export.int8.calibration import calibration_feeds, judge_feeds
    from tk.export.int8.search import int8_floor_db, int8_gate, require_int8_layers
    from tk.export.openvino.int8 import int8_ir_from_ir

    quantized, record = int8_ir_from_ir(
        model,
        calibration_feeds(ctx),
        judge_feeds(ctx),
        transformer=has_attention(model),
        min_sqnr_db=int8_floor_db(ctx),
        gate=int8_gate(ctx, "openvino"),
        share_gate=int8_gate(ctx, "openvino"),
        float_part_bf16=int8_float_part() == "bf16",
    )
    layers = record["quantizable_nodes"]
    require_int8_layers(layers - len(record["automatic_exclusions"]), layers, "openvino")
    ctx.versions.setdefault("nncf", nncf.__version__)
    return quantized, record


def _weight_only_ir(model: Any, mode: str) -> tuple[Any, dict[str, Any]]:
    """``model`` with its products' weights compressed by ``nncf.compress_weights``: int8 (asymmetric, per
    output channel) or int4 (symmetric, groups of 128; NNCF keeps the embeddings and the last product in int8)."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    kind = nncf.CompressWeightsMode.INT8_ASYM if mode == "weights" else nncf.CompressWeightsMode.INT4_SYM
    options: dict[str, Any] = {} if mode == "weights" else {"group_size": 128, "ratio": 1.0}
    # a product narrower than a group (a small model's) takes the largest group that divides it (32 at least)
    adjust = AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
    nncf.set_log_level(logging.WARNING)  # its statistics table goes to the log, not stdout
    try:
        compressed = nncf.compress_weights(model, mode=kind, advanced_parameters=adjust, **options)
    except Exception as exc:  # NNCF raises its own types, each a conversion failure of this model
        raise ConversionError(f"openvino --int8-mode {mode}: nncf.compress_weights failed ({first_line(exc)})") from exc
    return compressed, {"mode": mode, "quantizer": f"nncf.compress_weights {kind.value}", **options}


def _float32_program(ctx: ExportContext) -> Any:
    """The captured program, or under bf16 (where it holds tk's casts) the float32 model captured again."""
    assert ctx.program is not None
    if ctx.options.precision != "bf16":
        return ctx.program
    from tk.export.capture import exported_program_from_module

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
            cause = failed.split("; export --format")[0]  # its advice names onnx, which failed too
            raise ConversionError(
                f"{cause}; nor is there an ONNX graph of the program to convert (torch.onnx failed too): export "
                "--format torch or aoti instead"
            ) from exc
        try:
            model = named_and_bounded(converted(str(onnx_file.path), "tk's ONNX of the program"), ctx)
        except ConversionError as second:
            raise ConversionError(f"{failed}; converting tk's ONNX of the program failed too ({second})") from exc
    log.warning("export openvino: the PyTorch frontend failed (%s); converted tk's ONNX of the same program", failed)
    return model, f"converted from tk's ONNX of the program (the PyTorch frontend failed: {failed})"


def has_attention(model: Any) -> bool:
    """Whether the OpenVINO model computes attention (a softmax over scores, fused or not)."""
    return any(op.get_type_name() in ("ScaledDotProductAttention", "Softmax") for op in model.get_ordered_ops())


def ir_from_exported_program(program: Any, ctx: ExportContext) -> Any:
    """``program`` as an ``openvino.Model``: inputs bounded by the dims, outputs named as the signature."""
    return named_and_bounded(converted(program, "the exported program"), ctx)


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
