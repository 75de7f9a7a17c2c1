"""Crafted baseline files (issue 45, item 9): a real accuracy or speed baseline with one value, key or
entry replaced by something hostile (a negative seed, a lone surrogate, ``[{}]``, control characters,
markup, huge numbers). Every case ends in exit code 0, 1 or 2, at most one ``error:`` line, no
traceback, no escape character on the terminal, and a ``--junit`` file that xml.etree parses.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_fuzz import time_limit
from tk.cli import cli

CASE_SECONDS = 120
FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
HOSTILE_TEXT = ["\ud800", "on\x1b]52;c;eA==\x07nx", "[/bold]", "\x00", "\x9b2J", "", "onnx", "torch", "1", "01", "١"]
HOSTILE = st.one_of(
    st.sampled_from([-1, 0, 1, 2**32, 2**64, -(10**300), 10**400, 1e308, -0.0, True, None, {}, [], [{}], [None]]),
    st.sampled_from(HOSTILE_TEXT),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.sampled_from([1, -1, "x", {}, "\ud800"]), max_size=3),
)


@pytest.fixture(scope="module")
def recorded(exported, tmp_path_factory) -> dict[str, Any]:
    """The tiny mlp's torch artifact and an accuracy and a speed baseline recorded from it."""
    root = exported("mlp", ("torch",)).root
    where = tmp_path_factory.mktemp("baselines")
    runner = CliRunner()
    accuracy, speed = where / "accuracy.json", where / "speed.json"
    saved = runner.invoke(cli, ["check", str(root), "--engine", "torch", "--save-baseline", str(accuracy)])
    assert saved.exit_code == 0, saved.output
    bench = ["bench", str(root), "--engine", "eager,torch", "--no-baselines", "--iters", "1", "--warmup", "0"]
    saved = runner.invoke(cli, [*bench, "--batch-sizes", "1", "--save-baseline", str(speed)])
    assert saved.exit_code == 0, saved.output
    return {
        "check": (["check", str(root), "--engine", "torch"], json.loads(accuracy.read_text())),
        # --any-cpu and a loose slowdown: the gate's own verdict is not what is fuzzed here
        "bench": ([*bench, "--any-cpu", "--max-slowdown", "99"], json.loads(speed.read_text())),
    }


def places(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``node`` (dict keys and list indices), ``node`` itself first."""
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += places(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += places(value, (*path, index))
    return found


def mutated(data: Any, draw: Any) -> Any:
    """``data`` with one hostile change at a drawn place: a value replaced, a key renamed or removed, an entry added."""
    data = json.loads(json.dumps(data))
    path = draw(st.sampled_from(places(data)[1:]))
    parent = data
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = draw(st.sampled_from(["replace", "rename", "remove", "add"]))
    if action == "replace" or isinstance(parent, list):
        parent[last] = draw(HOSTILE)
    elif action == "rename":
        parent[draw(st.sampled_from(HOSTILE_TEXT))] = parent.pop(last)
    elif action == "remove":
        del parent[last]
    else:
        parent[draw(st.sampled_from(HOSTILE_TEXT))] = draw(HOSTILE)
    return data


def assert_one_clean_ending(result: Any, junit: Path) -> None:
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert "\x1b" not in result.output and "\x9b" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1 and (result.exit_code == 0 or len(errors) == 1), result.output
    ET.parse(junit)  # a file CI can read, whatever the run's ending


@pytest.mark.slow
@pytest.mark.parametrize("command", ["check", "bench"])
@FUZZ
@given(data=st.data())
def test_a_crafted_baseline_is_one_line_and_a_junit_file_that_parses(
    recorded, tmp_path_factory, command: str, data: Any
) -> None:
    args, baseline = recorded[command]
    where = tmp_path_factory.mktemp("case")
    path, junit = where / "baseline.json", where / "out.xml"
    path.write_text(json.dumps(mutated(baseline, data.draw)))  # ensure_ascii: a lone surrogate survives as \ud800
    with time_limit(CASE_SECONDS):
        result = CliRunner().invoke(cli, [*args, "--baseline", str(path), "--junit", str(junit)])
    assert_one_clean_ending(result, junit)


@pytest.mark.parametrize(
    ("command", "change", "fragment"),
    [
        ("check", lambda b: b["recipe"].update(seed=-1), "recipe seed is not 0 to 4294967295"),
        ("check", lambda b: b["engines"].update({"\ud800": b["engines"]["torch"]}), "engine '\\ud800' is not one"),
        ("check", lambda b: b["engines"]["torch"].update({"lo\x1bgits": {}}), "torch output 'lo\\x1bgits' is not"),
        ("bench", lambda b: b["machine"].update(cpu_flags=[{}]), "machine.cpu_flags is not a list of names"),
        ("bench", lambda b: b["engines"].update({"on\x07nx": {"1": 2.0}}), "engine 'on\\x07nx' is not one"),
    ],
)
def test_the_crafted_baselines_of_the_issue(recorded, tmp_path: Path, command: str, change: Any, fragment: str) -> None:
    """The issue's cases, each once: one line naming the damage, exit 2, and a JUnit error case."""
    args, baseline = recorded[command]
    crafted = json.loads(json.dumps(baseline))
    change(crafted)
    path, junit = tmp_path / "baseline.json", tmp_path / "out.xml"
    path.write_text(json.dumps(crafted))
    result = CliRunner().invoke(cli, [*args, "--baseline", str(path), "--junit", str(junit)])
    assert_one_clean_ending(result, junit)
    assert result.exit_code == 2 and fragment in result.stderr, result.output
    (case,) = ET.parse(junit).getroot().iter("testcase")
    assert fragment in case.find("error").get("message")
