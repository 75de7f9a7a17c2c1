"""JUnit XML from verdicts, parsed back with xml.etree (tk.workflows.junit)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from tests.test_baseline import bench_report, check_result
from tk.workflows.baseline_accuracy import Recipe, accuracy_baseline, accuracy_gate
from tk.workflows.baseline_speed import speed_baseline, speed_gate
from tk.workflows.junit import write_junit, write_junit_error


def cases(path: Path) -> dict[tuple[str, str], ET.Element]:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    return {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}


def test_check_without_baseline_lists_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "check.xml"
    write_junit(path, "tk.check", accuracy_gate(check_result(1e-3)).verdicts)
    found = cases(path)
    names = {name for _, name in found}
    assert names == {"logits parity", "logits max_abs", "logits sqnr_db", "logits cosine", "logits top1"}
    assert {cls for cls, _ in found} == {"tk.check.onnx"}
    assert not any(c.find("failure") is not None for c in found.values())
    sqnr = found[("tk.check.onnx", "logits sqnr_db")]
    value = float(sqnr.find("properties/property[@name='value']").get("value"))
    assert 55 < value < 65  # noise 1e-3 on unit-variance scores: ~60 dB
    suite = ET.parse(path).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("5", "0")
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed


def test_check_regression_is_a_failure_naming_the_output(tmp_path: Path) -> None:
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=[{"batch": 1}, {"batch": 8}]))
    path = tmp_path / "check.xml"
    write_junit(path, "tk.check", accuracy_gate(check_result(3e-2), before).verdicts)
    failure = cases(path)[("tk.check.onnx", "logits sqnr_db")].find("failure")
    assert failure is not None and "onnx logits sqnr_db" in failure.get("message")
    props = {p.get("name"): p.get("value") for p in cases(path)[("tk.check.onnx", "logits sqnr_db")].iter("property")}
    assert float(props["baseline"]) - float(props["value"]) > 25 and props["margin"] == "-1 dB"
    assert float(props["limit"]) == float(props["baseline"]) - 1
    suite = ET.parse(path).getroot().find("testsuite")
    assert int(suite.get("failures")) >= 3


def test_bench_busy_rows_are_skipped(tmp_path: Path) -> None:
    baseline = speed_baseline(bench_report({"onnx": 2.0}))
    path = tmp_path / "bench.xml"
    write_junit(path, "tk.bench", speed_gate(bench_report({"onnx": 1.0}, busy_at=(1, 8)), baseline).verdicts)
    found = cases(path)
    assert set(found) == {("tk.bench.onnx", "batch 1 speedup"), ("tk.bench.onnx", "batch 8 speedup")}
    assert all(c.find("skipped") is not None and c.find("failure") is None for c in found.values())
    write_junit(path, "tk.bench", speed_gate(bench_report({"onnx": 1.0}), baseline).verdicts)
    failure = cases(path)[("tk.bench.onnx", "batch 8 speedup")].find("failure")
    assert failure is not None and "1.00× below the baseline's 2.00×" in failure.get("message")


def test_a_run_that_failed_before_comparing_is_one_error_case(tmp_path: Path) -> None:
    path = tmp_path / "check.xml"
    write_junit(path, "tk.check", accuracy_gate(check_result(1e-3)).verdicts)  # an earlier, passing run
    write_junit_error(path, "tk.check", "baseline b.json: damaged (recipe seed is not 0 to 4294967295)")
    root = ET.parse(path).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("1", "0", "1")
    (case,) = root.iter("testcase")
    assert (case.get("classname"), case.get("name")) == ("tk.check", "run")
    assert "recipe seed" in case.find("error").get("message")


def test_names_no_xml_can_hold_still_make_a_file_that_parses(tmp_path: Path) -> None:
    """Control characters and a lone surrogate (from a crafted baseline or manifest) are written escaped."""
    before = accuracy_baseline(check_result(1e-3), Recipe(shapes=[{"batch": 1}, {"batch": 8}]))
    before.engines["onnx"]["lo\x1bgits\x00\ud800"] = dict(before.engines["onnx"]["logits"])
    path = tmp_path / "check.xml"
    write_junit(path, "tk.check", accuracy_gate(check_result(1e-3), before).verdicts)
    found = cases(path)
    failure = found[("tk.check.onnx", "lo\\x1bgits\\x00\\ud800 run")].find("failure")
    assert "onnx lo\\x1bgits\\x00\\ud800: in the baseline, missing from this run" in failure.get("message")
