"""docs/architecture.md's layer table names every module under tk/, in its own folder's row, so a
newcomer finds each file where the design says it lives (issue #46, item 5)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def layer_rows() -> dict[str, str]:
    """The layer table's text per folder (``cli``, ``workflows``, ``base`` for tk/*.py), from its ```text block."""
    text = PAGE.read_text()
    block = text.split("## Layers", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    rows: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        found = re.search(r"tk/(\w+)/|tk/\*\.py", line)
        if found:
            folder = found.group(1) or "base"
        if folder is not None:
            rows[folder] = rows.get(folder, "") + " " + line
    return rows


def test_every_module_is_named_in_its_folders_row():
    rows = layer_rows()
    missing = []
    for path in sorted((ROOT / "tk").rglob("*.py")):
        relative = path.relative_to(ROOT / "tk")
        if path.name in ("__init__.py", "__main__.py") and len(relative.parts) > 1:
            continue  # a package's own __init__ is named by its folder
        if path.name in ("__init__.py", "__main__.py"):
            continue
        folder = relative.parts[0] if len(relative.parts) > 1 else "base"
        if not re.search(rf"\b{re.escape(path.stem)}\b", rows.get(folder, "")):
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md's layer table does not name: {', '.join(missing)}"


def test_the_readme_links_the_table_instead_of_copying_it():
    readme = (ROOT / "README.md").read_text()
    assert "tk/cli/" not in readme and "tk/workflows/" not in readme, "README.md copies the layer table"
    assert "(docs/architecture.md)" in readme
