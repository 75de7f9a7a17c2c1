"""tk optimize's speed gate: an int8 search that cannot give the winner is skipped with its numbers.

The gate's verdict depends on timings and on the load guard's mark; these tests move its margin so that
the verdict is certain (any ratio skips, or none does), read the machine through the load guard's
injected readers (quiet for the whole suite, tests/conftest.py; busy where a test says so), and assert
what it records, never a speed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tk.export import ExportOptions, write_artifact
from tk.export.context import Int8Share
from tk.manifest import verify_artifact
from tk.measure import load_guard
from tk.models import build_model
from tk.workflows.check import run_export_check
from tk.workflows.optimize import OptimizeOptions, gate, optimize
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.gate import PROBE, SpeedGate

SIZES = {"batch": 4, "seq": 16}


@pytest.fixture(scope="module")
def fp32_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gate") / "fp32"
    write_artifact(
        build_model("transformer", size="tiny"), out, ExportOptions(formats=("onnx",)), check=run_export_check
    )
    return out


AOTI_INT8 = Candidate("aoti", "int8", "aoti")
OPENVINO_FP32 = Candidate("openvino", "fp32", "openvino")


def _asked_before(
    root: Path, passed: tuple[Candidate, ...], *questions: tuple[str, dict[str, float]], gap: float | None = None
) -> SpeedGate:
    """A gate with ``passed`` added and earlier quiet questions (format, p50s) whose fastest was the aoti int8 package."""
    speed_gate = SpeedGate(dict(SIZES), products_gap_ms=gap)
    for candidate in passed:
        speed_gate.add(candidate, root, verify_artifact(root))
    for fmt, p50 in questions:
        speed_gate.verdicts.append({"format": fmt, "p50_ms": p50, "fastest_passed": "aoti int8 static", "busy": False})
    return speed_gate


def _gate(root: Path) -> SpeedGate:
    speed_gate = SpeedGate(dict(SIZES))
    speed_gate.add(Candidate("onnx", "fp32", "onnx"), root, verify_artifact(root))
    return speed_gate


def test_a_slower_probe_gets_a_reason_with_both_times(fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "MARGIN", -1.0)  # any time is "slower": the verdict is certain
    speed_gate = _gate(fp32_artifact)
    model = (fp32_artifact / verify_artifact(fp32_artifact).file("onnx").path).read_bytes()
    reason = speed_gate("onnx", model)
    assert reason is not None and reason.startswith("cannot win here: with every layer int8 it ran")
    assert "of onnx fp32 in the same rounds" in reason and "batch 4 × seq 16" in reason
    (verdict,) = speed_gate.verdicts
    assert verdict["format"] == "onnx" and verdict["fastest_passed"] == "onnx fp32"
    assert set(verdict["p50_ms"]) == {"onnx fp32", PROBE} and all(v > 0 for v in verdict["p50_ms"].values())
    assert verdict["busy"] is False and verdict["skipped"] is True and verdict["others_cores"] == 0.0
    assert len(verdict["ratios"]) == 2  # a skip holds in a second set of rounds too
    assert verdict["ratio"] == min(verdict["ratios"])  # judged on the set most favourable to the probe


def busy_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load guard reads 9 times the core count, and others' CPU growing by 1000 s at each reading."""
    counter = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(load_guard.system, "load", lambda: 9.0 * (os.cpu_count() or 1))
    monkeypatch.setattr(load_guard.system, "cpu", lambda: (float(next(counter)), 0.0))


def test_on_a_busy_machine_the_probe_is_timed_once_and_not_judged(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate, "MARGIN", -1.0)  # any time is "slower": only the busy mark keeps the search
    busy_machine(monkeypatch)
    speed_gate = _gate(fp32_artifact)
    model = (fp32_artifact / verify_artifact(fp32_artifact).file("onnx").path).read_bytes()
    assert speed_gate("onnx", model) is None
    (verdict,) = speed_gate.verdicts
    assert verdict["busy"] is True and verdict["skipped"] is False and len(verdict["ratios"]) == 1
    assert speed_gate("aoti", Int8Share(1, 36, 0.02)) is None  # no quiet probe of aoti's: nothing to judge by


