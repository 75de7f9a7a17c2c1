"""The command line: exit codes and one-line messages, through click's CliRunner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tk.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_models_lists_every_builtin():
    result = invoke("models", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert {r["name"] for r in rows} == {"transformer", "linear", "mlp", "resnet18"}
    assert all(r["sizes"] == ["tiny", "small", "base"] for r in rows)


def test_unknown_model_name():
    assert_one_line_error(invoke("export", "bert"), 2, "unknown model 'bert'", "transformer")


def test_module_callable_that_does_not_import():
    assert_one_line_error(invoke("train", "no_such_package.models:build"), 2, "cannot import 'no_such_package.models'")


def test_module_callable_missing_attribute():
    assert_one_line_error(invoke("export", "examples.user_model:nothing"), 2, "has no attribute 'nothing'")


@pytest.mark.parametrize(
    "description, fragment",
    [
        ("features", "expected NAME:DTYPE:SHAPE"),
        ("features:float33:4x16", "expected a dtype"),
        ("features:float32:4xx16", "expected NAME:DTYPE:SHAPE"),
        ("features:float32:0x16", "sizes of at least 1"),
        ("features:float32:4x8", "forward failed"),
    ],
)
def test_bad_input_description(description, fragment):
    result = invoke("export", "examples.user_model:regressor", "--input", description, "--format", "torch")
    assert_one_line_error(result, 2, fragment)


def test_user_model_without_inputs_asks_for_them():
    assert_one_line_error(invoke("export", "examples.user_model:regressor"), 2, "--input NAME:DTYPE:SHAPE")


def test_bad_dimension_range():
    assert_one_line_error(invoke("export", "transformer", "--size", "tiny", "--batch", "8:1:2"), 2, "min <= opt <= max")


def test_debug_shows_the_traceback():
    result = CliRunner().invoke(cli, ["--debug", "export", "bert"])
    assert result.exit_code != 0
    assert result.exception is not None and "unknown model" in str(result.exception)


def test_train_writes_a_checkpoint_and_sidecar(tmp_path):
    out = tmp_path / "lin.safetensors"
    result = invoke("train", "linear", "--size", "tiny", "--out", str(out))
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "lin.safetensors.json").read_text())
    assert meta["name"] == "linear" and meta["train"]["final_loss"] < 1e-3
    assert meta["versions"]["torch"]


def test_train_user_model_has_no_task():
    assert_one_line_error(invoke("train", "examples.user_model:scorer"), 2, "no training task")


def test_export_and_inspect_a_user_model(tmp_path):
    out = tmp_path / "scorer"
    result = invoke("export", "examples.user_model:scorer", "--format", "torch", "--out", str(out))
    assert result.exit_code == 0, result.output
    shown = invoke("inspect", str(out))
    assert shown.exit_code == 0
    assert "tokens: int64[batch, seq]" in shown.stdout and "status: passed" in shown.stdout


def test_python_dash_m_tk_works_without_installing():
    done = subprocess.run([sys.executable, "-m", "tk", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "export" in done.stdout


def test_import_tk_cli_stays_light():
    code = "import sys, tk, tk.cli, tk.errors; print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_user_code_named_by_an_artifact_runs_only_when_trusted(tmp_path, monkeypatch):
    out = tmp_path / "scorer"
    assert invoke("export", "examples.user_model:scorer", "--format", "torch", "--out", str(out)).exit_code == 0
    own = invoke("check", str(out), "--engine", "torch")  # signed with the user's own key: trusted
    assert own.exit_code == 0, own.output
    from tk.signing import ensure_own_key

    signer = ensure_own_key()[1]
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))  # someone else receives it
    refused = invoke("check", str(out), "--engine", "torch")
    assert_one_line_error(refused, 2, "user code", "--trust-model-code", "--public-key")
    for flags in (["--trust-model-code"], ["--public-key", str(signer)]):
        trusted = invoke("check", str(out), "--engine", "torch", *flags)
        assert trusted.exit_code == 0, trusted.output
        assert "parity passed for torch" in trusted.stdout
