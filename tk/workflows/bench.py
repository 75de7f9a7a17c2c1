"""Latency and throughput of engines, compared in one run on the same inputs.

``measure`` gives every engine the same valid random NumPy feeds at each batch size, warms each
one up, then times them interleaved (one call of each engine in turn, in a new seeded random
order each round, ``tk.measure.timing.interleave``), so machine noise hits all of them alike,
with the load guard around each batch size's rounds. It reports percentiles of the per-call
latency, never the mean alone. ``render_table``, ``save_json`` and ``save_plot`` show
the same numbers to people and to machines.
"""

from __future__ import annotations

import datetime as dt
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tk.errors import BackendUnavailableError, InputError, UsageError
from tk.fileio import atomic_write_bytes, atomic_write_json
from tk.measure.hardware import machine_description
from tk.measure.load_guard import LoadGuard, LoadMark
from tk.measure.results import BenchRun, utc_now
from tk.measure.timing import (
    IO_MODES,
    CallTime,
    CallTimer,
    interleave,
    peak_gpu_memory_mb,
    peak_gpu_memory_reset,
)
from tk.runtime.base import Engine
from tk.runtime.inputs import random_inputs, sample_dim

if TYPE_CHECKING:
    from rich.table import Table

DEFAULT_SECONDS = 2.0  # timing budget per engine per batch size
MIN_ROUNDS = 3  # timed calls per engine, at least, when only a time budget is given
REFERENCE = "eager"  # speed-ups are relative to this engine


@dataclass
class BenchRow:
    engine: str
    batch_size: int
    iters: int  # timed calls
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float  # samples per second at the median latency
    speedup: float | None  # eager p50 / this p50 at the same batch size; None without eager
    io: str = "host"  # host: copies to and from the device included; device: inputs and outputs stay on it
    cold_ms: float | None = None  # the first call at this batch size (loads, compiles, captures), apart
    h2d_ms: float | None = None  # median host-to-device copy per call (CUDA, --io host)
    compute_ms: float | None = None  # median engine time per call by CUDA events (CUDA)
    d2h_ms: float | None = None  # median device-to-host copy per call (CUDA, --io host)
    peak_gpu_mb: float | None = None  # peak GPU memory allocated while warming this engine up (CUDA)
    gflops: float | None = None  # model FLOPs / p50 (with --roofline)
    peak_share: float | None = None  # gflops / the median matrix-product rate of its precision (--roofline)
    floor_share: float | None = None  # the model's products timed alone in its precision / p50 (--roofline)
    load_before: float | None = None  # 1-minute load average when this batch size's rounds began
    load_after: float | None = None  # and when they ended
    busy: bool = False  # other work competed for the cores (tk.measure.load_guard.LoadMark.busy)
    others_cores: float | None = None  # cores other processes kept busy during the rounds (None: unmeasured)


@dataclass
class BenchReport:
    rows: list[BenchRow]
    machine: dict[str, Any]
    settings: dict[str, Any]
    skipped: list[dict[str, Any]] = field(default_factory=list)  # engine, batch_size, reason
    started: dt.datetime = field(default_factory=utc_now)

    def results(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "skipped": self.skipped}

    def to_json(self, command: str = "tk bench") -> dict[str, Any]:
        """The report in the benchmarks' one envelope (``tk.measure.results``)."""
        run = BenchRun(command, self.settings, started=self.started, machine=self.machine)
        return run.envelope(self.results())


