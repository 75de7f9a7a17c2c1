"""The aoti format: AOTInductor packages, each compiled once per session (10-50 s on two cores)."""

from __future__ import annotations

import pytest

from tests.export.conftest import passed_check
from tk.errors import InputError
from tk.export import ExportOptions
from tk.export.aoti.writer import AotiOptions, inductor_configs_for
from tk.models import build_model
from tk.runtime import load
from tk.spec import random_feeds
from tk.workflows.export import export

pytestmark = pytest.mark.slow

# resnet18's package compile is the longest (38 s on a 2-core AVX2 EPYC): its cases run last, left out when
# CI's 30 minutes run short (tests/conftest.py's fits)
MODELS = ("transformer", "mlp", "linear", pytest.param("resnet18", marks=pytest.mark.fits(seconds=50)))
AOTI = ("aoti",)


@pytest.mark.parametrize("name", MODELS)
def test_export_passes_its_check(exported, name):
    m = exported(name, AOTI).manifest
    passed_check(m, "aoti")
    assert m.formats["aoti"]["file"] == "model.aoti.pt2"
    assert m.formats["aoti"]["device"] == "cpu"
    assert m.formats["aoti"]["inductor_configs"] == {}  # float32: Inductor's defaults, no freezing
    assert sorted(f.role for f in m.files) == ["aoti", "weights"]


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_dims_match_eager_at_other_shapes(exported, run_against_eager, other_sizes, name):
    e = exported(name, AOTI)
    with load(e.root, "aoti") as engine:
        errors = run_against_eager(engine, e, other_sizes(e.spec), seed=7)
    assert all(err < 1e-4 for err in errors.values()), errors


def test_static_export_refuses_other_shapes(exported, run_against_eager, other_sizes):
    e = exported("mlp", AOTI, dynamic=False)
    assert e.manifest.status == "passed"
    opt = {n: d.opt for n, d in e.manifest.signature.dims.items()}
    with load(e.root, "aoti") as engine:
        run_against_eager(engine, e, opt, seed=1)
        with pytest.raises(InputError, match=r"must be in \[8, 8\]"):
            engine.run(random_feeds(engine.inputs, other_sizes(e.spec), seed=2))


def test_a_frozen_float32_package_packs_its_weights_and_matches_eager(tmp_path, run_against_eager, other_sizes):
    import torch

    from tests.conftest import Exported, package_source
    from tk.manifest import read_manifest

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    options = ExportOptions(formats=AOTI, settings={"aoti": AotiOptions(freeze=True)})
    manifest = export(spec, tmp_path / "a", options).manifest
    passed_check(manifest, "aoti")
    record = manifest.formats["aoti"]
    assert record["inductor_configs"] == {"freezing": True, "cpp.enable_concat_linear": True}
    assert record["packed_for"]  # packed for this CPU: the engine refuses it on a CPU without these features
    # oneDNN's packed float32 linears, whatever package compiled earlier in this process (an int8 one unpacked)
    assert "_linear_pointwise" in package_source(tmp_path / "a") or not torch.backends.mkldnn.is_available()
    spec.module.eval()
    e = Exported(spec, tmp_path / "a", read_manifest(tmp_path / "a"))
    with load(e.root, "aoti") as engine:
        errors = run_against_eager(engine, e, other_sizes(spec), seed=3)
    assert all(err < 1e-4 for err in errors.values()), errors


def test_freezing_is_on_for_reduced_precisions_and_asked_for_float32():
    assert inductor_configs_for("fp32", "cpu") == {}
    assert inductor_configs_for("fp32", "cpu", freeze=False) == {}
    assert inductor_configs_for("fp32", "cpu", freeze=True) == {"freezing": True, "cpp.enable_concat_linear": True}
    assert inductor_configs_for("bf16", "cpu") == {"freezing": True}
    assert inductor_configs_for("bf16", "cpu", freeze=False) == {}
    assert inductor_configs_for("fp16", "cuda", freeze=True) == {}  # refused by the writer before it gets here
