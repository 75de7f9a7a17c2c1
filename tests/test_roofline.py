"""tk bench --roofline: a matrix-product peak measured in the run, model FLOPs counted, shares reported."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tk.cli import cli
from tk.workflows.hardware import cpu_precision_reason
from tk.workflows.roofline import engine_precision, matmul_peak, model_flops


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_matmul_peak_is_measured(precision):
    peak = matmul_peak(precision, shape=(256, 128, 256), repeats=2)
    assert peak.precision == precision and peak.shape == (256, 128, 256)
    assert peak.seconds > 0
    assert peak.gflops == pytest.approx(2 * 256 * 128 * 256 / peak.seconds / 1e9)


def test_model_flops_counts_matrix_products():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    assert model_flops(model, (torch.randn(3, 16),)) == 2 * 3 * (16 * 32 + 32 * 4)


def test_engine_precisions_follow_the_artifact():
    assert engine_precision("eager", "bf16") == "fp32"
    assert engine_precision("compile", "bf16") == "bf16"
    assert engine_precision("compile", "int8") == "fp32"
    assert engine_precision("onnx", "int8") == "int8"


def test_reduced_precision_needs_its_cpu_flags():
    avx2_only = frozenset({"avx2", "fma"})
    assert "avx512_bf16 or amx_bf16" in cpu_precision_reason("bf16", avx2_only)
    assert "avx512_vnni" in cpu_precision_reason("int8", avx2_only)
    assert cpu_precision_reason("bf16", frozenset({"avx512f", "avx512_bf16"})) is None
    assert cpu_precision_reason("int8", frozenset({"amx_int8"})) is None
    assert cpu_precision_reason("fp32", avx2_only) is None


@pytest.mark.slow
def test_bench_roofline_reports_each_engines_share_of_the_measured_peak(exported, tmp_path):
    root = exported("transformer", ("onnx",)).root
    out = tmp_path / "bench.json"
    args = ["bench", str(root), "--engine", "onnx", "--batch-sizes", "2", "--iters", "3", "--roofline"]
    result = CliRunner().invoke(cli, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "of peak" in result.output and "measured matmul peak GFLOP/s: fp32" in result.output
    data = json.loads(out.read_text())
    roofline = data["settings"]["roofline"]
    assert roofline["peaks"]["fp32"]["gflops"] > 0
    assert roofline["flops_per_sample"] > 0
    for row in data["rows"]:
        rate = roofline["flops_per_sample"] * row["batch_size"] / (row["p50_ms"] / 1e3) / 1e9
        assert row["gflops"] == pytest.approx(rate, rel=1e-2, abs=0.1)
        assert row["peak_share"] == pytest.approx(rate / roofline["peaks"]["fp32"]["gflops"], rel=1e-2, abs=1e-4)
