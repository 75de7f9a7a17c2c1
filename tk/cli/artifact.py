"""``tk export`` and ``tk inspect``: write an artifact, read its manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from tk.cli.common import (
    RegistryChoice,
    build,
    model_options,
    option_group,
    path_option,
    print_check_reports,
    public_key_option,
    refuse_writes_into,
    size_text,
    task_option,
    trust_policy,
)
from tk.errors import ParityError, PartialExportError, UsageError
from tk.registries import DEVICES, FORMATS, PRECISIONS
from tk.text import printable
from tk.tolerances import MIN_SQNR_DB


def _parse_dims(batch: str | None, seq: str | None, dims: tuple[str, ...]) -> dict[str, Any]:
    from tk.spec import Dim

    parsed = {}
    if batch:
        parsed["batch"] = Dim.parse("batch", batch)
    if seq:
        parsed["seq"] = Dim.parse("seq", seq)
    for item in dims:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--dim: expected NAME=MIN:OPT:MAX such as seq=1:128:512, got {item!r}")
        parsed[name] = Dim.parse(name, value)
    return parsed


# the flags of format options grouped on the command line (the others are the command's own parameters)
_FLAG_NAMES = {
    "fuse": "--fuse/--no-fuse",
    "keep_unfused": "--keep-unfused",
    "freeze": "--freeze/--no-freeze",
    "remove_padding": "--remove-padding/--keep-padding",
    "trt_workspace": "--trt-workspace",
    "trt_opt_level": "--trt-opt-level",
    "trt_hardware_compat": "--trt-hardware-compat",
    "trt_timing_cache": "--trt-timing-cache",
}


def _flags_by_name(**values: Any) -> dict[str, Any]:
    """Format options by their flag, as ``tk.export.settings_from_flags`` reads them (None: not given)."""
    return {_FLAG_NAMES[name]: value for name, value in values.items()}


@dataclass(frozen=True)
class _Ranges:
    """--dynamic/--static, --batch, --seq and --dim as given (parsed by ``_parse_dims``)."""

    dynamic: bool
    batch: str | None
    seq: str | None
    dims: tuple[str, ...]


@click.command("export")
@click.argument("model")
@model_options
@task_option
@click.option(
    "--format",
    "formats",
    multiple=True,
    type=RegistryChoice(FORMATS, ("all",)),
    help=f"{', '.join(FORMATS)} or all (repeatable; default onnx).",
)
@click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None, help="Weights from `tk train` (safetensors)."
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Artifact directory (default: artifacts/MODEL-SIZE)."
)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option(
    "--int8-mode",
    type=click.Choice(["static", "dynamic", "weights", "weights-int4"]),
    default=None,
    help="int8: calibrated QDQ graph (static, the default), activations quantized per call (dynamic, onnx), or "
    "weight-only: the products' weights in int8 (weights) or int4 (weights-int4) blocks, activations float "
    "(onnx, openvino; for decoders, whose decode step is bound by memory bandwidth).",
)
@click.option(
    "--calibrate",
    default=None,
    metavar="FILE|random:N",
    help="Static int8 calibration inputs: an .npz/.npy file like tk infer --inputs, for hf:DIR models a .txt/.jsonl "
    "file of texts, or random:N (default random:32).",
)
@path_option(
    "--check-inputs",
    help="Samples the check (and an int8 search's judge) runs, cut or padded to each shape of the range: an "
    ".npz/.npy file like tk infer --inputs, for hf:DIR models a .txt/.jsonl file of texts (default: random inputs).",
)
@click.option(
    "--calibration-method",
    type=click.Choice(["minmax", "entropy", "percentile", "histogram"]),
    default=None,
    help="Static int8 activation ranges. onnx: minmax (default), entropy or percentile; "
    "aoti: histogram (torchao's x86 default) or minmax.",
)
@option_group(
    "graph_flags",
    _flags_by_name,
    click.option(
        "--fuse/--no-fuse", default=None, help="onnxruntime's transformer fusions on the ONNX graph (default: on)."
    ),
    click.option(
        "--keep-unfused",
        is_flag=True,
        default=None,
        help="Also ship the ONNX graph before fusion (model.unfused.onnx).",
    ),
    click.option(
        "--freeze/--no-freeze",
        default=None,
        help="aoti on the CPU: Inductor's freezing, weights packed for this CPU (default: on for bf16/fp16/int8, off "
        "for fp32, where it is faster on some CPUs and slower on others: tk optimize times both).",
    ),
    click.option(
        "--remove-padding/--keep-padding",
        default=None,
        help="aoti on the CPU, a model with an attention mask: linears and the other per-token work "
        "on real tokens only, zeros at padding positions in the outputs (default: on; docs/formats.md).",
    ),
)
@option_group(
    "ranges",
    _Ranges,
    click.option(
        "--dynamic/--static",
        default=True,
        show_default=True,
        help="Dynamic dimensions, or every size fixed at its opt.",
    ),
    click.option("--batch", default=None, metavar="MIN:OPT:MAX", help="Range of the batch dimension, e.g. 1:8:64."),
    click.option("--seq", default=None, metavar="MIN:OPT:MAX", help="Range of the sequence dimension, e.g. 1:128:512."),
    click.option(
        "--dim", "dims", multiple=True, metavar="NAME=MIN:OPT:MAX", help="Range of any other named dimension."
    ),
)
@click.option("--opset", type=int, default=None, help="ONNX opset (default 20; at least 18).")
@click.option(
    "--max-cache-len", type=int, default=None, help="A decoder's static KV cache slots (default: its positions)."
)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--no-check", is_flag=True, help="Skip the export-time parity check (the manifest says unchecked).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance of the check (default: by precision).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance of the check (default: by precision).")
@option_group(
    "trt_flags",
    _flags_by_name,
    click.option("--trt-workspace", type=float, default=None, help="TensorRT workspace limit, GiB (default 4)."),
    click.option(
        "--trt-opt-level",
        type=click.IntRange(0, 5),
        default=None,
        help="TensorRT builder optimization level (default 3).",
    ),
    click.option(
        "--trt-hardware-compat",
        type=click.Choice(["ampere+", "same-compute-capability", "none"]),
        default=None,
        help="TensorRT engine's hardware compatibility (default ampere+).",
    ),
    path_option(
        "--trt-timing-cache",
        help="TensorRT timing cache file, reused across builds (default: ~/.cache/tk/trt-timing.cache).",
    ),
)
@path_option("--json", "json_path", help="Also write the manifest's check as JSON here.")
@click.option(
    "--keep-fp32",
    default=None,
    metavar="MODULE[,MODULE...]",
    help="Module paths kept in float32 under --precision fp16/bf16/int8 (what `tk debug precision` prints).",
)
@click.option(
    "--min-sqnr",
    type=float,
    default=None,
    metavar="DB",
    help=f"SQNR floor of the check under --precision {'/'.join(MIN_SQNR_DB)}, and the target of int8's "
    f"exclusion search (default: {'/'.join(f'{v:g}' for v in MIN_SQNR_DB.values())} dB).",
)
@path_option("--report", help="Where a failed capture's report goes (default: OUT.export-report.md beside OUT).")
@click.option("--force", is_flag=True, help="Replace an --out artifact that also holds other files, deleting them "
              "(a directory that is not a tk artifact is never replaced).")  # fmt: skip
def export_cmd(
    model: str,
    size: str | None,
    inputs: tuple[str, ...],
    task: str | None,
    formats: tuple[str, ...],
    checkpoint: Path | None,
    out: Path | None,
    precision: str,
    int8_mode: str | None,
    calibrate: str | None,
    check_inputs: Path | None,
    calibration_method: str | None,
    graph_flags: dict[str, Any],
    ranges: _Ranges,
    opset: int | None,
    max_cache_len: int | None,
    device: str,
    no_check: bool,
    rtol: float | None,
    atol: float | None,
    trt_flags: dict[str, Any],
    json_path: Path | None,
    keep_fp32: str | None,
    min_sqnr: float | None,
    report: Path | None,
    force: bool,
) -> None:
    """Export MODEL to static-graph artifacts and check each against PyTorch."""
    from tk.export import ExportOptions, settings_from_flags

    formats = formats or ("onnx",)
    # each format's options dataclass takes the ones it declares (tk.export.base); None: not given
    flags = {"--int8-mode": int8_mode, "--calibration-method": calibration_method, **graph_flags, "--opset": opset}
    settings = settings_from_flags(formats, {**flags, **trt_flags})
    spec = build(model, size, inputs, task, cache_len=max_cache_len)
    options = ExportOptions(
        formats=formats,
        precision=precision,
        calibrate=calibrate,
        check_inputs=check_inputs,
        dynamic=ranges.dynamic,
        dims=_parse_dims(ranges.batch, ranges.seq, ranges.dims),
        device=device,
        check=not no_check,
        rtol=rtol,
        atol=atol,
        checkpoint=checkpoint,
        settings=settings,
        keep_fp32=tuple(m.strip() for m in (keep_fp32 or "").split(",") if m.strip()),
        min_sqnr_db=min_sqnr,
        report=report,
        force=force,
    )
    default_name = f"hf-{Path(spec.name[3:]).name}" if spec.name.startswith("hf:") else spec.name.replace(":", "-")
    out = out or Path("artifacts") / (f"{spec.name}-{spec.size}" if spec.size else default_name)
    refuse_writes_into(out, json=json_path)  # the artifact is written whole and swapped into place
    _export_and_show(spec, out, options, json_path)


def _export_and_show(spec: Any, out: Path, options: Any, json_path: Path | None) -> None:
    """Export, then show the check's tables and the artifact's status (also when the artifact was written
    with a failure); the check as JSON at ``json_path``."""
    from tk.workflows.export import export

    try:
        result = export(spec, out, options)
    except (ParityError, PartialExportError):  # the artifact was written: show what its check found
        from tk.manifest import read_manifest

        print_check_reports(read_manifest(out).check)
        raise
    if result.manifest.check:
        print_check_reports(result.manifest.check)
    click.echo(f"artifact: {out} ({result.manifest.status})")
    if json_path:
        from tk.fileio import atomic_write_json

        atomic_write_json(json_path, result.manifest.check)


def _quantization_text(quant: object) -> str:
    """One line of a manifest's int8 record: how, how many layers int8, which were left out and in what."""
    if not isinstance(quant, dict):
        return str(quant)  # dynamic int8 records one sentence
    total = quant.get("quantizable_nodes", quant.get("quantizable_modules", 0))
    excluded = quant.get("excluded", [])
    automatic = quant.get("automatic_exclusions", [])
    kept = [name for name in excluded if name not in automatic]  # --keep-fp32
    how = ", ".join(str(quant[k]) for k in ("mode", "quantizer", "format", "method") if quant.get(k))
    left = (
        f"; left out ({quant.get('automatic_exclusions_run_in', 'fp32')}): {', '.join(automatic)}" if automatic else ""
    )
    left += f"; kept fp32: {', '.join(kept)}" if kept else ""
    left += f"; {quant['float_part']}" if isinstance(quant.get("float_part"), str) else ""
    int8 = quant.get("int8_modules", total - len(excluded))
    weights = f"; weights {quant['weights']}" if quant.get("weights", "int8") != "int8" else ""
    smoothing = quant.get("smoothing") or {}
    alpha = smoothing.get("alpha")
    unary = ", not after a unary" if smoothing.get("after_unary") is False else ""
    smoothed = f"; smoothed (alpha {alpha:g}{unary})" if isinstance(alpha, (int, float)) else ""
    seconds = quant.get("seconds")
    took = ""
    if isinstance(seconds, dict) and seconds and all(isinstance(v, (int, float)) for v in seconds.values()):
        took = f"; search {sum(seconds.values()):.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + ")"
    return (
        f"{how}; {int8} of {total} layers int8{smoothed}{left}; SQNR at export {quant.get('sqnr_db_export')} dB"
        f"{weights}{took}"
    )


