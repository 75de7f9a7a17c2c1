"""The precision race: which precisions can still win, from their product rates at the model's shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tk.export.onnx.writer import OnnxOptions
from tk.measure.roofline import Roofline
from tk.models import build_model
from tk.workflows.optimize import OptimizeOptions, OptimizeResult, optimize
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.groups import export_groups, int8_before_fp32
from tk.workflows.optimize.precision_race import (
    PrecisionRace,
    int8_probe_reason,
    int8_skip_reason,
    linear_int8_share,
    no_gain_reason,
    run_race,
    skip_reason,
)


def _race(
    rate: float = 400.0, fp32: float = 200.0, gflop: float = 25.8, share: float = 1.0, int8: float | None = None,
    precision: str = "bf16",
) -> PrecisionRace:  # fmt: skip
    rates = {"fp32": fp32, precision: rate} | ({"int8": int8} if int8 is not None else {})
    return PrecisionRace(rates, gflop, share, rounds=7)


def test_reduced_floats_are_written_before_float32_and_int8_stays_last() -> None:
    fused, unfused = None, OnnxOptions(fusions=False)
    static = None
    tried = [
        Candidate("onnx", "fp32", "onnx", fused), Candidate("aoti", "fp32", "aoti", fused),
        Candidate("onnx", "fp32", "onnx", unfused), Candidate("aoti", "bf16", "aoti", fused),
        Candidate("openvino", "bf16", "openvino", fused), Candidate("onnx", "int8", "onnx", static),
        Candidate("aoti", "int8", "aoti", static),
    ]  # fmt: skip
    first = [[c.name for c in members] for members in export_groups(tried, reduced_first=True).values()]
    assert first == [
        ["aoti bf16", "openvino bf16"],
        ["onnx fp32", "aoti fp32"],
        ["onnx fp32 unfused"],
        ["aoti int8 static"],
        ["onnx int8 static"],
    ]
    plain = [[c.name for c in members] for members in export_groups(tried).values()]
    assert plain[0] == ["onnx fp32", "aoti fp32"] and plain[2] == ["aoti bf16", "openvino bf16"]


def test_float32_is_out_only_with_a_clear_rate_most_of_the_work_and_enough_of_it() -> None:
    assert _race().fp32_cannot_win("bf16")
    assert _race(rate=290.0).ratio("bf16") == pytest.approx(1.45) and not _race(rate=290.0).fp32_cannot_win("bf16")
    assert not _race(share=0.5).fp32_cannot_win("bf16")  # a convolution net: its products are not nn.Linear
    assert not _race(gflop=0.002).fp32_cannot_win("bf16")  # a tiny call: overheads, not products, decide
    assert not _race().fp32_cannot_win("fp16") and not _race().fp32_cannot_win("fp32")  # fp16 was not raced
    reason = skip_reason(_race(), "aoti bf16", "bf16")
    assert reason.startswith("cannot win here: bf16 products ran 2.00× float32's")
    assert "400 vs 200 GFLOP/s, median of 7 interleaved rounds; 100% of its FLOPs" in reason
    assert "aoti bf16 kept your accuracy" in reason and "--keep all" in reason


def test_a_reduced_float_no_faster_than_float32_cannot_win() -> None:
    """Measured on a Xeon with AVX512-BF16 and no AMX: bf16 products 0.65x float32's, its packages 0.7x."""
    slow = _race(rate=150.0, fp32=230.0)
    assert slow.no_gain("bf16") and not slow.no_gain("fp32") and not slow.no_gain("fp16")  # fp16 not raced
    assert not _race(rate=276.0, fp32=230.0).no_gain("bf16")  # 1.2x: OUTRUNS_BY, worth a try
    assert _race(rate=275.0, fp32=230.0).no_gain("bf16")
    assert not _race(rate=150.0, fp32=230.0, share=0.5).no_gain("bf16")  # products are not the model's work
    reason = no_gain_reason(slow, "bf16")
    assert reason.startswith("cannot win here: bf16 products ran 0.65× float32's at this model's linear shapes")
    assert "(150 vs 230 GFLOP/s, median of 7 interleaved rounds; 100% of its FLOPs), under the 1.2×" in reason
    assert "float32 runs as fast and loses nothing" in reason
    assert slow.fastest_float() == "fp32" and _race().fastest_float() == "bf16"


