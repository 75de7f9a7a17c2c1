"""tk optimize on the tiny Transformer, over a reduced candidate set: judged, timed, written, cached."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import UsageError
from tk.manifest import verify_artifact
from tk.models import build_model
from tk.runtime import EngineChoice, load
from tk.spec import Dim, random_feeds
from tk.tolerances import TOLERANCES
from tk.workflows.optimize import OptimizeOptions, optimize, timing_sizes
from tk.workflows.optimize.candidates import enumerate_candidates, hardware_reason

CANDIDATES = ("onnx fp32", "torch fp32", "onnx int8 dynamic")


def _options(cache: Path) -> OptimizeOptions:
    return OptimizeOptions(
        accuracy="sqnr>=60",  # untrained int8 reaches ~35-40 dB: it must fail with its number
        sizes={"batch": 4, "seq": 16},
        candidates=CANDIDATES,
        seconds=0.05,
        cache_dir=cache,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("optimize")
    torch.manual_seed(0)
    first = optimize(build_model("transformer", size="tiny"), base / "out", _options(base / "cache"))
    torch.manual_seed(0)
    second = optimize(build_model("transformer", size="tiny"), base / "out", _options(base / "cache"))
    return {"base": base, "first": first, "second": second}


def _wrote_out(runs: dict[str, Any]) -> Any:
    """The run whose artifact ``out`` holds: the second. onnx and torch fp32 run within noise of each other
    on the tiny model, so each run may pick either: a test compares ``out`` with the run that wrote it."""
    return runs["second"]


def _row(result: Any, name: str) -> Any:
    return next(r for r in result.rows if r.candidate == name)


def test_the_winner_is_a_passing_fp32_candidate_whose_engine_load_opens(runs: dict[str, Any]) -> None:
    result, out = _wrote_out(runs), runs["base"] / "out"
    winner = result.winner
    assert winner is not None and winner.status == "passed" and winner.candidate in ("onnx fp32", "torch fp32")
    manifest = verify_artifact(out)
    assert manifest.status == "passed"
    assert manifest.optimize["recommended"]["engine"] == winner.engine == manifest.recommended_engine
    assert manifest.optimize["recommended"]["format"] == winner.format
    assert set(manifest.formats) == {winner.format}
    feeds = random_feeds(manifest.signature.inputs, {"batch": 3, "seq": 11}, seed=5)
    with load(out) as engine, load(out, "eager") as eager:
        assert engine.name == winner.engine
        got, want = engine.run(feeds), eager.run(feeds)
    rtol, atol = TOLERANCES["fp32"]
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=rtol, atol=atol)


def test_int8_under_a_strict_spec_fails_with_its_number(runs: dict[str, Any]) -> None:
    row = _row(runs["first"], "onnx int8 dynamic")
    assert row.status == "failed"
    assert "needs sqnr>=60" in row.reason
    assert 0 < row.accuracy["sqnr"] < 60
    assert f"{row.accuracy['sqnr']:.1f} dB" in row.accuracy_text
    assert row.p50_ms is None  # failed candidates are not timed
    from tk.manifest import read_manifest

    (group,) = (runs["base"] / "cache").glob("int8-*")
    manifest = read_manifest(group)  # exported with the spec's floor: the check and the exclusion search aim at it
    assert manifest.model["min_sqnr_db"] == 60.0 and manifest.check["onnx"]["min_sqnr_db"] == 60.0


def test_every_skipped_candidate_says_why(runs: dict[str, Any]) -> None:
    rows = runs["first"].rows
    skipped = [r for r in rows if r.status == "skipped"]
    assert skipped and all(r.reason for r in skipped)
    assert _row(runs["first"], "aoti fp32").reason == "not among --candidates"
    if not torch.cuda.is_available():
        assert "CUDA" in _row(runs["first"], "trt fp32").reason or "cuda" in _row(runs["first"], "trt fp32").reason
    assert "--precision int8 is written for the" in _row(runs["first"], "torch int8 static").reason


def test_passing_candidates_are_timed_against_eager(runs: dict[str, Any]) -> None:
    timed = [r for r in runs["first"].rows if r.status == "passed"]
    assert len(timed) == 2
    assert all(r.p50_ms is not None and r.p50_ms > 0 and r.speedup is not None and r.speedup > 0 for r in timed)
    assert runs["first"].record["timing"]["eager_p50_ms"] > 0
    # the tiny model's products are too small to have a rate: no share of "peak" (tests/test_roofline.py fills one)
    assert all(r.peak_share is None for r in timed)
    assert "too small to have a rate" in runs["first"].record["timing"]["roofline"]["no_share"]


def test_json_and_png_are_written_and_listed(runs: dict[str, Any]) -> None:
    out = runs["base"] / "out"
    record = json.loads((out / "optimize.json").read_text())
    assert record["accuracy"] == "sqnr>=60"
    assert len(record["candidates"]) == len(_wrote_out(runs).rows)
    assert record["recommended"]["candidate"] == _wrote_out(runs).winner.candidate
    assert (out / "optimize.png").read_bytes().startswith(b"\x89PNG")
    roles = {e.role for e in verify_artifact(out).files}
    assert {"optimize-json", "optimize-png", "weights"} <= roles


def test_the_record_says_where_the_time_went(runs: dict[str, Any]) -> None:
    """optimize.json's stages: each export (cached or not), judge and the timing, in order, with seconds."""
    for run, cached in (("first", False), ("second", True)):
        record = runs[run].record
        stages = [s["stage"] for s in record["stages"]]
        # named candidates with no aoti int8 among them: no race
        assert stages == [
            "export torch fp32, onnx fp32",
            "judge torch fp32",
            "judge onnx fp32",
            "export onnx int8 dynamic",
            "judge onnx int8 dynamic",
            "time 2 candidates",
        ]
        assert [s["cached"] for s in record["stages"] if "cached" in s] == [cached, cached]
        assert all(s["seconds"] >= 0 for s in record["stages"])
        assert sum(s["seconds"] for s in record["stages"]) <= record["seconds"] + 0.1


