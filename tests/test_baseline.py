"""Accuracy and speed baselines: files, recipes, margins and verdicts (tk.workflows.baseline, baseline_accuracy, baseline_speed)."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tk.errors import ParityError, UsageError
from tk.parity import ParityReport, compare_output
from tk.workflows.baseline_accuracy import (
    SQNR_CAP_DB,
    Margins,
    Recipe,
    accuracy_baseline,
    accuracy_gate,
    load_accuracy_baseline,
    parse_margins,
    recipe_of,
    resolve_recipe,
    save_accuracy_baseline,
)
from tk.workflows.baseline_speed import load_speed_baseline, save_speed_baseline, speed_baseline, speed_gate
from tk.workflows.bench import BenchReport, BenchRow
from tk.workflows.check import CheckResult

SHAPES = [{"batch": 1}, {"batch": 8}]


def check_result(noise: float, *, engine: str = "onnx", seed: int = 0) -> CheckResult:
    """A check of one class-score output whose candidate is the reference plus ``noise`` × N(0, 1)."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((64, 10)).astype(np.float32)
    cand = (ref + noise * rng.standard_normal(ref.shape)).astype(np.float32)
    report = ParityReport(engine, "eager", "fp32", 1e-4, 1e-5, None, shapes=[dict(s) for s in SHAPES])
    report.outputs = [compare_output("logits", ref, cand, rtol=0.2, atol=0.2)]
    return CheckResult({engine: report}, 1e-4, 1e-5)


def test_margins_parse_and_refuse() -> None:
    m = parse_margins(["sqnr=2", "cosine=1e-3", "top1=1", "max_abs=2:1e-4"])
    assert (m.sqnr_db, m.cosine, m.top1, m.max_abs, m.max_abs_atol) == (2.0, 1e-3, 1.0, 2.0, 1e-4)
    assert parse_margins([]) == Margins()
    for bad in ("psnr=1", "sqnr", "sqnr=abc", "cosine=-1", "top1=inf"):
        with pytest.raises(UsageError, match="--margin"):
            parse_margins([bad])


def test_accuracy_baseline_round_trip_and_same_run_passes(tmp_path: Path) -> None:
    result = check_result(1e-3)
    path = tmp_path / "acc.json"
    save_accuracy_baseline(path, accuracy_baseline(result, Recipe(seed=0, shapes=SHAPES), {"precision": "fp32"}))
    data = json.loads(path.read_text())
    assert (data["format"], data["kind"], data["version"]) == ("tk-baseline", "accuracy", 1)
    figures = data["engines"]["onnx"]["logits"]
    assert set(figures) == {"max_abs", "sqnr_db", "cosine", "top1", "atol"}
    assert figures["top1"] == pytest.approx(100.0 * result.reports["onnx"].outputs[0].top1_rate)
    loaded = load_accuracy_baseline(path)
    gate = accuracy_gate(check_result(1e-3), loaded)
    assert gate.passed
    judged = {v.figure: v for v in gate.verdicts if v.baseline is not None}
    assert set(judged) == {"max_abs", "sqnr_db", "cosine", "top1"}
    assert judged["sqnr_db"].limit == pytest.approx(judged["sqnr_db"].baseline - 1.0)
    assert judged["max_abs"].limit == pytest.approx(1.5 * judged["max_abs"].baseline + 1e-5)


def test_worse_candidate_fails_with_the_numbers() -> None:
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=SHAPES))
    after = check_result(3e-2)  # ~30 dB worse; still within its own loose tolerance
    assert after.passed
    gate = accuracy_gate(after, before)
    failed = {v.figure: v for v in gate.failures()}
    assert {"max_abs", "sqnr_db", "cosine"} <= set(failed)
    sqnr = failed["sqnr_db"]
    assert sqnr.value < sqnr.baseline - 25
    assert "onnx logits sqnr_db" in sqnr.message and "below the baseline" in sqnr.message
    with pytest.raises(ParityError, match="logits"):
        gate.raise_if_failed()