# --------------------------------------------------------------------------------------- inspect
@click.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@public_key_option
def inspect_cmd(artifact: Path, as_json: bool) -> None:
    """Summarize an artifact's manifest (and verify every file's hash)."""
    from tk.manifest import manifest_bytes, verify_artifact

    manifest = verify_artifact(artifact)
    if as_json:
        click.echo(manifest_bytes(manifest).decode().rstrip())  # JSON escapes every control character itself
        return
    model = manifest.model
    _show(f"artifact   {artifact}  status: {manifest.status}  (files verified)")
    _show(
        f"model      {model['name']}"
        + (f" size {model['size']}" if model.get("size") else "")
        + f"  precision {manifest.precision}  device {manifest.device}"
    )
    if model.get("checkpoint_sha256"):
        _show(f"checkpoint sha256 {model['checkpoint_sha256'][:16]}…")
    dims = ", ".join(f"{d.name} {d.min}:{d.opt}:{d.max}" for d in manifest.signature.dims.values())
    _show(f"dims       {dims or 'none'}")
    for label, specs in (("input", manifest.signature.inputs), ("output", manifest.signature.outputs)):
        for s in specs:
            _show(f"{label:<10} {s.name}: {s.dtype}[{', '.join(map(str, s.shape))}]")
    _print_signature(artifact, manifest)
    for entry in manifest.files:
        _show(f"file       {entry.path:<28} {entry.role:<10} {size_text(entry.size):>9}  sha256 {entry.sha256[:12]}…")
    for fmt, info in manifest.formats.items():
        for line in _format_lines(artifact, fmt, info):
            _show(line)
    for fmt, why in manifest.failed.items():
        _show(f"failed     {fmt}: {why}")
    _show("versions   " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items()))
    if manifest.timings:
        _show("timings    " + ", ".join(f"{k} {v:.1f} s" for k, v in manifest.timings.items()))
    for fmt, report in manifest.check.items():
        worst_abs = max((o["max_abs"] for o in report["outputs"]), default=0.0)
        worst_rel = max((o["max_rel"] for o in report["outputs"]), default=0.0)
        verdict = "passed" if report["passed"] else "FAILED"
        _show(
            f"check      {fmt}: {verdict}, max abs {worst_abs:.2e}, max rel {worst_rel:.2e} over {len(report['shapes'])} shapes (rtol {report['rtol']:g}, atol {report['atol']:g})"
        )
    for line in _generation_lines(manifest.generation):
        _show(line)


