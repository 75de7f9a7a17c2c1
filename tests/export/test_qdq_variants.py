"""Variants of one quantized QDQ graph: the same graph, output for output, as ``quantize_static``
writes when asked for fewer nodes with the same calibration ranges."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("onnxruntime")

from tk.export import ExportOptions
from tk.export.calibration import calibration_batches
from tk.export.onnx import OnnxOptions
from tk.export.qdq_variants import QdqVariants
from tk.export.quantize import weight_type
from tk.export.static_int8 import _quantize, _Reader, weight_matmul_nodes
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