def test_a_probe_within_the_margin_lets_the_search_run(fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "MARGIN", 1e9)
    speed_gate = _gate(fp32_artifact)
    model = (fp32_artifact / verify_artifact(fp32_artifact).file("onnx").path).read_bytes()
    assert speed_gate("onnx", model) is None
    assert speed_gate.verdicts[0]["skipped"] is False
    assert len(speed_gate.verdicts[0]["ratios"]) == 1  # nothing to confirm: one set


def test_no_passed_candidate_or_a_probe_that_cannot_run_is_no_reason(fp32_artifact: Path) -> None:
    assert SpeedGate(dict(SIZES))("onnx", b"") is None  # nothing passed yet: nothing to compare with
    assert _gate(fp32_artifact)("onnx", b"not an onnx graph") is None
    assert _gate(fp32_artifact)("tensorrt", object()) is None


def _probed(root: Path, fastest: Candidate, p50: dict[str, float], busy: bool = False) -> SpeedGate:
    """A gate that has timed aoti's all-int8 probe at ``p50`` (ms by name, ``PROBE`` among them)."""
    speed_gate = SpeedGate(dict(SIZES))
    speed_gate.add(fastest, root, verify_artifact(root))
    best = next(name for name in p50 if name != PROBE)
    speed_gate.verdicts.append(
        {"format": "aoti", "p50_ms": p50, "fastest_passed": best, "busy": busy, "skipped": False}
    )
    return speed_gate


def test_a_search_that_kept_too_little_int8_is_not_compiled(fp32_artifact: Path) -> None:
    """At best fastest - share x (fastest - all-int8): 200 - 0.02 x 60 = 198.8 ms, within TIE of the
    float32 candidate's 200 ms, which wins a tie; with 90% of the multiply-adds int8 it could win."""
    fp32 = Candidate("onnx", "fp32", "onnx")
    p50 = {"onnx fp32": 200.0, PROBE: 140.0}
    speed_gate = _probed(fp32_artifact, fp32, p50)
    reason = speed_gate("aoti", Int8Share(1, 36, 0.02))
    assert reason is not None and reason.startswith("cannot win here: its search kept 1 of 36 layers int8 (2% of")
    assert "at best 198.8 ms at batch 4 × seq 16, within 3% of onnx fp32's 200.0 ms, which wins a tie" in reason
    verdict = speed_gate.verdicts[-1]
    assert verdict["after_search"] == {"int8_layers": 1, "layers": 36, "share": 0.02}
    assert verdict["at_best_ms"] == pytest.approx(198.8) and verdict["skipped"] is True
    assert _probed(fp32_artifact, fp32, p50)("aoti", Int8Share(30, 36, 0.9)) is None  # at best 146 ms
    assert _probed(fp32_artifact, fp32, p50, busy=True)("aoti", Int8Share(1, 36, 0.02)) is None  # not judged
    assert _gate(fp32_artifact)("aoti", Int8Share(1, 36, 0.02)) is None  # no probe timed: nothing to go on
    # an int8 fastest does not win a tie by accuracy: only no faster at all is a reason
    int8 = Candidate("onnx", "int8", "onnx")
    assert (
        _probed(fp32_artifact, int8, {"onnx int8 static": 200.0, PROBE: 140.0})("aoti", Int8Share(1, 36, 0.02)) is None
    )


def float_part_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO's int8 float part as on a CPU without bfloat16 products (the CPUs these numbers are from)."""
    import tk.export.openvino.writer as ov_writer

    monkeypatch.setattr(ov_writer, "int8_float_part", lambda: "fp32")


