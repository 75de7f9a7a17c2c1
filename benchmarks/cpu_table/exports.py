"""The table's exports: one artifact per precision its rows need, each with the formats they load.

A failed export costs its rows, not the run; without AOTInductor (it needs a C++ toolchain) the
other formats are tried again on their own."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.cpu_table.rows import formats_by_artifact
from tk.export import ExportOptions
from tk.export.onnx.writer import OnnxOptions
from tk.models import ModelSpec
from tk.workflows.export import export


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def export_options(formats: tuple[str, ...], precision: str, *, check: bool, opset: int | None) -> ExportOptions:
    return ExportOptions(formats=formats, precision=precision, check=check, settings={"onnx": OnnxOptions(opset=opset)})


def attempts_of(formats: tuple[str, ...]) -> list[tuple[str, ...]]:
    """``formats``, then the same without aoti when that leaves something else to export."""
    without_aoti = tuple(f for f in formats if f != "aoti")
    return [formats, without_aoti] if without_aoti and without_aoti != formats else [formats]


def export_artifacts(
    spec: ModelSpec,
    rows: list[str],
    workdir: Path,
    *,
    check: bool = False,
    opset: int | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Export every artifact ``rows`` need under ``workdir``; their paths and, per precision, the
    export's timings, files and check status, or its errors."""
    paths: dict[str, Path] = {}
    info: dict[str, Any] = {}
    for precision, formats in formats_by_artifact(rows).items():
        errors: list[str] = []
        for attempt in attempts_of(formats):
            say(f"export {spec.size} {precision} {', '.join(attempt)}")
            start = time.perf_counter()
            try:
                options = export_options(attempt, precision, check=check, opset=opset)
                result = export(spec, workdir / precision, options)
            except Exception as exc:  # a failed export costs its rows, not the run
                errors.append(f"{', '.join(attempt)}: {one_line(exc)}")
                say(f"export {spec.size} {precision} failed: {errors[-1]}")
                continue
            paths[precision] = result.out
            info[precision] = {
                "formats": list(attempt),
                "seconds": round(time.perf_counter() - start, 1),
                "timings": result.manifest.timings,
                "files": {e.path: e.size for e in result.manifest.files},
                "check": result.manifest.status,
            }
            break
        if errors:
            info.setdefault(precision, {"formats": []})["errors"] = errors
        gc.collect()
    return paths, info
