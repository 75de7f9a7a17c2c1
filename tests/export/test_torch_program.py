"""The torch format: capture, dynamic ranges, static refusal and clear capture errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tk.errors import CaptureError, InputError
from tk.export import ExportOptions, write_artifact
from tk.export.capture import exported_program_from_module, exported_program_in_range, suggested_dims
from tk.manifest import FileEntry, manifest_bytes, read_manifest, verify_artifact
from tk.models import ModelSpec, build_model
from tk.parity import check_engines
from tk.runtime import load
from tk.spec import Dim, Signature, TensorSpec, random_feeds
from tk.workflows.export import export

MODELS = ["transformer", "mlp", "linear", "resnet18"]
OTHER_SIZES = {"batch": 3, "seq": 7}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch")
    return {
        name: export(build_model(name, size="tiny"), root / name, ExportOptions(formats=("torch",))) for name in MODELS
    }


@pytest.mark.parametrize("name", MODELS)
def test_export_check_passes_across_the_range(artifacts, name):
    manifest = artifacts[name].manifest
    report = manifest.check["torch"]
    assert manifest.status == "passed" and report["passed"]
    batches = sorted({s["batch"] for s in report["shapes"]})
    assert batches[0] == 1 and batches[-1] == manifest.signature.dims["batch"].max
    assert all(o["max_abs"] <= 1e-4 for o in report["outputs"])


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_dims_work_at_other_shapes(artifacts, name):
    out = artifacts[name].out
    with load(out, "eager") as eager, load(out, "torch") as program:
        sizes = {d: OTHER_SIZES.get(d, dim.opt) for d, dim in program.dims.items()}
        feeds = random_feeds(program.inputs, sizes, seed=11)
        ref, got = eager.run(feeds), program.run(feeds)
    for key in ref:
        assert got[key].shape[0] == 3
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-5)


def test_static_export_refuses_another_shape(tmp_path):
    out = tmp_path / "static"
    export(build_model("mlp", size="tiny"), out, ExportOptions(formats=("torch",), dynamic=False))
    with load(out, "torch") as engine:
        assert engine.dims["batch"].min == engine.dims["batch"].max == 8
        engine.run(random_feeds(engine.inputs, {"batch": 8}))
        with pytest.raises(InputError, match=r"'batch' \(axis 0\) must be in \[8, 8\].*got 3"):
            engine.run(random_feeds(engine.inputs, {"batch": 3}))


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # the line the error must name
            return x * 2
        return x


class FixesBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(8, -1)


def _spec_with(module: torch.nn.Module):
    spec = build_model("mlp", size="tiny")
    spec.module = module
    return spec


def test_data_dependent_control_flow_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(CaptureError) as info:
        export(_spec_with(DataDependent()), tmp_path / "dd", ExportOptions(formats=("torch",)))
    assert "def forward" not in capsys.readouterr().err  # torch.export's partial graph is not printed
    message = str(info.value)
    assert "could not capture" in message and "data-dependent" in message
    assert "test_torch_program.py" in message and "x.sum() > 0" in message
    assert "\n" not in message
    assert not (tmp_path / "dd").exists(), "no partial artifact"


def test_a_specialized_dynamic_dimension_is_named(tmp_path):
    with pytest.raises(CaptureError, match=r"dimension 'batch' was meant to be dynamic.*constant 8"):
        export(_spec_with(FixesBatch()), tmp_path / "fixed", ExportOptions(formats=("torch",)))


def test_a_swapped_program_fails_the_check(artifacts, tmp_path):
    """Another model's program, with hashes made to match, is caught by parity, not by integrity."""
    target = tmp_path / "swapped"
    shutil.copytree(artifacts["mlp"].out, target)
    other = build_model("mlp", size="tiny", seed=1)  # same shapes, different random weights
    export(other, tmp_path / "other", ExportOptions(formats=("torch",)))
    shutil.copy(tmp_path / "other" / "program.pt2", target / "program.pt2")
    manifest = read_manifest(target)
    manifest.files = [FileEntry.of(target, e.path, e.role) for e in manifest.files]
    (target / "manifest.json").write_bytes(manifest_bytes(manifest))
    verify_artifact(target)
    with load(target, "eager") as eager, load(target, "torch") as program:
        report = check_engines(eager, program, [{"batch": 4}], precision="fp32", rtol=1e-4, atol=1e-5)
    assert not report.passed and report.outputs[0].max_abs > 1e-3