def test_margins_decide() -> None:
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=SHAPES))
    after = check_result(1.3e-3, seed=0)  # ~2.3 dB worse
    sqnr = next(v for v in accuracy_gate(after, before).verdicts if v.figure == "sqnr_db")
    assert sqnr.failed and 1.5 < sqnr.baseline - sqnr.value < 3.5
    loose = parse_margins(["sqnr=5", "max_abs=3", "cosine=1e-3"])
    assert not any(v.failed for v in accuracy_gate(after, before, loose).verdicts)


def test_exact_baseline_sqnr_is_capped() -> None:
    exact = check_result(0.0)
    assert exact.reports["onnx"].outputs[0].sqnr_db == math.inf
    before = accuracy_baseline(exact, Recipe(shapes=SHAPES))
    assert before.engines["onnx"]["logits"]["sqnr_db"] is None
    gate = accuracy_gate(check_result(1e-7), before)  # float32 rounding territory: ~140 dB
    sqnr = next(v for v in gate.verdicts if v.figure == "sqnr_db")
    assert sqnr.limit == SQNR_CAP_DB - 1.0 and not sqnr.failed


def test_engines_and_shapes_that_differ() -> None:
    before = accuracy_baseline(check_result(1e-3, engine="onnx"), Recipe(shapes=SHAPES))
    gate = accuracy_gate(check_result(1e-3, engine="torch"), before)
    statuses = {(v.engine, v.figure): v.status for v in gate.verdicts}
    # the baseline's onnx was not run: a failure (a gate never passes what it could not run); torch has no baseline
    assert statuses[("onnx", "run")] == "fail" and statuses[("torch", "run")] == "skip"
    # nothing compared is no pass: a failing case for the JUnit file, and the line the command ends with (exit 2)
    assert gate.unmatched == (
        "--baseline: nothing was compared (the baseline holds engines onnx, this run ran torch); "
        "run what the baseline holds or record a new one"
    )
    assert [(v.engine, v.figure, v.status) for v in gate.failures()] == [
        ("onnx", "run", "fail"),
        ("*", "baseline", "fail"),
    ]
    allowed = accuracy_gate(check_result(1e-3, engine="torch"), before, allow_missing=True)
    assert [(v.engine, v.figure) for v in allowed.failures()] == [("*", "baseline")]
    assert next(v for v in allowed.verdicts if v.engine == "onnx").status == "skip"
    other = accuracy_baseline(check_result(1e-3), Recipe(shapes=[{"batch": 2}]))
    with pytest.raises(UsageError, match="sizes"):
        accuracy_gate(check_result(1e-3), other)


def test_figures_an_early_failure_left_unmeasured_fail_and_are_not_taken_as_perfect() -> None:
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=SHAPES))
    broken = check_result(1e-3)
    ref = np.zeros((64, 10), np.float32)
    cand = ref.copy()
    cand[0, :3] = np.nan  # NaN where the reference has none: the comparison stops before any figure
    broken.reports["onnx"].outputs = [compare_output("logits", ref, cand, rtol=0.2, atol=0.2)]
    gate = accuracy_gate(broken, before)
    figures = {v.figure: v for v in gate.verdicts if v.item == "logits"}
    for name in ("max_abs", "sqnr_db", "cosine"):
        assert figures[name].failed and figures[name].value is None, figures[name]
        assert "not measured (3 NaN and 0 Inf where the reference has 0" in figures[name].message


def test_a_speed_baseline_with_nothing_in_common_is_no_pass() -> None:
    baseline = speed_baseline(bench_report({"onnx": 2.0}))
    gate = speed_gate(bench_report({"torch": 2.0}), baseline)
    assert gate.unmatched is not None and "the baseline holds onnx at batch 1, 8" in gate.unmatched
    assert "this run measured torch at batch 1; torch at batch 8" in gate.unmatched
    assert not gate.passed
    busy = speed_gate(bench_report({"onnx": 1.0}, busy_at=(1, 8)), baseline)
    assert busy.unmatched is None and busy.passed  # compared, but not judged: a busy machine is no mismatch


