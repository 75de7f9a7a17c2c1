"""``tk check --save-golden / --golden / --reference / --tol`` and top-1 agreement, on the planted model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import ParityError, UsageError
from tk.export import ExportOptions
from tk.models import build_model
from tk.runtime import EngineChoice
from tk.workflows.check import check_artifact
from tk.workflows.export import export
from tk.workflows.golden import parse_tolerances

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "tests.planted:build"
TRUST = {"trust_model_code": True}


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two fp32 exports of the same weights (torch+onnx, and torch alone), and the failing fp16 one."""
    base = tmp_path_factory.mktemp("golden")
    export(build_model(PLANTED), base / "a", ExportOptions(formats=("torch", "onnx")))
    export(build_model(PLANTED), base / "b", ExportOptions(formats=("torch",)))
    with pytest.raises(ParityError):
        export(build_model(PLANTED), base / "fp16", ExportOptions(formats=("torch",), precision="fp16"))
    return {"a": base / "a", "b": base / "b", "fp16": base / "fp16", "dir": base}


def test_golden_round_trip_without_the_model_code(artifacts: dict[str, Path], tmp_path: Path) -> None:
    golden = artifacts["dir"] / "planted.golden.npz"
    saved = check_artifact(artifacts["a"], EngineChoice("onnx", options=TRUST), save_golden=golden)
    assert saved.passed and golden.is_file()
    with np.load(golden, allow_pickle=False) as archive:  # plain arrays, no pickle
        meta = json.loads(archive["meta"].tobytes().decode())
        assert meta["format"] == "tk-golden" and meta["runs"] == len(saved.reports["onnx"].shapes)
        assert meta["rtol"] == 1e-4 and meta["atol"] == 1e-5 and meta["model"]["name"] == PLANTED
        assert archive["in.0.x"].dtype == np.float32 and archive["out.0.logits"].shape[1] == 5
    # another machine: a fresh process in an empty directory, where tests.planted cannot be imported
    only_tk = tmp_path / "site"
    only_tk.mkdir()
    (only_tk / "tk").symlink_to(ROOT / "tk")  # this checkout's tk, and nothing else of the repository
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TK_SIGNING_KEY")}
    env["PYTHONPATH"] = str(only_tk)
    cmd = [sys.executable, "-m", "tk", "check", str(artifacts["b"]), "--engine", "all", "--golden", str(golden)]
    cmd += ["--json", str(tmp_path / "r.json")]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "parity against golden planted.golden.npz (eager)" in run.stdout
    assert "parity passed for torch" in run.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report) == ["torch"]  # all: eager and compile rebuild the model, so they are left out
    logits = report["torch"]["outputs"][0]
    assert logits["max_abs"] < 1e-4 and logits["top1_rate"] == 1.0
    probe = subprocess.run(
        [sys.executable, "-c", "import tests.planted"], cwd=tmp_path, env=env, capture_output=True, timeout=60
    )
    assert probe.returncode != 0  # the model code really was out of reach


def test_golden_catches_the_fp16_overflow(artifacts: dict[str, Path]) -> None:
    golden = artifacts["dir"] / "fp32.golden.npz"
    check_artifact(artifacts["a"], EngineChoice("torch", options=TRUST), save_golden=golden)
    result = check_artifact(artifacts["fp16"], EngineChoice("torch", allow_failed=True), golden=golden)
    report = result.reports["torch"]
    assert not result.passed and report.outputs[0].nan > 0
    assert report.rtol == 2e-2  # the golden's fp32 tolerances do not apply to an fp16 artifact


def test_reference_engine_and_per_output_tolerance(artifacts: dict[str, Path]) -> None:
    result = check_artifact(artifacts["a"], EngineChoice("torch"), reference="onnx", samples=16)
    report = result.reports["torch"]
    assert result.passed and report.reference == "onnx"
    out = report.outputs[0]
    assert 0 < out.max_abs < 1e-4 and out.top1_total == 16 and out.top1_rate == 1.0
    run = invoke("check", str(artifacts["a"]), "--engine", "torch", "--reference", "onnx", "--tol", "logits=0:0")
    assert run.exit_code == 1  # torch and onnx differ in the last bits: an exact tolerance fails
    assert "tolerance of logits: rtol 0, atol 0" in run.stdout
    assert "parity against onnx" in run.stdout


def test_tolerance_errors(artifacts: dict[str, Path]) -> None:
    assert parse_tolerances(["logits=1e-3:1e-4", "b=0:2"]) == {"logits": (1e-3, 1e-4), "b": (0.0, 2.0)}
    for bad in ("logits", "logits=1e-3", "=1:2", "logits=a:b", "logits=-1:0"):
        with pytest.raises(UsageError, match="--tol"):
            parse_tolerances([bad])
    run = invoke("check", str(artifacts["a"]), "--engine", "onnx", "--tol", "probs=1:1", "--trust-model-code")
    assert run.exit_code == 2 and "error: --tol: no output named probs; the outputs are logits" in run.stderr


def test_golden_refuses_other_inputs(artifacts: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--golden brings its own inputs"):
        check_artifact(artifacts["b"], EngineChoice("torch"), golden=tmp_path / "g.npz", samples=4)
    run = invoke("check", str(artifacts["b"]), "--engine", "torch", "--golden", str(tmp_path / "missing.npz"))
    assert run.exit_code == 2 and "no such file" in run.stderr
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.zeros((2, 16), np.float32))
    with pytest.raises(UsageError, match="found no meta"):
        check_artifact(artifacts["b"], EngineChoice("torch"), golden=foreign)
