"""The onnx format: export, parity at shapes other than the example, tk names in the graph, refusals."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch

from tests.export.conftest import passed_check
from tk.errors import ConversionError, InputError, IntegrityError, UsageError
from tk.export import ExportOptions
from tk.export.capture import exported_program_from_module
from tk.export.onnx.writer import OnnxOptions
from tk.manifest import MANIFEST, FileEntry, manifest_bytes, read_manifest, verify_artifact
from tk.models import build_model
from tk.parity import check_engines
from tk.runtime import load
from tk.spec import random_feeds
from tk.tolerances import tolerance_for
from tk.workflows.check import shapes_to_check
from tk.workflows.export import export

MODELS = ("transformer", "mlp", "linear", "resnet18")
ONNX = ("onnx",)


def tolerance(spec):
    return tolerance_for("fp32", model_overrides=spec.tolerances)


@pytest.mark.parametrize("name", MODELS)
def test_export_passes_its_check(exported, name):
    e = exported(name, ONNX)
    m = e.manifest
    report = passed_check(m, "onnx")
    assert (report["rtol"], report["atol"]) == tolerance(e.spec)
    onnx_info = dict(m.formats["onnx"])
    assert isinstance(onnx_info.pop("fusions")["applied"], bool)  # tk.export.onnx.fusions ran
    assert onnx_info == {
        "file": "model.onnx",
        "opset": 20,
        "ir_version": m.formats["onnx"]["ir_version"],
        "external_data": None,
    }
    assert sorted(f.role for f in m.files) == ["onnx", "weights"]  # one file: no external data below 2 GiB
    assert "onnx" in m.versions and "onnxscript" in m.versions


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_dims_match_eager_at_other_shapes(exported, run_against_eager, other_sizes, name):
    e = exported(name, ONNX)
    with load(e.root, "onnx") as engine:
        errors = run_against_eager(engine, e, other_sizes(e.spec), seed=7)
    assert all(err <= 1e-4 for err in errors.values()), errors


@pytest.mark.parametrize("name", MODELS)
def test_plain_onnxruntime_session_matches_pytorch(exported, eager_outputs, other_sizes, close, name):
    import onnxruntime as ort

    e = exported(name, ONNX)
    session = ort.InferenceSession(str(e.root / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [s.name for s in e.spec.signature.inputs]
    assert [o.name for o in session.get_outputs()] == [s.name for s in e.spec.signature.outputs]
    feeds = random_feeds(e.spec.signature.inputs, other_sizes(e.spec), seed=3)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    close(got, eager_outputs(e.spec, feeds), *tolerance(e.spec))


def _axes(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", MODELS)
def test_graph_axes_carry_tk_dimension_names(exported, name):
    e = exported(name, ONNX)
    model = onnx.load(str(e.root / "model.onnx"), load_external_data=False)
    sig = e.spec.signature
    assert [_axes(v) for v in model.graph.input] == [list(s.shape) for s in sig.inputs]
    assert [_axes(v) for v in model.graph.output] == [list(s.shape) for s in sig.outputs]
    assert {o.domain: o.version for o in model.opset_import}[""] == 20


def test_transformer_inputs_are_batch_by_seq(exported):
    model = onnx.load(str(exported("transformer", ONNX).root / "model.onnx"))
    assert {v.name: _axes(v) for v in model.graph.input} == {
        "input_ids": ["batch", "seq"],
        "attention_mask": ["batch", "seq"],
    }


def test_axes_are_renamed_when_the_exporter_does_not(monkeypatch, tmp_path):
    """The exporter names axes s0, s1… unless told; tk renames them everywhere in the graph."""
    import tk.export.onnx.writer as onnx_writer

    monkeypatch.setattr(onnx_writer, "_axis_names", lambda signature, dims: None)
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    spec.module.eval()
    program = exported_program_from_module(spec.module, spec.example_inputs(), spec.signature, spec.signature.dims)
    result = onnx_writer.onnx_from_exported_program(program, tmp_path / "m.onnx", spec.signature, spec.signature.dims)
    model = onnx.load(str(result.path))
    assert [_axes(v) for v in model.graph.input] == [["batch", "seq"], ["batch", "seq"]]
    assert _axes(model.graph.output[0]) == ["batch", 2]
    params = {d.dim_param for v in model.graph.value_info for d in v.type.tensor_type.shape.dim if d.dim_param}
    assert not any(p.startswith("s") and p[1:].isdigit() for p in params), params  # no exporter symbol left


@pytest.mark.parametrize("name", ["transformer", "resnet18"])
def test_static_export_refuses_other_shapes(exported, run_against_eager, other_sizes, name):
    e = exported(name, ONNX, dynamic=False)
    assert e.manifest.status == "passed"
    assert all(d.static for d in e.manifest.signature.dims.values())
    model = onnx.load(str(e.root / "model.onnx"))
    assert all(isinstance(a, int) for v in model.graph.input for a in _axes(v))  # no dim_param left
    opt = {n: d.opt for n, d in e.manifest.signature.dims.items()}
    with load(e.root, "onnx") as engine:
        run_against_eager(engine, e, opt, seed=1)
        with pytest.raises(InputError, match="must be in"):
            engine.run(random_feeds(engine.inputs, other_sizes(e.spec), seed=2))


def test_another_models_onnx_file_fails_the_check(exported, tmp_path):
    e = exported("mlp", ONNX)
    root = tmp_path / "swapped"
    shutil.copytree(e.root, root)
    other_weights = build_model("mlp", size="tiny", seed=1)  # the same architecture with other weights
    other = export(other_weights, tmp_path / "other", ExportOptions(formats=ONNX, check=False))
    shutil.copy(other.out / "model.onnx", root / "model.onnx")
    with pytest.raises(IntegrityError, match=r"sha256|bytes"):
        verify_artifact(root)  # the swap is caught by the hashes first

    manifest = read_manifest(root)
    manifest.files = [FileEntry.of(root, f.path, f.role) for f in manifest.files]  # hide the swap from the hashes
    (root / MANIFEST).write_bytes(manifest_bytes(manifest))
    manifest = verify_artifact(root)
    rtol, atol = tolerance(e.spec)
    with load(root, "eager") as reference, load(root, "onnx") as candidate:
        report = check_engines(
            reference, candidate, shapes_to_check(manifest.signature.dims), precision="fp32", rtol=rtol, atol=atol
        )
    assert not report.passed
    (failure,) = report.failures()
    assert failure.startswith("logits: max abs error")
    assert report.outputs[0].max_abs > 1e-3


def test_large_models_keep_weights_in_external_data(monkeypatch, tmp_path, eager_outputs, close):
    import onnxruntime as ort

    import tk.export.onnx.writer as onnx_writer

    monkeypatch.setattr(onnx_writer, "SINGLE_FILE_LIMIT", 0)  # every model counts as large
    torch.manual_seed(0)
    spec = build_model("linear", size="tiny")
    result = export(spec, tmp_path / "big", ExportOptions(formats=ONNX))
    m = result.manifest
    assert m.status == "passed"
    assert m.formats["onnx"]["external_data"] == "model.onnx.data"
    assert sorted((f.role, f.path) for f in m.files if f.role.startswith("onnx")) == [
        ("onnx", "model.onnx"),
        ("onnx-data", "model.onnx.data"),
    ]
    feeds = random_feeds(spec.signature.inputs, {"batch": 3}, seed=0)
    session = ort.InferenceSession(str(result.out / "model.onnx"), providers=["CPUExecutionProvider"])
    close({"y": session.run(None, feeds)[0]}, eager_outputs(spec, feeds), *tolerance(spec))


def test_opset_is_recorded_as_written(tmp_path):
    torch.manual_seed(0)
    result = export(
        build_model("linear", size="tiny"),
        tmp_path / "a",
        ExportOptions(formats=ONNX, settings={"onnx": OnnxOptions(opset=18)}),
    )
    assert result.manifest.formats["onnx"]["opset"] == 18
    model = onnx.load(str(result.out / "model.onnx"))
    assert {o.domain: o.version for o in model.opset_import}[""] == 18


def test_opset_below_18_is_refused(tmp_path):
    with pytest.raises(UsageError, match="opset: expected 18 or newer, got 17"):
        export(
            build_model("linear", size="tiny"),
            tmp_path / "a",
            ExportOptions(formats=ONNX, settings={"onnx": OnnxOptions(opset=17)}),
        )
    assert not (tmp_path / "a").exists()


def test_exporter_failure_is_one_line(monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise RuntimeError("Unsupported FX nodes: {'aten.weird_op'}\n  long traceback…\n  more")

    monkeypatch.setattr(torch.onnx, "export", fail)
    with pytest.raises(ConversionError) as info:
        export(build_model("linear", size="tiny"), tmp_path / "a", ExportOptions(formats=ONNX))
    message = str(info.value)
    assert "\n" not in message
    assert "RuntimeError: Unsupported FX nodes" in message and "--format torch" in message


def test_feeds_of_another_dtype_are_refused(exported):
    e = exported("linear", ONNX)
    with load(e.root, "onnx") as engine, pytest.raises(InputError, match="dtype float32, got float64"):
        engine.run({"x": np.zeros((2, 4))})
