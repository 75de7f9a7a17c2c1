"""The candidates table of an optimize run: one row per candidate, shown to people (rich), machines
(JSON, the same numbers) and eyes (speed against accuracy, PNG)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import BackendUnavailableError
from tk.fileio import atomic_write_bytes, atomic_write_json

if TYPE_CHECKING:
    from rich.table import Table

STATUSES = ("passed", "failed", "skipped")
# p50s within 3% of the fastest are a tie, won by the most accurate: interleaved p50s of one artifact
# in two formats (aoti, onnx and torch fp32) differ by 1-4% on these 2-core machines (history.md)
TIE = 0.03


@dataclass
class Row:
    candidate: str
    format: str
    precision: str
    engine: str
    options: dict[str, Any]
    status: str  # passed | failed | skipped
    reason: str = ""  # why it failed or was skipped
    accuracy: dict[str, Any] = field(default_factory=dict)  # metric -> worst value on the held-out samples
    accuracy_text: str = ""
    shape_range: dict[str, Any] = field(default_factory=dict)  # metric -> worst value over the shape range
    p50_ms: float | None = None  # on CPUs, in blocks of consecutive calls (tk.workflows.optimize.timing)
    speedup: float | None = None  # eager fp32 p50 / this p50, in the same run
    rounds_p50_ms: float | None = None  # in the rounds of one call each, where the blocks then ran
    peak_share: float | None = None  # model FLOPs / p50 / the matmul peak of its precision, where measured
    floor_share: float | None = None  # the model's products timed alone in its precision / p50, where measured
    busy: bool = False  # timed while the load average exceeded the usable cores
    cached: bool = False  # the artifact came from the cache
    winner: bool = False
    artifact: str | None = None  # the candidate's artifact directory (the cache's)
    engine_options: dict[str, Any] = field(default_factory=dict)  # the engine settings its timing is of (streams)
    tuned: list[dict[str, Any]] = field(default_factory=list)  # each engine setting timed: options, block_ms

    @property
    def label(self) -> str:
        """The candidate's name, with the engine settings it was timed at where not the defaults."""
        return tuned_label(self.candidate, self.engine_options)

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["accuracy"] = {k: _json_number(v) for k, v in self.accuracy.items()}
        data["shape_range"] = {k: _json_number(v) for k, v in self.shape_range.items()}
        return data


def tuned_label(name: str, options: dict[str, Any]) -> str:
    """A candidate's row label under engine ``options`` ("openvino bf16 [streams 2]"); ``name`` for the defaults."""
    return f"{name} [{', '.join(f'{k} {v}' for k, v in options.items())}]" if options else name


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else None)
    return value


def render(rows: list[Row], title: str) -> Table:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    floors = any(row.floor_share is not None for row in rows)  # measured with the peaks (not under --no-peaks)
    for header in ("candidate", "result", "accuracy (held-out)", "p50 ms", "× eager fp32", "of peak",
                   *(("of floor",) if floors else ())):  # fmt: skip
        table.add_column(
            header, justify="left" if header in ("candidate", "result", "accuracy (held-out)") else "right"
        )
    for row in rows:
        result = "WINNER" if row.winner else row.status
        if row.reason:
            result += f": {row.reason}"
        if row.busy:
            result += " (timed on a busy machine)"
        if row.cached:
            result += " [cached]"
        table.add_row(
            escape(row.label),
            escape(result),  # reasons quote commands such as pip install 'tk[gpu]': text, not markup
            row.accuracy_text or "—",
            "—" if row.p50_ms is None else f"{row.p50_ms:.3g}",
            "—" if row.speedup is None else f"{row.speedup:.2f}×",
            "—" if row.peak_share is None else f"{100 * row.peak_share:.0f}%",
            *(("—" if row.floor_share is None else f"{100 * row.floor_share:.0f}%",) if floors else ()),
        )
    return table


def save_json(path: Path, record: dict[str, Any]) -> None:
    atomic_write_json(path, record)


def plot_bytes(rows: list[Row], metric: str, title: str) -> bytes:
    """Speed-up over eager fp32 against the spec's first metric, one point per timed candidate (PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BackendUnavailableError(
            "the optimize plot needs matplotlib: pip install matplotlib (or tk[plot])"
        ) from exc
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    timed = [r for r in rows if r.speedup is not None]
    for row in timed:
        value = row.accuracy.get(metric)
        x = _plottable(value)
        marker = "*" if row.winner else ("o" if row.status == "passed" else "x")
        axes.scatter([x], [row.speedup], marker=marker, s=160 if row.winner else 50)
        axes.annotate(row.label, (x, row.speedup), textcoords="offset points", xytext=(5, 4), fontsize=8)
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel(
        f"{metric} on the held-out samples (capped at 150 for exact matches)" if metric == "sqnr" else metric
    )
    axes.set_ylabel("speed-up over eager fp32 (p50)")
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _plottable(value: Any) -> float:
    if value is None:
        return float("nan")
    value = float(value)
    return 150.0 if math.isinf(value) and value > 0 else value


def save_plot(path: Path, rows: list[Row], metric: str, title: str) -> None:
    atomic_write_bytes(path, plot_bytes(rows, metric, title))
