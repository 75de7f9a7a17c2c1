"""``tk debug locate`` / ``precision``, ``tk export --keep-fp32`` and capture reports, on planted models.

``tests/planted.py:build`` has one block (``blocks.2``) that overflows float16 and wrecks
per-tensor int8 weights, and is harmless in float32; the tests check that the tools name it.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import ParityError
from tk.export import ExportOptions
from tk.export.int8.search import minimize
from tk.export.onnx.writer import OnnxOptions
from tk.manifest import read_manifest
from tk.models import build_model
from tk.workflows.debug.locate import locate
from tk.workflows.debug.precision import find_fp32_modules
from tk.workflows.export import export

PLANTED = "tests.planted:build"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def export_planted(out: Path, precision: str, formats: tuple[str, ...], keep: tuple[str, ...] = ()) -> Path:
    """Export the planted model; a failed check still leaves the artifact (marked failed)."""
    spec = build_model(PLANTED)
    # int8 dynamically: the static quantizer would exclude the planted block by itself
    dynamic = {"onnx": OnnxOptions(int8_mode="dynamic")} if precision == "int8" and "onnx" in formats else {}
    try:
        export(spec, out, ExportOptions(formats=formats, precision=precision, keep_fp32=keep, settings=dynamic))
    except ParityError:
        pass
    return out


@pytest.fixture(scope="module")
def fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_planted(tmp_path_factory.mktemp("fp16") / "art", "fp16", ("torch", "onnx"))


@pytest.fixture(scope="module")
def int8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_planted(tmp_path_factory.mktemp("int8") / "art", "int8", ("onnx",))


def test_planted_divergence_is_real(fp16: Path, int8: Path) -> None:
    torch_report = read_manifest(fp16).check["torch"]
    assert not torch_report["passed"] and torch_report["outputs"][0]["nan"] > 0  # float16 overflow -> NaN
    int8_report = read_manifest(int8).check["onnx"]
    assert not int8_report["passed"] and int8_report["outputs"][0]["sqnr_db"] < 10  # floor is 35 dB


def test_locate_torch_names_the_planted_block(fp16: Path) -> None:
    result = locate(fp16, "torch", trust_model_code=True)
    first = result.first
    assert first is not None and first.module == "blocks.2.up", first
    assert first.nonfinite > 0
    before = [r for r in result.rows if r.order < first.order]
    assert len(before) >= 10 and all(r.passed for r in before)  # embed, blocks.0, blocks.1 and their parts
    assert all(r.max_rel < 5e-3 for r in before)
    assert {r.module for r in result.worst_growth(2)} == {"blocks.2.up", "blocks.2"}
    assert not result.engine_passed  # the torch engine's own output has NaN too


def test_locate_onnx_int8_names_the_planted_block(int8: Path, tmp_path: Path) -> None:
    out = tmp_path / "locate.json"
    run = invoke("debug", "locate", str(int8), "--engine", "onnx", "--trust-model-code", "--json", str(out))
    assert run.exit_code == 0, run.output
    assert "first divergence: blocks.2." in run.stdout
    assert "can change which fusions" in run.stdout
    table = json.loads(out.read_text())
    assert table["first_divergence"].startswith("blocks.2.")
    rows = {r["module"]: r for r in table["modules"]}
    assert rows["blocks.1"]["passed"] and rows["blocks.1"]["max_rel"] < 0.05
    assert not rows["blocks.2"]["passed"] and rows["blocks.2"]["max_rel"] > 0.3
    assert "blocks.2.up" in table["unmatched"]  # the quantizer's nodes carry no scope metadata


def test_locate_onnx_fp16_separates_instrumented_copy_from_engine(fp16: Path) -> None:
    # onnxruntime's CPU kernels compute float16 graphs in float32, so the engine passes; the copy
    # with module outputs added keeps float16 values and overflows: the output says so
    result = locate(fp16, "onnx", trust_model_code=True)
    assert result.engine_passed
    assert result.first is not None and result.first.module == "blocks.2.up"
    assert any("only in the instrumented graph" in n for n in result.notes)


@pytest.mark.slow
@pytest.mark.fits(seconds=60)  # 45 s on a 2-core AVX2 EPYC: run last, left out when CI's 30 minutes run short
def test_locate_aoti_names_the_planted_block(tmp_path: Path) -> None:
    root = export_planted(tmp_path / "aoti", "fp16", ("aoti",))
    result = locate(root, "aoti", trust_model_code=True)
    assert result.first is not None and result.first.module == "blocks.2.up"
    assert any("captured again" in result.via for _ in [0])
    assert not result.engine_passed and sum(o.nan for o in result.engine_outputs) > 0


def test_precision_fp16_finds_the_block_and_keep_fp32_passes(fp16: Path, tmp_path: Path) -> None:
    run = invoke("debug", "precision", str(fp16), "--trust-model-code", "--json", str(tmp_path / "p.json"))
    assert run.exit_code == 0, run.output
    found = json.loads((tmp_path / "p.json").read_text())
    keep = found["keep_fp32"]
    assert keep and len(keep) <= 3 and all(m.startswith("blocks.2") for m in keep), keep
    assert found["before"]["nonfinite"] > 0 and not found["before"]["passed"]
    assert found["after"]["passed"] and found["after"]["max_abs"] < 2e-2
    assert f"--keep-fp32 {','.join(keep)}" in run.stdout
    fixed = export_planted(tmp_path / "fixed", "fp16", ("torch", "onnx"), tuple(keep))
    manifest = read_manifest(fixed)
    assert manifest.status == "passed", manifest.check
    assert manifest.model["keep_fp32"] == keep
    assert manifest.check["torch"]["outputs"][0]["max_abs"] < 2e-2


def test_precision_int8_finds_the_block_and_keep_fp32_passes(int8: Path, tmp_path: Path) -> None:
    found = find_fp32_modules(int8, trust_model_code=True)
    # the planted block first; dynamic int8 then needs a few more Linears kept to reach the 35 dB floor,
    # still a small set out of the model's 22 modules and 10 quantized MatMuls
    assert "blocks.2.up" in found.keep and len(found.keep) <= 5, found.keep
    assert found.before.sqnr_db is not None and found.before.sqnr_db < 10
    assert found.after is not None and found.after.passed and found.after.sqnr_db >= 35
    fixed = export_planted(tmp_path / "fixed8", "int8", ("onnx",), tuple(found.keep))
    manifest = read_manifest(fixed)
    assert manifest.status == "passed", manifest.check
    assert manifest.formats["onnx"]["int8_excluded_nodes"] >= 1

    def quantized(root: Path) -> int:
        return sum(n.op_type == "MatMulInteger" for n in onnx.load(str(root / "model.onnx")).graph.node)

    assert quantized(int8) == 10  # embed, 4 blocks x (up, down), head
    assert quantized(fixed) == 10 - len(found.keep)  # all but the kept Linears


def test_keep_fp32_unknown_module_is_one_line_error(tmp_path: Path) -> None:
    run = invoke("export", PLANTED, "--precision", "fp16", "--keep-fp32", "blocks.9", "--out", str(tmp_path / "a"))
    assert run.exit_code == 2
    assert "error: --keep-fp32 blocks.9: the model has no module of that name" in run.stderr
    assert "blocks.0" in run.stderr


def test_minimize_finds_the_needed_pair() -> None:
    needed = {"c", "f"}
    calls: list[list[str]] = []

    def passes(keep: list[str]) -> bool:
        calls.append(keep)
        return needed <= set(keep)

    assert sorted(minimize(list("abcdefgh"), [], passes)) == ["c", "f"]
    assert len(calls) < 16


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        (
            "tests.planted:data_dependent",
            ["DATA_DEPENDENT_ERROR", "planted.py`, line", "if h.sum() > 0:", "torch.cond"],
        ),
        ("tests.planted:fixed_batch", ["GUARD_ADDED", "reshape(4, -1)", "--batch 4:4:4", "planted.py`, line"]),
        (
            "tests.planted:no_onnx",
            ["torch.onnx could not convert", "tkplanted.mystery", "planted.py:", "mystery(x) + 1"],
        ),
    ],
)
def test_failed_capture_writes_a_report(tmp_path: Path, model: str, fragments: list[str]) -> None:
    out = tmp_path / "art"
    run = invoke("export", model, "--out", str(out))
    assert run.exit_code == 2
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    report = tmp_path / "art.export-report.md"
    assert f"(report: {report})" in errors[0]
    assert not out.exists()  # no artifact directory on a failed capture
    text = report.read_text()
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_report_path_option(tmp_path: Path) -> None:
    where = tmp_path / "reports" / "why.md"
    run = invoke("export", "tests.planted:fixed_batch", "--out", str(tmp_path / "a"), "--report", str(where))
    assert run.exit_code == 2 and where.is_file()
    assert "fixes dimension `batch` to 4" in where.read_text()
    assert f"report: {where}" in run.stderr  # the one-line error names the report
