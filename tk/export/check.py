"""The export-time check: every written format against the PyTorch model, across the ranges."""

from __future__ import annotations

import logging
from pathlib import Path

from tk.check import check_engines
from tk.export.context import ExportContext
from tk.manifest import Manifest
from tk.spec import Dim
from tk.tolerances import MIN_SQNR_DB, tolerance_for

log = logging.getLogger("tk.export")


def shapes_to_check(dims: dict[str, Dim]) -> list[dict[str, int]]:
    """Min, opt, max and an odd size of every dimension, stepped together (all-min first, all-max last)."""
    per_dim = {name: dim.sizes_to_check() for name, dim in dims.items()}
    count = max((len(v) for v in per_dim.values()), default=1)
    shapes = []
    for i in range(count):
        sizes = {name: values[min(i, len(values) - 1)] for name, values in per_dim.items()}
        if sizes not in shapes:
            shapes.append(sizes)
    opt = {name: dim.opt for name, dim in dims.items()}
    if opt not in shapes:
        shapes.append(opt)
    return shapes


def run_export_check(root: Path, manifest: Manifest, formats: list[str], ctx: ExportContext) -> None:
    """Fill ``manifest.check`` with one parity report per format and set ``manifest.status``."""
    from tk.runtime import load

    rtol, atol = tolerance_for(
        manifest.precision, model_overrides=ctx.spec.tolerances, rtol=ctx.options.rtol, atol=ctx.options.atol
    )
    min_sqnr = MIN_SQNR_DB.get(manifest.precision)
    shapes = shapes_to_check(manifest.signature.dims)
    device = ctx.options.device
    with load(root, "eager", device=device, manifest=manifest, allow_failed=True) as reference:
        for fmt in formats:
            with load(root, fmt, device=device, manifest=manifest, allow_failed=True) as candidate:
                report = check_engines(
                    reference,
                    candidate,
                    shapes,
                    precision=manifest.precision,
                    rtol=rtol,
                    atol=atol,
                    min_sqnr_db=min_sqnr,
                )
            manifest.check[fmt] = report.to_json()
            worst = max((o.max_abs for o in report.outputs), default=0.0)
            log.info(
                "check  %-6s %s max abs error %.2e over %d shapes",
                fmt,
                "ok" if report.passed else "FAILED",
                worst,
                len(shapes),
            )
    manifest.status = "passed" if all(r["passed"] for r in manifest.check.values()) else "failed"
