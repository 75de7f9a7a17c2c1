"""The precision race: float32 candidates are skipped when a faster float precision kept the spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tk.models import build_model
from tk.workflows.optimize import OptimizeOptions, OptimizeResult, optimize
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.precision_race import PrecisionRace, int8_probe_reason, run_race, skip_reason
from tk.workflows.optimize.run import export_groups
from tk.workflows.roofline import Roofline


def _race(
    rate: float = 400.0, fp32: float = 200.0, gflop: float = 25.8, share: float = 1.0, int8: float | None = None
) -> PrecisionRace:
    return PrecisionRace("bf16", rate, fp32, gflop, share, rounds=7, int8_rate_gflops=int8)


def test_reduced_floats_are_written_before_float32_and_int8_stays_last() -> None:
    fused, unfused = (("onnx_fusions", True),), (("onnx_fusions", False),)
    static = (("int8_mode", "static"),)
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
    assert _race().fp32_cannot_win()
    assert _race(rate=290.0).ratio == pytest.approx(1.45) and not _race(rate=290.0).fp32_cannot_win()
    assert not _race(share=0.5).fp32_cannot_win()  # a convolution net: its products are not nn.Linear
    assert not _race(gflop=0.002).fp32_cannot_win()  # a tiny call: overheads, not products, decide
    reason = skip_reason(_race(), "aoti bf16")
    assert reason.startswith("cannot win here: bf16 products ran 2.00× float32's")
    assert "400 vs 200 GFLOP/s, median of 7 interleaved rounds; 100% of its FLOPs" in reason
    assert "aoti bf16 kept your accuracy" in reason and "--keep all" in reason


def test_int8_is_ahead_by_the_same_rule_and_says_why_the_probe_is_not_compiled() -> None:
    assert _race(int8=640.0).int8_ahead() and _race(int8=640.0).int8_ratio == pytest.approx(1.6)
    assert not _race().int8_ahead() and _race().int8_ratio is None  # not raced
    assert not _race(int8=560.0).int8_ahead()  # 1.4x: not clear enough
    assert not _race(int8=640.0, share=0.5).int8_ahead() and not _race(int8=640.0, gflop=0.002).int8_ahead()
    reason = int8_probe_reason(_race(int8=640.0))
    assert reason.startswith("int8 products ran 1.60× bf16's at this model's linear shapes (640 vs 400 GFLOP/s")
    assert reason.endswith("the all-int8 package was not compiled to ask, and the search runs")
    assert _race(int8=640.0).to_json()["int8_ratio"] == 1.6 and _race().to_json()["int8_rate_gflops"] is None


def test_int8_raced_alone_is_measured_against_float32_and_never_skips_float32() -> None:
    """Where the CPU has no bf16 dot products, int8 races float32 itself (after the float32 groups)."""
    alone = PrecisionRace("int8", 600.0, 200.0, 25.8, 1.0, rounds=7)
    assert alone.int8_ahead() and alone.int8_ratio == pytest.approx(3.0) and not alone.fp32_cannot_win()
    assert not PrecisionRace("int8", 280.0, 200.0, 25.8, 1.0, rounds=7).int8_ahead()  # 1.4x
    reason = int8_probe_reason(alone)
    assert reason.startswith("int8 products ran 3.00× float32's at this model's linear shapes (600 vs 200 GFLOP/s")


def test_the_race_measures_both_rates_at_the_models_own_linear_shapes() -> None:
    module = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()
    roofline = Roofline(module, (torch.randn(1, 8, 64),), ("fp32", "fp16"))  # fp16 is measurable on any CPU
    race = run_race(roofline, "fp16", batch=4, rounds=3)
    assert race is not None and race.precision == "fp16" and race.rounds == 3
    rows = 8 * 4  # every leading dimension, scaled to the batch
    assert race.linear_gflop == pytest.approx((2 * rows * 64 * 128 + 2 * rows * 128 * 32) / 1e9, rel=1e-12)
    assert race.linear_share == pytest.approx(1.0)  # the products are all of the model's FLOPs
    assert race.rate_gflops > 0 and race.fp32_rate_gflops > 0
    conv = nn.Sequential(nn.Conv2d(3, 8, 3)).eval()
    no_linear = Roofline(conv, (torch.randn(1, 3, 16, 16),), ("fp32", "fp16"))
    assert run_race(no_linear, "fp16", batch=2) is None  # no nn.Linear to race on
    assert run_race(roofline, "bf16", batch=4) is None  # a precision the roofline was not made for
    assert race.int8_rate_gflops is None  # int8 only where the roofline was made for it
    with_int8 = Roofline(module, (torch.randn(1, 8, 64),), ("fp32", "fp16", "int8"))
    raced = run_race(with_int8, "fp16", batch=4, rounds=3)
    assert raced is not None and raced.fp32_rate_gflops > 0
    if "int8" in with_int8.skipped:  # no oneDNN int8 linear here: raced without it
        assert raced.int8_rate_gflops is None
    else:
        assert raced.int8_rate_gflops is not None and raced.int8_rate_gflops > 0


@pytest.fixture
def bf16_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 candidates even on a CPU without AVX512-BF16 (they run emulated: slower, as accurate)."""
    import tk.workflows.optimize.candidates as candidates

    monkeypatch.setattr(candidates, "hardware_reason", lambda precision, device, flags=None: None)


