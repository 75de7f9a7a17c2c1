"""Variants of one quantized QDQ graph: the same graph, output for output, as ``quantize_static``
writes when asked for fewer nodes with the same calibration ranges."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("onnxruntime")

from tk.export import ExportOptions
from tk.export.int8.calibration import calibration_batches
from tk.export.onnx.dynamic_int8 import weight_type
from tk.export.onnx.qdq_variants import QdqVariants
from tk.export.onnx.static_int8 import _quantize, _Reader, weight_matmul_nodes
from tk.export.onnx.writer import OnnxOptions
from tk.models import build_model
from tk.spec import random_feeds
from tk.workflows.export import export


@pytest.fixture(scope="module", params=[False, True], ids=["unfused", "fused"])
def quantized(request, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Transformer's float32 graph, fully quantized once, with its calibration cache."""
    root = tmp_path_factory.mktemp("qdq")
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    export(spec, root / "fp32", ExportOptions(formats=("onnx",), settings={"onnx": OnnxOptions(fusions=request.param)}))
    source = root / "fp32" / "model.onnx"
    batches = calibration_batches(random_feeds(spec.signature.inputs, {"batch": 16, "seq": 16}, seed=5))
    nodes = weight_matmul_nodes(source)
    cache = root / "ranges.json"
    _quantize(source, root / "all.onnx", "minmax", cache, _Reader(batches), nodes, weight_type())
    return source, root, cache, nodes, batches


def _outputs(graph, batches):
    import onnxruntime as ort

    session = ort.InferenceSession(
        graph if isinstance(graph, bytes) else str(graph), providers=["CPUExecutionProvider"]
    )
    return [session.run(None, b) for b in batches]


def test_a_variant_computes_what_quantize_static_writes_for_the_same_nodes(quantized):
    source, root, cache, nodes, batches = quantized
    assert len(nodes) >= 5
    variants = QdqVariants(onnx.load(str(root / "all.onnx")), onnx.load(str(source)))
    for kept in ([nodes[0]], nodes[1:3], nodes[:-1]):
        direct = root / "direct.onnx"
        _quantize(source, direct, "minmax", cache, None, list(kept), weight_type())
        graph = variants.with_float(n for n in nodes if n not in kept)
        variant = onnx.load_from_string(graph)
        ops = [n.op_type for n in variant.graph.node]
        assert ops.count("QuantizeLinear") == [n.op_type for n in onnx.load(str(direct)).graph.node].count(
            "QuantizeLinear"
        )
        assert len(variant.graph.initializer) == len(onnx.load(str(direct)).graph.initializer)
        for ours, theirs in zip(_outputs(graph, batches), _outputs(direct, batches), strict=True):
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_every_node_back_in_float_is_the_float32_graph(quantized):
    source, root, _, nodes, batches = quantized
    graph = QdqVariants(onnx.load(str(root / "all.onnx")), onnx.load(str(source))).with_float(nodes)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in onnx.load_from_string(graph).graph.node}
    for ours, reference in zip(_outputs(graph, batches), _outputs(source, batches), strict=True):
        for a, b in zip(ours, reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    with pytest.raises(KeyError, match="not in the float32 graph"):
        QdqVariants(onnx.load(str(root / "all.onnx")), onnx.load(str(source))).with_float(["no-such-node"])


def _residual_graph(path) -> None:
    """y = (x + x @ w1) @ w2: x feeds a quantized MatMul and an Add that is not quantized (a residual)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), n) for n in ("w1", "w2")]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
        helper.make_node("Add", ["x", "a"], ["r"], name="residual"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 16]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "residual", [io[0]], [io[1]], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def test_an_input_shared_with_a_float_node_is_float_again_with_its_layer(tmp_path):
    """quantize_static quantizes an activation once for every reader, so the residual Add reads x
    dequantized while mm1 is int8; without mm1, x is not quantized at all, and the variant must agree."""
    source = tmp_path / "residual.onnx"
    _residual_graph(source)
    rng = np.random.default_rng(1)
    batches = [{"x": (rng.standard_normal((8, 16)) * 4).astype(np.float32)} for _ in range(3)]
    cache = tmp_path / "ranges.json"
    _quantize(source, tmp_path / "all.onnx", "minmax", cache, _Reader(batches), ["mm1", "mm2"], weight_type())
    full = onnx.load(str(tmp_path / "all.onnx"))
    dequantized = {o for n in full.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    assert any(i in dequantized for n in full.graph.node if n.name == "residual" for i in n.input)  # the premise
    variants = QdqVariants(full, onnx.load(str(source)), ["mm1", "mm2"])
    direct = tmp_path / "direct.onnx"
    _quantize(source, direct, "minmax", cache, None, ["mm2"], weight_type())
    for ours, theirs in zip(_outputs(variants.with_float(["mm1"]), batches), _outputs(direct, batches), strict=True):
        np.testing.assert_allclose(ours[0], theirs[0], rtol=0, atol=1e-5)
    everything = variants.with_float(["mm1", "mm2"])
    assert not {"QuantizeLinear", "DequantizeLinear"} & {
        n.op_type for n in onnx.load_from_string(everything).graph.node
    }
    for ours, reference in zip(_outputs(everything, batches), _outputs(source, batches), strict=True):
        np.testing.assert_allclose(ours[0], reference[0], rtol=0, atol=1e-5)
