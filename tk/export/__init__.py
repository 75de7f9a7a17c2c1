"""Turn a model into static-graph artifacts: the writers of every format.

``write_artifact()`` captures once with torch.export, writes each requested format into a
staging directory, writes the manifest last, runs the check it is given (the export-time parity
check of ``tk.workflows.export``, which opens the files through the same engines users get), and
renames the staging directory into place, so ``out`` holds either the previous artifact or the
new complete one. This layer never imports ``tk.runtime``.
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from tk.errors import BackendUnavailableError, CaptureError, ParityError, UsageError
from tk.export.context import ExportContext, ExportOptions
from tk.export.precision import module_at_precision
from tk.export.torch_program import exported_program_from_module
from tk.fileio import atomic_write_bytes, exchange_paths, exclusive_temp_dir, sha256_file
from tk.formats.precision import matmul_precision
from tk.limits import require_within_budget
from tk.manifest import MANIFEST, FileEntry, Manifest, manifest_bytes, signing_key
from tk.models import ModelSpec
from tk.registries import FORMATS as FORMAT_MODULES
from tk.spec import Dim, feeds_nbytes
from tk.versions import library_versions

log = logging.getLogger("tk.export")

FORMATS = tuple(FORMAT_MODULES)
WEIGHTS = "weights.safetensors"
UNFUSED_ONNX = "model.unfused.onnx"

# (staging directory, manifest, formats written, context): fills manifest.check and manifest.status
Checker = Callable[[Path, Manifest, list[str], ExportContext], None]

__all__ = ["FORMATS", "Checker", "ExportOptions", "ExportResult", "write_artifact"]


@dataclass
class ExportResult:
    out: Path
    manifest: Manifest
    skipped: dict[str, str] = field(default_factory=dict)  # format -> why it was not written

    @property
    def passed(self) -> bool:
        return self.manifest.status != "failed"


def resolve_formats(
    requested: tuple[str, ...], device: str, precision: str = "fp32"
) -> tuple[list[str], dict[str, str]]:
    """Formats to write, in order, and the ones ``all`` skips with the reason."""
    wanted: list[str] = []
    skipped: dict[str, str] = {}
    for fmt in requested:
        if fmt == "all":
            for name in FORMATS:
                reason = format_unavailable_reason(name, device, precision)
                if reason is None:
                    wanted.append(name)
                else:
                    skipped[name] = reason
        elif fmt in FORMATS:
            reason = format_unavailable_reason(fmt, device, precision)
            if reason is not None:
                raise BackendUnavailableError(f"--format {fmt}: {reason}")
            wanted.append(fmt)
        else:
            raise UsageError(f"--format: expected one of {', '.join(FORMATS)} or all, got {fmt!r}")
    ordered = [f for f in FORMATS if f in wanted]
    return ordered, skipped


# int8: onnxruntime's quantization of the ONNX graph, or torchao's PT2E quantization compiled by AOTInductor
INT8_FORMATS = ("onnx", "aoti")


def format_unavailable_reason(fmt: str, device: str, precision: str = "fp32") -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU, and torch finds none"
    if precision == "int8":
        if fmt not in INT8_FORMATS:
            return f"--precision int8 is written for the {' and '.join(INT8_FORMATS)} formats only"
        if fmt == "onnx":
            from tk.export.quantize import unavailable_reason

            reason = unavailable_reason()
        else:
            from tk.export.aoti_int8 import unavailable_reason as aoti_int8_reason

            reason = aoti_int8_reason(device)
        if reason:
            return reason
    writer_module = _writer_module(fmt)
    reason_fn = getattr(writer_module, "unavailable_reason", None)
    return reason_fn(device) if reason_fn else None


def _writer_module(fmt: str) -> ModuleType:
    return importlib.import_module(FORMAT_MODULES[fmt])


def resolve_dims(spec: ModelSpec, overrides: dict[str, Dim], dynamic: bool) -> dict[str, Dim]:
    dims = dict(spec.signature.dims)
    for name, dim in overrides.items():
        if name not in dims:
            raise UsageError(f"--{name}: this model has no dimension {name!r}; it has {', '.join(dims) or 'none'}")
        dims[name] = dim
    if not dynamic:
        return {name: Dim(name, d.opt, d.opt, d.opt) for name, d in dims.items()}
    for name, dim in dims.items():
        if dim.opt == 1 and not dim.static:
            raise UsageError(
                f"--{name} {dim.min}:{dim.opt}:{dim.max}: torch.export traces at the opt size and specializes a "
                f"size of 1 to a constant; give {name} an opt of 2 or more (such as {dim.min}:2:{max(dim.max, 2)}), "
                "or export it --static"
            )
    return dims


def _timed(ctx: ExportContext, step: str, fn: Callable[[], object]) -> object:
    start = time.perf_counter()
    result = fn()
    ctx.timings[step] = round(time.perf_counter() - start, 3)
    log.info("export %-6s ok %.1f s", step, ctx.timings[step])
    return result


def write_artifact(
    spec: ModelSpec, out: str | Path, options: ExportOptions | None = None, *, check: Checker | None = None
) -> ExportResult:
    """Export ``spec`` to ``out`` in ``options.formats``; with ``check`` (and ``options.check``), check them.

    Raises ``ParityError`` (after writing the artifact, marked failed) when a check fails. Without
    a checker the manifest says ``unchecked``: ``tk.workflows.export.export`` is the checked export.
    """
    options = options or ExportOptions()
    out = Path(out)
    formats, skipped = resolve_formats(options.formats, options.device, options.precision)
    for fmt, reason in skipped.items():
        log.info("export %-6s skipped: %s", fmt, reason)
    if not formats:
        raise BackendUnavailableError(
            "no requested format can be written on this machine: " + "; ".join(skipped.values())
        )
    from tk.tolerances import tolerance_for

    tolerance_for(options.precision, rtol=options.rtol, atol=options.atol)  # bad values fail before any work
    if options.precision == "int8":
        _check_int8_options(options, formats)
    signing_key()  # an empty key is an error now, not after the export
    if any(f in formats for f in ("onnx", "trt")):
        from tk.export.onnx import resolve_opset

        resolve_opset(options.opset)
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
    example = spec.example_inputs({n: d.opt for n, d in dims.items()})
    device = torch.device(options.device)
    recover_interrupted(out)
    _refuse_foreign_dir(out)  # before any work: never replace a directory tk did not write

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = exclusive_temp_dir(out.parent, f".{out.name}.", ".partial")
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the artifact directory ({exc.strerror or exc})") from exc
    try:
        with matmul_precision(options.precision == "tf32"):  # compiles bake TF32 in or out
            module = module_at_precision(spec.module.to(device), options.precision, options.device, options.keep_fp32)
            ctx = ExportContext(spec, module, dims, options, staging, tuple(t.to(device) for t in example))
            ctx.report = options.report or out.parent / f"{out.name}.export-report.md"
            ctx.versions = library_versions(options.device)
            _write_weights(ctx)
            if any(f in formats for f in ("torch", "onnx", "aoti", "trt")):
                ctx.program = _timed(ctx, "capture", lambda: _capture(ctx, out))
            for fmt in formats:
                writer = _writer_module(fmt)
                _timed(ctx, fmt, lambda w=writer: w.write(ctx))
                if fmt == "onnx" and options.onnx_fusions and _fuse_before_int8(options):
                    _timed(ctx, "fuse", lambda: _fuse_onnx(ctx))
                if fmt == "onnx" and options.precision == "int8":
                    _timed(ctx, "int8", lambda: _quantize_onnx(ctx))
        manifest = _manifest(ctx, checkpoint_sha)
        _write_manifest(staging, manifest)
        if options.check and check is not None:
            _timed(ctx, "check", lambda: check(staging, manifest, formats, ctx))
            manifest.timings = ctx.timings
            _write_manifest(staging, manifest)
        _replace_dir(staging, out)
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
    result = ExportResult(out, manifest, skipped)
    if manifest.status == "failed":
        failures = [f"{fmt}: {line}" for fmt, rep in manifest.check.items() for line in _failures(rep)]
        raise ParityError(f"export check failed, artifact kept at {out} and marked failed: " + "; ".join(failures))
    return result


def _failures(report: dict) -> list[str]:
    lines = [f"{o['name']} {o['problem']}" for o in report.get("outputs", []) if not o["passed"]]
    inv = report.get("batch_invariance")
    if inv and not inv["passed"]:
        lines.append(inv["problem"])
    return lines


def _capture(ctx: ExportContext, out: Path) -> torch.export.ExportedProgram:
    """``exported_program_from_module``; on a failure, a report beside ``out`` that the error names."""
    from tk.export.torch_program import write_capture_report

    try:
        return exported_program_from_module(ctx.module, ctx.example_inputs, ctx.spec.signature, ctx.dims)
    except CaptureError as exc:
        report = ctx.report or out.parent / f"{out.name}.export-report.md"
        written = write_capture_report(report, ctx.module, ctx.example_inputs, ctx.spec.signature, ctx.dims, exc)
        raise CaptureError(f"{exc} (report: {written})") from exc


def _fuse_onnx(ctx: ExportContext) -> None:
    from tk.export.onnx_optimize import optimize_onnx_in_place

    info = ctx.formats["onnx"]
    if info.get("external_data"):
        info["fusions"] = {"applied": False, "reason": "the graph has external data (over 2 GiB)"}
        return
    path = ctx.staging / info["file"]
    if ctx.options.keep_unfused:
        unfused = ctx.add_file(UNFUSED_ONNX, "onnx-unfused")
        shutil.copyfile(path, unfused)
    feeds = {s.name: t.cpu().numpy() for s, t in zip(ctx.spec.signature.inputs, ctx.example_inputs, strict=True)}
    # a CUDA export keeps SkipLayerNormalization (fused there); onnxruntime's CPU kernel is slower than LayerNormalization
    result = optimize_onnx_in_place(path, feeds, for_cpu=ctx.options.device != "cuda")
    info["fusions"] = result.to_json()
    if result.applied:
        log.info(
            "export fuse   %d -> %d nodes: %s %s",
            result.nodes_before,
            result.nodes_after,
            result.fused_ops,
            result.cpu_rewrites or "",
        )


INT8_MODES = ("static", "dynamic")


def _check_int8_options(options: ExportOptions, formats: list[str]) -> None:
    """The int8 settings each format takes, refused before any work."""
    if options.int8_mode not in INT8_MODES:
        raise UsageError(f"--int8-mode: expected one of {', '.join(INT8_MODES)}, got {options.int8_mode!r}")
    method = options.calibration_method
    if "onnx" in formats and options.int8_mode == "static" and method is not None:
        from tk.export.static_int8 import METHODS

        if method not in METHODS:
            raise UsageError(
                f"--calibration-method: static int8 ONNX calibrates with {', '.join(METHODS)}, got {method!r}"
            )
    if "aoti" in formats:
        from tk.export.aoti_int8 import METHODS as AOTI_METHODS

        if options.int8_mode != "static":
            raise UsageError(f"--int8-mode {options.int8_mode}: an int8 aoti package is calibrated; expected static")
        if method is not None and method not in AOTI_METHODS:
            raise UsageError(
                f"--calibration-method: int8 aoti packages calibrate with {' or '.join(AOTI_METHODS)}, got {method!r}"
            )
        if options.nodes_to_exclude:
            raise UsageError(
                "nodes_to_exclude names ONNX nodes; an int8 aoti package leaves modules in float32 with keep_fp32 "
                "(--keep-fp32)"
            )


def _fuse_before_int8(options: ExportOptions) -> bool:
    """Whether the ONNX graph is fused: always but under dynamic int8.

    Static int8 quantizes the fused graph: its attention is one ``MultiHeadAttention`` instead of
    MatMul/Where/Softmax/Transpose plumbing, which took the small Transformer at 32 x 128 from
    217 to 204 ms per call at the same SQNR (AMD EPYC Zen 4, interleaved, under load). Dynamic
    int8 stays unfused: fusions made it 20-30% slower when measured (the README's performance section).
    """
    return options.precision != "int8" or options.int8_mode == "static"


def _quantize_onnx(ctx: ExportContext) -> None:
    from tk.export.quantize import QUANTIZED_OPS, int8_onnx_from_onnx

    path = ctx.staging / ctx.formats["onnx"]["file"]
    quantized = path.with_name(".int8." + path.name)
    excluded: list[str] = list(ctx.options.nodes_to_exclude)
    kept_modules: list[str] = []
    if ctx.options.keep_fp32:
        import onnx

        from tk.formats.onnx_scopes import nodes_in_modules

        kept_modules = nodes_in_modules(onnx.load(str(path), load_external_data=False), ctx.options.keep_fp32)
        excluded += kept_modules + [f"{name}_MatMul" for name in kept_modules]  # a Gemm splits into NAME_MatMul + Add
    mode = ctx.options.int8_mode  # checked by _check_int8_options before any work
    if mode == "static":
        from tk.export.calibration import calibration_feeds, judge_feeds
        from tk.export.static_int8 import static_int8_onnx_from_onnx
        from tk.tolerances import MIN_SQNR_DB

        result = static_int8_onnx_from_onnx(
            path,
            quantized,
            calibration_feeds(ctx),
            method=ctx.options.calibration_method or "minmax",
            nodes_to_exclude=excluded,
            min_sqnr_db=MIN_SQNR_DB["int8"],
            judge=judge_feeds(ctx),
        )
        os.replace(quantized, path)
        ctx.formats["onnx"]["quantization"] = result.to_json()
        if kept_modules:
            ctx.formats["onnx"]["int8_excluded_nodes"] = len(kept_modules)
        return
    int8_onnx_from_onnx(path, quantized, nodes_to_exclude=excluded)
    os.replace(quantized, path)
    ctx.formats["onnx"]["quantization"] = f"dynamic int8 ({', '.join(QUANTIZED_OPS)})"
    if kept_modules:
        ctx.formats["onnx"]["int8_excluded_nodes"] = len(kept_modules)


def _write_weights(ctx: ExportContext) -> None:
    from tk.models.checkpoint import state_dict_bytes

    path = ctx.add_file(WEIGHTS, "weights")
    path.write_bytes(state_dict_bytes(ctx.spec.module))


def _manifest(ctx: ExportContext, checkpoint_sha: str | None) -> Manifest:
    model = {**ctx.spec.reference(), "checkpoint_sha256": checkpoint_sha}
    if ctx.options.keep_fp32:
        model["keep_fp32"] = list(ctx.options.keep_fp32)  # modules left in float32 (tk export --keep-fp32)
    if ctx.spec.tolerances:
        model["tolerances"] = {p: list(t) for p, t in ctx.spec.tolerances.items()}
    signature = type(ctx.spec.signature)(ctx.spec.signature.inputs, ctx.spec.signature.outputs, ctx.dims)
    return Manifest(
        model=model,
        signature=signature,
        precision=ctx.options.precision,
        device=ctx.options.device,
        formats=ctx.formats,
        files=[FileEntry.of(ctx.staging, rel, role) for rel, role in ctx.files],
        versions=ctx.versions,
        timings=ctx.timings,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _write_manifest(staging: Path, manifest: Manifest) -> None:
    atomic_write_bytes(staging / MANIFEST, manifest_bytes(manifest))


def _replace_dir(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out`` with no moment at which ``out`` is missing.

    Where the OS can, the two directories are exchanged in one step and the old one (now at the
    staging name) removed. Elsewhere the old one is first moved aside into a ``.old`` directory,
    which ``recover_interrupted`` puts back if a kill lands between the two renames.
    """
    _refuse_foreign_dir(out)
    if not (out.exists() or out.is_symlink()):
        os.replace(staging, out)
        return
    if exchange_paths(staging, out):
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = exclusive_temp_dir(out.parent, f".{out.name}.", ".old")
    os.replace(out, old / "artifact")
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted(out: Path) -> None:
    """Undo what a killed export left: put a moved-aside artifact back where ``out`` is missing, and
    remove leftover ``.old`` directories of a complete ``out`` (staging ``.partial`` ones are
    another export's, possibly running, and stay)."""
    leftovers = sorted(out.parent.glob(f".{out.name}.*.old")) if out.parent.is_dir() else []
    for old in leftovers:
        moved = old / "artifact"
        if not (out.exists() or out.is_symlink()) and (moved / MANIFEST).is_file():
            os.replace(moved, out)
            log.info("export: restored the previous artifact at %s from an interrupted export", out)
        shutil.rmtree(old, ignore_errors=True)


def _refuse_foreign_dir(out: Path) -> None:
    """``out`` may be absent, empty, or a previous artifact (it has a manifest); nothing else is replaced."""
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise UsageError(f"--out {out}: expected a directory (or nothing), found a file")
    if (out / MANIFEST).is_file() or not any(out.iterdir()):
        return
    raise UsageError(
        f"--out {out}: this directory holds files and no {MANIFEST}, so it is not a tk artifact and export "
        "will not replace (delete) it; choose another --out, or empty it first"
    )