def _generation_lines(generation: dict[str, Any]) -> list[str]:
    """A decoder's entry points, cache, special tokens and generation checks (none for other models)."""
    if not generation:
        return []
    lines = []
    for name, entry in generation.get("entry_points", {}).items():
        seq, batch = entry.get("seq", [0, 0]), entry.get("batch", [0, 0])
        tokens = f"{seq[0]}" if seq[0] == seq[1] else f"{seq[0]} to {seq[1]}"
        lines.append(
            f"entry      {name}: {tokens} new token{'s' if seq[1] > 1 else ''}, batch {batch[0]} to {batch[1]} (graph {entry.get('graph')})"
        )
    cache = generation["cache"]
    row = 2 * cache["layers"] * cache["heads"] * cache["slots"] * cache["head_dim"] * 4
    lines.append(
        f"cache      {cache['slots']} slots, {cache['layers']} layers x {cache['heads']} heads x {cache['head_dim']} "
        f"({cache.get('layout')}), keys and values {size_text(row)} a row in float32"
    )
    special = ", ".join(
        f"{k.removesuffix('_token_id')} {generation.get(k)}" for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    )
    lines.append(f"tokens     vocabulary {generation['vocab_size']}, {special}")
    for engine, report in generation.get("check", {}).items():
        verdict = "passed" if report.get("passed") else "FAILED"
        agree = "identical" if report.get("identical") else f"{report.get('agreement', 0):.1%} agree"
        lines.append(
            f"generate   {engine}: {verdict}, {report.get('prompts')} prompts x {report.get('new_tokens')} greedy tokens "
            f"{agree}, max logit error {report.get('max_logit_error', 0):.2e}"
        )
    return lines