class NeedsThree(torch.nn.Module):
    """One graph for seq >= 3 only, as BART's attention mask (torch.export suggests min=3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] < 3:
            return x * 2
        return x * 3


class NoSliceOfOne(torch.nn.Module):
    """Needs seq >= 3 (suggested) and seq != 3 (a slice of one would broadcast), which no range from 3 holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] < 3:
            return x * 2
        return x[:, 2:].sum(1, keepdim=True) + x


def _seq_spec(module: torch.nn.Module) -> ModelSpec:
    dims = {"batch": Dim("batch", 1, 4, 16), "seq": Dim("seq", 1, 8, 64)}
    signature = Signature(
        [TensorSpec("x", "float32", ("batch", "seq"))], [TensorSpec("y", "float32", ("batch", "seq"))], dims
    )
    return ModelSpec("needs-three", None, {}, module, signature)


def test_a_range_the_model_does_not_take_is_narrowed_as_torch_export_suggests(tmp_path, caplog):
    spec = _seq_spec(NeedsThree())
    with caplog.at_level("INFO", logger="tk.export"):
        result = write_artifact(spec, tmp_path / "art", ExportOptions(formats=("torch", "onnx")))
    assert "the artifact holds --seq 3:8:64" in caplog.text
    assert result.manifest.signature.dims["seq"] == Dim("seq", 3, 8, 64)  # what the program holds
    assert read_manifest(tmp_path / "art").signature.dims["seq"] == Dim("seq", 3, 8, 64)
    x = np.arange(2 * 3, dtype=np.float32).reshape(2, 3)
    for fmt in ("torch", "onnx"):
        with load(tmp_path / "art", fmt) as engine:
            assert engine.dims["seq"].min == 3
            np.testing.assert_array_equal(engine.run({"x": x})["y"], x * 3)
            with pytest.raises(InputError, match=r"'seq' \(axis 1\) must be in \[3, 64\]"):
                engine.run({"x": x[:, :2]})


def test_a_failed_capture_names_the_suggested_flag_and_the_guard():
    spec = _seq_spec(NeedsThree())
    with pytest.raises(CaptureError) as info:  # no retry here: the message says what to pass
        exported_program_from_module(spec.module, spec.example_inputs(), spec.signature, spec.signature.dims)
    assert "Constraints violated (seq)" in str(info.value) and str(info.value).endswith("export with --seq 3:8:64")
    spec = _seq_spec(NoSliceOfOne())
    with pytest.raises(CaptureError) as info:
        exported_program_in_range(spec.module, spec.example_inputs(), spec.signature, spec.signature.dims)
    message = str(info.value)
    assert "\n" not in message
    assert "needs ((-2) + seq) != 1" in message and "3 <= seq <= 64" in message
    assert "export --seq in a range where it holds, or --static" in message
    assert message.endswith("(captured again with --seq 3:8:64, torch.export's suggestion)")


def test_suggested_ranges_are_narrowed_within_the_range_asked_for():
    dims = {"batch": Dim("batch", 1, 4, 16), "seq": Dim("seq", 2, 8, 64), "fixed": Dim("fixed", 5, 5, 5)}
    text = (
        "Constraints violated (seq)!\nSuggested fixes:\n  seq = Dim('seq', min=3, max=128)\n"
        "  batch = Dim('batch', max=2)\n  fixed = Dim('fixed', min=1, max=9)\n  other = Dim('other', min=3)\n"
    )
    # seq: min raised to 3, max kept at the 64 asked for; batch: opt 4 outside max 2, not held; static and
    # unknown dimensions are left alone
    assert suggested_dims(text, dims) == {"seq": Dim("seq", 3, 8, 64)}
    assert suggested_dims("seq = Dim('seq', min=3)", dims) == {}  # only under "Suggested fixes:"
