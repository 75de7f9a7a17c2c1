"""Baselines: last week's accuracy and speed, recorded, so that this week's artifact is judged against them.

An accuracy baseline holds, per engine and output, the figures of a ``tk check`` (max abs error,
SQNR, cosine, top-1 agreement for class scores) and the recipe of its inputs (seed, shapes,
sample count, the hash of an input or golden file), so a later check recomputes them on the same
inputs (``tk.workflows.baseline_accuracy``). A speed baseline holds each engine's speed-up over eager
at each batch size measured in the same run, never absolute times (they do not travel between
machines), and the CPU it ran on: ratios do not travel between CPUs either, so another CPU's
baseline is refused unless asked (``tk.workflows.baseline_speed``).

Both are JSON files with a kind and a version; reading validates them, and a damaged or foreign
file is one ``UsageError`` line (here: the envelope and the checks of its fields). ``accuracy_gate``
and ``speed_gate`` turn a run and an optional baseline into ``Verdict``s (one per engine × output or
batch size × figure), the rows of the before/after table (``render_gate``) and of the JUnit file
(``tk.workflows.junit``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import ParityError, UsageError, first_line
from tk.fileio import atomic_write_json
from tk.json_values import is_choice, shown
from tk.registries import ENGINES

if TYPE_CHECKING:
    from rich.table import Table

FORMAT = "tk-baseline"
VERSION = 1


@dataclass
class Verdict:
    """One figure of one engine's output (or batch size), judged against its baseline when there is one."""

    suite: str  # check or bench
    engine: str
    item: str  # an output's name, or "batch N"
    figure: str  # max_abs, sqnr_db, cosine, top1, parity (the check's own tolerances), speedup, run
    value: float | None = None  # now (None: not measured, or an SQNR of an exact match)
    baseline: float | None = None
    limit: float | None = None  # the worst value that passes
    margin: str = ""  # the margin applied, in words
    status: str = "pass"  # pass, fail or skip
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclass
class Gate:
    """The verdicts of one run, and notes for people (a busy machine, another CPU allowed)."""

    suite: str
    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    judged: bool = False  # whether a baseline was compared
    unmatched: str | None = None  # a baseline was given and nothing in it was run (the line to end with)

    @property
    def passed(self) -> bool:
        return not any(v.failed for v in self.verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.failed]

    def raise_if_failed(self) -> None:
        failed = self.failures()
        if failed:
            shown = "; ".join(v.message for v in failed[:4])
            more = f" (and {len(failed) - 4} more)" if len(failed) > 4 else ""
            raise ParityError(f"{self.suite}: {len(failed)} figure(s) failed: {shown}{more}")


def missing_verdict(suite: str, engine: str, item: str, why: str, allow_missing: bool) -> Verdict:
    """A row of the baseline that this run has no figure for: a failure, or with ``allow_missing`` a skip."""
    if allow_missing:
        return Verdict(suite, engine, item, "run", status="skip", message=f"{why}; accepted (--allow-missing)")
    return Verdict(
        suite, engine, item, "run", status="fail", message=f"{why}; run it, or accept its absence with --allow-missing"
    )


def nothing_compared(gate: Gate, why: str) -> None:
    """A baseline given and nothing it holds run: one failing case for the JUnit file, and the line
    ``Gate.unmatched`` that the command ends with (exit 2: a setup to fix, not a regression)."""
    gate.unmatched = f"--baseline: nothing was compared ({why}); run what the baseline holds or record a new one"
    gate.verdicts.append(Verdict(gate.suite, "*", "*", "baseline", status="fail", message=gate.unmatched))


def figure_text(value: float | None, figure: str) -> str:
    """A figure as the table and the verdicts' messages show it."""
    if value is None:
        return "inf" if figure == "sqnr_db" else "—"
    if figure == "sqnr_db":
        return f"{value:.1f} dB"
    if figure == "top1":
        return f"{value:.1f}%"
    if figure == "cosine":
        return f"{value:.6f}"
    if figure == "speedup":
        return f"{value:.2f}×"
    return f"{value:.3g}"


# ---------------------------------------------------------------- the file and its fields


def write_baseline(path: str | Path, kind: str, body: dict[str, Any]) -> None:
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    atomic_write_json(path, {"format": FORMAT, "kind": kind, "version": VERSION, "created": created, **body})


def read_baseline(path: str | Path, kind: str) -> dict[str, Any]:
    """The file's JSON object after its envelope is checked; any problem is one ``UsageError`` line."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"baseline {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"baseline {path}: not a readable JSON file ({first_line(exc)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f'baseline {path}: not a tk baseline (no "format": "{FORMAT}")')
    if data.get("kind") != kind:
        raise UsageError(f"baseline {path}: a {shown(data.get('kind'))} baseline, expected a {kind} one")
    version = data.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise UsageError(f"baseline {path}: version {shown(version)}, this tk reads version {VERSION}")
    return data


def require_intact(ok: bool, path: str | Path, what: str) -> None:
    if not ok:
        raise UsageError(f"baseline {path}: damaged ({what})")


def engine_entries(engines: Any, path: str | Path, holds: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each engine of a baseline's ``engines`` and what it holds (``holds``: outputs, batch sizes), each
    checked to be one of tk's engines with a non-empty object."""
    require_intact(isinstance(engines, dict) and bool(engines), path, "no engines")
    for engine, entries in engines.items():
        require_intact(is_choice(engine, ENGINES), path, f"engine {shown(engine)} is not one of tk's engines")
        require_intact(isinstance(entries, dict) and bool(entries), path, f"engine {engine} has no {holds}")
        yield engine, entries


# ---------------------------------------------------------------- table


def render_gate(gate: Gate, title: str | None = None) -> Table:
    """Before/after: one row per verdict that has a baseline or failed."""
    from rich.table import Table

    from tk.text import table_cell

    table = Table(title=table_cell(title or f"{gate.suite} against the baseline"))
    for column in (
        "engine",
        "output" if gate.suite == "check" else "batch",
        "figure",
        "baseline",
        "now",
        "limit",
        "result",
    ):
        table.add_column(
            column, justify="left" if column in ("engine", "output", "batch", "figure", "result") else "right"
        )
    for v in gate.verdicts:
        if v.limit is None and v.status == "pass":  # not judged against a baseline
            continue
        names = (table_cell(v.engine), table_cell(v.item), table_cell(v.figure))  # a baseline file's names
        if v.figure == "run":
            table.add_row(*names, "", "", "", table_cell(f"{v.status}: {v.message}"))
            continue
        if v.figure == "parity":
            if v.failed:
                table.add_row(*names, "", "", "", table_cell(f"FAIL: {v.message}"))
            continue
        result = {"pass": "pass", "fail": "FAIL", "skip": "skip"}[v.status]
        table.add_row(
            *names, figure_text(v.baseline, v.figure), figure_text(v.value, v.figure),
            f"{figure_text(v.limit, v.figure)} ({v.margin})" if v.limit is not None else "", result,
        )  # fmt: skip
    if gate.notes:
        table.caption = "\n".join(table_cell(note) for note in gate.notes)
    return table
