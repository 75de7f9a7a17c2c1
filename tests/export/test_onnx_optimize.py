"""onnxruntime's transformer fusions on the exported graph: fewer nodes, same outputs, check passes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

pytest.importorskip("onnxruntime")

from tk.cli import cli
from tk.export import ExportOptions
from tk.export.onnx_optimize import fused_op_counts
from tk.models import build_model
from tk.runtime import load
from tk.workflows.export import export


@pytest.fixture(scope="module")
def fused_and_unfused(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("fuse") / "transformer"
    result = export(build_model("transformer", size="tiny"), out, ExportOptions(formats=("onnx",), keep_unfused=True))
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
    assert counts.get("SkipLayerNormalization", 0) >= 2  # 2 blocks: residual + LayerNorm fused
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
    assert f"SkipLayerNormalization {info['fused_ops']['SkipLayerNormalization']}" in shown.output


def test_no_fuse_ships_the_exporters_graph(tmp_path):
    result = export(
        build_model("mlp", size="tiny"), tmp_path / "m", ExportOptions(formats=("onnx",), onnx_fusions=False)
    )
    assert "fusions" not in result.manifest.formats["onnx"]
    assert fused_op_counts(ir.load(tmp_path / "m" / "model.onnx")) == {}