def _show(line: str) -> None:
    """One line of ``tk inspect``: the manifest's strings in it shown escaped, never obeyed by the terminal."""
    click.echo(printable(line))


def _format_lines(artifact: Path, fmt: str, info: dict[str, Any]) -> list[str]:
    """``tk inspect``'s lines of one format's record (its file and settings, int8, fusions); a record
    whose fields are not what tk writes is a damaged manifest, said in one line."""
    from tk.errors import IntegrityError

    try:
        shown_apart = ("file", "fusions", "quantization", "fallback")
        extra = ", ".join(f"{k}={v}" for k, v in info.items() if k not in shown_apart)
        lines = [f"format     {fmt}: {info.get('file', '')}" + (f" ({extra})" if extra else "")]
        if "fallback" in info:
            lines.append(f"fallback   {fmt}: {info['fallback']}")
        if "quantization" in info:
            lines.append(f"int8       {fmt}: {_quantization_text(info['quantization'])}")
        fusions = info.get("fusions")
        if fusions:
            ops = ", ".join(f"{op} {n}" for op, n in fusions.get("fused_ops", {}).items()) or "none"
            verdict = "applied" if fusions["applied"] else f"not applied: {fusions.get('reason')}"
            before = fusions.get("nodes_before")
            nodes = f"{before} -> {fusions.get('nodes_after')} nodes; " if before else ""
            cpu = ", ".join(f"{k} {n}" for k, n in fusions.get("cpu_rewrites", {}).items())
            lines.append(f"fused      {fmt}: {nodes}{ops}{'; for the CPU: ' + cpu if cpu else ''} ({verdict})")
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise IntegrityError(
            f"{artifact / 'manifest.json'}: formats.{fmt} is not the record tk writes ({type(exc).__name__}: {exc}); "
            "re-export the artifact"
        ) from exc
    return lines


def _print_signature(artifact: Path, manifest: Any) -> None:
    """Who signed the artifact, whether that key is trusted here, and whether loading it runs its native code."""
    from tk.signing import SIGNATURE, holds_native_code, signature_summary

    found = signature_summary(artifact, manifest, trust_policy())
    if found.trusted:
        _show(f"signed     by key {found.fingerprint} ({found.key}): verified, trusted")
    elif found.signed:
        who = f"by key {found.fingerprint}" if found.fingerprint else "by an unknown key"
        _show(f"signed     {who}: NOT trusted here, because {found.reason}")
    else:
        _show(f"signed     no ({SIGNATURE} missing): sign it with `tk sign {artifact}`")
    native = holds_native_code(manifest, artifact)
    if native:
        verdict = "loads" if found.trusted else "refused unless trusted (--public-key, tk sign, --trust-artifact-code)"
        _show(f"native     {', '.join(native)}: runs the artifact's own code when loaded; {verdict}")
    else:
        _show("native     none: no format here loads code from the artifact")


COMMANDS = (export_cmd, inspect_cmd)