def measure(
    engines: dict[str, Engine],
    batch_sizes: list[int],
    *,
    seconds: float | None = None,
    iters: int | None = None,
    sizes: dict[str, int] | None = None,
    warmup: int = 3,
    seed: int = 0,
    io: str = "host",
    progress: Callable[[str], None] | None = None,
    guard: LoadGuard | None = None,
    between: Callable[..., Sequence[Callable[[], object]]] | None = None,
) -> BenchReport:
    """Time every engine at every batch size on the same random feeds.

    Timing stops after ``iters`` calls per engine or once the time budget (``seconds`` per engine
    per batch size) is spent, whichever comes first. An engine that does not accept a batch size
    (outside its range) is skipped there, with the reason in ``report.skipped``. Defaults: a
    2.0 s budget, 3 warm-up calls, other dimensions at ``sizes`` or their opt size, seed 0, ``io``
    host (see ``tk.measure.timing``). Each engine's first call at each batch size is timed apart
    (``cold_ms``); on CUDA each row also has its copy and compute times and peak GPU memory.
    ``guard`` (default: one that marks but does not wait) reads the load around each batch size's
    rounds and marks its rows busy; ``between(batch_size, feeds=feeds)`` gives untimed calls run in every
    round (a peak measurement that keeps its own samples; ``Roofline.between``, whose floor counts the
    feeds' real tokens).
    """
    seconds = _check_arguments(engines, seconds, iters, warmup, io)
    first = next(iter(engines.values()))
    specs, dims = first.inputs, first.dims
    started, machine = utc_now(), machine_description()  # before timing: the load is not the benchmark's own
    guard = guard or LoadGuard()
    say = progress or (lambda _: None)
    rows: list[BenchRow] = []
    skipped: list[dict[str, Any]] = []
    for size in batch_sizes:
        feeds = random_inputs(specs, dims, size, seed=seed, sizes=sizes)
        active, extra = _warm_up_engines(engines, feeds, size, io=io, warmup=warmup, skipped=skipped, say=say)
        calls = between(size, feeds=feeds) if between and active else ()
        with guard.row() as mark:
            times = interleave(active, iters=iters, seconds=seconds, min_rounds=MIN_ROUNDS, between=calls, seed=0)
        rows.extend(_batch_rows(times, size, extra, mark, say))
    if not rows and skipped:  # every engine refused every size: a run that measured nothing is the user's error
        first = skipped[0]
        raise UsageError(f"nothing could be timed: {first['engine']} at batch {first['batch_size']}: {first['reason']}")
    settings = {
        "batch_sizes": list(batch_sizes),
        "seconds": seconds,
        "iters": iters,
        "sizes": {n: d.opt for n, d in dims.items() if n != sample_dim(specs)} | (sizes or {}),  # besides the batch
        "warmup": warmup,
        "seed": seed,
        "io": io,
        "engines": list(engines),
        "reference": REFERENCE if REFERENCE in engines else None,
        "wait_quiet_s": guard.wait_quiet_s,
        "cores": guard.cores,
    }
    return BenchReport(rows, machine, settings, skipped, started)


def _warm_up_engines(
    engines: dict[str, Engine],
    feeds: dict[str, Any],
    size: int,
    *,
    io: str,
    warmup: int,
    skipped: list[dict[str, Any]],
    say: Callable[[str], None],
) -> tuple[dict[str, CallTimer], dict[str, dict[str, Any]]]:
    """Load and warm up each engine that accepts batch ``size`` (the others go to ``skipped``, with the
    reason): their timers, and what each warm-up measured (cold call, CUDA copies, peak memory)."""
    cuda = any(getattr(e, "device", "cpu") == "cuda" for e in engines.values())
    active: dict[str, CallTimer] = {}
    extra: dict[str, dict[str, Any]] = {}
    for label, engine in engines.items():
        try:
            engine.load()
            timer = CallTimer(engine, feeds, io)
        except InputError as exc:
            skipped.append({"engine": label, "batch_size": size, "reason": str(exc)})
            say(f"batch {size}: {label} skipped: {exc}")
            continue
        say(f"batch {size}: {label} warm-up")
        extra[label] = _warm_up(timer, warmup, io, cuda)
        active[label] = timer
    return active, extra


def _batch_rows(
    times: dict[str, list[CallTime]],
    size: int,
    extra: dict[str, dict[str, Any]],
    mark: LoadMark,
    say: Callable[[str], None],
) -> list[BenchRow]:
    """One batch size's rows, with the load readings around its rounds (``mark``) and each engine's
    speed-up over the reference."""
    load = {
        "load_before": mark.before,
        "load_after": mark.after,
        "busy": mark.busy,
        "others_cores": mark.to_json()["others_cores"],
    }
    batch_rows = [_row(label, size, t, extra[label] | load) for label, t in times.items()]
    reference = next((r for r in batch_rows if r.engine == REFERENCE), None)
    for row in batch_rows:
        row.speedup = reference.p50_ms / row.p50_ms if reference is not None and row.p50_ms > 0 else None
        busy = " (busy machine)" if row.busy else ""
        say(f"batch {size}: {row.engine} p50 {row.p50_ms:.3f} ms over {row.iters} calls{busy}")
    return batch_rows


