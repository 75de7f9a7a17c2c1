"""A format is one module plus one registry entry (issue #46, item 1): ``tests/toy_format.py``, registered
here and nowhere else, is exported, inspected, checked and optimized like the built-in formats."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tk import registries
from tk.cli import cli
from tk.manifest import verify_artifact


@pytest.fixture
def toy(monkeypatch):
    """The registry entry a new format adds: its writer, its engine, the file role that engine runs."""
    monkeypatch.setitem(registries.FORMATS, "toy", "tests.toy_format:WRITER")
    monkeypatch.setitem(registries.ENGINES, "toy", "tests.toy_format:ToyEngine")
    monkeypatch.setitem(registries.ENGINE_FILE_ROLE, "toy", "toy")


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_export_inspect_and_check_a_registered_format(toy, tmp_path):
    out = tmp_path / "art"
    done = invoke("export", "mlp", "--size", "tiny", "--format", "toy", "--format", "onnx", "--out", str(out))
    assert done.exit_code == 0, done.output
    manifest = verify_artifact(out)
    assert set(manifest.formats) == {"toy", "onnx"} and manifest.check["toy"]["passed"]
    assert manifest.check["toy"]["outputs"][0]["max_abs"] == 0.0  # the same program as eager runs
    shown = invoke("inspect", str(out))
    assert shown.exit_code == 0 and "format     toy: model.toy.pt2" in shown.stdout, shown.output
    checked = invoke("check", str(out), "--engine", "toy")
    assert checked.exit_code == 0 and "parity passed for toy" in checked.stdout, checked.output
    every = invoke("check", str(out))
    assert every.exit_code == 0 and "toy" in every.stdout.split("parity passed for ", 1)[1], every.output


@pytest.mark.slow
def test_optimize_tries_the_formats_own_variants(toy, tmp_path):
    out = tmp_path / "best"
    done = invoke("optimize", "mlp", "--size", "tiny", "--formats", "toy,torch", "--precisions", "fp32",
                  "--batch", "4", "--seconds", "0.2", "--out", str(out))  # fmt: skip
    assert done.exit_code == 0, done.output
    record = json.loads((out / "optimize.json").read_text())
    rows = {row["candidate"]: row for row in record["candidates"]}
    assert {"toy fp32", "toy fp32 second", "torch fp32"} <= set(rows), sorted(rows)
    assert rows["toy fp32 second"]["options"] == {"note": "second"} and rows["toy fp32"]["options"] == {}
    assert rows["toy fp32"]["status"] == rows["toy fp32 second"]["status"] == "passed"
