"""The benchmark scripts: their help, and a tiny dry run that writes the harness' envelope (no timings judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("module", ["scripts.bench_cpu", "scripts.bench_goals", "scripts.load_test"])
def test_help_names_the_shared_options(module):
    done = run_script(module, "--help")
    assert done.returncode == 0, done.stderr
    assert "--wait-quiet" in done.stdout and "--out" in done.stdout


def envelope(out: Path, command: str) -> dict:
    (path,) = out.glob(f"*Z-{command}.json")
    data = json.loads(path.read_text())
    assert data["command"] == command and data["versions"]["torch"]
    assert set(data["load_average"]) == {"before", "after"} and data["settings"]["wait_quiet"] == 0
    return data


def test_bench_goals_dry_run_writes_an_empty_envelope(tmp_path):
    done = run_script(
        "scripts.bench_goals", "--int8-sizes", "", "--bf16-sizes", "", "--skip-hf", "--wait-quiet", "0",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert envelope(tmp_path, "bench-goals")["results"] == {"rows": []}


@pytest.mark.slow
def test_bench_cpu_tiny_run_writes_rows_peaks_and_load_marks(tmp_path):
    done = run_script(
        "scripts.bench_cpu", "--sizes", "tiny", "--batch-sizes", "2", "--seq", "8", "--rows", "eager",
        "--seconds", "0.01", "--no-train", "--wait-quiet", "0", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = envelope(tmp_path, "bench-cpu")
    tiny = data["results"]["sizes"]["tiny"]
    (row,) = tiny["bench"]["rows"]
    assert row["engine"] == "eager" and row["batch_size"] == 2 and isinstance(row["busy"], bool)
    fp32 = tiny["peaks"]["peaks"]["fp32"]["2"]
    assert fp32["gflops"]["median"] > 0 and fp32["gflops"]["n"] == row["iters"]
    assert [m for m, k, n, c in fp32["shapes_mknc"]][:1] == [16]  # batch 2 x seq 8 tokens


def test_load_test_marks_busy_scenarios_and_reads_its_goals_from_the_rows():
    pytest.importorskip("ray.serve", reason="the load test runs on Ray Serve")
    from rich.console import Console

    from scripts.load_test import goals_of, render

    load = {"load_before": 0.5, "load_after": 0.7, "busy": False}
    common = {"requests": 4, "lost": 0, "duplicated": 0, "mismatched": None, "p50_ms": 2.0}
    rows = [
        {"scenario": "single", "batching": True, "samples_per_s": 300.0, "p99_ms": 6.0, **common, **load},
        {"scenario": "single", "batching": False, "samples_per_s": 100.0, "p99_ms": 3.0, **common, **load},
        {
            "scenario": "one client", "batching": False, "samples_per_s": 50.0, "p99_ms": 3.0, **common,
            "engine_p50_ms": 1.5, "overhead_p50_ms": 0.5, "health_p50_ms": 0.2,
            "load_before": 3.5, "load_after": 2.5, "busy": True,
        },
    ]  # fmt: skip
    goals = goals_of(rows, {"gain": 4.0})
    assert goals["single_throughput_ratio"] == 3.0 and goals["single_p99_on_over_p50_off"] == 3.0
    assert goals["engine_batching_bound"] == 4.0 and goals["overhead_ms"] == 0.5
    console = Console(record=True, width=200)
    console.print(render(rows, "tiny"))
    text = console.export_text()
    assert "3.5→2.5 busy" in text and "0.5→0.7" in text and text.count("busy") == 1