def test_a_second_run_reuses_every_candidate_artifact(runs: dict[str, Any]) -> None:
    first, second = runs["first"], runs["second"]
    assert (first.exports, first.cache_hits) == (2, 0)  # one capture for onnx + torch fp32, one for int8 dynamic
    assert (second.exports, second.cache_hits) == (0, 2)
    assert all(r.cached for r in second.rows if r.status != "skipped")
    assert _row(second, "onnx int8 dynamic").accuracy["sqnr"] == pytest.approx(
        _row(first, "onnx int8 dynamic").accuracy["sqnr"]
    )


def test_auto_opens_the_recommended_engine(runs: dict[str, Any]) -> None:
    from tk.workflows.auto import choose_engine

    out = runs["base"] / "out"
    choice = choose_engine(out, verify_artifact(out), EngineChoice(), batch_size=2)
    assert choice.engine == _wrote_out(runs).winner.engine
    assert "tk optimize recommends" in choice.reason


def test_check_auto_checks_the_recommended_engine(runs: dict[str, Any]) -> None:
    result = CliRunner().invoke(cli, ["check", str(runs["base"] / "out"), "--engine", "auto"], obj={})
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == f"parity passed for {_wrote_out(runs).winner.engine}"


def test_the_command_prints_the_table_from_the_cache(runs: dict[str, Any]) -> None:
    base = runs["base"]
    args = ["optimize", "transformer", "--size", "tiny", "--accuracy", "sqnr>=60", "--batch", "4", "--seq", "16",
            "--candidates", ",".join(CANDIDATES), "--seconds", "0.05", "--no-peaks", "--cache-dir", str(base / "cache"),
            "--out", str(base / "cli-out")]  # fmt: skip
    torch.manual_seed(0)
    result = CliRunner().invoke(cli, args, obj={})
    assert result.exit_code == 0, result.output
    assert "winner:" in result.output and "onnx int8 dynamic" in result.output
    assert "needs sqnr>=60" in result.output
    assert "cache: 2 candidate artifacts reused, 0 exported" in result.output


