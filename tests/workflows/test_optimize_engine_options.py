"""tk optimize times engine settings beside the defaults (OpenVINO's streams), keeps the fastest beyond the
tie margin, and the artifact opens with it wherever its recommended engine is opened unnamed."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tk.manifest import verify_artifact
from tk.models import build_model
from tk.runtime import EngineChoice, load
from tk.runtime.openvino import OpenVINOEngine
from tk.workflows.optimize import OptimizeOptions, optimize
from tk.workflows.optimize.table import TIE, Row, render
from tk.workflows.optimize.timing import Timed, keep_fastest

pytestmark = pytest.mark.skipif(OpenVINOEngine.unavailable_reason() is not None, reason="openvino is not installed")

STREAMS = "openvino fp32 [streams 2]"


def test_openvino_tries_two_streams_and_one_per_core_where_the_batch_splits() -> None:
    assert OpenVINOEngine.tuned_options(8, 2) == [{"streams": 2}]
    assert OpenVINOEngine.tuned_options(8, 16) == [{"streams": 2}, {"streams": 8}]
    assert OpenVINOEngine.tuned_options(3, 16) == [{"streams": 2}, {"streams": 3}]
    assert OpenVINOEngine.tuned_options(1, 16) == []  # one row: nothing to split
    assert OpenVINOEngine.tuned_options(8, 1) == []  # one core: the requests would take turns


def _timed() -> Timed:
    timed = Timed()
    timed.p50_ms = {"eager": 80.0, "openvino fp32": 8.0}  # the blocks' medians (time_in_turn sets them first)
    timed.floor_share = {"openvino fp32": 0.5}
    return timed


def _tuned(defaults_ms: float, streams_ms: float) -> list[dict[str, Any]]:
    return [{"options": {}, "block_ms": defaults_ms}, {"options": {"streams": 2}, "block_ms": streams_ms}]


def test_a_setting_faster_than_the_tie_margin_becomes_the_candidates_numbers() -> None:
    timed = _timed()
    keep_fastest(timed, "openvino fp32", _tuned(8.0, 7.2))
    assert timed.engine_options == {"openvino fp32": {"streams": 2}}
    assert timed.p50_ms["openvino fp32"] == 7.2
    assert timed.floor_share["openvino fp32"] == pytest.approx(0.5 * 8.0 / 7.2)  # the products' time over the p50
    assert timed.tuned["openvino fp32"] == _tuned(8.0, 7.2)


def test_within_the_tie_margin_the_defaults_stay() -> None:
    streams_ms = 8.0 / (1 + TIE) + 0.01  # faster, but by less than the margin
    timed = _timed()
    keep_fastest(timed, "openvino fp32", _tuned(8.0, streams_ms))
    assert timed.engine_options == {}
    assert (timed.p50_ms["openvino fp32"], timed.floor_share["openvino fp32"]) == (8.0, 0.5)
    assert timed.tuned["openvino fp32"] == _tuned(8.0, streams_ms)


def test_the_table_names_the_setting_a_row_was_timed_at() -> None:
    from rich.console import Console

    row = Row("openvino fp32", "openvino", "fp32", "openvino", {}, "passed", p50_ms=9.0, speedup=2.0)
    row.engine_options = {"streams": 2}
    console = Console(width=200, record=True)
    console.print(render([row], "t"))
    assert STREAMS in console.export_text()


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("optimize-streams")
    torch.manual_seed(0)
    options = OptimizeOptions(accuracy="sqnr>=40", sizes={"batch": 4, "seq": 16}, candidates=("openvino fp32",),
                              seconds=0.05, cache_dir=base / "cache")  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # the settings tried depend on the cores: two, as CI's machine
        patch.setattr("tk.workflows.optimize.timing.usable_cores", lambda: 2)
        result = optimize(build_model("transformer", size="tiny"), base / "out", options)
    return {"out": base / "out", "result": result}


def test_each_setting_is_timed_and_the_pick_records_the_one_kept(optimized: dict[str, Any]) -> None:
    winner, out = optimized["result"].winner, optimized["out"]
    assert winner.candidate == "openvino fp32"
    tried = {tuple(t["options"].items()): t["block_ms"] for t in winner.tuned}
    assert set(tried) == {(), (("streams", 2),)} and all(ms > 0 for ms in tried.values())
    kept = tuple(winner.engine_options.items())
    if kept:  # whichever ran faster here: the rule, read from the numbers recorded
        assert tried[kept] * (1 + TIE) < tried[()]
    else:
        assert tried[(("streams", 2),)] * (1 + TIE) >= tried[()]
    assert winner.p50_ms == tried[kept] and winner.rounds_p50_ms > 0  # ranked by the blocks; the rounds kept
    record = optimized["result"].record
    assert record["timing"]["eager_p50_ms"] / winner.p50_ms == pytest.approx(winner.speedup, rel=1e-6)
    assert record["timing"]["blocks"]["engines"] == ["eager", "openvino fp32", STREAMS]
    assert record["timing"]["blocks"]["block"] == 5 and 2 <= record["timing"]["blocks"]["rounds"] <= 6
    manifest = verify_artifact(out)
    assert manifest.optimize["recommended"]["engine_options"] == winner.engine_options
    assert manifest.recommended_engine_options == winner.engine_options
    with load(out) as engine:
        assert engine.name == "openvino" and engine.options.streams == winner.engine_options.get("streams")


def _recommending_streams(out: Path) -> Any:
    manifest = copy.deepcopy(verify_artifact(out))
    manifest.optimize["recommended"]["engine_options"] = {"streams": 2}
    return manifest


def test_unnamed_the_recommended_engine_opens_with_its_settings_under_the_callers(optimized: dict[str, Any]) -> None:
    out = optimized["out"]
    manifest = _recommending_streams(out)
    with load(out, manifest=manifest) as engine:
        assert engine.options.streams == 2
        assert engine.load().settings()["num_streams"] == 2
    with load(out, manifest=manifest, streams=1) as engine:
        assert engine.options.streams == 1
    with load(out, manifest=manifest, streams=None) as engine:  # None is not given, as EngineChoice has it
        assert engine.options.streams == 2
    with load(out, "openvino", manifest=manifest) as engine:  # named: its defaults, as the user asked
        assert engine.options.streams is None


def test_auto_takes_the_recommended_settings_and_says_so(optimized: dict[str, Any]) -> None:
    from tk.workflows.auto import choose_engine

    out = optimized["out"]
    auto = choose_engine(out, _recommending_streams(out), EngineChoice("auto"), batch_size=4)
    assert auto.engine == "openvino" and auto.options == {"streams": 2}
    assert "with streams 2" in auto.reason and auto.to_json()["options"] == {"streams": 2}
    chosen = EngineChoice("auto", options={"streams": 3}).with_defaults(auto.options, [auto.engine])
    assert chosen.options == {"streams": 3}  # the user's own win


def _opened_streams(module: Any, monkeypatch: pytest.MonkeyPatch, manifest: Any) -> dict[str, Any]:
    """``module`` (a workflow) reading ``manifest`` for its artifact, and the streams of each engine it opens."""
    from tk.runtime import open_engine

    streams: dict[str, Any] = {}

    @contextlib.contextmanager
    def recording(root: Any, choice: Any, engine: str, **kwargs: Any) -> Any:
        with open_engine(root, choice, engine, **kwargs) as opened:
            streams[engine] = getattr(opened.options, "streams", None)
            yield opened

    monkeypatch.setattr(module, "verify_artifact", lambda root: manifest)
    monkeypatch.setattr(module, "open_engine", recording)
    return streams


def test_infer_and_check_auto_open_the_pick_with_its_settings(optimized: dict[str, Any], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tk.workflows import check, infer

    out = optimized["out"]
    manifest = _recommending_streams(out)
    opened = _opened_streams(infer, monkeypatch, manifest)
    infer.infer_artifact(out, EngineChoice("auto"), tmp_path / "auto.npz", random=4, batch_size=4)
    assert opened == {"openvino": 2}
    infer.infer_artifact(out, EngineChoice("openvino"), tmp_path / "named.npz", random=4, batch_size=4)
    assert opened == {"openvino": None}  # named: its defaults
    opened = _opened_streams(check, monkeypatch, manifest)
    result = check.check_artifact(out, EngineChoice("auto"), samples=4, batch_size=4)
    assert opened == {"eager": None, "openvino": 2} and result.passed  # eager takes no streams option


def test_a_setting_that_cannot_open_is_left_out_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    tried = [{"performance_hint": "FASTEST"}, {"streams": 2}]  # OpenVINO has no FASTEST hint: its options refuse it
    monkeypatch.setattr(OpenVINOEngine, "tuned_options", classmethod(lambda cls, batch, cores: tried))
    torch.manual_seed(0)
    options = OptimizeOptions(accuracy="sqnr>=40", sizes={"batch": 4, "seq": 16}, candidates=("openvino fp32",),
                              seconds=0.05, cache_dir=tmp_path / "cache", peaks=False)  # fmt: skip
    with caplog.at_level("WARNING", logger="tk.optimize"):
        result = optimize(build_model("transformer", size="tiny"), tmp_path / "out", options)
    assert [t["options"] for t in result.winner.tuned] == [{}, {"streams": 2}]
    assert (
        "openvino fp32 [performance_hint FASTEST] left out: engine 'openvino': performance_hint must be" in caplog.text
    )
