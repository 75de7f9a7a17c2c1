"""onnxruntime's transformer fusions on the exported graph: fewer nodes, same outputs, check passes;
the residual LayerNorms rewritten for onnxruntime's CPU kernels."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

pytest.importorskip("onnxruntime")

from tk.cli import cli
from tk.export import ExportOptions
from tk.export.onnx.fusions import fused_op_counts, layer_norms_for_cpu, optimized_onnx_from_onnx
from tk.export.onnx.writer import OnnxOptions
from tk.models import build_model
from tk.runtime import load
from tk.workflows.export import export


@pytest.fixture(scope="module")
def fused_and_unfused(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("fuse") / "transformer"
    result = export(
        build_model("transformer", size="tiny"),
        out,
        ExportOptions(formats=("onnx",), settings={"onnx": OnnxOptions(keep_unfused=True)}),
    )
    return out, result


def test_fused_graph_ships_passes_the_check_and_has_fewer_nodes(fused_and_unfused):
    out, result = fused_and_unfused
    assert result.passed and result.manifest.check["onnx"]["passed"]
    info = result.manifest.formats["onnx"]["fusions"]
    assert info["applied"]
    fused = ir.load(out / "model.onnx")
    unfused = ir.load(out / "model.unfused.onnx")
    assert len(fused.graph) == info["nodes_after"] < info["nodes_before"] == len(unfused.graph)
    counts = fused_op_counts(fused)
    assert counts == info["fused_ops"]
    # 2 blocks, 2 residual LayerNorms each: fused by onnxscript, then back to Sum + LayerNormalization for the CPU
    assert info["fusions"]["skip_layer_normalization"] == 4
    assert info["cpu_rewrites"]["skip_layer_norm_to_sum_layer_norm"] == 4
    assert "SkipLayerNormalization" not in counts and counts["MultiHeadAttention"] == 2 and counts["BiasGelu"] == 2
    assert sum(n.op_type == "Sum" for n in fused.graph) >= 4
    assert fused_op_counts(unfused) == {}
    assert info["max_abs_diff"] <= 1e-4


def test_fused_and_unfused_graphs_agree_on_new_inputs(fused_and_unfused):
    import onnxruntime as ort

    out, _ = fused_and_unfused
    rng = np.random.default_rng(7)
    feeds = {"input_ids": rng.integers(0, 64, (5, 11)).astype(np.int64), "attention_mask": np.ones((5, 11), np.int64)}
    feeds["attention_mask"][2, 6:] = 0
    with load(out, "onnx") as engine:
        fused = engine.run(feeds)["logits"]
    unfused = ort.InferenceSession(str(out / "model.unfused.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    assert fused.shape == (5, 2)
    assert float(np.abs(fused - unfused).max()) <= 1e-5


def test_inspect_shows_fused_operator_counts(fused_and_unfused):
    out, result = fused_and_unfused
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    info = result.manifest.formats["onnx"]["fusions"]
    assert f"{info['nodes_before']} -> {info['nodes_after']} nodes" in shown.output
    assert f"BiasGelu {info['fused_ops']['BiasGelu']}" in shown.output
    undone = info["cpu_rewrites"]["skip_layer_norm_to_sum_layer_norm"]
    assert f"for the CPU: skip_layer_norm_to_sum_layer_norm {undone}" in shown.output


def test_no_fuse_ships_the_exporters_graph(tmp_path):
    result = export(
        build_model("mlp", size="tiny"),
        tmp_path / "m",
        ExportOptions(formats=("onnx",), settings={"onnx": OnnxOptions(fusions=False)}),
    )
    assert "fusions" not in result.manifest.formats["onnx"]
    assert fused_op_counts(ir.load(tmp_path / "m" / "model.onnx")) == {}


def _skip_layer_norm_chain(blocks: int, hidden: int = 16, *, use_mean: bool = False) -> bytes:
    """``blocks`` SkipLayerNormalization nodes in a chain (with bias; the last one's sum output used)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), name)
        for name in ("gamma", "beta", "bias")
    ]
    nodes, x = [], "x"
    for i in range(blocks):
        outputs = [f"y{i}", f"mean{i}" if use_mean else "", "", f"sum{i}" if i == blocks - 1 else ""]
        nodes.append(
            helper.make_node(
                "SkipLayerNormalization",
                [x, "skip", "gamma", "beta", "bias"],
                outputs,
                domain="com.microsoft",
                epsilon=1e-12,
            )
        )
        x = f"y{i}"
    outs = [x, f"sum{blocks - 1}"] + (["mean0"] if use_mean else [])
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", hidden]) for n in ("x", "skip")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outs],
        inits,
    )
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _ort_run(model: bytes, feeds: dict[str, np.ndarray], optimized: str | None = None) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if optimized:
        opts.optimized_model_filepath = optimized  # what onnxruntime's ORT_ENABLE_ALL made of the graph
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_layer_norms_for_cpu_gives_the_same_values_and_onnxruntime_does_not_fuse_them_back(tmp_path):
    import onnx

    source = _skip_layer_norm_chain(3)
    model = ir.from_proto(onnx.load_from_string(source))
    assert layer_norms_for_cpu(model) == {"skip_layer_norm_to_sum_layer_norm": 3}
    ops = [n.op_type for n in model.graph]
    assert ops == ["Add", "Sum", "LayerNormalization"] * 3  # bias, residual, norm
    assert fused_op_counts(model) == {}
    rewritten = ir.to_proto(model).SerializeToString()
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 5, 16)).astype(np.float32) for n in ("x", "skip")}
    want = _ort_run(source, feeds)
    got = _ort_run(rewritten, feeds, optimized=str(tmp_path / "ort.onnx"))
    for w, g in zip(want, got, strict=True):  # output and the x + skip + bias sum
        assert float(np.abs(w - g).max()) <= 1e-5
    after_ort = Counter(n.op_type for n in onnx.load(tmp_path / "ort.onnx").graph.node)
    assert after_ort["SkipLayerNormalization"] == 0 and after_ort["LayerNormalization"] == 3


def test_layer_norms_for_cpu_keeps_a_skip_layer_norm_whose_mean_is_used():
    import onnx

    model = ir.from_proto(onnx.load_from_string(_skip_layer_norm_chain(2, use_mean=True)))
    assert layer_norms_for_cpu(model) == {"skip_layer_norm_to_sum_layer_norm": 1}
    assert fused_op_counts(model) == {"SkipLayerNormalization": 1}


def test_a_cuda_export_keeps_skip_layer_normalization(fused_and_unfused, tmp_path):
    out, _ = fused_and_unfused
    before, after, fusions, ops, rewrites = optimized_onnx_from_onnx(
        out / "model.unfused.onnx", tmp_path / "cuda.onnx", for_cpu=False
    )
    assert ops["SkipLayerNormalization"] == fusions["skip_layer_normalization"] == 4
    assert rewrites == {} and after < before
