"""The aoti format: AOTInductor packages, each compiled once per session (10-50 s on two cores)."""

from __future__ import annotations

import pytest

from tk.errors import InputError
from tk.runtime import load
from tk.spec import random_feeds
from tk.tolerances import tolerance_for

pytestmark = pytest.mark.slow

MODELS = ("transformer", "mlp", "linear", "resnet18")
AOTI = ("aoti",)


@pytest.mark.parametrize("name", MODELS)
def test_export_passes_its_check(exported, name):
    e = exported(name, AOTI)
    m = e.manifest
    assert m.status == "passed", m.check
    report = m.check["aoti"]
    assert report["passed"] and len(report["shapes"]) >= 2
    for out in report["outputs"]:
        assert out["max_abs"] < 1e-4, out
    assert m.formats["aoti"]["file"] == "model.aoti.pt2"
    assert m.formats["aoti"]["device"] == "cpu"
    assert m.formats["aoti"]["inductor_configs"] == {}  # float32: Inductor's defaults, no freezing
    assert sorted(f.role for f in m.files) == ["aoti", "weights"]


@pytest.mark.parametrize("name", MODELS)
def test_dynamic_dims_match_eager_at_other_shapes(exported, eager_outputs, other_sizes, close, name):
    e = exported(name, AOTI)
    feeds = random_feeds(e.spec.signature.inputs, other_sizes(e.spec), seed=7)
    with load(e.root, "aoti") as engine:
        got = engine.run(feeds)
    errors = close(got, eager_outputs(e.spec, feeds), *tolerance_for("fp32", model_overrides=e.spec.tolerances))
    assert all(err < 1e-4 for err in errors.values()), errors


def test_static_export_refuses_other_shapes(exported, eager_outputs, other_sizes, close):
    e = exported("mlp", AOTI, dynamic=False)
    assert e.manifest.status == "passed"
    opt = {n: d.opt for n, d in e.manifest.signature.dims.items()}
    with load(e.root, "aoti") as engine:
        feeds = random_feeds(engine.inputs, opt, seed=1)
        close(engine.run(feeds), eager_outputs(e.spec, feeds), *tolerance_for("fp32"))
        with pytest.raises(InputError, match=r"must be in \[8, 8\]"):
            engine.run(random_feeds(engine.inputs, other_sizes(e.spec), seed=2))
