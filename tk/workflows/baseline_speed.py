"""Speed baselines: each engine's speed-up over eager per batch size, and the CPU it was measured on.

``speed_gate`` judges a ``tk bench`` run against one: a speed-up may drop by ``--max-slowdown``
percent; a busy machine's rows are reported, not judged; another CPU's baseline is refused unless
asked. The file, the verdicts and the table are shared with accuracy baselines
(``tk.workflows.baseline``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import UsageError
from tk.json_values import is_choice, is_count, is_name, is_number, is_sizes, shown
from tk.registries import PRECISIONS
from tk.workflows.baseline import (
    Gate,
    Verdict,
    engine_entries,
    missing_verdict,
    nothing_compared,
    read_baseline,
    require_intact,
    write_baseline,
)

if TYPE_CHECKING:
    from tk.workflows.bench import BenchReport

SPEED = "speed"  # the file's kind
DEFAULT_MAX_SLOWDOWN_PCT = 10.0  # tk bench --baseline: a speed-up may drop by this share before it fails
SPEED_FLAG_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2", "fma")  # CPU flags that decide speed ratios
IO_MODES = ("host", "device")  # tk bench --io


@dataclass
class SpeedBaseline:
    machine: dict[str, Any]  # cpu, cpu_flags, cores, torch_threads
    settings: dict[str, Any]  # batch_sizes, sizes, io
    engines: dict[str, dict[str, float]]  # engine -> batch size (text) -> speed-up over eager
    created: str = ""


def cpu_identity(machine: Mapping[str, Any]) -> dict[str, Any]:
    """The CPU model and its speed flags (from the machine description, else read here)."""
    flags = machine.get("cpu_flags")
    if flags is None:
        from tk.formats.aoti import cpu_flags

        flags = sorted(f for f in cpu_flags() if f.startswith(SPEED_FLAG_PREFIXES))
    return {"cpu": machine.get("cpu"), "cpu_flags": list(flags)}


def speed_baseline(report: BenchReport) -> SpeedBaseline:
    """Each engine's speed-up over eager in ``report`` (eager itself and rows without eager are left out)."""
    engines: dict[str, dict[str, float]] = {}
    for row in report.rows:
        if row.engine != "eager" and row.speedup is not None and math.isfinite(row.speedup):
            engines.setdefault(row.engine, {})[str(row.batch_size)] = row.speedup
    if not engines:
        raise UsageError(
            "--save-baseline: no speed-up over eager to record; bench with eager (--baselines) and another engine"
        )
    machine = {
        **cpu_identity(report.machine),
        "cores": report.machine.get("usable_cores"),
        "torch_threads": report.machine.get("torch_threads"),
    }
    settings = {k: report.settings.get(k) for k in ("batch_sizes", "sizes", "io")}
    settings["eager_precision"] = _eager_precision(report)
    return SpeedBaseline(machine, settings, engines)


def _eager_precision(report: BenchReport) -> str | None:
    """The precision eager ran in (the artifact's unless set: a bf16 artifact's eager runs under bf16 autocast)."""
    engines = report.settings.get("engines")
    eager = engines.get("eager") if isinstance(engines, dict) else None
    return eager.get("precision") if isinstance(eager, dict) else None


def save_speed_baseline(path: str | Path, baseline: SpeedBaseline) -> None:
    write_baseline(
        path,
        SPEED,
        {"machine": baseline.machine, "settings": baseline.settings, "reference": "eager", "engines": baseline.engines},
    )


def load_speed_baseline(path: str | Path) -> SpeedBaseline:
    data = read_baseline(path, SPEED)
    machine, settings, engines = data.get("machine"), data.get("settings"), data.get("engines")
    require_intact(isinstance(machine, dict) and is_name(machine.get("cpu")), path, "no machine.cpu")
    flags = machine.get("cpu_flags", [])
    require_intact(
        isinstance(flags, list) and all(is_name(f) for f in flags), path, "machine.cpu_flags is not a list of names"
    )
    _check_settings(settings, path)
    for engine, rows in engine_entries(engines, path, "batch sizes"):
        for batch, value in rows.items():
            require_intact(_is_batch_key(batch), path, f"{engine} batch size {shown(batch)} is not an integer")
            require_intact(
                is_number(value) and value > 0,
                path,
                f"{engine} batch {batch} speed-up {shown(value)} is not a positive number",
            )
    return SpeedBaseline(machine, settings, engines, str(data.get("created", "")))


