"""int8 for the CPU: onnxruntime's dynamic quantization of the exported ONNX graph.

Weights of the MatMul/Gemm layers become int8 once, at export; activations are quantized per
call from their observed range. Embedding lookups stay float32: quantizing the Gather cost more
accuracy than it saved time in our measurements. The check judges int8 by its SQNR in dB.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tk.errors import ConversionError, first_line

QUANTIZED_OPS = ["MatMul", "Gemm"]


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return "int8 uses onnxruntime's quantization tools: pip install 'tk[cpu]'"
    return None


def int8_onnx_from_onnx(source: Path, target: Path, *, nodes_to_exclude: list[str] | None = None) -> None:
    """Write ``source`` dynamically quantized to int8 at ``target`` (same inputs and outputs).

    ``nodes_to_exclude``: ONNX node names left in float32 (the nodes of ``--keep-fp32`` modules).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # the quantizer logs every skipped node on the root logger: the application decides whether
    # that is shown (the tk command line shows errors only without --debug)
    try:
        quantize_dynamic(
            str(source),
            str(target),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=QUANTIZED_OPS,
            nodes_to_exclude=list(nodes_to_exclude or []),
        )
    except Exception as exc:  # the quantizer raises many types; each is a conversion failure
        raise ConversionError(f"onnxruntime could not quantize {source.name} to int8: {first_line(exc)}") from exc
