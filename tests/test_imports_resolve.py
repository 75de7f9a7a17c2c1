"""Every ``tk`` import in the repository names a module and names that exist, also the imports inside
functions and tests, which collecting the tests does not run: a module moved or renamed breaks here, not
in the one test or command path that imports it lazily."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("tk", "tests", "scripts", "examples", "benchmarks")


def _tk_imports(path: Path) -> list[tuple[int, str, str | None]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tk":
            found += [(node.lineno, node.module, alias.name) for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "tk"]
    return found


def _resolves(module: str, name: str | None) -> str | None:
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        return str(e)
    if name is None or hasattr(imported, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return f"{module} has no {name}"
    return None


def test_every_tk_import_resolves():
    files = [path for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py"))]
    assert len(files) > 200, "the walk found the repository's modules"
    broken = [
        f"{path.relative_to(REPO)}:{line}: {problem}"
        for path in files
        for line, module, name in _tk_imports(path)
        if (problem := _resolves(module, name))
    ]
    assert broken == []
