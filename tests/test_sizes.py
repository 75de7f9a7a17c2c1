"""Sizes a reader can hold in mind (issue 46's goals): no function in tk/ over 60 lines, no module over 500.

A function counts from its ``def`` to its last line (decorators left out; its parameters and docstring
count).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TK = Path(__file__).resolve().parents[1] / "tk"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
MODULES = sorted(TK.rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function or method in ``source`` longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, node.lineno, lines))
    return found


def test_the_measure_counts_from_def_to_the_last_line_without_decorators() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    source = f"@decorator\n@another\ndef f(\n    a,\n):\n{body}\n"  # 3 + 59 = 62 lines from the def
    assert long_functions(source) == [("f", 3, 62)]
    assert long_functions(source, limit=62) == []
    nested = "class C:\n    def method(self):\n" + "\n".join(f"        y{i} = {i}" for i in range(60)) + "\n"
    assert long_functions(nested) == [("method", 2, 61)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(TK).as_posix())
def test_no_module_over_500_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(TK)}: {lines} lines; split it by job"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(TK).as_posix())
def test_no_function_over_60_lines(path: Path) -> None:
    found = long_functions(path.read_text())
    shown = ", ".join(f"{name} (line {line}: {lines} lines)" for name, line, lines in found)
    assert not found, f"{path.relative_to(TK)}: {shown}; split it into named steps"


def test_the_workflows_hold_at_most_a_fifth_of_tk() -> None:
    """Workflows call the layers beneath them; what grows there is usually a job for a lower layer."""
    lines = {p: len(p.read_text().splitlines()) for p in MODULES}
    workflows = sum(n for p, n in lines.items() if p.relative_to(TK).parts[0] == "workflows")
    assert workflows <= 0.2 * sum(lines.values()), f"tk/workflows holds {workflows / sum(lines.values()):.1%} of tk/"
