"""The export-time check: every written format against the PyTorch model, across the ranges."""

from __future__ import annotations

import logging
from pathlib import Path

from tk.check import check_engines, reference_runs
from tk.export.context import ExportContext
from tk.manifest import Manifest
from tk.spec import Dim
from tk.tolerances import artifact_tolerance

log = logging.getLogger("tk.export")


def shapes_to_check(dims: dict[str, Dim]) -> list[dict[str, int]]:
    """All-min, all-opt, an odd size of each, then each dimension at its max with the others at opt.

    Every bound is exercised without running every dimension at its max at once (batch 64 x
    sequence 512 would dominate the check's time and prove nothing more).
    """
    opt = {name: dim.opt for name, dim in dims.items()}
    candidates = [{name: dim.min for name, dim in dims.items()}, opt]
    candidates.append({name: _odd_inside(dim) for name, dim in dims.items()})
    candidates += [{**opt, name: dim.max} for name, dim in dims.items()]
    shapes: list[dict[str, int]] = []
    for sizes in candidates:
        if sizes not in shapes:
            shapes.append(sizes)
    return shapes


def _odd_inside(dim: Dim) -> int:
    inside = [s for s in dim.sizes_to_check() if s not in (dim.min, dim.opt, dim.max)]
    return inside[0] if inside else dim.opt


def run_export_check(root: Path, manifest: Manifest, formats: list[str], ctx: ExportContext) -> None:
    """Fill ``manifest.check`` with one parity report per format and set ``manifest.status``."""
    from tk.runtime import load, unavailable_reason

    rtol, atol, min_sqnr = artifact_tolerance(
        manifest.precision, manifest.model, rtol=ctx.options.rtol, atol=ctx.options.atol
    )
    shapes = shapes_to_check(manifest.signature.dims)
    device = ctx.options.device
    # the model was just built from the user's own command line, so its code is trusted here
    with load(root, "eager", device=device, manifest=manifest, allow_failed=True, trust_model_code=True) as reference:
        runs = reference_runs(reference, shapes)
        for fmt in formats:
            fmt_device = device
            if fmt == "onnx" and device == "cuda" and unavailable_reason("onnx", "cuda"):
                fmt_device = "cpu"  # the ONNX file is device-free; check it where onnxruntime runs
            with load(root, fmt, device=fmt_device, manifest=manifest, allow_failed=True) as candidate:
                report = check_engines(
                    reference,
                    candidate,
                    shapes,
                    precision=manifest.precision,
                    rtol=rtol,
                    atol=atol,
                    min_sqnr_db=min_sqnr,
                    runs=runs,
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
