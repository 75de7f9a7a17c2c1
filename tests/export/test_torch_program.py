"""The torch format: capture, dynamic ranges, static refusal and clear capture errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tk.errors import CaptureError, InputError
from tk.export import ExportOptions
from tk.manifest import FileEntry, manifest_bytes, read_manifest, verify_artifact
from tk.models import build_model
from tk.parity import check_engines
from tk.runtime import load
from tk.spec import random_feeds
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