def test_a_bad_spec_is_one_line_before_any_work(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"other.weight": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    (tmp_path / "file").write_text("x")
    cases = {
        ("--accuracy", "sqnr>35"): "error: --accuracy:",
        ("--time-budget", "nan"): "error: --time-budget: expected a finite number of minutes above 0, got nan",
        ("--seconds", "0"): "error: --seconds: expected a finite number of seconds above 0, got 0.0",
        ("--checkpoint", str(tmp_path / "other.safetensors")): "error: checkpoint ",  # of another model
        ("--batch", "99999999999"): "error: inputs at sizes",  # past the memory budget
        ("--cache-dir", str(tmp_path / "file")): "error: --cache-dir: expected a directory, found a file",
    }
    for flags, start in cases.items():
        result = CliRunner().invoke(cli, ["optimize", "transformer", *flags, "--out", "x"], obj={})
        assert result.exit_code == 2
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(start), result.output


def test_the_cache_key_holds_the_weights_and_code_of_models_no_name_pins() -> None:
    from torch import nn

    from tk.workflows.optimize.artifacts import model_digest

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    b = copy.deepcopy(a)
    assert model_digest(a) == model_digest(b)
    with torch.no_grad():
        b[0].weight[0, 0] += 1e-3  # new weights saved into the same hf:DIR, say
    assert model_digest(a) != model_digest(b)
    c = nn.Sequential(nn.Linear(4, 3), nn.GELU())
    c.load_state_dict(a.state_dict())
    assert model_digest(a) != model_digest(c)  # the same weights under other code


def test_a_npy_or_damaged_npz_has_no_labels_and_read_inputs_says_what_is_wrong(tmp_path: Path) -> None:
    from tk.workflows.user_inputs import _has_array

    np.save(tmp_path / "x.npy", np.zeros((2, 3)))
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not a zip")
    assert not _has_array(tmp_path / "x.npy", "labels") and not _has_array(tmp_path / "bad.npz", "labels")


def test_candidates_skip_reduced_precision_this_cpu_cannot_run() -> None:
    assert "would run emulated" in (hardware_reason("bf16", "cpu", frozenset()) or "")
    assert hardware_reason("bf16", "cpu", frozenset({"amx_bf16"})) is None
    assert "(bf16 is the CPU's)" in (hardware_reason("fp16", "cpu", frozenset({"avx512_bf16"})) or "")
    assert "(int8 is the CPU's)" in (hardware_reason("fp16", "cpu", frozenset({"avx512_vnni"})) or "")
    assert "(float32 is the CPU's)" in (hardware_reason("fp16", "cpu", frozenset({"avx2"})) or "")
    assert hardware_reason("int8", "cpu", frozenset()) is None  # int8 is judged and timed: it may still win
    with pytest.raises(UsageError, match="unknown onnx fp64"):
        enumerate_candidates("cpu", names=("onnx fp64",))


def test_a_frozen_float32_package_is_its_own_candidate_on_the_cpu_only() -> None:
    from tk.export import ExportOptions
    from tk.export.aoti.writer import AotiOptions
    from tk.workflows.optimize.artifacts import group_export_options

    found = enumerate_candidates("cpu", formats=("aoti",), precisions=("fp32",))
    assert [c.name for c in found.tried] == ["aoti fp32", "aoti fp32 frozen"]
    plain, frozen = found.tried
    assert plain.group != frozen.group  # one export each: the frozen package is compiled apart
    assert frozen.to_json()["options"] == {"freeze": True}
    options = group_export_options([frozen], ExportOptions())
    assert options.formats == ("aoti",) and options.settings == {"aoti": AotiOptions(freeze=True)}
    assert group_export_options([plain], ExportOptions()).settings == {}
    on_gpu = {s.candidate.name: s.reason for s in enumerate_candidates("cuda").skipped}
    assert "applies to CPU packages only" in on_gpu["aoti fp32 frozen"]  # the writer's own refusal (validate)


def test_timing_sizes_stay_inside_the_ranges() -> None:
    dims = {"batch": Dim("batch", 1, 8, 64), "seq": Dim("seq", 1, 16, 64)}
    assert timing_sizes(dims, {"batch": 32}) == {"batch": 32, "seq": 16}
    with pytest.raises(UsageError, match="outside the artifact's range"):
        timing_sizes(dims, {"seq": 128})


def test_the_timing_size_becomes_the_opt_of_a_widened_range() -> None:
    from tk.workflows.optimize import ranges_for_sizes

    model = {"batch": Dim("batch", 1, 8, 64), "seq": Dim("seq", 1, 16, 64)}
    ranges = ranges_for_sizes(model, {}, {"batch": 128, "seq": 1})
    assert ranges["batch"] == Dim("batch", 1, 128, 128)
    assert ranges["seq"] == Dim("seq", 1, 16, 64)  # an opt of 1 would be specialized by torch.export
    given = Dim("batch", 2, 4, 8)
    assert ranges_for_sizes(model, {"batch": given}, {"batch": 4})["batch"] == given


def test_keep_all_copies_the_other_passing_artifacts(runs: dict[str, Any]) -> None:
    from dataclasses import replace

    base = runs["base"]
    torch.manual_seed(0)
    options = replace(_options(base / "cache"), keep="all", peaks=False)
    result = optimize(build_model("transformer", size="tiny"), base / "keep-all", options)
    assert result.exports == 0
    kept = sorted(p.name for p in (base / "keep-all" / "candidates").iterdir())
    assert kept == [Path(_row(result, "onnx fp32").artifact).name]  # onnx and torch fp32 share one artifact
    assert verify_artifact(base / "keep-all" / "candidates" / kept[0]).formats.keys() >= {"onnx", "torch"}


def test_a_spent_budget_skips_every_candidate_and_writes_nothing(tmp_path: Path) -> None:
    from tk.errors import ParityError

    options = OptimizeOptions(candidates=("onnx fp32",), time_budget_min=1e-9, cache_dir=tmp_path / "cache")
    with pytest.raises(ParityError) as info:
        optimize(build_model("transformer", size="tiny"), tmp_path / "out", options)
    assert str(info.value) == (  # nothing failed the spec: the line says what became of each candidate instead
        "no candidate to pick: none failed sqnr>=35, and none passed and was timed "
        "(onnx fp32: skipped (budget: --time-budget spent))"
    )
    row = _row(info.value.result, "onnx fp32")  # type: ignore[attr-defined]
    assert (row.status, row.reason) == ("skipped", "budget: --time-budget spent")
    assert not (tmp_path / "out").exists()


def test_data_splits_into_calibration_and_held_out_with_labels(tmp_path: Path) -> None:
    from tk.workflows.optimize.data import optimize_data

    spec = build_model("transformer", size="tiny")
    feeds = random_feeds(spec.signature.inputs, {"batch": 7, "seq": 12}, seed=1)
    np.savez(tmp_path / "data.npz", **feeds, labels=np.arange(7) % 2)
    data = optimize_data(spec, spec.signature.dims, {"batch": 4, "seq": 12}, tmp_path / "data.npz")
    assert data.calibration is not None and data.calibration["input_ids"].shape == (4, 12)
    assert data.held_out["input_ids"].shape == (3, 12) and data.labels.tolist() == [0, 1, 0]
    np.testing.assert_array_equal(data.held_out["attention_mask"], feeds["attention_mask"][4:])
    synthetic = optimize_data(spec, spec.signature.dims, {"batch": 4, "seq": 12}, None)
    lengths = synthetic.mask.sum(axis=1)
    assert synthetic.calibration is None and synthetic.mask.shape == (32, 12) and len(set(lengths.tolist())) > 1
    np.savez(tmp_path / "one.npz", **{k: v[:1] for k, v in feeds.items()})
    with pytest.raises(UsageError, match="expected 2 or more samples"):
        optimize_data(spec, spec.signature.dims, {"batch": 4}, tmp_path / "one.npz")


def test_each_int8_format_is_its_own_export_and_the_others_share_a_capture() -> None:
    from tk.workflows.optimize.candidates import Candidate
    from tk.workflows.optimize.groups import export_groups

    fused = None
    static = None
    tried = [
        Candidate("onnx", "fp32", "onnx", fused), Candidate("aoti", "fp32", "aoti", fused),
        Candidate("onnx", "int8", "onnx", static), Candidate("aoti", "int8", "aoti", static),
        Candidate("openvino", "int8", "openvino", static),
    ]  # fmt: skip
    groups = [[c.name for c in members] for members in export_groups(tried).values()]
    # the int8 formats by their writers' int8_rank (aoti first: its search is likeliest to give the winner)
    assert groups == [["onnx fp32", "aoti fp32"], ["aoti int8 static"], ["onnx int8 static"], ["openvino int8 static"]]


def test_data_calibrates_the_int8_groups_only() -> None:
    from tk.export import ExportOptions
    from tk.workflows.optimize.artifacts import group_export_options
    from tk.workflows.optimize.candidates import Candidate

    calibration = {"input_ids": np.zeros((2, 8), np.int64)}
    base = ExportOptions(calibration_data=calibration)
    fp32 = group_export_options([Candidate("onnx", "fp32", "onnx")], base)
    int8 = group_export_options([Candidate("aoti", "int8", "aoti")], base)
    assert fp32.calibration_data is None  # an fp32 export refuses calibration data (--data made it fail)
    assert int8.calibration_data is calibration


def test_reasons_print_as_text_not_rich_markup() -> None:
    from rich.console import Console

    from tk.workflows.optimize.table import Row, render

    row = Row("trt fp32", "trt", "fp32", "trt", {}, "skipped", "tensorrt is not installed (pip install 'tk[gpu]')")
    row.cached = True
    console = Console(width=200, record=True)
    console.print(render([row], "t"))
    text = console.export_text()
    assert "pip install 'tk[gpu]'" in text and "[cached]" in text


def _timed(name: str, p50_ms: float, **accuracy: float) -> Any:
    from tk.workflows.optimize.table import Row

    fmt, precision = name.split()[:2]
    return Row(name, fmt, precision, fmt, {}, "passed", accuracy=accuracy, p50_ms=p50_ms)


def test_a_tie_within_the_margin_goes_to_the_most_accurate() -> None:
    from tk.workflows.optimize.winner import TIE, pick_winner

    int8 = _timed("onnx int8 static", 228.0, cosine=0.999964)
    fp32 = _timed("onnx fp32", 228.0 * (1 + TIE) - 0.1, cosine=1.0)
    slow = _timed("aoti fp32", 228.0 * (1 + TIE) + 1.0, cosine=1.0)
    winner = pick_winner([int8, fp32, slow], "cosine")
    assert winner is fp32 and winner.winner and not int8.winner
    assert winner.reason == "within 3% of onnx int8 static's 228 ms (a tie) and more accurate"


def test_outside_the_margin_or_as_accurate_the_fastest_wins() -> None:
    from tk.workflows.optimize.winner import TIE, pick_winner

    int8 = _timed("aoti int8 static", 156.0, sqnr=42.4)
    fp32 = _timed("aoti fp32", 156.0 * (1 + TIE) + 0.5, sqnr=140.9)
    assert pick_winner([fp32, int8], "sqnr") is int8 and int8.reason == ""
    a, b = _timed("onnx fp32", 100.0, cosine=1.0), _timed("aoti fp32", 101.0, cosine=1.0)
    assert pick_winner([b, a], "cosine") is a  # equally accurate: the faster
    low, high = _timed("onnx int8 static", 100.0, max_abs=0.05), _timed("onnx fp32", 101.0, max_abs=1e-5)
    assert pick_winner([low, high], "max_abs") is high  # max_abs: the lower is the more accurate
    fewer, more = _timed("aoti int8 static", 100.0, sqnr=40.0), _timed("onnx int8 static", 102.0, sqnr=45.0)
    more.reason = "14 of 17 layers int8"
    assert pick_winner([fewer, more], "sqnr") is more
    assert more.reason == "14 of 17 layers int8; within 3% of aoti int8 static's 100 ms (a tie) and more accurate"


def test_an_interrupted_swap_puts_the_previous_artifact_and_the_cache_back(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the two directories cannot be exchanged in one step, the old artifact is moved aside first; a
    Ctrl-C between the two renames must leave OUT as it was, with its cache, and nothing half-written."""
    import os
    import shutil

    import tk.workflows.optimize.artifacts as artifacts
    from tk.manifest import read_manifest
    from tk.signing import sign_artifact
    from tk.workflows.optimize.artifacts import CACHE, refuse_foreign_out, write_winner
    from tk.workflows.optimize.candidates import Candidate

    art = exported("mlp", ("torch",))
    out = tmp_path / "out"
    shutil.copytree(art.root, out)
    (out / CACHE).mkdir()
    (out / CACHE / "kept").write_text("a cached candidate")
    sign_artifact(out, ignore=(CACHE,))  # as write_winner signs it: a moved-aside artifact goes back once it verifies
    before = sorted(p.name for p in out.iterdir())

    def interrupted(staging: Path, target: Path) -> None:  # the fallback's first rename, then Ctrl-C
        old = tmp_path / f".{target.name}.x.old"
        old.mkdir()
        os.replace(target, old / "artifact")
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "swap_into_place", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_winner(out, art.root, read_manifest(art.root), Candidate("torch", "fp32", "torch"), {},
                     {"accuracy": "sqnr>=35"}, {}, [], out / CACHE)  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / CACHE / "kept").read_text() == "a cached candidate"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no .old, no .partial

    # a run killed outright between the renames: the next optimize puts the artifact back before it starts
    old = tmp_path / ".out.y.old"
    old.mkdir()
    os.replace(out, old / "artifact")
    refuse_foreign_out(out)
    assert sorted(p.name for p in out.iterdir()) == before and not old.exists()
    with pytest.raises(UsageError, match=r"--cache-dir .*mine: inside --out it must be .*\.candidates"):
        refuse_foreign_out(out, out / "mine")  # replaced with the old artifact when the winner is written
    refuse_foreign_out(out, out / CACHE)
    with pytest.raises(UsageError, match=r"does not list \(\.candidates/kept\); replacing it would delete them"):
        refuse_foreign_out(out, tmp_path / "elsewhere")  # with the cache elsewhere, this one would be deleted


def test_mistakes_in_the_inputs_are_one_line_before_any_export(tmp_path: Path) -> None:
    """Each is the user's to fix, so it fails at once (exit 2, one line), not as every candidate failing."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    (name,) = [s.name for s in build_model("mlp", size="tiny").signature.inputs]
    samples = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    samples[6, 1] = np.nan  # in the held-out half
    np.savez(tmp_path / "nan.npz", **{name: samples})
    np.savez(tmp_path / "empty.npz")
    ids = np.random.default_rng(0).integers(0, 1000, (8, 16))
    np.savez(tmp_path / "labels.npz", input_ids=ids, attention_mask=np.ones_like(ids), labels=np.full(8, 7))
    out = tmp_path / "out"
    tiny = ["transformer", "--size", "tiny"]
    cases = {
        ("mlp", "--size", "tiny", "--data", str(tmp_path / "empty.npz"), "--out", str(out)): f"error: "
        f"{tmp_path / 'empty.npz'}: expected an .npz holding the model's inputs, found an .npz with no arrays",
        (*tiny, "--out", str(blocker / "sub")): f"error: --out {blocker / 'sub'}: expected a directory path, "
        f"found a file at {blocker}",
        (*tiny, "--cache-dir", str(blocker / "c"), "--out", str(out)): f"error: --cache-dir {blocker / 'c'}: "
        "expected a directory path, found a file at",
        (*tiny, "--data", str(tmp_path / "labels.npz"), "--out", str(out)): "error: ",  # the line's end: below
        (*tiny, "--seq", "100", "--out", str(out)): "error: --seq: this model takes seq up to 64 (the length of "
        "its position table), found 100",
        (*tiny, "--dim", "foo=1:2:3", "--out", str(out)): "error: --dim foo: this model has no dimension 'foo'",
        ("mlp", "--size", "tiny", "--data", str(tmp_path / "nan.npz"), "--out", str(out)): f"error: --data "
        f"{tmp_path / 'nan.npz'}: input {name!r}: expected finite values (judging the candidates needs them), "
        "found 1 NaN",
        ("linear", "--accuracy", "top1>=99", "--out", str(out)): "error: --accuracy top1: expected an output of "
        "batch x classes (its argmax is compared), found y (batch x 1)",
        (*tiny, "--formats", "onnx,foo", "--out", str(out)): "error: --formats: unknown foo; expected some of ",
        (*tiny, "--precisions", "fp64", "--out", str(out)): "error: --precisions: unknown fp64; expected some of ",
        (*tiny, "--candidates", "", "--out", str(out)): "error: --candidates: expected comma-separated names, got ''",
        (*tiny, "--accuracy", " ", "--out", str(out)): "error: --accuracy: expected a spec such as sqnr>=35",
    }
    for args, start in cases.items():
        result = CliRunner().invoke(cli, ["optimize", *args], obj={})
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(start), (args, result.output)
        assert not out.exists(), args
        if "labels.npz" in " ".join(args):
            assert "class 7 is outside the valid range [0, 2) of this model" in lines[0], lines


def test_no_candidate_to_try_says_the_reason_of_those_asked_for() -> None:
    from tk.workflows.optimize.candidates import Candidate, Skipped, nothing_to_try

    skipped = [Skipped(Candidate(f, "fp32", f), "not among --candidates") for f in ("onnx", "aoti", "torch")]
    skipped.append(Skipped(Candidate("trt", "fp32", "trt"), "tensorrt is not installed"))
    assert nothing_to_try(skipped) == "no candidate can run here: trt fp32: tensorrt is not installed"
    cuda = [
        Skipped(Candidate(f, p, f), "--device cuda needs a CUDA GPU")
        for f in ("onnx", "aoti")
        for p in ("fp32", "bf16")
    ]
    assert nothing_to_try(cuda) == "no candidate can run here: 4 candidates: --device cuda needs a CUDA GPU"


def test_an_artifact_holding_other_files_is_not_replaced(runs: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "mine"
    shutil.copytree(runs["base"] / "out", out)
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.npy").write_bytes(b"")
    with pytest.raises(UsageError) as info:
        optimize(build_model("transformer", size="tiny"), out, _options(runs["base"] / "cache"))
    assert str(info.value) == (
        f"--out {out}: a tk artifact that also holds files its manifest.json does not list (data/x.npy, notes.txt); "
        "replacing it would delete them: move them or choose another --out, or pass --force to replace it and "
        "delete them"
    )
    assert (out / "notes.txt").read_text() == "mine" and verify_artifact(out).status == "passed"


def test_the_table_says_what_the_layers_left_out_of_int8_run_in():
    from tk.workflows.optimize.candidates import layers_text

    aoti = {"quantization": {"quantizable_modules": 36, "int8_modules": 34, "automatic_exclusions_run_in": "bf16"}}
    onnx = {"quantization": {"quantizable_nodes": 9, "excluded": ["a", "b", "c"]}}
    every = {"quantization": {"quantizable_modules": 4, "int8_modules": 4, "automatic_exclusions_run_in": "bf16"}}
    assert layers_text(aoti) == "34 of 36 layers int8, 2 bf16"
    assert layers_text(onnx) == "6 of 9 layers int8, 3 fp32"
    assert layers_text(every) == "4 of 4 layers int8" and layers_text({}) is None
