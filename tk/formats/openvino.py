"""The ``openvino`` format: an OpenVINO IR (``model.xml`` + ``model.bin``) and what its writer and engine share.

The IR holds float32 weights (saved without OpenVINO's default fp16 compression) or, for int8,
NNCF's FakeQuantize nodes with int8 weights. The precision the CPU computes in is not in the IR:
it is the compile-time ``INFERENCE_PRECISION_HINT``. OpenVINO's CPU plugin defaults that hint to
bf16 on CPUs with AVX512-BF16 or AMX, so a float32 artifact must ask for f32 explicitly; on a CPU
without bfloat16 dot products a bf16 hint silently falls back to f32.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tk.spec import Dim, Signature

XML = "model.xml"
BIN = "model.bin"
ROLE = "openvino"  # the IR's graph (what the engine registry names)
WEIGHTS_ROLE = "openvino-weights"

# the manifest's ``formats.openvino.cache`` of a decoder whose IR keeps its KV cache (tk.export.openvino.stateful)
CACHE_IN_STATE = "state"
STATE_INPUTS = ("input_ids", "position_ids", "attention_mask", "beam_idx")  # such an IR's inputs and outputs
STATE_OUTPUTS = ("logits",)
# the cache's precision inside OpenVINO (its KV_CACHE_PRECISION) under each precision hint: float32 artifacts
# keep float32 keys (tokens identical to PyTorch's); bf16 ones float16, as optimum-intel writes into its IRs
KV_CACHE_PRECISIONS = {"f32": "f32", "bf16": "f16"}

# tk precision -> the CPU plugin's INFERENCE_PRECISION_HINT; int8's unquantized layers stay float32
PRECISION_HINTS: dict[str, str] = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}


def missing_reason() -> str | None:
    """Why OpenVINO cannot be used here (not installed), or None."""
    if importlib.util.find_spec("openvino") is None:
        return "openvino is not installed (pip install 'tk[openvino]')"
    return None


def bounded_shapes(signature: Signature, dims: dict[str, Dim]) -> dict[str, Any]:
    """Each input's ``openvino.PartialShape``: named dimensions bounded by their Dim's [min, max]."""
    import openvino as ov

    shapes = {}
    for spec in signature.inputs:
        axes = []
        for axis in spec.shape:
            if isinstance(axis, str):
                dim = dims[axis]
                axes.append(ov.Dimension(dim.min) if dim.static else ov.Dimension(dim.min, dim.max))
            else:
                axes.append(ov.Dimension(axis))
        shapes[spec.name] = ov.PartialShape(axes)
    return shapes


def precision_name(value: Any) -> str:
    """An OpenVINO element type (``<Type: 'float32'>``) as its short name (``f32``)."""
    name = getattr(value, "get_type_name", None)
    return str(name() if callable(name) else value)
