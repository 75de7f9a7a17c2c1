"""The README's Python API example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_api_example_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    section = text[text.index("## The Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("passed ")
    assert (tmp_path / "artifacts" / "tiny" / "manifest.json").is_file()


def test_readme_names_only_commands_that_exist():
    from tk.cli import cli

    used = set(re.findall(r"\$ tk (\w+)", README.read_text()))
    assert used and used <= set(cli.commands), used - set(cli.commands)