def _check_arguments(
    engines: dict[str, Engine], seconds: float | None, iters: int | None, warmup: int, io: str
) -> float | None:
    """Refuse what ``measure`` cannot time; the time budget to use (the default without ``iters``)."""
    if io not in IO_MODES:
        raise UsageError(f"--io: expected one of {', '.join(IO_MODES)}, got {io!r}")
    if warmup < 0:
        raise UsageError(f"--warmup: expected 0 or more calls, got {warmup}")
    if not engines:
        raise UsageError("bench: expected at least one engine")
    if iters is not None and iters < 1:
        raise UsageError(f"--iters: expected at least 1, got {iters}")
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"--seconds: expected a finite time budget above 0, got {seconds}")
    names = [s.name for s in next(iter(engines.values())).inputs]
    for label, engine in engines.items():
        if [s.name for s in engine.inputs] != names:
            raise UsageError(
                f"bench: engine {label!r} takes inputs {[s.name for s in engine.inputs]}, expected {names}"
            )
    return DEFAULT_SECONDS if seconds is None and iters is None else seconds


def _warm_up(timer: CallTimer, warmup: int, io: str, cuda: bool) -> dict[str, Any]:
    """The cold call (timed apart) and ``warmup`` more; the row's fields they give."""
    peak_gpu_memory_reset(cuda)
    cold = timer()
    for _ in range(warmup):
        timer()
    return {"io": io, "cold_ms": cold.total_s * 1e3, "peak_gpu_mb": peak_gpu_memory_mb(cuda)}


def _row(label: str, batch_size: int, calls: list[CallTime], extra: dict[str, Any]) -> BenchRow:
    ms = np.asarray([c.total_s for c in calls]) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    throughput = batch_size / (p50 / 1e3) if p50 > 0 else float("inf")

    def median(field: str) -> float | None:
        values = [getattr(c, field) for c in calls if getattr(c, field) is not None]
        return float(np.median(values)) if values else None

    return BenchRow(
        label, batch_size, len(ms), p50, p90, p99, float(ms.mean()), throughput, None,
        h2d_ms=median("h2d_ms"), compute_ms=median("compute_ms"), d2h_ms=median("d2h_ms"), **extra,
    )  # fmt: skip


def render_table(report: BenchReport) -> Table:
    """The report as a rich table: one row per engine and batch size, skipped pairs in the caption."""
    from rich.table import Table

    machine = report.machine
    title = (
        f"latency per call, {machine.get('gpu') or machine.get('cpu')}, {machine.get('torch_threads')} torch threads"
    )
    table = Table(title=title)
    gpu_columns = any(r.compute_ms is not None for r in report.rows)
    roofline = report.settings.get("roofline")
    loads = any(r.load_before is not None for r in report.rows)
    headers = ["engine", "batch", "calls", "p50 ms", "p90 ms", "p99 ms", "mean ms", "samples/s", "speed-up", "cold ms"]
    if gpu_columns:
        headers += ["H2D ms", "compute ms", "D2H ms", "peak MiB"]
    if roofline:
        headers += ["GFLOP/s", "of peak", "of floor"]
    if loads:
        headers += ["load"]
    for header in headers:
        table.add_column(header, justify="left" if header == "engine" else "right")
    for r in report.rows:
        speedup = "—" if r.speedup is None else f"{r.speedup:.2f}×"
        cells = [r.engine, str(r.batch_size), str(r.iters), _ms(r.p50_ms), _ms(r.p90_ms), _ms(r.p99_ms)]
        cells += [_ms(r.mean_ms), f"{r.throughput:,.0f}", speedup, _maybe_ms(r.cold_ms)]
        if gpu_columns:
            peak = "—" if r.peak_gpu_mb is None else f"{r.peak_gpu_mb:,.0f}"
            cells += [_maybe_ms(r.h2d_ms), _maybe_ms(r.compute_ms), _maybe_ms(r.d2h_ms), peak]
        if roofline:
            cells += [_gflops(r.gflops), _share(r.peak_share), _share(r.floor_share)]
        if loads:
            cells += [_load(r)]
        table.add_row(*cells)
    notes = []
    if roofline:
        notes.append(roofline_note(roofline))
    cores = report.settings.get("cores") or machine.get("cores")
    busy = [r for r in report.rows if r.busy]
    if busy:
        others = max((r.others_cores for r in busy if r.others_cores is not None), default=None)
        by_others = f"; other processes used up to {others:.2f} of a core" if others is not None else ""
        notes.append(
            f"busy machine: other work competed for the {cores} cores while the rows marked busy were timed "
            f"(load average before→after in the load column{by_others}); expect noise"
        )
    else:
        load = machine.get("load_average")
        if load and cores and load[0] > cores:
            notes.append(f"busy machine: load average {load[0]} on {cores} cores before timing; expect noise")
    if report.skipped:
        notes.append("skipped: " + "; ".join(f"{s['engine']} at batch {s['batch_size']}" for s in report.skipped))
    table.caption = "\n".join(notes) or None
    return table


