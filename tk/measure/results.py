"""The one writer of benchmark results: a UTC-stamped file name and one envelope around the numbers.

Every benchmark (``tk bench --json``, ``scripts/bench_cpu.py``, ``bench_goals.py``,
``load_test.py``) writes the same envelope, so one reader can tell what ran where:

    {"command": "bench-cpu", "argv": [...], "started_utc": "...", "finished_utc": "...",
     "machine": {...}, "versions": {...}, "load_average": {"before": [...], "after": [...]},
     "settings": {...}, "results": {...}}

``machine`` is ``tk.measure.hardware.machine_description()`` taken when the run starts (its
``versions`` are lifted to the top level); the load averages are read at the start and at the end
of the run (each timed row also carries its own, see ``tk.measure.load_guard``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.fileio import atomic_write_json
from tk.measure.hardware import load_average, machine_description

STAMP = "%Y%m%dT%H%M%SZ"  # sorts by time; Z: UTC whatever the machine's zone
DEFAULT_OUT = "benchmarks/results"
SCRIPT_WAIT_QUIET_S = 30.0  # the scripts run long jobs meant to be quoted: they wait for a quiet machine


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass
class BenchRun:
    """One run of a benchmark: started now, written once with its results."""

    command: str  # the scenario's name: bench-cpu, bench-goals, serve-load, tk bench
    settings: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    started: dt.datetime = field(default_factory=utc_now)
    machine: dict[str, Any] = field(default_factory=machine_description)

    @property
    def stamp(self) -> str:
        return self.started.strftime(STAMP)

    def path(self, out: str | Path, suffix: str = ".json", part: str = "") -> Path:
        """``OUT/<UTC stamp>-<command>[-part]<suffix>``: the run's file (or a sibling such as a plot)."""
        name = "-".join(p for p in (self.stamp, self.command.replace(" ", "-"), part) if p)
        return Path(out) / f"{name}{suffix}"

    def envelope(self, results: dict[str, Any]) -> dict[str, Any]:
        """The run's description around ``results``, the load average read now as ``after``."""
        machine = dict(self.machine)
        versions = machine.pop("versions", {})
        return {
            "command": self.command,
            "argv": [str(a) for a in self.argv],
            "started_utc": self.started.isoformat(timespec="seconds"),
            "finished_utc": utc_now().isoformat(timespec="seconds"),
            "machine": machine,
            "versions": versions,
            "load_average": {"before": machine.get("load_average"), "after": load_average()},
            "settings": jsonable(self.settings),
            "results": results,
        }

    def write(self, results: dict[str, Any], out: str | Path | None = None, *, path: str | Path | None = None) -> Path:
        """Write the envelope to ``path``, or to the stamped name under ``out``; returns where (atomic)."""
        target = Path(path) if path is not None else self.path(out if out is not None else ".")
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(target, self.envelope(results))
        return target


def jsonable(value: Any) -> Any:
    """Settings as JSON: paths and other objects as strings, containers walked."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def add_run_arguments(parser: argparse.ArgumentParser, wait_quiet_s: float = SCRIPT_WAIT_QUIET_S) -> None:
    """The options every benchmark script shares: ``--wait-quiet SECONDS`` and ``--out DIR``."""
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=wait_quiet_s,
        metavar="SECONDS",
        help=f"wait up to this long before each timed row for the load to drop to the core count; "
        f"rows timed above it are marked busy (default {wait_quiet_s:g})",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), help=f"where the stamped JSON goes (default {DEFAULT_OUT})"
    )


def settings_of(args: Any, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """An argparse namespace as the run's settings (without ``leave_out``)."""
    return {k: v for k, v in vars(args).items() if k not in leave_out}
