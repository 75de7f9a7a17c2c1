"""The benchmark scripts: their help, and a tiny dry run that writes the harness' envelope (no timings judged)."""

from __future__ import annotations

import importlib
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
def test_help_names_the_shared_options(module, capsys):
    # in this process: a subprocess per script spent its seconds importing torch (the runs below start them for real)
    with pytest.raises(SystemExit) as ended:
        importlib.import_module(module).parse_args(["--help"])
    assert ended.value.code == 0
    out = capsys.readouterr().out
    assert "--wait-quiet" in out and "--out" in out


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


@pytest.mark.slow
@pytest.mark.fits(seconds=100)
def test_load_test_tiny_run_writes_every_scenario_with_its_load_mark(tmp_path):
    pytest.importorskip("ray.serve", reason="the load test runs on Ray Serve")
    pytest.importorskip("tritonclient.http", reason="the load test's clients are tritonclient's")
    done = run_script(
        "scripts.load_test", "--size", "tiny", "--requests", "12", "--clients", "2", "--max-batch", "4", "--seq", "8",
        "--ingress", "proxy", "--one-client-requests", "4", "--wait-quiet", "0", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = envelope(tmp_path, "serve-load")["results"]
    scenarios = [(r["scenario"], r["batching"]) for r in results["rows"]]
    assert scenarios == [
        ("mixed 1-4", True),
        ("single", True),
        ("mixed 1-4", False),
        ("single", False),
        ("one client", False),
    ]
    assert all(r["lost"] == 0 and r["duplicated"] == 0 and isinstance(r["busy"], bool) for r in results["rows"])
    assert results["rows"][0]["mismatched"] == 0 and results["engine_batching"]["max_batch"] == 4
    assert set(results["goals"]) >= {"single_throughput_ratio", "overhead_ms"} and results["ingress"] == "proxy"