def test_missing_output_fails() -> None:
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=SHAPES))
    before.engines["onnx"]["probabilities"] = dict(before.engines["onnx"]["logits"])
    failed = accuracy_gate(check_result(1e-3), before).failures()
    assert [(v.item, v.figure) for v in failed] == [("probabilities", "run")]


def test_what_the_baseline_holds_and_this_run_did_not_run_fails_unless_allowed() -> None:
    """Issue 45 (5): a gate that skips what it could not run passes a tampered artifact by removal."""
    both = check_result(1e-3)
    both.reports["torch"] = check_result(1e-3, engine="torch").reports["torch"]
    before = accuracy_baseline(both, Recipe(shapes=SHAPES))
    gate = accuracy_gate(check_result(1e-3), before)  # onnx ran, torch (say, untrusted now) did not
    (failed,) = gate.failures()
    assert (failed.engine, failed.item, failed.figure) == ("torch", "*", "run") and gate.unmatched is None
    assert "not run here" in failed.message and "--allow-missing" in failed.message
    with pytest.raises(ParityError, match="torch: in the baseline, not run here"):
        gate.raise_if_failed()
    allowed = accuracy_gate(check_result(1e-3), before, allow_missing=True)
    assert allowed.passed
    assert "accepted (--allow-missing)" in next(v for v in allowed.verdicts if v.engine == "torch").message

    speed = speed_baseline(bench_report({"onnx": 2.0, "torch": 2.0}))
    now = bench_report({"onnx": 2.0})
    missing = speed_gate(now, speed).failures()
    assert [(v.engine, v.item, v.baseline) for v in missing] == [("torch", "batch 1", 2.0), ("torch", "batch 8", 2.0)]
    assert speed_gate(now, speed, allow_missing=True).passed


def test_recipe_resolution(tmp_path: Path) -> None:
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.arange(4.0))
    recorded = recipe_of(seed=3, samples=16, inputs=inputs)
    assert recorded.inputs["sha256"] and recorded.inputs["file"] == str(inputs)
    opts = resolve_recipe(recorded, {})
    assert (opts["seed"], opts["samples"], opts["inputs"]) == (3, 16, inputs)
    with pytest.raises(UsageError, match="--seed 3, this run asks for --seed 4"):
        resolve_recipe(recorded, {"seed": 4})
    np.savez(tmp_path / "other.npz", x=np.arange(5.0))
    with pytest.raises(UsageError, match="sha256"):
        resolve_recipe(recorded, {"inputs": tmp_path / "other.npz"})
    with pytest.raises(UsageError, match="recorded without --golden"):
        resolve_recipe(recorded, {"golden": tmp_path / "g.npz"})
    inputs.unlink()
    with pytest.raises(UsageError, match="pass that file"):
        resolve_recipe(recorded, {})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not a readable JSON"),
        ("[1, 2]", "not a tk baseline"),
        ('{"format": "tk-baseline", "kind": "speed", "version": 1}', "a 'speed' baseline, expected a accuracy"),
        ('{"format": "tk-baseline", "kind": "accuracy", "version": 9}', "version 9"),
        (
            '{"format": "tk-baseline", "kind": "accuracy", "version": 1, "recipe": {"seed": 0}, "engines": {}}',
            "no engines",
        ),
        (
            '{"format": "tk-baseline", "kind": "accuracy", "version": 1, "recipe": {"seed": 0},'
            ' "engines": {"onnx": {"y": {"sqnr_db": "high"}}}}',
            "not a finite number",
        ),
        (  # Python's json reads NaN: a NaN limit would pass every value
            '{"format": "tk-baseline", "kind": "accuracy", "version": 1, "recipe": {"seed": 0},'
            ' "engines": {"onnx": {"y": {"max_abs": NaN, "cosine": Infinity}}}}',
            "onnx y max_abs is not a finite number",
        ),
        (
            '{"format": "tk-baseline", "kind": "accuracy", "version": 1, "recipe": {"seed": 0, "samples": "x"},'
            ' "engines": {"onnx": {"y": {"max_abs": 0.1}}}}',
            "recipe samples is not a count",
        ),
        (
            '{"format": "tk-baseline", "kind": "accuracy", "version": 1, "recipe": {"seed": 0, "shapes": [[1]]},'
            ' "engines": {"onnx": {"y": {"max_abs": 0.1}}}}',
            "recipe shapes are not a list of dimension sizes",
        ),
    ],
)
def test_damaged_accuracy_files_are_one_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "b.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=match) as info:
        load_accuracy_baseline(path)
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="no such file"):
        load_accuracy_baseline(tmp_path / "absent.json")


