"""The checked export: write an artifact's formats, then check each one through the engines users get."""

from __future__ import annotations

from pathlib import Path

from tk.export import ExportOptions, ExportResult, write_artifact
from tk.models import ModelSpec
from tk.workflows.check import run_export_check


def export(spec: ModelSpec, out: str | Path, options: ExportOptions | None = None) -> ExportResult:
    """Export ``spec`` to ``out`` in ``options.formats`` and check each format against PyTorch.

    Raises ``ParityError`` (after writing the artifact, marked failed) when a check fails;
    ``options.check=False`` writes it unchecked.
    """
    return write_artifact(spec, out, options, check=run_export_check)
