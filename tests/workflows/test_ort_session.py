"""Sessions built by hand (tk.workflows.ort_session) on a real ONNX artifact: their options, their
outputs against tk's engine, and onnxruntime's profile of them by op type (benchmarks.goals.profiles)."""

from __future__ import annotations

import numpy as np

from benchmarks.goals.profiles import profile_onnx
from tk.runtime import load
from tk.runtime.inputs import random_inputs
from tk.workflows.ort_session import ORT_SPINNING, plain_session


def test_plain_session_runs_like_tks_engine_without_spinning(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    path = art.root / art.manifest.file("onnx").path
    session = plain_session(path, threads=1)
    options = session.get_session_options()
    assert options.intra_op_num_threads == 1 and options.get_session_config_entry(ORT_SPINNING) == "0"
    assert session.get_providers() == ["CPUExecutionProvider"] and not options.enable_profiling
    with load(art.root, "onnx") as engine:
        feeds = random_inputs(engine.inputs, engine.dims, 2, seed=3, sizes={"seq": 8})
        want = engine.run(feeds)
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    assert got.keys() == want.keys() and max(float(np.abs(got[k] - want[k]).max()) for k in got) < 1e-5


def test_profile_onnx_lists_op_types_whose_shares_add_up(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    with load(art.root, "eager") as eager:
        feeds = random_inputs(eager.inputs, eager.dims, 2, seed=3, sizes={"seq": 8})
    top = profile_onnx(art.root / art.manifest.file("onnx").path, feeds, tmp_path, runs=2)
    assert top and abs(sum(t["share"] for t in top) - 1.0) < 0.01
    assert all(t["nodes"] >= 1 and t["ms_per_call"] >= 0 for t in top)
    assert any("MatMul" in t["op"] or "Gemm" in t["op"] for t in top)  # the model's linears
    assert list(tmp_path.glob("*-ort-profile*.json"))  # the profile file went where it was told