def _optimize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: PrecisionRace, **kwargs: object
) -> tuple[OptimizeResult, list[tuple[str, int]]]:
    """A tiny optimize run over torch fp32 and bf16 whose race returns ``race``; the result, and each race asked."""
    import tk.workflows.optimize.run as run

    asked: list[tuple[str, int]] = []

    def fixed_race(roofline: Roofline, precision: str, batch: int, rounds: int = 7) -> PrecisionRace:
        asked.append((precision, batch))  # the rates are the machine's: the rule is what is tested here
        return race

    monkeypatch.setattr(run, "run_race", fixed_race)
    options = OptimizeOptions(accuracy="sqnr>=20", sizes={"batch": 4, "seq": 16}, formats=("torch",),
                              precisions=("fp32", "bf16"), seconds=0.05, peaks=False, cache_dir=tmp_path / "cache",
                              **kwargs)  # type: ignore[arg-type]  # fmt: skip
    torch.manual_seed(0)
    return optimize(build_model("transformer", size="tiny"), tmp_path / "out", options), asked


@pytest.mark.usefixtures("bf16_here")
def test_a_passing_bf16_candidate_with_twice_the_rate_skips_the_float32_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, asked = _optimize(tmp_path, monkeypatch, _race())
    rows = {r.candidate: r for r in result.rows}
    assert asked == [("bf16", 4)]  # once, at the timing batch
    assert rows["torch bf16"].status == "passed" and rows["torch bf16"].winner
    assert rows["torch fp32"].status == "skipped"
    assert rows["torch fp32"].reason == skip_reason(_race(), "torch bf16")
    assert result.exports == 1  # the float32 group was never written
    record = result.record["precision_race"]
    assert record["skipped_fp32"] is True and record["ratio"] == 2.0 and record["precision"] == "bf16"


@pytest.mark.usefixtures("bf16_here")
def test_a_close_rate_lets_float32_run_and_keep_all_never_races(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    close, _ = _optimize(tmp_path / "close", monkeypatch, _race(rate=250.0))
    rows = {r.candidate: r for r in close.rows}
    assert rows["torch fp32"].status == "passed" and rows["torch fp32"].p50_ms is not None
    assert close.record["precision_race"]["skipped_fp32"] is False
    every, asked = _optimize(tmp_path / "all", monkeypatch, _race(), keep="all")
    assert asked == [] and every.record["precision_race"] is None
    assert {r.candidate: r.status for r in every.rows}["torch fp32"] == "passed"


def test_without_a_reduced_float_int8_races_float32_before_the_int8_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bf16 candidate passed (a CPU without bf16 dot products): before the first int8 group, int8's
    rate is raced against float32's; a clear lead spares the gate the aoti all-int8 compile."""
    import tk.workflows.optimize.run as run
    from tk.accuracy import parse_accuracy
    from tk.export import ExportOptions, write_artifact
    from tk.manifest import verify_artifact
    from tk.workflows.check import run_export_check
    from tk.workflows.optimize.run import _Run

    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    root = tmp_path / "fp32"
    write_artifact(spec, root, ExportOptions(formats=("torch",)), check=run_export_check)
    passed = [(Candidate("torch", "fp32", "torch"), root, verify_artifact(root))]
    for int8_rate, ahead in ((600.0, True), (250.0, False)):
        asked: list[tuple[str, int]] = []

        def fixed_race(
            roofline: Roofline, precision: str, batch: int, rounds: int = 7, rate: float = int8_rate,
            asked: list[tuple[str, int]] = asked,
        ) -> PrecisionRace:  # fmt: skip
            asked.append((precision, batch))
            assert {"fp32", "int8"} <= set(roofline.precisions)
            return PrecisionRace("int8", rate, 200.0, 25.8, 1.0, rounds=7)

        monkeypatch.setattr(run, "run_race", fixed_race)
        state = _Run(spec, tmp_path / "out", OptimizeOptions(cache_dir=tmp_path), parse_accuracy(None), None,  # type: ignore[arg-type]
                     {"batch": 4, "seq": 16}, lambda *_: None)  # fmt: skip
        state._race_int8 = True
        state._race_int8_alone(passed)
        assert asked == [("int8", 4)]
        assert state.race is not None and state.race["precision"] == "int8" and state.race["skipped_fp32"] is False
        assert state.gate is not None
        if ahead:
            assert state.gate.no_probe["aoti"].startswith("int8 products ran 3.00× float32's")
        else:
            assert "aoti" not in state.gate.no_probe