def bench_report(
    speedups: dict[str, float], *, cpu: str = "Test CPU", busy_at: tuple[int, ...] = (), cores: int = 2
) -> BenchReport:
    """Rows at batch 1 and 8 whose p50 makes the given speed-ups over eager's 10 ms; the load guard's
    marks say busy (load 5.0 on 2 cores) at the batch sizes ``busy_at``."""
    rows = []
    for batch in (1, 8):
        rows.append(BenchRow("eager", batch, 5, 10.0, 10.0, 10.0, 10.0, batch / 0.01, 1.0))
        for engine, speedup in speedups.items():
            p50 = 10.0 / speedup
            rows.append(BenchRow(engine, batch, 5, p50, p50, p50, p50, batch / (p50 / 1e3), speedup))
    for row in rows:
        load = 5.0 if row.batch_size in busy_at else 0.5
        row.load_before, row.load_after, row.busy = load, load, row.batch_size in busy_at
    machine = {
        "cpu": cpu,
        "cpu_flags": ["avx2", "fma"],
        "cores": cores,
        "usable_cores": cores,
        "torch_threads": cores,
    }
    return BenchReport(rows, machine, {"batch_sizes": [1, 8], "sizes": {"seq": 16}, "io": "host"})


def test_speed_baseline_round_trip_and_slowdown(tmp_path: Path) -> None:
    path = tmp_path / "speed.json"
    save_speed_baseline(path, speed_baseline(bench_report({"onnx": 2.0})))
    loaded = load_speed_baseline(path)
    assert loaded.engines == {"onnx": {"1": 2.0, "8": 2.0}}
    assert speed_gate(bench_report({"onnx": 1.9}), loaded, max_slowdown_pct=10).passed
    gate = speed_gate(bench_report({"onnx": 1.7}), loaded, max_slowdown_pct=10)
    failed = gate.failures()
    assert [v.item for v in failed] == ["batch 1", "batch 8"]
    assert failed[0].limit == pytest.approx(1.8) and "1.70× below the baseline's 2.00×" in failed[0].message
    assert speed_gate(bench_report({"onnx": 1.7}), loaded, max_slowdown_pct=20).passed
    with pytest.raises(UsageError, match="--max-slowdown"):
        speed_gate(bench_report({"onnx": 1.7}), loaded, max_slowdown_pct=100)


def test_speed_baseline_from_another_cpu_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "speed.json"
    save_speed_baseline(path, speed_baseline(bench_report({"onnx": 2.0}, cpu="Other CPU")))
    loaded = load_speed_baseline(path)
    with pytest.raises(UsageError, match=r"measured on 'Other CPU', this is 'Test CPU'.*--any-cpu") as info:
        speed_gate(bench_report({"onnx": 1.0}), loaded)
    assert "\n" not in str(info.value)
    gate = speed_gate(bench_report({"onnx": 1.0}), loaded, any_cpu=True)
    assert not gate.passed and "another CPU" in gate.notes[0]


def test_busy_machine_is_reported_not_judged() -> None:
    baseline = speed_baseline(bench_report({"onnx": 2.0}))
    busy = speed_gate(bench_report({"onnx": 1.0}, busy_at=(1, 8)), baseline)
    assert busy.passed and all(v.status == "skip" for v in busy.verdicts)
    assert busy.notes == [
        "busy machine, not judged (batch 1, 8): 1-minute load average 5.0 before, 5.0 after timing, on 2 cores"
    ]
    half = speed_gate(bench_report({"onnx": 1.0}, busy_at=(8,)), baseline)
    assert [(v.item, v.status) for v in half.verdicts] == [("batch 1", "fail"), ("batch 8", "skip")]


