"""Turn a model into static-graph artifacts: the writers of every format.

``write_artifact()`` captures once with torch.export, writes each requested format into a
staging directory, writes the manifest last, runs the check it is given (the export-time parity
check of ``tk.workflows.export``, which opens the files through the same engines users get), and
renames the staging directory into place, so ``out`` holds either the previous artifact or the
new complete one; ``tk.outdir`` decides what ``out`` may hold before it is replaced. This layer
never imports ``tk.runtime``.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tk.errors import (
    BackendUnavailableError,
    CaptureError,
    ConversionError,
    ParityError,
    PartialExportError,
    UsageError,
    first_line,
)
from tk.export.capture import exported_program_in_range
from tk.export.casts import module_at_precision
from tk.export.context import ExportContext, ExportOptions
from tk.export.registry import (
    FORMATS,
    format_unavailable_reason,
    in_use,
    resolve_formats,
    resolve_settings,
    settings_from_flags,
    writer,
    writer_options_reason,
)
from tk.fileio import atomic_write_bytes, sha256_file
from tk.formats.tf32 import matmul_precision
from tk.limits import require_within_budget
from tk.manifest import MANIFEST, FileEntry, Manifest, manifest_bytes, refuse_legacy_hmac_key
from tk.models import ModelSpec
from tk.outdir import recover_interrupted, require_replaceable, staging_dir, swap_into_place
from tk.registries import FORMATS as REGISTRY
from tk.signing import sign_artifact
from tk.spec import Dim, dim_flag, feeds_nbytes
from tk.versions import library_versions

log = logging.getLogger("tk.export")

WEIGHTS = "weights.safetensors"

# (staging directory, manifest, formats written, context): fills manifest.check and manifest.status
Checker = Callable[[Path, Manifest, list[str], ExportContext], None]

__all__ = [
    "FORMATS",
    "Checker",
    "ExportOptions",
    "ExportResult",
    "format_unavailable_reason",
    "recover_interrupted",
    "settings_from_flags",
    "swap_into_place",
    "write_artifact",
    "writer",
    "writer_options_reason",
]


@dataclass
class ExportResult:
    out: Path
    manifest: Manifest
    skipped: dict[str, str] = field(default_factory=dict)  # format -> why it was not written

    @property
    def passed(self) -> bool:
        return self.manifest.status != "failed"


def resolve_dims(spec: ModelSpec, overrides: dict[str, Dim], dynamic: bool) -> dict[str, Dim]:
    dims = dict(spec.signature.dims)
    for name, dim in overrides.items():
        if name not in dims:
            raise UsageError(
                f"{dim_flag(name)}: this model has no dimension {name!r}; it has {', '.join(dims) or 'none'}"
            )
        dims[name] = dim
    for name, dim in dims.items():
        limit = spec.max_sizes.get(name)
        if limit is not None and dim.max > limit:
            raise UsageError(
                f"{dim_flag(name)}: this model takes {name} up to {limit} (the length of its position table), found "
                f"{dim.max}"
            )
    if not dynamic:
        return {name: Dim(name, d.opt, d.opt, d.opt) for name, d in dims.items()}
    for name, dim in dims.items():
        if dim.opt == 1 and not dim.static:
            raise UsageError(
                f"{dim_flag(name)} {dim.min}:{dim.opt}:{dim.max}: torch.export traces at the opt size and specializes a "
                f"size of 1 to a constant; give {name} an opt of 2 or more (such as {dim.min}:2:{max(dim.max, 2)}), "
                "or export it --static"
            )
    return dims


def write_artifact(
    spec: ModelSpec, out: str | Path, options: ExportOptions | None = None, *, check: Checker | None = None
) -> ExportResult:
    """Export ``spec`` to ``out`` in ``options.formats``; with ``check`` (and ``options.check``), check them.

    Raises ``ParityError`` (after writing the artifact, marked failed) when a check fails. Without
    a checker the manifest says ``unchecked``: ``tk.workflows.export.export`` is the checked export.
    """
    options = options or ExportOptions()
    out = Path(out)
    formats, skipped, settings = _plan(options)
    checkpoint_sha, dims, example = _prepare_model(spec, options)
    recover_interrupted(out)
    require_replaceable(out, force=options.force)  # before any work: never replace what tk did not write
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_dir(out)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the artifact directory ({exc.strerror or exc})") from exc
    try:
        ctx = _write_formats(spec, out, options, staging, dims, example, formats, settings)
        manifest = _manifest(ctx, checkpoint_sha)
        _write_manifest(staging, manifest)
        if options.check and check is not None:
            written = [f for f in formats if f not in ctx.failed]
            ctx.timed("check", lambda: check(staging, manifest, written, ctx))
            manifest.timings = ctx.timings
            _write_manifest(staging, manifest)
        sign_artifact(staging)  # after the last write to the directory: the signature covers every file
        require_replaceable(out, force=options.force)  # again: files may have been added to it meanwhile
        swap_into_place(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        where = f" {exc.filename}" if exc.filename else ""
        raise UsageError(
            f"export to {out}: cannot write{where} ({exc.strerror or exc}); nothing was replaced. "
            "Free some space or choose another --out"
        ) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _raise_on_failures(manifest, out)
    return ExportResult(out, manifest, skipped)


def _prepare_model(
    spec: ModelSpec, options: ExportOptions
) -> tuple[str | None, dict[str, Dim], tuple[torch.Tensor, ...]]:
    """The checkpoint's weights loaded (and its sha256), the model in eval mode, the resolved dimensions
    (the largest inputs the check will run sized against the memory budget first) and the example inputs."""
    checkpoint_sha = None
    if options.checkpoint is not None:
        from tk.models.checkpoint import load_weights

        load_weights(spec.module, options.checkpoint)
        checkpoint_sha = sha256_file(options.checkpoint)
    spec.module.eval()
    dims = resolve_dims(spec, options.dims, options.dynamic)
    opt = {n: d.opt for n, d in dims.items()}
    for name, dim in dims.items():  # the check runs each dimension at its max: size that before any work
        sizes = {**opt, name: dim.max}
        require_within_budget(feeds_nbytes(spec.signature.inputs, sizes), f"inputs at sizes {sizes}")
    return checkpoint_sha, dims, spec.example_inputs(opt)


def _raise_on_failures(manifest: Manifest, out: Path) -> None:
    """``PartialExportError`` where a format failed to convert (the others kept), ``ParityError`` where the
    check failed (the artifact kept, marked failed)."""
    failures = [f"{fmt}: {line}" for fmt, rep in manifest.check.items() for line in _failures(rep)]
    if manifest.failed:
        held = f"{', '.join(manifest.formats)} ({manifest.status}{': ' + '; '.join(failures) if failures else ''})"
        raise PartialExportError(
            "export: "
            + "; ".join(f"{fmt} failed ({why})" for fmt, why in manifest.failed.items())
            + f"; the artifact at {out} holds {held}, and its manifest names the failure"
        )
    if manifest.status == "failed":
        raise ParityError(f"export check failed, artifact kept at {out} and marked failed: " + "; ".join(failures))


def _plan(options: ExportOptions) -> tuple[list[str], dict[str, str], dict[str, object]]:
    """The formats to write, those ``all`` skips, and every format's settings, all checked before any work."""
    formats, skipped = resolve_formats(options.formats, options.device, options.precision)
    for fmt, reason in skipped.items():
        log.info("export %-6s skipped: %s", fmt, reason)
    if not formats:
        raise BackendUnavailableError(
            "no requested format can be written on this machine: " + "; ".join(skipped.values())
        )
    from tk.tolerances import checked_sqnr_floor, tolerance_for

    tolerance_for(options.precision, rtol=options.rtol, atol=options.atol)  # bad values fail before any work
    checked_sqnr_floor(options.min_sqnr_db, options.precision)
    if options.precision != "int8" and (options.calibrate is not None or options.calibration_data is not None):
        raise UsageError(f"--calibrate: applies to --precision int8 only; this export is {options.precision}")
    from tk.export.int8.calibration import require_finite

    if options.calibration_data is not None:
        require_finite(options.calibration_data, f"--calibrate {options.calibrate or 'data'}")
    if options.check_data is not None:
        require_finite(options.check_data, f"--check-inputs {options.check_inputs or 'data'}", "the export check")
    settings = resolve_settings(options.formats, options.settings, skipped)
    for fmt in in_use(formats):
        writer(fmt).validate(settings[fmt], options)
    refuse_legacy_hmac_key()  # a stale setting is an error now, not after the export
    return formats, skipped, settings