def test_mid_search_the_most_int8_left_is_judged_against_the_formats_own_float_time(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX512-VNNI Xeon's numbers: OpenVINO's all-int8 IR 124.1 ms, its fp32 IR 226.0, the aoti int8
    package (the fastest) 129.7. A search that must leave 10% of the multiply-adds in float32 is at best
    124.1 + 0.1 x (226.0 - 124.1) = 134.3 ms: it stops; with 97% int8 left (127.2 ms) it goes on."""
    float_part_fp32(monkeypatch)

    def probed() -> SpeedGate:
        p50 = {"aoti int8 static": 129.7, "openvino fp32": 226.0, PROBE: 124.1}
        return _asked_before(fp32_artifact, (AOTI_INT8, OPENVINO_FP32), ("openvino", p50))

    speed_gate = probed()
    reason = speed_gate("openvino", Int8Share(21, 23, 0.9, bound=True))
    assert reason is not None and reason.startswith(
        "cannot win here: its search must leave more layers out: at most 21 of 23 int8 (90% of their multiply-adds)"
    )
    assert "at best 134.3 ms at batch 4 × seq 16, no faster than aoti int8 static's 129.7 ms" in reason
    assert "(all-int8 124.1 ms in the same rounds, float 226.0 ms in the same rounds)" in reason
    verdict = speed_gate.verdicts[-1]
    assert verdict["during_search"] == {"int8_layers": 21, "layers": 23, "share": 0.9} and "after_search" not in verdict
    assert verdict["at_best_ms"] == pytest.approx(134.29) and verdict["float_ms"] == 226.0 and verdict["skipped"]
    assert probed()("openvino", Int8Share(22, 23, 0.97, bound=True)) is None  # at best 127.2 ms
    # without its own float candidate in the rounds, the fastest stands in (the optimistic side)
    assert probed()("aoti", Int8Share(21, 23, 0.9, bound=True)) is None  # no aoti probe timed
    lone = _asked_before(fp32_artifact, (AOTI_INT8,), ("openvino", {"aoti int8 static": 129.7, PROBE: 124.1}))
    assert lone("openvino", Int8Share(21, 23, 0.9, bound=True)) is None  # 124.1 + 0.1 x 5.6: faster
    assert (
        lone.verdicts[-1]["float_ms"] == 129.7 and lone.verdicts[-1]["float_from"] == "aoti int8 static's, standing in"
    )


def test_a_float_left_out_of_the_rounds_is_scaled_from_an_earlier_question(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Xeon without AMX: OpenVINO fp32 (168 ms) was timed beside the aoti int8 package (90.5) in onnx's
    question, then left out of OpenVINO's as over twice the fastest. Its 1.86x the package there, times the
    package's 78.4 ms in OpenVINO's rounds, is the float end: with 83% int8 left, at best 69.3 + 0.17 x
    (145.8 - 69.3) = 82.3 ms, no faster than 78.4: the search stops (the fastest standing in read 70.8)."""
    float_part_fp32(monkeypatch)
    earlier = {"openvino fp32": 168.0, "aoti int8 static": 90.5, PROBE: 137.6}
    here = {"aoti int8 static": 78.4, PROBE: 69.3}  # openvino fp32 not timed: 168 > 2 x 69.3
    speed_gate = _asked_before(fp32_artifact, (OPENVINO_FP32, AOTI_INT8), ("onnx", earlier), ("openvino", here))
    reason = speed_gate("openvino", Int8Share(19, 23, 0.83, bound=True))
    float_ms = 168.0 / 90.5 * 78.4
    assert (
        reason is not None
        and f"float {float_ms:.1f} ms by its time over aoti int8 static's in an earlier question" in reason
    )
    verdict = speed_gate.verdicts[-1]
    assert verdict["float_ms"] == pytest.approx(float_ms, abs=1e-3) and verdict["skipped"]
    assert verdict["at_best_ms"] == pytest.approx(69.3 + 0.17 * (float_ms - 69.3), abs=1e-3)
    assert speed_gate("openvino", Int8Share(21, 23, 0.92, bound=True)) is None  # 75.4 ms: it may still win
    speed_gate.verdicts[0]["busy"] = True  # a busy question's times decide nothing: the fastest stands in
    assert speed_gate("openvino", Int8Share(19, 23, 0.83, bound=True)) is None


def test_a_format_the_race_cleared_is_not_compiled_to_ask(fp32_artifact: Path) -> None:
    speed_gate = _gate(fp32_artifact)
    speed_gate.no_probe["aoti"] = "int8 products ran 1.60× bf16's"
    compiled = []
    assert speed_gate("aoti", lambda: compiled.append(1)) is None and compiled == []  # the search runs
    assert speed_gate.verdicts == [
        {"format": "aoti", "probe": "not timed", "reason": "int8 products ran 1.60× bf16's", "skipped": False}
    ]
    assert speed_gate("aoti", Int8Share(1, 36, 0.02)) is None  # no probe timed: the package is compiled
    assert speed_gate._contenders() == speed_gate.passed  # the record without times leaves every contender in


def test_later_questions_leave_out_candidates_an_earlier_one_timed_far_slower(fp32_artifact: Path) -> None:
    manifest = verify_artifact(fp32_artifact)
    fast, slow, slowish, late = (
        Candidate("openvino", "bf16", "openvino"),
        Candidate("torch", "fp32", "torch"),
        Candidate("onnx", "fp32", "onnx"),
        Candidate("aoti", "bf16", "aoti"),
    )
    speed_gate = SpeedGate(dict(SIZES))
    for candidate in (fast, slow, slowish):
        speed_gate.add(candidate, fp32_artifact, manifest)
    assert [c for c, _, _ in speed_gate._contenders()] == [fast, slow, slowish]  # nothing timed yet: all
    p50 = {"openvino bf16": 45.0, "torch fp32": 163.0, "onnx fp32": 89.0, PROBE: 38.0}  # 163 > 2 x 45 >= 89
    speed_gate.verdicts.append({"format": "aoti", "p50_ms": p50, "fastest_passed": "openvino bf16", "busy": False})
    speed_gate.add(late, fp32_artifact, manifest)  # passed after that question: timed
    assert [c for c, _, _ in speed_gate._contenders()] == [fast, slowish, late]
    speed_gate.verdicts.append({"format": "onnx", "p50_ms": dict(p50), "fastest_passed": "openvino bf16", "busy": True})
    assert [c for c, _, _ in speed_gate._contenders()] == [fast, slowish, late]  # a busy question decides nothing
    quiet = {"openvino bf16": 45.0, "onnx fp32": 95.0, "aoti bf16": 50.0, PROBE: 60.0}  # torch fp32 not timed again
    speed_gate.verdicts.append({"format": "onnx", "p50_ms": quiet, "fastest_passed": "openvino bf16", "busy": False})
    assert [c for c, _, _ in speed_gate._contenders()] == [fast, late]  # each judged by the last question that timed it


def _force_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every int8 model misses the floor (so the gate is asked), and every probe is 'slower'."""
    monkeypatch.setattr(gate, "MARGIN", -1.0)


@pytest.mark.fits(seconds=60)  # 40 s on the 2-core AMX Xeon
def test_optimize_skips_int8_searches_that_cannot_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _force_search(monkeypatch)
    options = OptimizeOptions(
        accuracy="sqnr>=80",  # untrained tiny int8 reaches ~35-45 dB: each int8 writer would search
        sizes=dict(SIZES),
        candidates=("onnx fp32", "onnx int8 static", "aoti int8 static", "openvino int8 static"),
        seconds=0.05,
        cache_dir=tmp_path / "cache",
    )
    torch.manual_seed(0)
    result = optimize(build_model("transformer", size="tiny"), tmp_path / "out", options)
    rows: dict[str, Any] = {r.candidate: r for r in result.rows}
    assert result.winner is not None and result.winner.candidate == "onnx fp32"
    for name in ("onnx int8 static", "aoti int8 static", "openvino int8 static"):
        assert rows[name].status == "skipped", (name, rows[name].status, rows[name].reason)
        assert rows[name].reason.startswith(f"{name.split()[0]} int8: cannot win here"), rows[name].reason
    gate_record = result.record["speed_gate"]
    assert [v["format"] for v in gate_record] == ["aoti", "onnx", "openvino"]  # the writers' int8_rank
    assert all(v["fastest_passed"] == "onnx fp32" for v in gate_record)
    assert not any(v["busy"] for v in gate_record)  # the suite's quiet machine (tests/conftest.py)
    race = result.record["precision_race"]  # named candidates: raced before the first group for the int8 probe
    assert set(race["rates_gflops"]) <= {"fp32", "int8"} and "fp32" in race["rates_gflops"] and race["skipped"] == []
    assert race["linear_gflop"] < 1.0 and "probe" not in gate_record[0]  # tiny: too small to trust, so probed
    assert not any(p.name.startswith("int8") for p in (tmp_path / "cache").iterdir())  # nothing half-written cached


@pytest.mark.fits(seconds=35)  # 22 s on the 2-core AMX Xeon
def test_onnx_and_openvino_ask_before_judging_even_a_passing_all_int8_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their probes cost seconds, so they ask before the judge: an all-int8 model that would pass but
    cannot win is skipped without its verdict (aoti, whose probe is a compile, asks only before a search)."""
    monkeypatch.setattr(gate, "MARGIN", -1.0)
    options = OptimizeOptions(
        accuracy="sqnr>=5",  # every all-int8 model of tiny passes this floor: no search
        sizes=dict(SIZES),
        candidates=("onnx fp32", "onnx int8 static", "openvino int8 static"),
        seconds=0.05,
        cache_dir=tmp_path / "cache",
    )
    torch.manual_seed(0)
    result = optimize(build_model("transformer", size="tiny"), tmp_path / "out", options)
    rows: dict[str, Any] = {r.candidate: r for r in result.rows}
    for name in ("onnx int8 static", "openvino int8 static"):
        assert rows[name].status == "skipped" and "cannot win here" in rows[name].reason, rows[name].reason
    assert [v["format"] for v in result.record["speed_gate"]] == ["onnx", "openvino"]
    assert not any(v["busy"] for v in result.record["speed_gate"])


def test_keep_all_turns_the_gate_off(tmp_path: Path) -> None:
    """--keep all asks for every candidate's artifact, so every int8 search must run: no gate."""
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize.run import _Run

    spec = build_model("transformer", size="tiny")
    for keep, gated in (("all", False), ("best", True)):
        options = OptimizeOptions(keep=keep, cache_dir=tmp_path)
        state = _Run(spec, tmp_path / "out", options, parse_accuracy(None), None, dict(SIZES), lambda *_: None)  # type: ignore[arg-type]
        assert (state.gate is not None) is gated


def test_with_no_float_candidate_of_its_format_the_race_gives_the_float_end(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Xeon without AMX once float32 was skipped: OpenVINO's all-int8 IR 75.1 ms against the aoti int8
    package's 76.0, no OpenVINO fp32 ever timed. The race's rates put the linears at 92 ms more per call in
    float32: with 92% int8 left, at best 75.1 + 0.08 x 92 = 82.5 ms: the search stops (standing in, the
    package's own 76.0 read at best 75.2 and the search ran 107 s to lose)."""
    float_part_fp32(monkeypatch)  # that IR ran its float part in float32

    def probed(gap: float | None) -> SpeedGate:
        p50 = {"aoti int8 static": 76.0, PROBE: 75.1}
        return _asked_before(fp32_artifact, (AOTI_INT8,), ("openvino", p50), gap=gap)

    speed_gate = probed(92.0)
    reason = speed_gate("openvino", Int8Share(21, 23, 0.92, bound=True))
    assert reason is not None and "float 167.1 ms (all-int8 plus its products at float32's rate)" in reason
    assert speed_gate.verdicts[-1]["at_best_ms"] == pytest.approx(75.1 + 0.08 * 92.0)
    assert probed(None)("openvino", Int8Share(21, 23, 0.92, bound=True)) is None  # the fastest stands in


def test_the_products_gap_is_the_linears_time_at_float32_less_at_int8() -> None:
    from tk.workflows.optimize.precision_race import PrecisionRace

    race = PrecisionRace({"fp32": 193.0, "int8": 621.0}, 25.77, 0.923, rounds=7)
    assert race.products_gap_ms() == pytest.approx(25.77 * (1 / 193.0 - 1 / 621.0) * 1e3)  # ~92 ms
    assert PrecisionRace({"fp32": 193.0}, 25.77, 0.923).products_gap_ms() is None


def test_the_float_end_is_the_precision_the_int8_models_left_out_layers_run_in(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MiniLM on the AVX512-BF16 EPYC: OpenVINO's all-int8 IR 44.9 ms, its bf16 IR 68.5, the aoti bf16
    package (the fastest) 67.6, no OpenVINO fp32 timed (the race skipped float32). The IR's left-out layers
    run in float32, not bf16: the race's 73.3 ms gap gives the float end, and with 61% of the multiply-adds
    left int8 the search is at best 44.9 + 0.39 x 73.3 = 73.5 ms: it stops (bf16 standing in read 54.1)."""
    import tk.export.aoti.int8 as aoti_int8
    import tk.export.openvino.writer as ov_writer
    from tk.formats.aoti import runs_natively
    from tk.workflows.optimize.gate import int8_float_part

    assert int8_float_part("openvino") == ("bf16" if runs_natively("bf16") else "fp32")
    float_part_fp32(monkeypatch)  # the EPYC's IR ran its float part in float32 then
    aoti_bf16 = Candidate("aoti", "bf16", "aoti")
    openvino_bf16 = Candidate("openvino", "bf16", "openvino")
    p50 = {"aoti bf16": 67.6, "openvino bf16": 68.5, PROBE: 44.9}
    speed_gate = _asked_before(fp32_artifact, (aoti_bf16, openvino_bf16), ("openvino", p50), gap=73.3)
    speed_gate.verdicts[-1]["fastest_passed"] = "aoti bf16"
    reason = speed_gate("openvino", Int8Share(37, 45, 0.61, bound=True))
    assert reason is not None and "float 118.2 ms (all-int8 plus its products at float32's rate)" in reason
    assert speed_gate.verdicts[-1]["at_best_ms"] == pytest.approx(44.9 + 0.39 * 73.3)
    assert speed_gate("openvino", Int8Share(43, 45, 0.89, bound=True)) is None  # 53.0 ms: it may still win
    assert int8_float_part("onnx") == int8_float_part("openvino") == "fp32"
    # now it runs it in bf16 where the IR holds the judge's target so: the float end is OpenVINO's bf16 IR in
    # the same rounds, and the search is at best 44.9 + 0.39 x (68.5 - 44.9) = 54.1 ms, so it may win
    monkeypatch.setattr(ov_writer, "int8_float_part", lambda: "bf16")
    assert int8_float_part("openvino") == "bf16"
    bf16_gate = _asked_before(fp32_artifact, (aoti_bf16, openvino_bf16), ("openvino", p50), gap=73.3)
    bf16_gate.verdicts[-1]["fastest_passed"] = "aoti bf16"
    assert bf16_gate("openvino", Int8Share(37, 45, 0.61, bound=True)) is None
    assert bf16_gate.verdicts[-1]["float_ms"] == 68.5 and bf16_gate.verdicts[-1]["float_from"] == "in the same rounds"
    for in_bf16, part in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(aoti_int8, "excluded_run_in_bf16", lambda in_bf16=in_bf16: in_bf16)
        assert int8_float_part("aoti") == part


def test_the_probe_is_also_timed_at_its_engines_settings_and_its_fastest_counts(
    fp32_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenVINO's all-int8 IR runs at its defaults and with 2 streams (as the ranking would try it); with the
    blocks' times injected, the faster setting is the probe's time and the verdict names it."""
    ov = pytest.importorskip("openvino")
    monkeypatch.setattr(gate, "usable_cores", lambda: 2)  # two streams are worth trying at batch 4
    streams = f"{PROBE} [streams 2]"
    injected = {"onnx fp32": 9e-3, PROBE: 10e-3, streams: 8e-3}  # seconds per call
    ran: list[str] = []

    def blocks(calls: dict[str, Any], **_: Any) -> dict[str, list[float]]:
        ran.extend(calls)
        return {name: [injected[name]] * 5 for name in calls}

    monkeypatch.setattr(gate, "time_in_blocks", blocks)
    speed_gate = _gate(fp32_artifact)
    model = ov.Core().read_model(str(fp32_artifact / verify_artifact(fp32_artifact).file("onnx").path))
    assert speed_gate("openvino", model) is None  # 8 ms against 9: the search runs
    (verdict,) = speed_gate.verdicts
    assert set(ran) == {"onnx fp32", PROBE, streams}  # both settings were compiled, run and timed
    assert verdict["p50_ms"] == {"onnx fp32": 9.0, PROBE: 8.0} and verdict["probe_timed_as"] == streams
    assert verdict["ratio"] == round(8 / 9, 3) and verdict["skipped"] is False
