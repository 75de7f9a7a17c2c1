"""int8 for the CPU: onnxruntime's dynamic quantization of the exported ONNX graph.

Weights of the MatMul/Gemm layers become int8 once, at export; activations are quantized per
call from their observed range. Embedding lookups stay float32: quantizing the Gather cost more
accuracy than it saved time in our measurements. The check judges int8 by its SQNR in dB.

On an x86 CPU without int8 dot products (VNNI, AMX), onnxruntime multiplies uint8 activations by
int8 weights with ``vpmaddubsw``, which saturates the sum of each pair of products to int16: with
activations over the full uint8 range, layers lose their signal. There the weights are uint8 (with
a zero point): onnxruntime's uint8 x uint8 kernel widens to int16 first and is exact. 7-bit int8
weights (``reduce_range``, the other fix onnxruntime documents) also stay exact but cost each layer
about 6 dB of SQNR. The choice is recorded in the manifest's quantization record.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tk.errors import ConversionError, UsageError, first_line
from tk.formats.products import saturating_int8_products

QUANTIZED_OPS = ["MatMul", "Gemm"]
WEIGHT_TYPES = ("int8", "uint8")


def weight_type(weights: str | None = None) -> str:
    """``int8`` or ``uint8``: the weights' type on this CPU (``uint8`` where int8 products saturate)."""
    if weights is None:
        return "uint8" if saturating_int8_products() else "int8"
    if weights not in WEIGHT_TYPES:
        raise UsageError(f"int8 weights: expected one of {', '.join(WEIGHT_TYPES)}, got {weights!r}")
    return weights


def weight_record(weights: str) -> str:
    """How the manifest names the weights' type, with the reason for uint8."""
    return "uint8 (this CPU has no VNNI/AMX: int8 products saturate)" if weights == "uint8" else weights


def quant_type(weights: str) -> Any:
    from onnxruntime.quantization import QuantType

    return QuantType.QUInt8 if weights == "uint8" else QuantType.QInt8


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return "int8 uses onnxruntime's quantization tools: pip install 'tk[cpu]'"
    return None


def int8_onnx_from_onnx(
    source: Path, target: Path, *, nodes_to_exclude: list[str] | None = None, weights: str | None = None
) -> None:
    """Write ``source`` dynamically quantized to int8 at ``target`` (same inputs and outputs).

    ``nodes_to_exclude``: ONNX node names left in float32 (the nodes of ``--keep-fp32`` modules).
    ``weights``: ``int8`` or ``uint8``; by default ``weight_type()`` (uint8 where int8 products saturate).
    """
    from onnxruntime.quantization import quantize_dynamic

    # the quantizer logs every skipped node on the root logger: the application decides whether
    # that is shown (the tk command line shows errors only without --debug)
    try:
        quantize_dynamic(
            str(source),
            str(target),
            weight_type=quant_type(weight_type(weights)),
            op_types_to_quantize=QUANTIZED_OPS,
            nodes_to_exclude=list(nodes_to_exclude or []),
        )
    except Exception as exc:  # the quantizer raises many types; each is a conversion failure
        raise ConversionError(f"onnxruntime could not quantize {source.name} to int8: {first_line(exc)}") from exc
