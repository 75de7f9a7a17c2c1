"""One validator for every form of tolerance: ``--rtol/--atol``, ``--tol NAME=RTOL:ATOL`` and a golden file's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.models import build_model
from tk.runtime import EngineChoice
from tk.tolerances import checked_pair, checked_tolerance, tolerance_for
from tk.workflows.check import check_artifact
from tk.workflows.export import export
from tk.workflows.golden import parse_tolerances

PLANTED = "tests.planted:build"
BAD = ("nan", "inf", "-inf", "-1e-3")


@pytest.mark.parametrize("bad", [float(b) for b in BAD] + ["1e-3", None, True])
def test_checked_tolerance_refuses_all_but_finite_non_negative_numbers(bad):
    with pytest.raises(UsageError, match=r"^--x: expected a finite tolerance of 0 or more, got"):
        checked_tolerance(bad, "--x")


def test_checked_tolerance_accepts_zero_and_finite_numbers():
    assert checked_tolerance(0, "--x") == 0.0 and checked_tolerance(1e-3, "--x") == 1e-3
    assert checked_pair(1, 2.5, "--tol y") == (1.0, 2.5)
    with pytest.raises(UsageError, match=r"^--tol y atol: expected"):
        checked_pair(1, math.nan, "--tol y")


@pytest.mark.parametrize("bad", BAD)
def test_global_form(bad):
    with pytest.raises(UsageError, match=r"^--rtol: expected a finite tolerance"):
        tolerance_for("fp32", rtol=float(bad))
    with pytest.raises(UsageError, match=r"^--atol: expected a finite tolerance"):
        tolerance_for("fp32", atol=float(bad))


@pytest.mark.parametrize("pair", [f"{b}:0" for b in BAD] + [f"0:{b}" for b in BAD] + ["nan:nan", "inf:inf"])
def test_per_output_form(pair):
    with pytest.raises(UsageError, match=r"^--tol logits (rtol|atol): expected a finite tolerance of 0 or more"):
        parse_tolerances([f"logits={pair}"])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tol") / "a"
    export(build_model(PLANTED), root, ExportOptions(formats=("torch",)))
    return root


def _golden_off_by_100(artifact: Path, path: Path, rtol: object, atol: object, per_output: object) -> Path:
    check_artifact(artifact, EngineChoice("torch", options={"trust_model_code": True}), save_golden=path)
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    meta.update(rtol=rtol, atol=atol, tolerances=per_output)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)  # json writes NaN/Infinity
    for key in [k for k in arrays if k.startswith("out.")]:
        arrays[key] = arrays[key] + 100  # a reference that is off by 100
    np.savez(path, **arrays)
    return path


def test_cli_nan_tolerance_is_refused_not_passed(artifact: Path):
    run = CliRunner().invoke(cli, ["check", str(artifact), "--engine", "torch", "--tol", "logits=nan:nan"])
    assert run.exit_code == 2
    lines = [line for line in run.stderr.splitlines() if line]
    assert lines == ["error: --tol logits rtol: expected a finite tolerance of 0 or more, got nan"]


@pytest.mark.parametrize(
    "rtol, atol, per_output, fragment",
    [
        (math.nan, 1e-5, {}, "rtol: expected a finite tolerance"),
        (1e-4, math.inf, {}, "atol: expected a finite tolerance"),
        (1e-4, 1e-5, {"logits": [math.nan, math.nan]}, "tolerance of logits rtol: expected a finite"),
        (1e-4, 1e-5, {"logits": [0, -1]}, "tolerance of logits atol: expected a finite"),
        (1e-4, 1e-5, {"logits": 3}, "tolerance of logits: expected [RTOL, ATOL]"),
    ],
)
def test_golden_file_form(artifact: Path, tmp_path: Path, rtol, atol, per_output, fragment):
    golden = _golden_off_by_100(artifact, tmp_path / "g.npz", rtol, atol, per_output)
    with pytest.raises(UsageError, match=f"^--golden {golden}:.*{fragment}".replace("[", r"\[")):
        check_artifact(artifact, EngineChoice("torch"), golden=golden)
    run = CliRunner().invoke(cli, ["check", str(artifact), "--engine", "torch", "--golden", str(golden)])
    assert run.exit_code == 2 and "--rtol" not in run.stderr and "--atol" not in run.stderr


def test_golden_off_by_100_with_sound_tolerances_fails(artifact: Path, tmp_path: Path):
    golden = _golden_off_by_100(artifact, tmp_path / "g.npz", 1e-4, 1e-5, {"logits": [1e-4, 1e-5]})
    result = check_artifact(artifact, EngineChoice("torch"), golden=golden)
    assert not result.passed and result.reports["torch"].outputs[0].max_abs > 99