def test_int8_is_ahead_of_the_fastest_float_that_may_win_and_says_why_the_probe_is_not_compiled() -> None:
    assert _race(int8=640.0).int8_ahead() and _race(int8=640.0).ratio("int8", "bf16") == pytest.approx(1.6)
    assert not _race().int8_ahead() and _race().ratio("int8") is None  # not raced
    assert not _race(int8=560.0).int8_ahead()  # 1.4x bf16's: not clear enough
    assert not _race(int8=640.0, share=0.5).int8_ahead() and not _race(int8=640.0, gflop=0.002).int8_ahead()
    reason = int8_probe_reason(_race(int8=640.0))
    assert reason.startswith("int8 products ran 1.60× bf16's at this model's linear shapes (640 vs 400 GOP/s")
    assert reason.endswith("the all-int8 package was not compiled to ask, and the search runs")
    # bf16 slower than float32 is out of the race: int8 is measured against float32
    slow_bf16 = _race(rate=150.0, fp32=230.0, int8=700.0)
    assert slow_bf16.int8_ahead() and int8_probe_reason(slow_bf16).startswith("int8 products ran 3.04× float32's")
    alone = PrecisionRace({"fp32": 200.0, "int8": 600.0}, 25.8, 1.0, rounds=7)  # a CPU without bf16 dot products
    assert alone.int8_ahead() and not alone.fp32_cannot_win("int8")  # int8 may miss the accuracy
    data = _race(int8=640.0).to_json()
    assert data["rates_gflops"] == {"fp32": 200.0, "bf16": 400.0, "int8": 640.0}
    assert data["over_fp32"] == {"bf16": 2.0, "int8": 3.2} and data["rule"]["outruns_by"] == 1.2


def test_the_race_measures_every_rate_at_the_models_own_linear_shapes() -> None:
    module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    roofline = Roofline(module, (torch.randn(1, 8, 64),), ("fp32", "fp16"))  # fp16 is measurable on any CPU
    race = run_race(roofline, batch=4, rounds=3)
    assert race is not None and set(race.rates) == {"fp32", "fp16"} and race.rounds == 3
    rows = 8 * 4  # every leading dimension, scaled to the batch
    assert race.linear_gflop == pytest.approx((2 * rows * 64 * 128 + 2 * rows * 128 * 32) / 1e9, rel=1e-12)
    assert race.linear_share == pytest.approx(1.0)  # the products are all of the model's FLOPs
    assert all(rate > 0 for rate in race.rates.values())
    conv = nn.Sequential(nn.Conv2d(3, 8, 3)).eval()
    no_linear = Roofline(conv, (torch.randn(1, 3, 16, 16),), ("fp32", "fp16"))
    assert run_race(no_linear, batch=2) is None  # no nn.Linear to race on
    with_int8 = Roofline(module, (torch.randn(1, 8, 64),), ("fp32", "fp16", "int8"))
    raced = run_race(with_int8, batch=4, rounds=3)
    assert raced is not None
    assert ("int8" in raced.rates) is ("int8" not in with_int8.skipped)  # where oneDNN's int8 linear exists


