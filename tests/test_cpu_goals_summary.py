"""scripts/cpu_goals_summary.py on the files of a real run of scripts/cpu_goals.sh (benchmarks/results):
the goals read from it, and the AMX targets where the CPU has AMX."""

import json
import shutil
from pathlib import Path

import pytest

from scripts.cpu_goals_summary import main

RUN = Path(__file__).parent.parent / "benchmarks/results/20261205T042934Z-cpu-goals-epyc-bf16"


def _work(tmp_path: Path, amx: bool = False) -> Path:
    work = tmp_path / "work"
    shutil.copytree(RUN, work)
    if amx:  # the same run as read on a CPU with AMX
        (bench,) = (work / "bf16").glob("*-bench-goals.json")
        data = json.loads(bench.read_text())
        data["machine"]["cpu_flags"] += ["amx_bf16", "amx_int8", "amx_tile"]
        bench.write_text(json.dumps(data))
    return work


def _goals(tmp_path: Path, amx: bool = False) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    out.mkdir()
    code = main(_work(tmp_path, amx), out)
    return code, json.loads((out / "cpu_goals.json").read_text())["goals"], (out / "cpu_goals.json").read_text()


def test_goals_are_read_from_the_run(tmp_path, capsys):
    code, goals, _ = _goals(tmp_path)
    assert code == 0
    # the pick (aoti int8 static, 64.8 ms) against eager float32 in optimize's rounds: 3.3x on AVX512-BF16
    assert goals["pick >= 3.3x eager fp32"] == pytest.approx(
        {"value": 2.844763, "target": ">= 3.3", "met": False, "why": ""}
    )
    # the worse of the held-out SQNR (44.1 dB) and the export check across the range (42.68 dB)
    assert goals["pick held out and across the range >= 35 dB"]["value"] == pytest.approx(42.68)
    assert goals["pick p50 / fastest passed p50"]["value"] == pytest.approx(1.0)
    assert goals["tk optimize seconds"] == {"value": 122.0, "target": "<= 300", "met": True, "why": ""}
    assert goals["bf16 package, share of the bf16 rate"]["value"] == pytest.approx(0.747)
    # aoti bf16 85.16 ms over aoti int8 64.77 ms, same rounds: a ratio without a verdict on a CPU without AMX
    int8 = goals["aoti int8 over aoti bf16, same rounds"]
    assert int8["value"] == pytest.approx(85.15933 / 64.77375, rel=1e-5)
    assert (int8["met"], int8["why"]) == (None, "the goal names CPUs with AMX")
    printed = capsys.readouterr().out
    assert printed.startswith("cpu_goals on AMD EPYC (avx512_bf16; no AMX; cores: all; torch 2.14.1+cu130)")
    assert "aoti int8 static         WINNER       64.8     2.84  sqnr 44.1 dB 17 of 17 layers int8" in printed


def test_on_a_cpu_with_amx_its_targets_apply(tmp_path):
    _, goals, _ = _goals(tmp_path, amx=True)
    assert goals["pick >= 4x eager fp32"]["met"] is False and goals["pick >= 4x eager fp32"]["target"] == ">= 4"
    int8 = goals["aoti int8 over aoti bf16, same rounds"]
    assert (int8["target"], int8["met"], int8["why"]) == (">= 1.2", True, "")


def test_missing_runs_are_not_measured_and_a_failed_step_fails(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "bf16").mkdir(parents=True)
    out.mkdir()
    (work / "steps.tsv").write_text("train\tok\t80\noptimize\ttimeout\t900\nbf16\tfailed (exit 1)\t3\n")
    assert main(work, out) == 1
    goals = json.loads((out / "cpu_goals.json").read_text())["goals"]
    assert all(g["value"] is None and g["met"] is None for g in goals.values())
    assert "aoti int8 static: not a candidate in this run" in goals["aoti int8 over aoti bf16, same rounds"]["why"]
    assert "not measured" in capsys.readouterr().out


def test_an_exact_winner_and_the_files_of_a_step_that_failed(tmp_path):
    """A float32 winner equal to eager reads SQNR "inf" in optimize.json; a failed step's files are not read."""
    work, out = _work(tmp_path), tmp_path / "out"
    out.mkdir()
    table = json.loads((work / "optimize" / "optimize.json").read_text())
    winner = next(c for c in table["candidates"] if c.get("winner"))
    winner["accuracy"]["sqnr"] = winner["shape_range"]["sqnr"] = "inf"
    (work / "optimize" / "optimize.json").write_text(json.dumps(table))
    (work / "steps.tsv").write_text("train\tok\t78\noptimize\tok\t122\nbf16\tfailed (exit 1)\t3\n")
    assert main(work, out) == 1
    goals = json.loads((out / "cpu_goals.json").read_text())["goals"]
    assert goals["pick held out and across the range >= 35 dB"] == {
        "value": "inf",
        "target": ">= 35",
        "met": True,
        "why": "",
    }
    assert goals["bf16 package, share of the bf16 rate"]["value"] is None  # the old bench file is left unread


def test_a_cpu_without_bf16_skips_the_bf16_step_and_says_why(tmp_path, capsys):
    """cpu_goals.sh writes this step line and the reason where the CPU has no bf16 products (the AVX2 EPYC):
    the run is complete (exit 0) and the bf16 goal names the reason instead of a row."""
    work, out = _work(tmp_path), tmp_path / "out"
    out.mkdir()
    shutil.rmtree(work / "bf16")
    steps = [line for line in (work / "steps.tsv").read_text().splitlines() if not line.startswith("bf16\t")]
    (work / "steps.tsv").write_text("\n".join([*steps, "bf16\tskipped (no bf16)\t0"]) + "\n")
    reason = "this CPU (AVX2) has no avx512_bf16 or amx_bf16: bf16 would run emulated"
    (work / "bf16-skipped.txt").write_text(reason + "\n")
    assert main(work, out) == 0
    goals = json.loads((out / "cpu_goals.json").read_text())["goals"]
    bf16 = goals["bf16 package, share of the bf16 rate"]
    assert (bf16["value"], bf16["met"], bf16["why"]) == (None, None, reason)
    assert goals["pick held out and across the range >= 35 dB"]["value"] == pytest.approx(42.68)  # the rest read
    assert "bf16       skipped (no bf16)        0" in capsys.readouterr().out