def test_speed_settings_must_match() -> None:
    baseline = speed_baseline(bench_report({"onnx": 2.0}))
    report = bench_report({"onnx": 2.0})
    report.settings["sizes"] = {"seq": 32}
    with pytest.raises(UsageError, match="sizes"):
        speed_gate(report, baseline)


def test_damaged_speed_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"format": "tk-baseline", "kind": "speed", "version": 1, "machine": {"cpu": "x"},
                                "settings": {}, "engines": {"onnx": {"one": 2.0}}}))  # fmt: skip
    with pytest.raises(UsageError, match="not an integer"):
        load_speed_baseline(path)
    good = {"format": "tk-baseline", "kind": "speed", "version": 1, "machine": {"cpu": "x"}, "settings": {},
            "engines": {"onnx": {"1": 2.0}}}  # fmt: skip
    for settings, match in (
        ({"batch_sizes": 8}, "settings.batch_sizes is not a list of batch sizes"),
        ({"sizes": [128]}, "settings.sizes is not an object of dimension sizes"),
        ({"io": 1}, "settings.io is not one of host, device"),
    ):
        path.write_text(json.dumps({**good, "settings": settings}))
        with pytest.raises(UsageError, match=match):
            load_speed_baseline(path)
    path.write_text(json.dumps(good).replace("2.0", "Infinity"))
    with pytest.raises(UsageError, match="speed-up inf is not a positive number"):
        load_speed_baseline(path)
    with pytest.raises(UsageError, match="no speed-up over eager"):
        speed_baseline(bench_report({}))


# ---------------------------------------------------------------- through the command line


def invoke(*args: str):
    from click.testing import CliRunner

    from tk.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.slow
def test_bf16_fails_the_fp32_baseline_and_fp32_passes_its_own(exported, tmp_path: Path) -> None:
    """Issue 23's goal: exit 1 and a JUnit failure naming the output; the same fp32 artifact passes on a second run."""
    import xml.etree.ElementTree as ET

    import torch

    from tk.export import ExportOptions
    from tk.models import build_model
    from tk.workflows.export import export

    fp32 = exported("mlp", ("torch",)).root
    torch.manual_seed(0)
    bf16 = tmp_path / "mlp-bf16"
    export(build_model("mlp", size="tiny"), bf16, ExportOptions(formats=("torch",), precision="bf16"))
    baseline, junit = tmp_path / "acc.json", tmp_path / "check.xml"

    saved = invoke("check", fp32, "--engine", "torch", "--save-baseline", baseline)
    assert saved.exit_code == 0, saved.output
    recorded = json.loads(baseline.read_text())
    assert recorded["recipe"]["seed"] == 0 and len(recorded["recipe"]["shapes"]) >= 2
    assert recorded["engines"]["torch"]["logits"]["top1"] == 100.0

    again = invoke("check", fp32, "--engine", "torch", "--baseline", baseline, "--junit", junit)
    assert again.exit_code == 0, again.output
    assert "accuracy against the baseline" in again.stdout
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "0" and int(root.get("tests")) >= 5

    worse = invoke("check", bf16, "--engine", "torch", "--baseline", baseline, "--junit", junit)
    assert worse.exit_code == 1, worse.output
    assert "torch logits sqnr_db" in one_error_line(worse)
    failed = {c.get("name"): c.find("failure") for c in ET.parse(junit).getroot().iter("testcase")}
    assert failed["logits sqnr_db"] is not None and failed["logits max_abs"] is not None
    assert "torch logits sqnr_db" in failed["logits sqnr_db"].get("message")
    assert failed["logits parity"] is None  # bf16 passes its own tolerances: only the baseline catches it


