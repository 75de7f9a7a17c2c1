"""Writers: one object per format from the registry, settings that cannot apply refused, int8 that is int8."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import tk.export
import tk.export.registry
from tk.cli import cli
from tk.errors import ConversionError, UsageError
from tk.export import ExportOptions
from tk.export.aoti.writer import AotiOptions
from tk.export.base import Writer
from tk.export.context import ExportContext
from tk.export.int8.search import require_int8_layers
from tk.export.onnx.writer import OnnxOptions
from tk.export.registry import FORMATS, resolve_settings, settings_from_flags, writer
from tk.export.tensorrt.writer import TrtOptions
from tk.models import build_model
from tk.workflows.export import export


# -- the registry and the interface -------------------------------------------------------------
def test_every_registered_format_is_one_writer_object_with_its_own_options():
    for fmt in FORMATS:
        w = writer(fmt)
        assert isinstance(w, Writer) and w.name == fmt
        defaults = w.Options()
        fields = dataclasses.fields(defaults)
        assert all(getattr(defaults, f.name) in (None, ()) for f in fields), fmt  # None: "the default"
        assert all(f.metadata.get("flag") for f in fields), fmt  # each names the option that sets it


def test_the_orchestrator_names_no_format():
    for module in (tk.export, tk.export.registry):
        source = inspect.getsource(module)
        named = [fmt for fmt in FORMATS if f'"{fmt}"' in source or f"'{fmt}'" in source]
        assert named == [], f"{module.__name__} names {named}"


class PlainOnnxOps(Writer):
    """A format added by one module and one registry line: the operator domains of the ONNX graph it
    asks for by name, and which artifact file (if any) holds that graph unchanged."""

    name = "plainops"
    requires = ("onnx-plain",)

    def write(self, ctx: ExportContext) -> None:
        plain = ctx.require("onnx-plain")
        domains = sorted({n.domain or "ai.onnx" for n in onnx.load(str(plain.path)).graph.node})
        path = ctx.add_file("plain-ops.txt", "plainops")
        path.write_text("\n".join(domains))
        ctx.formats[self.name] = {"file": path.name, "domains": domains, "shipped_as": ctx.shipped_copy(plain.path)}


PLAIN_ONNX_OPS = PlainOnnxOps()


def test_a_writer_gets_the_standard_op_graph_it_requires_whatever_onnx_ships(monkeypatch, tmp_path):
    """What the trt writer relies on: ``ctx.require("onnx-plain")`` is the exporter's graph, not the
    fused ``model.onnx`` the onnx writer ships (onnxruntime contrib operators)."""
    monkeypatch.setitem(tk.export.registry.REGISTRY, "plainops", "tests.export.test_writers:PLAIN_ONNX_OPS")
    torch.manual_seed(0)
    settings = {"onnx": OnnxOptions(keep_unfused=True)}
    options = ExportOptions(formats=("onnx", "plainops"), check=False, settings=settings)
    result = export(build_model("transformer", size="tiny"), tmp_path / "a", options)
    shipped = {n.domain or "ai.onnx" for n in onnx.load(str(tmp_path / "a" / "model.onnx")).graph.node}
    assert result.manifest.formats["onnx"]["fusions"]["applied"] and "com.microsoft" in shipped
    plain = result.manifest.formats["plainops"]
    assert plain["domains"] == ["ai.onnx"]
    assert plain["shipped_as"] == "model.unfused.onnx"  # the artifact's copy of it: trt's manifest names it
    assert (tmp_path / "a" / "plain-ops.txt").read_text() == "ai.onnx"
    assert not (tmp_path / "a" / ".scratch").exists()  # intermediate files do not ship


# -- no silent flags ----------------------------------------------------------------------------
REFUSED = [
    (["--calibrate", "random:8"], "--calibrate: applies to --precision int8 only; this export is fp32"),
    (["--calibration-method", "minmax"], "--calibration-method: applies to --precision int8 only; this export is fp32"),
    (["--int8-mode", "dynamic"], "--int8-mode: applies to --precision int8 only; this export is fp32"),
    (["--trt-workspace", "2"], "--trt-workspace: applies to --format trt only; this export writes onnx"),
    (["--trt-opt-level", "1"], "--trt-opt-level: applies to --format trt only; this export writes onnx"),
    (["--trt-hardware-compat", "none"], "--trt-hardware-compat: applies to --format trt only; this export writes onnx"),
    (["--trt-timing-cache", "t.cache"], "--trt-timing-cache: applies to --format trt only; this export writes onnx"),
    (["--keep-unfused", "--no-fuse"], "--keep-unfused: with --no-fuse the shipped model.onnx is the unfused graph"),
    (["--format", "torch", "--no-fuse"], "--fuse/--no-fuse: applies to --format onnx only; this export writes torch"),
    (["--format", "aoti", "--opset", "18"], "--opset: applies to --format onnx only; this export writes aoti"),
    (["--freeze"], "--freeze/--no-freeze: applies to --format aoti only; this export writes onnx"),
    (
        ["--format", "aoti", "--precision", "int8", "--no-freeze"],
        "--no-freeze: int8 packages need Inductor's freezing to lower their quantized linears",
    ),
    (
        ["--precision", "int8", "--int8-mode", "dynamic", "--keep-unfused"],
        "--keep-unfused: dynamic int8 quantizes the unfused graph",
    ),
    (
        ["--precision", "int8", "--int8-mode", "dynamic", "--calibration-method", "minmax"],
        "--calibration-method: dynamic int8 is not calibrated",
    ),
]


@pytest.mark.parametrize(("args", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_flags_that_cannot_apply_are_refused_in_one_line_before_any_work(tmp_path, args, message):
    out = tmp_path / "a"
    result = CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.output and not out.exists()


def test_each_flag_goes_to_the_formats_it_applies_to():
    assert settings_from_flags(("onnx",), {"--opset": None, "--trt-workspace": None}) == {}
    # trt builds from the onnx writer's standard-op graph: --opset shapes it, so it applies
    assert settings_from_flags(("trt",), {"--opset": 18}) == {"onnx": OnnxOptions(opset=18)}
    assert settings_from_flags(("all",), {"--calibration-method": "minmax"}) == {
        "onnx": OnnxOptions(calibration_method="minmax"),
        "aoti": AotiOptions(calibration_method="minmax"),
    }
    assert settings_from_flags(("aoti",), {"--calibration-method": "minmax"}) == {
        "aoti": AotiOptions(calibration_method="minmax")
    }
    with pytest.raises(UsageError, match=r"^--fuse/--no-fuse: applies to --format onnx only; this export writes trt$"):
        settings_from_flags(("trt",), {"--fuse/--no-fuse": False})


def test_python_settings_are_checked_like_the_flags(tmp_path, caplog):
    spec = build_model("linear", size="tiny")
    with pytest.raises(UsageError, match=r"^--trt-workspace: applies to --format trt only; this export writes torch$"):
        export(spec, tmp_path / "a", ExportOptions(formats=("torch",), settings={"trt": TrtOptions(workspace_gb=2)}))
    with pytest.raises(UsageError, match=r"settings\['onnx'\]: expected OnnxOptions, got TrtOptions"):
        export(spec, tmp_path / "a", ExportOptions(formats=("onnx",), settings={"onnx": TrtOptions()}))
    with pytest.raises(UsageError, match=r"settings: expected format names .* got 'tflite'"):
        export(spec, tmp_path / "a", ExportOptions(formats=("onnx",), settings={"tflite": OnnxOptions()}))
    with pytest.raises(UsageError, match="--trt-opt-level: expected 0 to 5, got 9"):
        tk.export.registry.writer("trt").validate(TrtOptions(optimization_level=9), ExportOptions())
    assert not (tmp_path / "a").exists()
    # under --format all, settings of a format this machine skips are harmless: a warning, not an error
    caplog.set_level(logging.WARNING, logger="tk.export")
    skipped = {"trt": "TensorRT needs a CUDA GPU; none found"}
    resolved = resolve_settings(("all",), {"trt": TrtOptions(workspace_gb=2)}, skipped)
    assert resolved["trt"] == TrtOptions(workspace_gb=2) and resolved["onnx"] == OnnxOptions()
    assert "--trt-workspace ignored: trt is not written (TensorRT needs a CUDA GPU; none found)" in caplog.text


# -- int8 that is int8 ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_calibration_data_is_refused_before_any_work(tmp_path, bad):
    spec = build_model("mlp", size="tiny")
    (name,) = [s.name for s in spec.signature.inputs]
    samples = np.random.default_rng(0).standard_normal((8, *spec.example_inputs()[0].shape[1:])).astype(np.float32)
    samples[3, 0] = bad
    np.savez(tmp_path / "calib.npz", **{name: samples})
    out = tmp_path / "a"
    args = ["export", "mlp", "--size", "tiny", "--precision", "int8", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--calibrate", str(tmp_path / "calib.npz")])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr
    expected = f"input {name!r}: expected finite values (int8 calibration needs them), found 1 NaN or infinite value(s)"
    assert expected in errors[0] and errors[0].startswith("error: --calibrate ")
    assert not out.exists()


def test_an_int8_export_in_which_no_layer_stayed_int8_fails_saying_what_to_try(tmp_path):
    """Random weights lose every layer to the SQNR floor (the tiny linear model has one)."""
    torch.manual_seed(0)
    out = tmp_path / "a"
    args = ["export", "linear", "--size", "tiny", "--precision", "int8", "--no-check", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "--precision int8 --format onnx: no layer stayed int8 (all 1 were left out" in errors[0]
    from tk.formats.aoti import runs_natively

    other = "--precision bf16" if runs_natively("bf16") else "export float32 (this CPU has no bf16 dot products)"
    assert "(--calibrate FILE; tk optimize: --data FILE)" in errors[0] and errors[0].endswith(other)  # one it runs
    assert not out.exists()


def test_an_int8_aoti_package_with_no_int8_layer_fails_before_compiling(tmp_path):
    pytest.importorskip("torchao", reason="int8 aoti packages need torchao (pip install 'tk[int8]')")
    from tk.export.aoti.int8 import unavailable_reason

    if unavailable_reason("cpu"):
        pytest.skip(unavailable_reason("cpu"))
    torch.manual_seed(0)
    spec = build_model("mlp", size="tiny")
    options = ExportOptions(formats=("aoti",), precision="int8", keep_fp32=("net",), check=False)
    with pytest.raises(ConversionError, match=r"--format aoti: no layer stayed int8 \(all \d+ were left out"):
        export(spec, tmp_path / "a", options)
    assert not (tmp_path / "a").exists()


def test_a_partial_int8_export_logs_how_many_layers_stayed_int8(caplog):
    caplog.set_level(logging.INFO, logger="tk.export")
    require_int8_layers(3, 9, "aoti")
    assert "export int8   3 of 9 layers int8" in caplog.text
    with pytest.raises(ConversionError, match="no layer stayed int8"):
        require_int8_layers(0, 9, "onnx")
    require_int8_layers(0, 0, "onnx")  # a model with no quantizable layer is not refused here
