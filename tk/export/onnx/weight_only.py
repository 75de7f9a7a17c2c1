"""Weight-only int8 and int4 for ONNX: onnxruntime's ``MatMulNBitsQuantizer`` (``--int8-mode weights``).

A decoder's step at batch 1 reads every weight once for one token: it is bound by memory bandwidth, so
storing the products' weights in 8 (or 4) bits cuts the bytes each step reads, while the activations
stay float (no calibration). Each ``MatMul`` with a constant weight becomes a ``MatMulNBits`` (blocks of
32 along the input dimension, symmetric, one scale per block); ``accuracy_level`` 4 lets onnxruntime
quantize the activation to int8 per block and use the CPU's int8 dot products (VNNI, AMX), which was
6x faster than dequantizing to float32 (accuracy level 0) on a Xeon with AMX (benchmarks/history.md).

The language-model head is a ``Gemm`` in the exported graph (a 2-D product), which the quantizer
skips; it is rewritten as ``MatMul`` + ``Add`` first, since it is the largest product a step reads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

WEIGHT_MODES = {"weights": 8, "weights-int4": 4}  # --int8-mode -> bits
BLOCK = 32
ACCURACY_LEVEL = 4  # int8 activations per block: the CPU's int8 dot products


def weight_only_onnx_from_onnx(
    source: Path, target: Path, bits: int, nodes_to_exclude: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """``source`` with its constant-weight products in ``bits``-bit blocks, written to ``target``; the record."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    model = onnx.load(str(source))
    rewritten = gemms_as_matmuls(model)
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, accuracy_level=ACCURACY_LEVEL, bits=bits)
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=BLOCK, is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
        nodes_to_exclude=list(nodes_to_exclude), algo_config=config,
    )  # fmt: skip
    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # one INFO line per node otherwise
    try:
        quantizer.process()
    finally:
        logger.setLevel(level)
    quantizer.model.save_model_to_file(str(target), use_external_data_format=False)
    nodes = quantizer.model.model.graph.node
    return {
        "mode": "weights",
        "bits": bits,
        "block_size": BLOCK,
        "accuracy_level": ACCURACY_LEVEL,
        "quantizer": "onnxruntime MatMulNBitsQuantizer",
        "quantized_products": sum(n.op_type == "MatMulNBits" for n in nodes),
        "float_products": sum(n.op_type in ("MatMul", "Gemm") for n in nodes),
        "gemms_rewritten": rewritten,
    }


def gemms_as_matmuls(model: Any) -> int:
    """Rewrite each plain ``Gemm`` (alpha = beta = 1, no transposed A) whose B is a constant as ``MatMul`` of
    B (transposed if it was) + ``Add`` of C, in place; how many."""
    from onnx import helper, numpy_helper

    graph = model.graph
    constants = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    count = 0
    nodes = []
    for node in graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0
        shared = uses.get(node.input[1], 0) > 1 if len(node.input) > 1 else True  # a tied weight: left alone
        if (
            node.op_type != "Gemm"
            or not plain
            or attributes.get("transA", 0)
            or node.input[1] not in constants
            or shared
        ):
            nodes.append(node)
            continue
        weight = constants[node.input[1]]
        if attributes.get("transB", 0):
            transposed = numpy_helper.to_array(weight).T.copy()
            weight.CopyFrom(numpy_helper.from_array(transposed, weight.name))
        has_bias = len(node.input) > 2 and node.input[2]
        product = node.output[0] + "_matmul" if has_bias else node.output[0]
        made = [helper.make_node("MatMul", [node.input[0], node.input[1]], [product], name=node.name + "_MatMul")]
        if has_bias:
            made.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=node.name + "_Add"))
        for new in made:  # the exporter's scope metadata: which module the product belongs to (tk debug locate)
            new.metadata_props.extend(node.metadata_props)
        nodes += made
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return count