def test_check_baseline_refusals(exported, tmp_path: Path) -> None:
    root = exported("mlp", ("torch",)).root
    baseline = tmp_path / "acc.json"
    assert invoke("check", root, "--engine", "torch", "--samples", "16", "--save-baseline", baseline).exit_code == 0
    assert json.loads(baseline.read_text())["recipe"]["samples"] == 16
    same = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--margin", "sqnr=2")
    assert same.exit_code == 0, same.output  # --samples 16 came from the recipe
    other = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--samples", "8")
    assert other.exit_code == 2 and "--samples 16" in one_error_line(other)
    bad_margin = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--margin", "psnr=1")
    assert bad_margin.exit_code == 2 and "--margin" in one_error_line(bad_margin)
    recorded = json.loads(baseline.read_text())
    # a regression: not saved over the baseline it failed (exit 1)
    strict = json.loads(json.dumps(recorded))
    for figures in strict["engines"]["torch"].values():
        figures.update(cosine=2.0)  # no output can reach it: the torch engine matches eager exactly here
    baseline.write_text(json.dumps(strict))
    again = tmp_path / "again.json"
    failed = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--save-baseline", again)
    assert failed.exit_code == 1 and not again.exists(), failed.output
    assert "baseline not saved" in failed.stderr and "comparison with --baseline failed" in failed.stderr
    # a baseline of other engines compares nothing: one line, exit 2, and a failing JUnit case that says why
    recorded["engines"] = {"onnx": recorded["engines"]["torch"]}
    baseline.write_text(json.dumps(recorded))
    junit = tmp_path / "check.xml"
    unmatched = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--junit", junit)
    assert unmatched.exit_code == 2 and "nothing was compared" in one_error_line(unmatched)
    assert "nothing was compared" in junit.read_text()
    baseline.write_text(baseline.read_text()[:40])
    damaged = invoke("check", root, "--engine", "torch", "--baseline", baseline)
    assert damaged.exit_code == 2 and "not a readable JSON" in one_error_line(damaged)


def junit_cases(path: Path) -> dict[str, ET.Element]:
    return {f"{c.get('classname')} {c.get('name')}": c for c in ET.parse(path).getroot().iter("testcase")}


def test_check_fails_what_it_did_not_run_and_leaves_no_stale_junit(exported, tmp_path: Path) -> None:
    """Issue 45 (5): an engine of the baseline not run fails (exit 1) unless --allow-missing; a run that
    fails before comparing writes one error case over the earlier run's passing file."""
    root = exported("mlp", ("torch", "onnx")).root
    baseline, junit = tmp_path / "acc.json", tmp_path / "check.xml"
    saved = invoke("check", root, "--engine", "torch,onnx", "--save-baseline", baseline, "--junit", junit)
    assert saved.exit_code == 0, saved.output
    passing = junit.read_bytes()

    removed = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--junit", junit)
    assert removed.exit_code == 1 and "onnx: in the baseline, not run here" in one_error_line(removed)
    assert "not run here" in junit_cases(junit)["tk.check.onnx * run"].find("failure").get("message")
    allowed = invoke("check", root, "--engine", "torch", "--baseline", baseline, "--junit", junit, "--allow-missing")
    assert allowed.exit_code == 0, allowed.output
    assert junit_cases(junit)["tk.check.onnx * run"].find("skipped") is not None
    alone = invoke("check", root, "--engine", "torch", "--allow-missing")
    assert alone.exit_code == 2 and "--allow-missing applies to --baseline" in one_error_line(alone)

    crafted = tmp_path / "crafted.json"
    crafted.write_text(baseline.read_text().replace('"seed": 0', '"seed": -1'))
    for args, fragment in (
        (["check", root, "--engine", "torch", "--baseline", crafted], "recipe seed is not 0 to 4294967295"),
        (["check", tmp_path / "absent", "--engine", "torch"], "absent"),
        (["check", root, "--engine", "torch", "--margin", "sqnr=1"], "--margin applies to --baseline"),
    ):
        junit.write_bytes(passing)
        failed = invoke(*args, "--junit", junit)
        assert failed.exit_code == 2 and fragment in one_error_line(failed), failed.output
        (error,) = junit_cases(junit).values()
        assert error.get("name") == "run" and fragment in error.find("error").get("message")