@pytest.fixture
def bf16_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 candidates even on a CPU without AVX512-BF16 (they run emulated: slower, as accurate)."""
    import tk.workflows.optimize.candidates as candidates

    monkeypatch.setattr(candidates, "hardware_reason", lambda precision, device, flags=None: None)


def _optimize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: PrecisionRace, **kwargs: object
) -> tuple[OptimizeResult, list[tuple[tuple[str, ...], int]]]:
    """A tiny optimize run over torch fp32 and bf16 whose race returns ``race``; the result, and each race
    asked (the precisions its roofline was made for, the batch)."""
    import tk.workflows.optimize.run as run

    asked: list[tuple[tuple[str, ...], int]] = []

    def fixed_race(roofline: Roofline, batch: int, rounds: int = 7) -> PrecisionRace:
        # the rates are the machine's: the rules are what is tested here
        asked.append((tuple(sorted({*roofline.precisions, *roofline.skipped})), batch))
        return race

    monkeypatch.setattr(run, "run_race", fixed_race)
    options = OptimizeOptions(**{"accuracy": "sqnr>=20", "sizes": {"batch": 4, "seq": 16}, "formats": ("torch",),
                                 "precisions": ("fp32", "bf16"), "seconds": 0.05, "peaks": False,
                                 "cache_dir": tmp_path / "cache", **kwargs})  # type: ignore[arg-type]  # fmt: skip
    torch.manual_seed(0)
    return optimize(build_model("transformer", size="tiny"), tmp_path / "out", options), asked


@pytest.mark.usefixtures("bf16_here")
def test_a_passing_bf16_candidate_with_twice_the_rate_skips_the_float32_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, asked = _optimize(tmp_path, monkeypatch, _race())
    rows = {r.candidate: r for r in result.rows}
    assert asked == [(("bf16", "fp32"), 4)]  # once, before the first group, at the timing batch
    assert rows["torch bf16"].status == "passed" and rows["torch bf16"].winner
    assert rows["torch fp32"].status == "skipped"
    assert rows["torch fp32"].reason == skip_reason(_race(), "torch bf16", "bf16")
    assert result.exports == 1  # the float32 group was never written
    record = result.record["precision_race"]
    assert record["skipped"] == ["fp32"] and record["over_fp32"] == {"bf16": 2.0}


@pytest.mark.usefixtures("bf16_here")
def test_a_bf16_no_faster_than_float32_is_skipped_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Xeon with AVX512-BF16 and no AMX: bf16 products 0.65x float32's, so bf16 is never exported."""
    slow = _race(rate=150.0, fp32=230.0)
    result, asked = _optimize(tmp_path, monkeypatch, slow)
    rows = {r.candidate: r for r in result.rows}
    assert len(asked) == 1
    assert rows["torch bf16"].status == "skipped" and rows["torch bf16"].reason == no_gain_reason(slow, "bf16")
    assert rows["torch fp32"].status == "passed" and rows["torch fp32"].winner
    assert result.exports == 1 and result.record["precision_race"]["skipped"] == ["bf16"]


