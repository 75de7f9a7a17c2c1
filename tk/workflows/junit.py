"""JUnit XML: what CI dashboards (GitHub Actions reporters, GitLab, Jenkins) read and show per test.

``tk check --junit`` and ``tk bench --junit`` write one ``<testcase>`` per engine × output (or
batch size) × figure, classname ``tk.check.ENGINE`` / ``tk.bench.ENGINE``, name ``OUTPUT FIGURE``.
A failure's message carries the numbers (value, baseline, margin, limit); a figure that was not
judged (a busy machine, no baseline) is ``<skipped>``. The file is written whole or not at all.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tk.fileio import atomic_write_bytes
from tk.workflows.baseline import Verdict


@dataclass
class TestCase:
    classname: str
    name: str
    failure: str | None = None  # the failure's one-line message
    skipped: str | None = None  # why it was not judged
    output: str = ""  # system-out: the numbers of a passing case
    properties: dict[str, str] = field(default_factory=dict)

    __test__ = False  # not a pytest class


def case_from_verdict(verdict: Verdict) -> TestCase:
    case = TestCase(f"tk.{verdict.suite}.{verdict.engine}", f"{verdict.item} {verdict.figure}")
    for key in ("value", "baseline", "limit"):
        value = getattr(verdict, key)
        if value is not None:
            case.properties[key] = repr(float(value))
    if verdict.figure == "sqnr_db" and verdict.limit is not None and verdict.baseline is None:
        case.properties["baseline"] = "inf"  # an exact match
    if verdict.margin:
        case.properties["margin"] = verdict.margin
    if verdict.status == "fail":
        case.failure = verdict.message
    elif verdict.status == "skip":
        case.skipped = verdict.message
    else:
        case.output = verdict.message
    return case


def junit_xml(suite: str, cases: Sequence[TestCase]) -> bytes:
    """One ``<testsuites>`` holding one ``<testsuite name=suite>``."""
    failures = sum(c.failure is not None for c in cases)
    skipped = sum(c.skipped is not None and c.failure is None for c in cases)
    root = ET.Element("testsuites", tests=str(len(cases)), failures=str(failures), errors="0", skipped=str(skipped))
    node = ET.SubElement(
        root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures), errors="0", skipped=str(skipped)
    )
    for case in cases:
        element = ET.SubElement(node, "testcase", classname=case.classname, name=case.name, time="0")
        if case.properties:
            props = ET.SubElement(element, "properties")
            for key, value in case.properties.items():
                ET.SubElement(props, "property", name=key, value=value)
        if case.failure is not None:
            failure = ET.SubElement(element, "failure", message=case.failure, type="regression")
            failure.text = case.failure
        elif case.skipped is not None:
            ET.SubElement(element, "skipped", message=case.skipped)
        if case.output:
            ET.SubElement(element, "system-out").text = case.output
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def write_junit(path: str | Path, suite: str, verdicts: Sequence[Verdict]) -> None:
    """The verdicts as a JUnit XML file at ``path``, written to a temporary name and renamed."""
    atomic_write_bytes(path, junit_xml(suite, [case_from_verdict(v) for v in verdicts]))
