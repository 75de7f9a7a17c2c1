"""The goals scenario's logic (benchmarks.goals): rows from measured times, shares of the peak,
onnxruntime profiles by op type, the comparison with Optimum and the table. No timings judged."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console

from benchmarks.goals.hf import OPTIMUM, TK, KeywordCall, versus_optimum
from benchmarks.goals.profiles import op_type_shares
from benchmarks.goals.report import render
from benchmarks.goals.transformer import EAGER, GoalSettings, bf16_row, int8_row, shares
from tk.measure.timing import CallTime


def test_shares_are_the_calls_rate_over_the_median_rates():
    got = shares(int(2e9), 10.0, {"int8": 400.0, "fp32": 100.0}, "int8")  # 2 GFLOP in 10 ms: 200 GFLOP/s
    assert got == {"gflops": 200.0, "int8_peak_share": 0.5, "fp32_peak_share": 2.0}
    assert shares(int(2e9), 10.0, {}, "bf16") == {"gflops": 200.0}


def test_int8_and_bf16_rows_read_speed_ups_sqnr_and_the_manifest():
    logits = np.linspace(-1, 1, 32, dtype=np.float32)
    outputs = {EAGER: logits, "onnx int8": logits + 1e-3, "aoti bf16": logits + 1e-4}
    wall = {EAGER: [0.040, 0.040, 0.044], "onnx int8": [0.010, 0.010, 0.012], "aoti bf16": [0.020] * 3}
    quant = {"excluded": ["lm_head"], "quantizable_nodes": 12}
    manifest = SimpleNamespace(
        formats={"onnx": {"quantization": quant}, "aoti": {"inductor_configs": {"freezing": True}}},
        timings={"onnx": 1.5, "aoti": 20.0},
    )
    s = GoalSettings(batch=4, seq=8)
    row = int8_row("tiny", "onnx", None, s, manifest, outputs, wall, 3.14)
    assert row["speedup_vs_eager"] == 4.0 and row["shape"] == "4x8" and row["excluded_layers"] == 1
    assert row["quantizable_layers"] == 12 and row["export_s"] == 3.1 and row["met"] is True  # SQNR about 55 dB
    bf16 = bf16_row("tiny", s, outputs, wall, int(2e9), manifest, {"bf16": 200.0})
    assert bf16["speedup_vs_eager"] == 2.0 and bf16["gflops"] == 100.0 and bf16["peak_share"] == 0.5
    assert bf16["met"] is False and bf16["inductor_configs"] == {"freezing": True}
    assert bf16_row("tiny", s, outputs, wall, int(2e9), manifest, {})["peak_share"] is None


def test_onnx_profile_counts_the_last_runs_by_op_type():
    def run(scale: int) -> list[dict]:
        return [
            {"cat": "Node", "name": "a_kernel_time", "dur": 300 * scale, "args": {"op_name": "MatMul"}},
            {"cat": "Node", "name": "b_kernel_time", "dur": 100 * scale, "args": {"op_name": "Add"}},
            {"cat": "Session", "name": "model_run", "dur": 999},
        ]

    top = op_type_shares(run(50) + run(1) + run(1), runs=2)  # the warm-up run (scaled) is left out
    assert [t["op"] for t in top] == ["MatMul", "Add"]
    assert top[0]["share"] == 0.75 and top[0]["ms_per_call"] == 0.3 and top[0]["nodes"] == 1


def test_versus_optimum_takes_ratios_of_medians_and_of_rounds():
    tk = [CallTime(t, cpu_s=t) for t in (0.010, 0.012, 0.011)]
    opt = [CallTime(t, cpu_s=2 * t) for t in (0.022, 0.022, 0.033)]
    got = versus_optimum(tk, opt, {TK: 1e-5, OPTIMUM: 2e-5}, int(1e9), 100.0)
    assert got["speedup_vs_optimum"] == 2.0 and got["paired_speedup_vs_optimum"] == 2.2
    assert got["cpu_time_ratio_vs_optimum"] == 4.0 and got["min_ratio_vs_optimum"] == 2.2 and got["met"] is True


def test_keyword_call_passes_positional_args_by_name():
    class Two(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return input_ids - attention_mask

    out = KeywordCall(Two(), ["attention_mask", "input_ids"])(torch.tensor([1]), torch.tensor([5]))
    assert out.item() == 4


@pytest.mark.parametrize("busy", [False, True])
def test_table_names_busy_rows_and_missing_rates(busy):
    rows = [
        {"goal": "bf16 tiny", "shape": "4x8", "ms": 2.0, "speedup_vs_eager": 2.0, "sqnr_db": 40.0,
         "peak_share": None, "met": False, "goal_text": "t", "busy": busy},
        {"goal": "hf x", "shape": "1x8", "ms": 1.0, "fp32_peak_share": 0.5, "max_abs_vs_transformers": 1e-6,
         "speedup_vs_optimum": 1.2, "paired_speedup_vs_optimum": 1.1, "cpu_time_ratio_vs_optimum": 1.3,
         "met": True, "goal_text": "u"},
    ]  # fmt: skip
    console = Console(record=True, width=250)
    console.print(render(rows, {"cpu": "test cpu", "torch_threads": 2}))
    text = console.export_text()
    assert "— (no bf16 rate)" in text and "50% fp32" in text and "1.20× (paired 1.10×, CPU time 1.30×)" in text
    assert ("(busy machine)" in text) == busy


def _peer_rows(**engines: tuple[float, float, float | None, bool]) -> dict:
    """compare_peers-like rows: engine -> (ms in blocks, ms alone, min cosine, valid)."""
    rows = [{"engine": e, "ms": b, "ms_alone": a, "min_cosine": c, "valid": v} for e, (b, a, c, v) in engines.items()]
    return {"rows": rows, "verdict": {"speedup": None, "faster_valid_rival": None}}


def test_the_0999_goal_asks_1_3x_openvino_default_by_the_lower_ratio_and_to_beat_nncf_where_it_holds_the_bar():
    from benchmarks.goals.pick import EAGER, GOALS, NNCF, OPENVINO, PICK, judge

    goal = GOALS[0.999]
    base = {PICK: (30.0, 31.0, 0.9995, True), OPENVINO: (40.0, 41.0, 0.99995, True), EAGER: (150.0, 150.0, None, True)}
    # 40 / 30 = 1.333 in the blocks, 41 / 31 = 1.323 alone: the lower, 1.323, holds 1.3; NNCF under the bar is no rival
    checks = judge(_peer_rows(**base, **{NNCF: (20.0, 20.0, 0.987, False)}), goal)
    assert [c["met"] for c in checks] == [True, True] and checks[1]["value"] == pytest.approx(1.323, abs=1e-3)
    # alone the pick loses its lead: 38 / 31 = 1.226
    slower_alone = base | {OPENVINO: (40.0, 38.0, 0.99995, True)}
    assert [c["met"] for c in judge(_peer_rows(**slower_alone), goal)] == [True, False]
    # NNCF holding the bar and running faster: not met; slower but more accurate than the pick: not met either
    faster_nncf = judge(_peer_rows(**base, **{NNCF: (25.0, 25.0, 0.9992, True)}), goal)
    assert [c["met"] for c in faster_nncf] == [True, True, False] and faster_nncf[2]["value"] == pytest.approx(
        0.806, abs=1e-3
    )
    sharper_nncf = judge(_peer_rows(**base, **{NNCF: (35.0, 35.0, 0.9999, True)}), goal)
    assert [c["met"] for c in sharper_nncf] == [True, True, False]
    # a pick under the bar fails whatever its speed
    assert judge(_peer_rows(**base | {PICK: (10.0, 10.0, 0.9985, False)}), goal)[0]["met"] is False
    # the 0.9999 goal reads compare_peers' verdict: 1.1x the faster valid rival
    float_goal = _peer_rows(**base | {PICK: (30.0, 31.0, 0.99995, True)})
    float_goal["verdict"] = {"speedup": 1.05, "faster_valid_rival": OPENVINO}
    assert [c["met"] for c in judge(float_goal, GOALS[0.9999])] == [True, False]
    assert "1.3x openvino default at min cosine >= 0.999, and ahead of openvino nncf int8" in goal.text


def test_a_pick_bar_that_no_goal_names_is_refused():
    pytest.importorskip("openvino")
    from benchmarks.goals.pick import PickSettings, bench_pick
    from tk.errors import UsageError

    with pytest.raises(
        UsageError, match=r"expected a pick bar of 0\.9999 or 0\.999 \(issue 47's goals\), found 0\.99$"
    ):
        bench_pick(Path("pick"), Path("model"), None, PickSettings(bar=0.99), Path("work"))


@pytest.mark.slow
@pytest.mark.fits(seconds=60)  # 51 s on the 2-core AMX Xeon: NNCF's quantize, 3 lone processes per engine
def test_pick_results_judge_every_engine_on_the_same_feeds_in_the_fair_harness(tmp_path):
    """Issue 47's rivals on a tiny BERT: tk's unfused ONNX stands in for Optimum's file, an onnx artifact for
    the optimize pick; OpenVINO with NNCF int8 beside them. Every engine gets its own inputs of the same
    realistic feeds and computes transformers' embeddings (cosine); the pick's verdict follows its numbers."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from transformers import BertConfig, BertModel

    from benchmarks.goals import pick as goal
    from benchmarks.goals.report import render_pick
    from tk.errors import UsageError
    from tk.export import ExportOptions
    from tk.formats.aoti import runs_natively
    from tk.models import build_model
    from tk.workflows.export import export

    directory = tmp_path / "bert"
    config = BertConfig(
        vocab_size=200, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    BertModel(config).save_pretrained(directory)
    pick = tmp_path / "pick"
    export(build_model(f"hf:{directory}"), pick, ExportOptions(formats=("onnx",)))
    settings = goal.PickSettings(shapes=[(2, 16)], rounds=2, block=2, samples=8, nncf=True, alone_calls=3)
    (result,) = goal.bench_pick(pick, directory, None, settings, tmp_path / "work")
    rows = {r["engine"]: r for r in result["rows"]}
    rival = "tk onnx unfused (onnxruntime)"
    assert set(rows) == {goal.PICK, rival, goal.OPENVINO, goal.NNCF, goal.EAGER}
    assert result["shape"] == "2x16" and result["settings"]["samples"] == 8
    for row in rows.values():
        assert row["ms"] > 0 and row["ms_alone"] > 0 and row["floor_ms"] > 0 and 0 < row["floor_share"]
        assert len(row["ms_alone_processes"]) == 3 and min(row["ms_alone_processes"]) > 0  # three lone passes
        assert set(row["inputs"]) <= {"input_ids", "attention_mask", "token_type_ids"}
    assert min(rows[goal.PICK]["min_cosine"], rows[rival]["min_cosine"]) >= 0.99999  # both float32
    # OpenVINO's default compile runs bf16 on a CPU with bf16 products (AMX, AVX512-BF16), float32 elsewhere
    assert rows[goal.OPENVINO]["min_cosine"] >= (0.999 if runs_natively("bf16") else 0.99999)
    assert rows[goal.OPENVINO]["precision"] == ("bf16" if runs_natively("bf16") else "fp32")
    assert rows[goal.NNCF]["precision"] == "int8" and rows[goal.NNCF]["min_cosine"] > 0.9
    verdict = result["verdict"]
    valid = [r for name, r in rows.items() if name not in (goal.PICK, goal.EAGER) and r["min_cosine"] >= 0.9999]
    assert set(verdict["invalid_rivals"]) == {n for n, r in rows.items() if r["min_cosine"] is not None
                                              and n != goal.PICK and r["min_cosine"] < 0.9999}  # fmt: skip
    faster = min(valid, key=lambda r: r["ms"])
    assert verdict["faster_valid_rival"] == faster["engine"]
    alone = min(r["ms_alone"] for r in valid) / rows[goal.PICK]["ms_alone"]
    assert verdict["speedup"] == pytest.approx(min(faster["ms"] / rows[goal.PICK]["ms"], alone), rel=1e-2)
    assert result["floors"][rows[goal.PICK]["precision"]]["floor_ms"] == rows[goal.PICK]["floor_ms"]
    assert result["met"] == (verdict["speedup"] >= 1.1 and rows[goal.PICK]["min_cosine"] >= 0.9999)
    assert [c["value"] for c in result["goal_checks"]] == [rows[goal.PICK]["min_cosine"], verdict["speedup"]]
    with pytest.raises(UsageError, match=r"expected Optimum's export with a model\.onnx, found none"):
        goal.bench_pick(pick, directory, tmp_path, settings, tmp_path / "work")
    console = Console(record=True, width=250)
    for table in render_pick([result], {"cpu": "test", "torch_threads": 2}):
        console.print(table)
    text = console.export_text()
    assert "tk pick" in text and "openvino default" in text and "of floor" in text
    assert "pick's min cosine >= 0.9999" in text and f">= 1.1x {faster['engine']}" in text
