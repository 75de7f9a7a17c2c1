"""The aoti format: AOTInductor packages, each compiled once per session (10-50 s on two cores)."""

from __future__ import annotations

import pytest

from tests.export.conftest import passed_check
from tk.errors import InputError
from tk.runtime import load
from tk.spec import random_feeds

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