def _check_settings(settings: Any, path: str | Path) -> None:
    """A speed baseline's settings as tk bench takes them (``UsageError``, one line, for the first that is not)."""
    require_intact(isinstance(settings, dict), path, "no settings")
    batch_sizes, sizes = settings.get("batch_sizes"), settings.get("sizes")
    require_intact(
        batch_sizes is None or (isinstance(batch_sizes, list) and all(is_count(b) for b in batch_sizes)),
        path,
        "settings.batch_sizes is not a list of batch sizes",
    )
    require_intact(sizes is None or is_sizes(sizes), path, "settings.sizes is not an object of dimension sizes")
    for name, choices in (("io", IO_MODES), ("eager_precision", PRECISIONS)):
        value = settings.get(name)
        require_intact(
            value is None or is_choice(value, choices), path, f"settings.{name} is not one of {', '.join(choices)}"
        )


def _is_batch_key(value: str) -> bool:
    """A batch size as a JSON key: ASCII digits without a leading zero (``str(int)`` of a count)."""
    return value.isascii() and value.isdigit() and not value.startswith("0") and len(value) <= 18


def refuse_other_cpu(
    baseline: SpeedBaseline, machine: Mapping[str, Any], *, any_cpu: bool = False, where: str = "--baseline"
) -> str | None:
    """One ``UsageError`` line when ``baseline`` was measured on another CPU (model or speed flags),
    unless ``any_cpu``: then a note to print, as when the CPU is the same (None)."""
    here = cpu_identity(machine)
    then = {"cpu": baseline.machine.get("cpu"), "cpu_flags": list(baseline.machine.get("cpu_flags", []))}
    if here == then:
        return None
    gained = sorted(set(here["cpu_flags"]) - set(then["cpu_flags"]))
    lost = sorted(set(then["cpu_flags"]) - set(here["cpu_flags"]))
    flags = ", ".join([*(f"+{f}" for f in gained), *(f"-{f}" for f in lost)])
    flags = f" (flags {flags})" if flags else ""
    if not any_cpu:
        raise UsageError(
            f"{where}: measured on {then['cpu']!r}, this is {here['cpu']!r}{flags}: "
            "speed ratios do not travel between CPUs; record a baseline here or pass --any-cpu"
        )
    return f"baseline from another CPU ({then['cpu']}{flags}), judged anyway (--any-cpu)"


def busy_reason(report: BenchReport) -> dict[int, str]:
    """Batch sizes whose rows the load guard marked busy (``tk.measure.load_guard``), with the readings."""
    reasons: dict[int, str] = {}
    cores = report.machine.get("cores")
    for row in report.rows:
        if row.busy:
            others = f"; other processes kept {row.others_cores:.2f} cores busy" if row.others_cores is not None else ""
            reasons[row.batch_size] = (
                f"1-minute load average {row.load_before} before, {row.load_after} after timing, on {cores} cores"
                + others
            )
    return reasons


def check_max_slowdown(pct: float) -> None:
    if not (math.isfinite(pct) and 0 <= pct < 100):
        raise UsageError(f"--max-slowdown: expected a percentage from 0 to below 100, got {pct:g}")


def speed_gate(
    report: BenchReport,
    baseline: SpeedBaseline | None = None,
    *,
    max_slowdown_pct: float = DEFAULT_MAX_SLOWDOWN_PCT,
    any_cpu: bool = False,
    where: str = "--baseline",
    allow_missing: bool = False,
) -> Gate:
    """Per engine × batch size: the speed-up over eager, judged against ``baseline`` unless the machine was busy.

    A baseline from another CPU (model or speed flags) is refused with one ``UsageError`` line
    unless ``any_cpu``; so is one measured at other sizes or another ``io`` mode. A busy machine's
    rows are reported and skipped, not judged. A baseline row not measured here fails, unless
    ``allow_missing``.
    """
    check_max_slowdown(max_slowdown_pct)
    gate = Gate("bench", judged=baseline is not None)
    busy = busy_reason(report)
    if baseline is not None:
        gate.notes.extend(_comparable_or_refused(report, baseline, any_cpu=any_cpu, where=where))
    for why in dict.fromkeys(busy.values()):
        batches = ", ".join(str(b) for b, w in sorted(busy.items()) if w == why)
        gate.notes.append(f"busy machine, not judged (batch {batches}): {why}")
    seen: set[tuple[str, str]] = set()
    for row in report.rows:
        if row.engine != "eager":
            seen.add((row.engine, str(row.batch_size)))
            gate.verdicts.append(_speedup_verdict(row, baseline, row.batch_size in busy, max_slowdown_pct))
    if baseline is not None:
        _judge_unmeasured(gate, baseline, seen, allow_missing)
    return gate


