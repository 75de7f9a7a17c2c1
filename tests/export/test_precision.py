"""Reduced-precision exports pass the check with their own tolerance rows; int8 is judged by its SQNR floor.

The tiny Transformer is exported under fp16 and bf16 autocast (torch and aoti formats) and as int8
ONNX; each report must carry its precision's (rtol, atol) and SQNR floor from tk.tolerances, and
the verdict must follow from the numbers it reports.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import package_source
from tk.export import ExportOptions
from tk.export.aoti.passes import ATTENTION_AS_MATMULS, flash_attention_preferred
from tk.export.aoti.unpadded import PADDING_REMOVED
from tk.formats.aoti import packing_features
from tk.models import build_model
from tk.tolerances import MIN_SQNR_DB, TOLERANCES
from tk.workflows.export import export


def _export(tmp_path, precision, formats, *, train_steps=0):
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    if train_steps:
        from tk.models.train import train

        train(spec, steps=train_steps, seed=0)
    return export(spec, tmp_path / precision, ExportOptions(formats=formats, precision=precision))


@pytest.mark.slow
@pytest.mark.fits(seconds=40)  # 26 s each on the 2-core AVX2 EPYC
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_exports_pass_with_their_tolerance_row(tmp_path, precision):
    result = _export(tmp_path, precision, ("torch", "aoti"))
    rtol, atol = TOLERANCES[precision]
    assert result.manifest.precision == precision and result.manifest.status == "passed"
    assert result.manifest.formats["aoti"]["inductor_configs"] == {"freezing": True}  # weights folded, prepacked
    assert result.manifest.formats["aoti"]["packed_for"] == packing_features()  # for this CPU's oneDNN kernels
    source = package_source(tmp_path / precision)
    # the Transformer has an attention mask: its linears run on real tokens only
    if flash_attention_preferred(precision):  # AMX for the precision: aten's flash kernel on its tiles
        assert result.manifest.formats["aoti"]["graph_passes"] == [PADDING_REMOVED]
        assert "flash_attention" in source
    else:
        assert result.manifest.formats["aoti"]["graph_passes"] == [PADDING_REMOVED, ATTENTION_AS_MATMULS]
        assert "flash_attention" not in source and "bmm" in source  # attention as two products
        assert "baddbmm" in source  # the padding mask added inside the first product, not in the softmax
    for fmt in ("torch", "aoti"):
        report = result.manifest.check[fmt]
        assert (report["rtol"], report["atol"], report["min_sqnr_db"]) == (rtol, atol, MIN_SQNR_DB[precision])
        for output in report["outputs"]:
            assert output["passed"], output
            # reduced precision really ran: not bit-exact with float32, yet well inside the row
            assert 0 < output["max_abs"] <= atol + rtol * 10, output
            assert output["sqnr_db"] >= MIN_SQNR_DB[precision], output


def test_int8_verdict_follows_its_sqnr_floor(tmp_path, monkeypatch):
    from tk.errors import ParityError
    from tk.manifest import read_manifest

    # random weights lose every layer to the int8 floor (and such an export fails); 100 training steps
    # keep most int8, as a trained model does. 3 judged batches per check shape keep the test short
    monkeypatch.setattr("tk.export.int8.calibration.JUDGE_SEEDS", 3)
    try:
        _export(tmp_path, "int8", ("onnx",), train_steps=100)
    except ParityError:
        pass  # a failed check keeps the artifact, marked failed: the verdict is checked below
    manifest = read_manifest(tmp_path / "int8")
    report = manifest.check["onnx"]
    assert report["min_sqnr_db"] == MIN_SQNR_DB["int8"]
    worst = min(o["sqnr_db"] if o["sqnr_db"] is not None else math.inf for o in report["outputs"])
    rtol, atol = TOLERANCES["int8"]
    within_bounds = all(o["max_abs"] <= atol + rtol * 1e9 for o in report["outputs"])  # elementwise bounds are loose
    assert within_bounds
    assert 10.0 < worst < 80.0, "int8 is quantized: its SQNR is finite and far above noise"
    assert report["passed"] == (worst >= MIN_SQNR_DB["int8"])
    assert manifest.status == ("passed" if report["passed"] else "failed")
