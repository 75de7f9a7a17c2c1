"""A format is known only where it lives (issue #46): outside tk/export, tk/formats and tk/runtime (and the
registries), no code compares a value with a format's name; what the rest of tk needs to know of a format,
its writer or its engine declares."""

from __future__ import annotations

import ast
from pathlib import Path

from tk.registries import FORMATS

ROOT = Path(__file__).resolve().parents[1] / "tk"
HOMES = ("export", "formats", "runtime")  # where a format lives


def comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison in ``source`` with a format's name among its operands."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        flat = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
        if any(isinstance(e, ast.Constant) and e.value in FORMATS for e in flat):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_format_name_is_compared_outside_its_homes():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in HOMES or relative.name == "registries.py":
            continue
        found += [f"tk/{relative}:{line}: {code}" for line, code in comparisons(path.read_text())]
    assert not found, "format names compared outside tk/export, tk/formats, tk/runtime:\n" + "\n".join(found)


def test_the_scan_sees_comparisons():
    assert [line for line, _ in comparisons('def f(fmt):\n    return fmt == "onnx" or fmt in ("trt", "x")\n')] == [2, 2]
