"""Strings tk did not write reach the terminal escaped (tk.text): tk inspect, the error line, rich tables, logs."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

from tk.cli import cli
from tk.manifest import manifest_bytes, read_manifest
from tk.text import printable, table_cell

OSC_TITLE = "\x1b]0;owned\x07"  # sets the terminal window's title
OSC_CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4K\x07"  # writes the clipboard
CLEAR = "\x1b[2J"  # clears the screen
C1_CSI = "\x9b2J"  # the one-byte CSI (C1): the same on terminals that read C1 controls
EVIL = f"mlp{OSC_TITLE}{OSC_CLIPBOARD}{CLEAR}{C1_CSI}\u202e\ud800"


def test_printable_escapes_what_a_terminal_obeys_and_keeps_the_rest() -> None:
    assert printable("logits") == "logits"
    assert printable("héllo wörld ✓ 日本") == "héllo wörld ✓ 日本"
    shown = printable(EVIL)
    assert shown == "mlp\\x1b]0;owned\\x07\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\x9b2J\\u202e\\ud800"
    assert shown.isprintable() and shown.encode("ascii")  # no surrogate left: any encoder takes it
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"  # one line stays one line
    assert printable("a\nb\x1b", keep_newlines=True) == "a\nb\\x1b"
    assert printable("\U000e0001") == "\\U000e0001"


def test_a_table_cell_is_neither_markup_nor_escape_sequences() -> None:
    out = io.StringIO()
    table = Table()
    table.add_column("name")
    table.add_row(table_cell(f"[/bold][link=http://x]{CLEAR}"))
    Console(file=out, width=120).print(table)  # unescaped, "[/bold]" raises MarkupError
    assert "[/bold][link=http://x]\\x1b[2J" in out.getvalue() and "\x1b" not in out.getvalue()


@pytest.fixture
def evil_artifact(exported, copy_of) -> Path:
    """The session's tiny mlp with escape sequences in its model and output names, manifest re-hashed."""
    root = copy_of(exported("mlp", ("torch",)).root, "evil")
    manifest = read_manifest(root)
    manifest.model["name"] = EVIL
    outputs = manifest.signature.outputs
    outputs[0] = dataclasses.replace(outputs[0], name=f"logits{OSC_CLIPBOARD}")
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))
    return root


def test_inspect_shows_a_manifests_escape_sequences_escaped(evil_artifact: Path) -> None:
    result = CliRunner().invoke(cli, ["inspect", str(evil_artifact)])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x9b" not in result.output and "\x07" not in result.output
    assert "model      mlp\\x1b]0;owned\\x07\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\x9b2J\\u202e\\ud800" in result.output
    assert "output     logits\\x1b]52;c;cm0gLXJmIH4K\\x07: float32" in result.output
    as_json = CliRunner().invoke(cli, ["inspect", str(evil_artifact), "--json"])
    assert as_json.exit_code == 0 and "\x1b" not in as_json.output
    assert json.loads(as_json.output)["model"]["name"] == EVIL  # JSON escapes them itself: the value is kept


def test_the_error_line_shows_a_quoted_escape_sequence_escaped(tmp_path: Path) -> None:
    missing = tmp_path / f"no{OSC_TITLE}such"
    result = CliRunner().invoke(cli, ["inspect", str(missing)])
    assert result.exit_code == 2
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no\\x1b]0;owned\\x07such" in lines[0]


def test_check_shows_a_crafted_output_name_as_text_in_its_table_notes_and_lines(exported, copy_of) -> None:
    """An output named with rich markup and an escape sequence: before, ``[/bold]`` raised rich's MarkupError."""
    root = copy_of(exported("mlp", ("torch",)).root, "crafted-output")
    manifest = read_manifest(root)
    name = f"lo[/bold]{OSC_TITLE}gits"
    manifest.signature.outputs[0] = dataclasses.replace(manifest.signature.outputs[0], name=name)
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))
    result = CliRunner().invoke(cli, ["check", str(root), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    shown = "lo[/bold]\\x1b]0;owned\\x07gits"
    assert f"top-1 agreement torch {shown}: 100.0%" in result.output
    assert f"│ torch  │ {shown} │" in result.output  # the table's cell, markup shown as text