@pytest.mark.slow
def test_an_aoti_package_changed_after_its_baseline_fails_the_gate(exported, copy_of, tmp_path: Path) -> None:
    """Issue 45 (5), as found: the package changed, --engine all leaves the now-untrusted aoti out; the
    baseline's aoti figures are a failure (exit 1, a JUnit failure), not "not run here", exit 0."""
    from tests.conftest import rehash

    root = copy_of(exported("mlp", ("torch", "onnx", "aoti")).root, "gated")
    baseline, junit = tmp_path / "acc.json", tmp_path / "check.xml"
    saved = invoke("check", root, "--engine", "onnx,aoti", "--save-baseline", baseline)  # signed by our key: trusted
    assert saved.exit_code == 0, saved.output
    package = root / "model.aoti.pt2"
    package.write_bytes(package.read_bytes() + b"\0")
    rehash(root)  # every hash matches again, as anyone can make them: only the signature tells
    gated = invoke("check", root, "--baseline", baseline, "--junit", junit)
    assert gated.exit_code == 1, gated.output
    assert "skipping aoti" in gated.stderr and "aoti: in the baseline, not run here" in one_error_line(gated)
    cases = junit_cases(junit)
    assert "not run here" in cases["tk.check.aoti * run"].find("failure").get("message")
    assert cases["tk.check.onnx logits sqnr_db"].find("failure") is None  # what ran was judged as before


def test_bench_baseline_through_the_command_line(exported, tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    root = exported("mlp", ("torch",)).root
    baseline, junit = tmp_path / "speed.json", tmp_path / "bench.xml"
    args = ["bench", root, "--engine", "eager,torch", "--no-baselines", "--iters", "2", "--warmup", "0"]
    saved = invoke(*args, "--batch-sizes", "1,2", "--save-baseline", baseline, "--junit", junit)
    assert saved.exit_code == 0, saved.output
    recorded = json.loads(baseline.read_text())
    assert set(recorded["engines"]["torch"]) == {"1", "2"} and recorded["settings"]["batch_sizes"] == [1, 2]
    assert {c.get("name") for c in ET.parse(junit).getroot().iter("testcase")} == {"batch 1 speedup", "batch 2 speedup"}

    again = invoke(*args, "--baseline", baseline, "--max-slowdown", "99", "--junit", junit)
    assert again.exit_code == 0, again.output  # batch sizes from the baseline; 99%: only a busy mark could skip
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) == 2 and all(c.find("failure") is None for c in cases)

    recorded["machine"]["cpu"] = "Another CPU 9000"
    baseline.write_text(json.dumps(recorded))
    refused = invoke(*args, "--baseline", baseline)
    line = one_error_line(refused)
    assert refused.exit_code == 2 and "Another CPU 9000" in line and "--any-cpu" in line
    assert "warm-up" not in refused.stderr  # refused before any timing
    allowed = invoke(*args, "--baseline", baseline, "--any-cpu", "--max-slowdown", "99")
    assert allowed.exit_code == 0, allowed.output
    assert "another CPU" in allowed.stdout
    alone = invoke(*args, "--max-slowdown", "5")
    assert alone.exit_code == 2 and "--baseline" in one_error_line(alone)
    for flags, fragment in ((["--max-slowdown", "150"], "--max-slowdown: expected a percentage"),
                            (["--io", "device"], "measured with --io host, this run asks for --io device")):  # fmt: skip
        refused = invoke(*args, "--baseline", baseline, "--any-cpu", *flags)
        assert refused.exit_code == 2 and fragment in one_error_line(refused)
        assert "warm-up" not in refused.stderr  # before any timing


def test_eager_precision_is_recorded_and_a_change_noted() -> None:
    report = bench_report({"onnx": 2.0})
    report.settings["engines"] = {"eager": {"precision": "fp32"}, "onnx": {}}
    baseline = speed_baseline(report)
    assert baseline.settings["eager_precision"] == "fp32"
    now = bench_report({"onnx": 2.0})
    now.settings["engines"] = {"eager": {"precision": "bf16"}, "onnx": {}}
    gate = speed_gate(now, baseline)
    assert gate.passed and "over eager in bf16 here, in fp32 in the baseline" in gate.notes[0]