def _write_formats(
    spec: ModelSpec,
    out: Path,
    options: ExportOptions,
    staging: Path,
    dims: dict[str, Dim],
    example: tuple[torch.Tensor, ...],
    formats: list[str],
    settings: dict[str, object],
) -> ExportContext:
    """Capture once, then let each writer write its files into ``staging``; the context they filled."""
    device = torch.device(options.device)
    with matmul_precision(options.precision == "tf32"):  # compiles bake TF32 in or out
        module = module_at_precision(spec.module.to(device), options.precision, options.device, options.keep_fp32)
        ctx = ExportContext(spec, module, dims, options, staging, tuple(t.to(device) for t in example))
        ctx.report = options.report or out.parent / f"{out.name}.export-report.md"
        ctx.versions = library_versions(options.device)
        ctx.settings = settings
        ctx.providers = {product: _provider(fmt, product) for fmt in REGISTRY for product in writer(fmt).provides}
        _write_weights(ctx)
        ctx.program = ctx.timed("capture", lambda: _capture(ctx, out))
        for fmt in formats:
            _write_one(ctx, fmt, alone=len(formats) == 1)
        if len(ctx.failed) == len(formats):
            raise ctx.failed_errors[formats[0]]  # nothing written: the first failure is the error, as for one format
    shutil.rmtree(staging / ".scratch", ignore_errors=True)
    return ctx


