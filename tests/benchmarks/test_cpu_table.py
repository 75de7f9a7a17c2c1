"""The CPU table's logic (benchmarks.cpu_table): which exports its rows need, parity against eager,
the bare and hand-built backends on a real ONNX artifact, and the goals read from its rows. No timings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console

from benchmarks.cpu_table.direct import bare, peer_compile, peer_onnx
from benchmarks.cpu_table.exports import attempts_of, one_line
from benchmarks.cpu_table.parity import named_numpy, open_and_check, parity_of
from benchmarks.cpu_table.report import fastest, goals, results_table
from benchmarks.cpu_table.rows import ROWS, formats_by_artifact, ordered_rows
from tk.runtime import load
from tk.spec import random_feeds


def test_rows_ask_each_precision_for_the_formats_their_engines_load():
    keys = ["eager", "onnx", "compile-bf16", "aoti-bf16", "onnx-int8", "peer-onnx"]
    assert formats_by_artifact(keys) == {"fp32": ("onnx",), "bf16": ("aoti",), "int8": ("onnx",)}
    assert formats_by_artifact(["eager", "compile"]) == {"fp32": ("torch",)}
    assert ordered_rows(["peer-onnx", "onnx"]) == ["eager", "onnx", "peer-onnx"]
    assert ordered_rows(["onnx", "eager", "aoti"]) == ["eager", "onnx", "aoti"]


def test_a_failed_aoti_export_is_tried_again_without_it():
    assert attempts_of(("aoti", "onnx")) == [("aoti", "onnx"), ("onnx",)]
    assert attempts_of(("aoti",)) == [("aoti",)] and attempts_of(("onnx",)) == [("onnx",)]
    assert one_line(ValueError("first\nsecond")) == "ValueError: first" and one_line(RuntimeError()) == "RuntimeError"


def test_parity_is_judged_by_the_rows_precision():
    ref = {"logits": np.linspace(-1, 1, 64, dtype=np.float32).reshape(4, 16)}
    same = parity_of("fp32", ref, {"logits": ref["logits"].copy()})
    assert same["passed"] and same["max_rel"] == 0.0 and same["sqnr_db"] is None  # infinite SQNR: no noise
    off = parity_of("fp32", ref, {"logits": ref["logits"] + 1e-2})
    assert not off["passed"] and off["max_rel"] == pytest.approx(1e-2, rel=1e-3)
    int8 = parity_of("int8", ref, {"logits": ref["logits"] + 1e-3})
    assert int8["passed"] and int8["sqnr_db"] > 40 and int8["min_sqnr_db"] is not None


def test_bare_and_peer_sessions_run_the_artifacts_onnx_file(exported):
    art = exported("transformer", ("onnx",))
    engines, parity, failed = open_and_check(
        ["eager", "onnx", "peer-onnx", "aoti"], {"fp32": art.root}, _feeds(art), threads=1
    )
    try:
        assert list(engines) == ["eager", "onnx", "peer-onnx"] and set(failed) == {"aoti"}
        assert all(parity[k]["passed"] for k in engines) and parity["onnx"]["settings"]["allow_spinning"] == "0"
        direct = bare(engines["onnx"])
        direct.load()
        feeds = _feeds(art)
        got = named_numpy(direct, direct.run(feeds))
        want = named_numpy(engines["onnx"], engines["onnx"].run(feeds))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
        peer = peer_onnx(load(art.root, "onnx"), threads=1)
        peer.load()
        assert np.array_equal(named_numpy(peer, peer.run(feeds))["logits"], want["logits"])
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.slow
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch: Inductor packs nothing")
def test_the_hand_built_compile_peer_is_frozen(exported):
    # frozen as the table says: its three linears handed to oneDNN's packed linear (counted with the cache off)
    from torch._dynamo.utils import counters

    art = exported("mlp", ("torch",))
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    with load(art.root, "eager") as eager:
        peer = peer_compile(eager)  # its own module, built from the same manifest
        peer.load()
        feeds = random_feeds(eager.inputs, {"batch": 4}, seed=2)
        with torch._inductor.config.patch(fx_graph_cache=False):
            got = named_numpy(peer, peer.run(feeds))
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] - packed == 3
        want = named_numpy(eager, eager.run(feeds))
    assert all(np.abs(got[k] - want[k]).max() < 1e-5 for k in want)


def _feeds(art) -> dict[str, np.ndarray]:
    from tk.runtime.inputs import random_inputs

    like = load(art.root, "eager")
    return random_inputs(like.inputs, like.dims, 2, seed=1, sizes={"seq": 8})


def _size_result() -> dict:
    p50 = {("eager", 1): 2.0, ("onnx", 1): 1.0, ("peer-onnx", 1): 1.5, ("onnx-int8", 1): 0.5,
           ("eager", 8): 16.0, ("onnx", 8): 10.0, ("peer-onnx", 8): 12.0, ("onnx-int8", 8): 4.0}  # fmt: skip
    rows = [{"engine": e, "batch_size": b, "p50_ms": ms, "busy": b == 8} for (e, b), ms in p50.items()]
    parity = {k: {"max_rel": 1e-6, "passed": k != "onnx-int8", "sqnr_db": 30.0} for k in ("eager", "onnx", "onnx-int8")}
    return {"bench": {"rows": rows}, "fp32_peak": {8: 100.0}, "flop": {"8": 0.5}, "parity": parity}


def test_goals_are_ratios_of_the_rows():
    by_name = {(g["goal"].split(" (")[0], g["batch_size"]): g for g in goals({"small": _size_result()}, [1, 8])}
    peer = "best tk fp32 engine vs best hand-tuned peer"
    assert by_name[(peer, 1)]["value"] == 1.5 and by_name[(peer, 8)]["value"] == 1.2
    assert by_name[("fraction of the fp32 floor", 8)]["value"] == 0.5  # 0.5 GFLOP / 100 GFLOP/s = 5 ms of 10
    assert by_name[("onnx-int8 speed-up over eager fp32", 8)]["value"] == 4.0
    assert by_name[("latency at the smallest batch", 1)]["value"] == 0.5
    assert fastest({("onnx", 1): 1.0}, ("eager",), 1) is None


def test_results_table_marks_failed_parity_and_busy_batches():
    console = Console(record=True, width=250)
    console.print(results_table({"small": _size_result() | {"unavailable": {"aoti": "no compiler"}}}, [1, 8], {}, 2))
    text = console.export_text()
    assert ROWS["onnx-int8"].label in text and "✗" in text and "4.00×" in text
    assert "small aoti: no compiler" in text and "batch [8]" in text
