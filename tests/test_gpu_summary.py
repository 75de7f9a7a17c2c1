"""scripts/gpu_summary.py on the files of a real H200 run of scripts/gpu_check.sh (benchmarks/results)."""

import json
import shutil
from pathlib import Path

import pytest

from scripts.gpu_summary import main

RUN = Path(__file__).parent.parent / "benchmarks/results/20261204T162600Z-gpu-check-h200-run2"
FILES = ("bench_small.json", "bench_small_graphs.json", "bench_base_fp32.json", "bench_base_bf16.json", "train.json")


def _work(tmp_path, files=FILES, steps="export-small\tok\t20\nparity\tskipped (SKIP)\t0\n"):
    work = tmp_path / "work"
    work.mkdir()
    for name in files:
        shutil.copy(RUN / name, work / name)
    (work / "steps.tsv").write_text(steps)
    return work


def test_goals_are_read_from_the_run(tmp_path, capsys):
    work, out = _work(tmp_path), tmp_path / "out"
    out.mkdir()
    assert main(work, out) == 0
    goals = json.loads((out / "gpu_check.json").read_text())["goals"]
    # best device-resident p50: eager and torch replayed from CUDA graphs, 0.352 ms at batch 1, 1.102 at 32
    assert goals["small b1 best p50 <= 0.15 ms"]["value"] == pytest.approx(0.35187, rel=1e-4)
    assert goals["small b1 best p50 <= 0.15 ms"]["met"] is False
    assert goals["small b32 best p50 <= 0.3 ms"]["value"] == pytest.approx(1.10183, rel=1e-4)
    # against eager as users call it (2.883 ms, no graphs), not eager replayed from a graph
    assert goals["small b1 best >= 8x eager"]["value"] == pytest.approx(2.88259 / 0.35187, rel=1e-4)
    # the torch program in bf16 from CUDA graphs (2.904 ms) against the fastest eager float32 row (18.877 ms)
    assert goals["base bf16 b32 >= 5x eager fp32"]["value"] == pytest.approx(18.87728 / 2.90416, rel=1e-4)
    assert goals["compiled training >= 1.3x eager"]["value"] == pytest.approx(1.9653, rel=1e-3)
    printed = capsys.readouterr().out
    assert "compile  mode=reduce-overhead, dynamic=True, precision=fp32, cuda_graphs=used" in printed


def test_missing_runs_are_not_measured_and_a_failed_step_fails(tmp_path, capsys):
    work, out = _work(tmp_path, files=("bench_base_fp32.json",), steps="parity\ttimeout\t150\n"), tmp_path / "out"
    out.mkdir()
    assert main(work, out) == 1
    goals = json.loads((out / "gpu_check.json").read_text())["goals"]
    assert all(g["value"] is None and g["met"] is None for g in goals.values())
    assert "not measured" in capsys.readouterr().out