def _write_one(ctx: ExportContext, fmt: str, *, alone: bool) -> None:
    """``fmt``'s writer into the staging directory. A conversion failure costs only this format when others
    are written: its files are removed and the failure recorded (``ctx.failed``) for the manifest."""
    fmt_writer = writer(fmt)
    files_before = len(ctx.files)
    try:
        ctx.timed(fmt, lambda: fmt_writer.write(ctx))
    except ConversionError as exc:
        if alone:
            raise
        for relative, _ in ctx.files[files_before:]:
            (ctx.staging / relative).unlink(missing_ok=True)
        del ctx.files[files_before:]
        ctx.formats.pop(fmt, None)
        ctx.failed[fmt] = first_line(exc)
        ctx.failed_errors[fmt] = exc
        log.warning("export %-6s FAILED: %s", fmt, first_line(exc))


def _provider(fmt: str, product: str) -> Callable[[ExportContext], object]:
    """What makes ``product``: the ``provide`` of ``fmt``'s writer."""
    return lambda ctx: writer(fmt).provide(product, ctx)


def _failures(report: dict) -> list[str]:
    lines = [f"{o['name']} {o['problem']}" for o in report.get("outputs", []) if not o["passed"]]
    inv = report.get("batch_invariance")
    if inv and not inv["passed"]:
        lines.append(inv["problem"])
    return lines


def _capture(ctx: ExportContext, out: Path) -> torch.export.ExportedProgram:
    """``exported_program_in_range``; ``ctx.dims`` becomes the ranges the program holds (narrowed where
    torch.export suggested), which the manifest and the other formats then use. On a failure, a report
    beside ``out`` that the error names."""
    from tk.export.capture import write_capture_report

    try:
        program, ctx.dims = exported_program_in_range(ctx.module, ctx.example_inputs, ctx.spec.signature, ctx.dims)
        return program
    except CaptureError as exc:
        report = ctx.report or out.parent / f"{out.name}.export-report.md"
        written = write_capture_report(report, ctx.module, ctx.example_inputs, ctx.spec.signature, ctx.dims, exc)
        raise CaptureError(f"{exc} (report: {written})") from exc


def _write_weights(ctx: ExportContext) -> None:
    from tk.models.checkpoint import state_dict_bytes

    path = ctx.add_file(WEIGHTS, "weights")
    path.write_bytes(state_dict_bytes(ctx.spec.module))


def _manifest(ctx: ExportContext, checkpoint_sha: str | None) -> Manifest:
    model = {**ctx.spec.reference(), "checkpoint_sha256": checkpoint_sha}
    if ctx.options.keep_fp32:
        model["keep_fp32"] = list(ctx.options.keep_fp32)  # modules left in float32 (tk export --keep-fp32)
    if ctx.options.min_sqnr_db is not None:
        model["min_sqnr_db"] = ctx.options.min_sqnr_db  # the check's floor, and tk check's later (tk export --min-sqnr)
    tolerances = {p: list(t) for p, t in (ctx.spec.tolerances or {}).items()}
    if ctx.options.rtol is not None or ctx.options.atol is not None:  # tk export --rtol/--atol: tk check's later too
        from tk.tolerances import tolerance_for

        given = tolerance_for(ctx.options.precision, model_overrides={p: tuple(t) for p, t in tolerances.items()},
                              rtol=ctx.options.rtol, atol=ctx.options.atol)  # fmt: skip
        tolerances[ctx.options.precision] = list(given)
    if tolerances:
        model["tolerances"] = tolerances
    signature = type(ctx.spec.signature)(ctx.spec.signature.inputs, ctx.spec.signature.outputs, ctx.dims)
    return Manifest(
        model=model,
        signature=signature,
        precision=ctx.options.precision,
        device=ctx.options.device,
        formats=ctx.formats,
        files=[FileEntry.of(ctx.staging, rel, role) for rel, role in ctx.files],
        failed=dict(ctx.failed),
        versions=ctx.versions,
        timings=ctx.timings,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        generation=entry_points(ctx.spec.generation, ctx.dims),
    )


def entry_points(generation: dict[str, Any] | None, dims: dict[str, Dim]) -> dict[str, Any]:
    """A decoder's ``generation`` facts with its two entry points (prefill and decode: the same graph, the
    new tokens' ``seq`` from 1 to the cache's length, and exactly 1); empty for other models."""
    if not generation:
        return {}
    seq, batch = dims["seq"], dims["batch"]
    return {
        **generation,
        "entry_points": {
            "prefill": {"graph": "step", "seq": [seq.min, seq.max], "batch": [batch.min, batch.max]},
            "decode": {"graph": "step", "seq": [1, 1], "batch": [batch.min, batch.max]},
        },
    }


def _write_manifest(staging: Path, manifest: Manifest) -> None:
    atomic_write_bytes(staging / MANIFEST, manifest_bytes(manifest))
