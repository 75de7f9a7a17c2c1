"""JUnit XML: what CI dashboards (GitHub Actions reporters, GitLab, Jenkins) read and show per test.

``tk check --junit`` and ``tk bench --junit`` write one ``<testcase>`` per engine × output (or
batch size) × figure, classname ``tk.check.ENGINE`` / ``tk.bench.ENGINE``, name ``OUTPUT FIGURE``.
A failure's message carries the numbers (value, baseline, margin, limit); a figure that was not
judged (a busy machine, no baseline) is ``<skipped>``. A run that ended before its figures were
judged (a damaged baseline, an artifact that does not load) is one ``<error>`` case, ``run``, with
the error's line: a CI step never reads an earlier run's file as this one's. The file is written
whole or not at all, and every string in it (names from a manifest or a baseline) goes through
``tk.text.printable``, so that a control character or a lone surrogate cannot make it unreadable XML.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tk.fileio import atomic_write_bytes
from tk.text import printable
from tk.workflows.baseline import Verdict


@dataclass
class TestCase:
    classname: str
    name: str
    failure: str | None = None  # the failure's one-line message
    error: str | None = None  # the run ended before this was judged: why
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
    errors = sum(c.error is not None and c.failure is None for c in cases)
    skipped = sum(c.skipped is not None and c.failure is None and c.error is None for c in cases)
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": str(errors), "skipped": str(skipped)}
    root = ET.Element("testsuites", **counts)
    node = ET.SubElement(root, "testsuite", name=printable(suite), **counts)
    for case in cases:
        element = ET.SubElement(
            node, "testcase", classname=printable(case.classname), name=printable(case.name), time="0"
        )
        if case.properties:
            props = ET.SubElement(element, "properties")
            for key, value in case.properties.items():
                ET.SubElement(props, "property", name=printable(key), value=printable(value))
        if case.failure is not None:
            failure = ET.SubElement(element, "failure", message=printable(case.failure), type="regression")
            failure.text = printable(case.failure)
        elif case.error is not None:
            error = ET.SubElement(element, "error", message=printable(case.error), type="error")
            error.text = printable(case.error)
        elif case.skipped is not None:
            ET.SubElement(element, "skipped", message=printable(case.skipped))
        if case.output:
            ET.SubElement(element, "system-out").text = printable(case.output)
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def write_junit(path: str | Path, suite: str, verdicts: Sequence[Verdict]) -> None:
    """The verdicts as a JUnit XML file at ``path``, written to a temporary name and renamed."""
    atomic_write_bytes(path, junit_xml(suite, [case_from_verdict(v) for v in verdicts]))


def write_junit_error(path: str | Path, suite: str, message: str) -> None:
    """A run that ended before its verdicts: one ``<error>`` case (classname ``suite``, name ``run``) at ``path``."""
    atomic_write_bytes(path, junit_xml(suite, [TestCase(suite, "run", error=message)]))