def _comparable_or_refused(report: BenchReport, baseline: SpeedBaseline, *, any_cpu: bool, where: str) -> list[str]:
    """Refuse (one ``UsageError`` line) a baseline from another CPU (unless ``any_cpu``), at other sizes or
    another ``io`` mode; the notes for people: another CPU allowed, eager in another precision."""
    notes = []
    note = refuse_other_cpu(baseline, report.machine, any_cpu=any_cpu, where=where)
    if note:
        notes.append(note)
    for key in ("sizes", "io"):
        then_value, now_value = baseline.settings.get(key), report.settings.get(key)
        if then_value is not None and now_value is not None and then_value != now_value:
            raise UsageError(f"{where}: measured with {key} {then_value}, this run with {now_value}: not comparable")
    then_precision, now_precision = baseline.settings.get("eager_precision"), _eager_precision(report)
    if then_precision and now_precision and then_precision != now_precision:
        notes.append(
            f"speed-ups are over eager in {now_precision} here, in {then_precision} in the baseline: "
            "compare artifacts of one precision"
        )
    return notes


def _speedup_verdict(row: Any, baseline: SpeedBaseline | None, busy: bool, max_slowdown_pct: float) -> Verdict:
    """One bench row's (a ``BenchRow``) speed-up, judged against its baseline row unless ``busy``."""
    item, batch = f"batch {row.batch_size}", str(row.batch_size)
    verdict = Verdict("bench", row.engine, item, "speedup", row.speedup)
    label = f"{row.engine} {item} speed-up"
    before = baseline.engines.get(row.engine, {}).get(batch) if baseline is not None else None
    if row.speedup is None:
        verdict.status, verdict.message = "skip", f"{label}: no eager row to compare with"
    elif baseline is None:
        verdict.message = f"{label} {row.speedup:.2f}×"
    elif before is None:
        verdict.status, verdict.message = "skip", f"{label} {row.speedup:.2f}× (no baseline)"
    else:
        keep = 1 - max_slowdown_pct / 100
        verdict.baseline, verdict.limit, verdict.margin = before, before * keep, f"-{max_slowdown_pct:g}%"
        if busy:
            verdict.status = "skip"
            verdict.message = f"{label} {row.speedup:.2f}× vs {before:.2f}×: busy machine, not judged"
        else:
            failed = row.speedup < verdict.limit
            verdict.status = "fail" if failed else "pass"
            verdict.message = (
                f"{label} {row.speedup:.2f}× {'below' if failed else 'within'} the baseline's "
                f"{before:.2f}× -{max_slowdown_pct:g}% = {verdict.limit:.2f}×"
            )
    return verdict


def _judge_unmeasured(gate: Gate, baseline: SpeedBaseline, seen: set[tuple[str, str]], allow_missing: bool) -> None:
    """A verdict for each baseline row not measured here; the gate's end line when nothing was compared."""
    for engine, rows in baseline.engines.items():
        for batch in rows:
            if (engine, batch) not in seen:
                why = f"{engine} batch {batch}: in the baseline, not measured here"
                verdict = missing_verdict("bench", engine, f"batch {batch}", why, allow_missing)
                verdict.figure, verdict.baseline = "speedup", rows[batch]
                gate.verdicts.append(verdict)
    if not any(v.limit is not None for v in gate.verdicts):  # busy rows count: they were compared, not judged
        held = "; ".join(f"{e} at batch {', '.join(rows)}" for e, rows in baseline.engines.items())
        ran = "; ".join(f"{e} at batch {b}" for e, b in sorted(seen)) or "nothing besides eager"
        nothing_compared(gate, f"the baseline holds {held}, this run measured {ran}")