def roofline_note(roofline: dict[str, Any]) -> str:
    """One line: the model's FLOPs and each precision's median rate at its shapes (with its range)."""
    rates = []
    for precision, by_batch in roofline["peaks"].items():
        for batch, peak in by_batch.items():
            g = peak["gflops"]
            rates.append(f"{precision} @{batch} {g['median']:,.0f} ({g['min']:,.0f}-{g['max']:,.0f})")
    floors = [f"{precision} @{batch} {1e3 * f['seconds']['median']:.3g} ms"
              for precision, by_batch in roofline.get("floors", {}).items() for batch, f in by_batch.items()
              if f.get("seconds")]  # fmt: skip
    skipped = "; ".join(f"{p}: {why}" for p, why in roofline.get("skipped", {}).items())
    no_share = f"; no share of peak at {roofline['no_share']}" if roofline.get("no_share") else ""
    products = "its linear, convolution and attention products alone, median"
    return (
        f"roofline: {roofline['flops_per_sample'] / 1e9:.3g} GFLOP per sample; matmul rate at the model's "
        f"linear shapes, median (min-max) GFLOP/s: {', '.join(rates)}"
        + (f"; floor ({products}): {', '.join(floors)}" if floors else "")
        + (f"; skipped {skipped}" if skipped else "")
        + no_share
    )


def _load(row: BenchRow) -> str:
    after = "—" if row.load_after is None else f"{row.load_after:.1f}"
    text = "—" if row.load_before is None else f"{row.load_before:.1f}→{after}"
    return f"{text} busy" if row.busy else text


def _maybe_ms(value: float | None) -> str:
    return "—" if value is None else _ms(value)


def _gflops(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def save_json(report: BenchReport, path: str | Path, command: str = "tk bench") -> None:
    """Write the report in the benchmarks' envelope as JSON, atomically."""
    atomic_write_json(path, report.to_json(command))


def save_plot(report: BenchReport, path: str | Path) -> None:
    """Two panels, one line per engine: p50 latency and throughput against batch size (PNG, atomic)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BackendUnavailableError("plots need matplotlib: pip install matplotlib (or tk[plot])") from exc

    figure = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(figure)
    latency, throughput = figure.subplots(1, 2)
    engines = list(dict.fromkeys(r.engine for r in report.rows))
    for engine in engines:
        rows = sorted((r for r in report.rows if r.engine == engine), key=lambda r: r.batch_size)
        sizes = [r.batch_size for r in rows]
        latency.plot(sizes, [r.p50_ms for r in rows], marker="o", label=engine)
        throughput.plot(sizes, [r.throughput for r in rows], marker="o", label=engine)
    batch_sizes = sorted({r.batch_size for r in report.rows})
    for axes, ylabel in ((latency, "p50 latency (ms)"), (throughput, "throughput (samples/s)")):
        if batch_sizes and batch_sizes[-1] >= 8 * batch_sizes[0]:
            axes.set_xscale("log", base=2)
        axes.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        axes.set_xlabel("batch size")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        if engines:
            axes.legend()
    figure.suptitle(report.machine.get("gpu") or report.machine.get("cpu") or "")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    atomic_write_bytes(path, buffer.getvalue())