@pytest.mark.usefixtures("bf16_here")
def test_a_close_rate_lets_both_run_and_keep_all_never_races(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    close, _ = _optimize(tmp_path / "close", monkeypatch, _race(rate=250.0))  # 1.25x: bf16 tried, fp32 kept
    rows = {r.candidate: r for r in close.rows}
    assert rows["torch fp32"].status == "passed" and rows["torch fp32"].p50_ms is not None
    assert rows["torch bf16"].status == "passed" and close.record["precision_race"]["skipped"] == []
    every, asked = _optimize(tmp_path / "all", monkeypatch, _race(), keep="all")
    assert asked == [] and every.record["precision_race"] is None
    assert {r.candidate: r.status for r in every.rows}["torch fp32"] == "passed"


def test_a_reduced_float_is_not_skipped_for_float32_when_no_float32_candidate_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--precisions bf16 on a CPU whose bf16 is slower than its float32: bf16 is all there is, so it runs."""
    import tk.workflows.optimize.run as run
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize.run import _Run

    slow = _race(rate=150.0, fp32=230.0)
    monkeypatch.setattr(run, "run_race", lambda roofline, batch, rounds=7: slow)
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    for tried, skipped in (([Candidate("torch", "bf16", "torch")], False),
                           ([Candidate("torch", "bf16", "torch"), Candidate("torch", "fp32", "torch")], True)):  # fmt: skip
        state = _Run(spec, tmp_path / "out", OptimizeOptions(cache_dir=tmp_path), parse_accuracy(None), None,  # type: ignore[arg-type]
                     {"batch": 4, "seq": 16}, lambda *_: None)  # fmt: skip
        state._run_race(tried)
        assert state.race is slow
        assert (state._race_skip("bf16", []) == no_gain_reason(slow, "bf16")) is skipped


def test_named_candidates_race_only_for_the_int8_probe_and_skip_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --candidates the user asked for those artifacts: the race runs (before the first group) only
    where an aoti int8 candidate is to come, and only spares the gate's all-int8 compile."""
    import tk.workflows.optimize.run as run
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize.run import _Run

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    tried = [Candidate("torch", "fp32", "torch"), Candidate("aoti", "int8", "aoti")]
    for int8_rate, ahead in ((600.0, True), (250.0, False)):
        asked: list[tuple[str, ...]] = []

        def fixed_race(
            roofline: Roofline, batch: int, rounds: int = 7, rate: float = int8_rate, asked: list = asked
        ) -> PrecisionRace:
            asked.append(tuple(sorted({*roofline.precisions, *roofline.skipped})))
            return PrecisionRace({"fp32": 200.0, "int8": rate}, 25.8, 1.0, rounds=7)

        monkeypatch.setattr(run, "run_race", fixed_race)
        options = OptimizeOptions(cache_dir=tmp_path, candidates=("torch fp32", "aoti int8 static"))
        state = _Run(spec, tmp_path / "out", options, parse_accuracy(None), None,  # type: ignore[arg-type]
                     {"batch": 4, "seq": 16}, lambda *_: None)  # fmt: skip
        state._run_race(tried)
        assert asked == [("fp32", "int8")] and state.race is not None and state.gate is not None
        assert state._race_skip("fp32", []) is None  # named: nothing skipped
        if ahead:
            assert state.gate.no_probe["aoti"].startswith("int8 products ran 3.00× float32's")
        else:
            assert "aoti" not in state.gate.no_probe
    no_int8 = _Run(spec, tmp_path / "out", OptimizeOptions(cache_dir=tmp_path, candidates=("torch fp32",)),
                   parse_accuracy(None), None, {"batch": 4, "seq": 16}, lambda *_: None)  # type: ignore[arg-type]  # fmt: skip
    no_int8._run_race(tried[:1])
    assert no_int8.race is None  # nothing to decide: not measured


def test_int8_leads_where_float32_is_the_fastest_float_and_amdahl_decides_float32s_skip() -> None:
    """The Xeon without AMX: int8 3.4x float32's, bf16 0.6x (out of the race), the products 92% of the FLOPs."""
    xeon = PrecisionRace({"fp32": 200.0, "bf16": 120.0, "int8": 680.0}, 25.8, 0.923, rounds=7)
    assert xeon.int8_leads() and xeon.fastest_float() == "fp32"
    assert not _race(int8=640.0).int8_leads()  # bf16 2x float32 is the fastest float: bf16 goes first instead
    kept = 0.937  # the small Transformer's package: head and one qkv left out
    want = 1 / ((1 - 0.923) + 0.923 * (kept / 3.4 + 1 - kept))
    assert xeon.int8_speedup(kept) == pytest.approx(want) and want == pytest.approx(2.57, abs=0.01)
    assert xeon.fp32_loses_to_int8(kept)
    assert not xeon.fp32_loses_to_int8(0.3)  # 1.27x: most of the work left in float32
    assert not PrecisionRace({"fp32": 200.0, "int8": 680.0}, 0.002, 0.923, rounds=7).fp32_loses_to_int8(kept)
    reason = int8_skip_reason(xeon, "aoti int8 static", kept)
    assert reason.startswith("cannot win here: aoti int8 static kept your accuracy with 94% of the linears'")
    assert "int8 products ran 3.40× float32's at this model's linear shapes (680 vs 200 GOP/s" in reason
    assert "by Amdahl's law about 2.57× float32's speed, over the 1.5× this needs" in reason


def test_the_aoti_int8_group_moves_before_the_first_float32_group() -> None:
    static = None
    tried = [
        Candidate("torch", "fp32", "torch"), Candidate("aoti", "fp32", "aoti"), Candidate("onnx", "int8", "onnx", static),
        Candidate("aoti", "int8", "aoti", static), Candidate("openvino", "int8", "openvino", static),
    ]  # fmt: skip
    moved = [[c.name for c in members] for members in int8_before_fp32(export_groups(tried)).values()]
    assert moved == [["aoti int8 static"], ["torch fp32", "aoti fp32"], ["onnx int8 static"], ["openvino int8 static"]]
    no_aoti = export_groups(tried[:3])
    assert int8_before_fp32(no_aoti) == no_aoti


def test_the_int8_share_counts_each_linears_multiply_adds_outside_the_left_out_paths() -> None:
    module = build_model("transformer", size="tiny").module  # hidden 32, ffn 64, 2 blocks, 2 labels
    per_block = 32 * 96 + 32 * 32 + 32 * 64 + 64 * 32  # qkv, proj, up, down
    total = 2 * per_block + 32 * 2
    assert linear_int8_share(module, []) == pytest.approx(1.0)
    assert linear_int8_share(module, ["head", "blocks.0.attn.qkv"]) == pytest.approx(1 - (64 + 32 * 96) / total)
    assert linear_int8_share(module, ["blocks.1"]) == pytest.approx(1 - per_block / total)  # a path holds its linears
    assert linear_int8_share(nn.Sequential(nn.ReLU()), []) is None


@pytest.mark.parametrize("kdim", [None, 8])
def test_the_int8_share_counts_a_multihead_attentions_input_projection(kdim: int | None) -> None:
    """PyTorch's attention holds its q, k and v projection as its own weight (3 x 16 x 16, or 16 x 16 for the
    queries and 16 x 8 each for keys and values of width 8), beside its out_proj and a 16 x 16 head."""
    module = nn.ModuleDict({"attn": nn.MultiheadAttention(16, 2, kdim=kdim, vdim=kdim), "head": nn.Linear(16, 16)})
    in_proj = 3 * 16 * 16 if kdim is None else 16 * 16 + 2 * 16 * 8
    total = in_proj + 16 * 16 + 16 * 16
    assert linear_int8_share(module, ["head"]) == pytest.approx(1 - 256 / total)
    assert linear_int8_share(module, ["attn"]) == pytest.approx(256 / total)  # its in- and out-projections


@pytest.mark.slow
@pytest.mark.fits(seconds=30)  # 19 s on the 2-core AMX Xeon
@pytest.mark.skipif(not hasattr(torch.ops.onednn, "qlinear_pointwise"), reason="no oneDNN int8 linear in this torch")
def test_where_int8_leads_a_passing_int8_package_skips_the_float32_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rates of the Xeon without AMX (the race's numbers are the machine's; the rule is tested): the aoti
    int8 group is written first and, once it passes, float32 is never written."""
    import tk.workflows.optimize.run as run

    xeon = PrecisionRace({"fp32": 200.0, "int8": 680.0}, 25.8, 0.923, rounds=7)
    monkeypatch.setattr(run, "run_race", lambda roofline, batch, rounds=7: xeon)
    options = OptimizeOptions(accuracy="sqnr>=5", sizes={"batch": 4, "seq": 16}, formats=("torch", "aoti"),
                              precisions=("fp32", "int8"), seconds=0.05, peaks=False, cache_dir=tmp_path / "cache")  # fmt: skip
    torch.manual_seed(0)
    result = optimize(build_model("transformer", size="tiny"), tmp_path / "out", options)
    rows = {r.candidate: r for r in result.rows}
    stages = [s["stage"] for s in result.record["stages"]]
    assert stages[:3] == ["race", "export aoti int8 static", "judge aoti int8 static"], stages
    assert rows["aoti int8 static"].status == "passed" and rows["aoti int8 static"].winner
    for name in ("torch fp32", "aoti fp32"):
        assert rows[name].status == "skipped" and rows[name].reason.startswith(
            "cannot win here: aoti int8 static kept your accuracy"
        ), rows[name].reason
    assert result.exports == 1 and result.record["precision_race"]["skipped"] == ["fp32"]


def test_a_reduced_float_whose_candidates_all_missed_the_accuracy_leaves_the_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small Transformer on the AVX512-BF16 EPYC: bf16 2x float32's, int8 2.8x float32's but 1.4x bf16's,
    and every bf16 candidate under the accuracy. Then int8 leads float32: its group goes first, unprobed."""
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize.run import _Run
    from tk.workflows.optimize.table import Row

    epyc = _race(int8=560.0)
    assert not epyc.int8_ahead() and epyc.fastest_float() == "bf16"
    out = epyc.without("bf16")
    assert out.fastest_float() == "fp32" and out.int8_ahead() and out.int8_leads() and epyc.out == frozenset()
    assert out.to_json()["out"] == ["bf16"] and out.rates == epyc.rates
    static = None
    tried = [
        Candidate("torch", "bf16", "torch"), Candidate("aoti", "bf16", "aoti"), Candidate("torch", "fp32", "torch"),
        Candidate("aoti", "int8", "aoti", static),
    ]  # fmt: skip
    spec = build_model("transformer", size="tiny")

    def run_with(bf16_status: str) -> tuple[_Run, list[list[str]]]:
        state = _Run(spec, tmp_path / "out", OptimizeOptions(cache_dir=tmp_path), parse_accuracy(None), None,  # type: ignore[arg-type]
                     {"batch": 4, "seq": 16}, lambda *_: None)  # fmt: skip
        state.race = epyc
        groups = export_groups(tried, reduced_first=True)
        first = groups.pop(next(iter(groups)))
        assert [c.name for c in first] == ["torch bf16", "aoti bf16"]
        rows = [Row(c.name, c.format, c.precision, c.engine, c.export_options, bf16_status) for c in first]
        left = state._drop_failed_floats(groups, rows)
        return state, [[c.name for c in members] for members in left.values()]

    failed, order = run_with("failed")
    assert failed.race is not None and failed.race.out == frozenset({"bf16"})
    assert order == [["aoti int8 static"], ["torch fp32"]]
    assert failed.gate is not None and failed.gate.no_probe["aoti"].startswith("int8 products ran 2.80× float32's")
    for status in ("passed", "skipped"):  # a bf16 that passed, or was never tried, stays in the race
        kept, order = run_with(status)
        assert kept.race is epyc and order == [["torch fp32"], ["aoti int8 static"]]
        assert kept.gate is not None and "aoti" not in kept.gate.no_probe
    # a bf16 group still to write keeps bf16 in the race, though the first one failed
    later = [*tried, Candidate("onnx", "bf16", "onnx", OnnxOptions(fusions=False))]
    state = _Run(spec, tmp_path / "out", OptimizeOptions(cache_dir=tmp_path), parse_accuracy(None), None,  # type: ignore[arg-type]
                 {"batch": 4, "seq": 16}, lambda *_: None)  # fmt: skip
    state.race = epyc
    groups = export_groups(later, reduced_first=True)
    first = groups.pop(next(iter(groups)))
    rows = [Row(c.name, c.format, c.precision, c.engine, c.export_options, "failed") for c in first]
    assert [c.name for c in first] == ["torch bf16", "aoti bf16"] and any(
        m[0].precision == "bf16" for m in groups.values()
    )
    assert state._drop_failed_floats(groups, rows) is groups and state.race is epyc


@pytest.mark.usefixtures("bf16_here")
def test_an_optimize_run_records_the_precision_that_left_the_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _ = _optimize(tmp_path, monkeypatch, _race(), accuracy="sqnr>=70")  # bf16 keeps ~40-50 dB here
    rows = {r.candidate: r for r in result.rows}
    assert rows["torch bf16"].status == "failed" and rows["torch fp32"].status == "passed"
    assert result.record["precision_race"]["out"] == ["bf16"] and result.record["precision_race"]["skipped"] == []
