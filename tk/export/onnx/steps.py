"""The ``onnx`` writer's precision steps on its shipped graph: onnxruntime's fusions, then int8.

Static int8 quantizes the fused graph: its attention is one ``MultiHeadAttention`` instead of
MatMul/Where/Softmax/Transpose plumbing, so fewer float32 operators sit between the quantized
products. Dynamic int8 stays unfused: fusions made it slower when measured (the README's
performance section).
"""

from __future__ import annotations

import logging
import os
import shutil

from tk.export.context import ExportContext

log = logging.getLogger("tk.export")

UNFUSED_ONNX = "model.unfused.onnx"
INT8_MODES = ("static", "dynamic", "weights", "weights-int4")  # the last two: weight-only (tk.export.onnx.weight_only)


def fuses(precision: str, int8_mode: str) -> bool:
    """Whether the ONNX graph is fused: always but under dynamic int8 (see the module docstring)."""
    return precision != "int8" or int8_mode != "dynamic"


def fuse(ctx: ExportContext, *, keep_unfused: bool) -> None:
    """onnxruntime's transformer fusions on the shipped ``model.onnx`` (``tk.export.onnx.fusions``)."""
    from tk.export.onnx.fusions import optimize_onnx_in_place

    info = ctx.formats["onnx"]
    if info.get("external_data"):
        info["fusions"] = {"applied": False, "reason": "the graph has external data (over 2 GiB)"}
        return
    path = ctx.staging / info["file"]
    if keep_unfused:
        shutil.copyfile(path, ctx.add_file(UNFUSED_ONNX, "onnx-unfused"))
    feeds = {s.name: t.cpu().numpy() for s, t in zip(ctx.spec.signature.inputs, ctx.example_inputs, strict=True)}
    # a CUDA export keeps SkipLayerNormalization (fused there); onnxruntime's CPU kernel is slower than LayerNormalization
    result = optimize_onnx_in_place(path, feeds, for_cpu=ctx.options.device != "cuda")
    info["fusions"] = result.to_json()
    if result.applied:
        log.info(
            "export fuse   %d -> %d nodes: %s %s",
            result.nodes_before,
            result.nodes_after,
            result.fused_ops,
            result.cpu_rewrites or "",
        )


def quantize(ctx: ExportContext, *, mode: str, method: str | None, nodes_to_exclude: tuple[str, ...]) -> None:
    """The shipped ``model.onnx`` in int8: ``static`` (calibrated QDQ, costly layers left out) or ``dynamic``."""
    from tk.export.onnx.dynamic_int8 import QUANTIZED_OPS, int8_onnx_from_onnx, weight_record, weight_type

    path = ctx.staging / ctx.formats["onnx"]["file"]
    quantized = path.with_name(".int8." + path.name)
    excluded: list[str] = list(nodes_to_exclude)
    kept_modules: list[str] = []
    if ctx.options.keep_fp32:
        import onnx

        from tk.formats.onnx_scopes import nodes_in_modules

        kept_modules = nodes_in_modules(onnx.load(str(path), load_external_data=False), ctx.options.keep_fp32)
        excluded += kept_modules + [f"{name}_MatMul" for name in kept_modules]  # a Gemm splits into NAME_MatMul + Add
    if mode.startswith("weights"):
        from tk.export.onnx.weight_only import WEIGHT_MODES, weight_only_onnx_from_onnx

        record = weight_only_onnx_from_onnx(path, quantized, WEIGHT_MODES[mode], excluded)
        os.replace(quantized, path)
        ctx.formats["onnx"]["quantization"] = record
    elif mode == "static":
        from tk.export.int8.calibration import calibration_feeds, judge_feeds
        from tk.export.int8.search import int8_floor_db, int8_gate, require_int8_layers
        from tk.export.onnx.static_int8 import static_int8_onnx_from_onnx

        result = static_int8_onnx_from_onnx(
            path,
            quantized,
            calibration_feeds(ctx, one_shape=method in ("entropy", "percentile")),
            method=method or "minmax",
            nodes_to_exclude=excluded,
            min_sqnr_db=int8_floor_db(ctx),
            judge=judge_feeds(ctx),
            gate=int8_gate(ctx, "onnx"),
            share_gate=int8_gate(ctx, "onnx"),
        )
        require_int8_layers(result.int8_nodes, result.quantizable, "onnx")
        os.replace(quantized, path)
        ctx.formats["onnx"]["quantization"] = result.to_json()
    else:
        weights = weight_type()
        int8_onnx_from_onnx(path, quantized, nodes_to_exclude=excluded, weights=weights)
        os.replace(quantized, path)
        ctx.formats["onnx"]["quantization"] = (
            f"dynamic int8 ({', '.join(QUANTIZED_OPS)}), weights {weight_record(weights)}"
        )
    if kept_modules:
        ctx.formats["onnx"]["int8_excluded_nodes"] = len(kept_modules)
