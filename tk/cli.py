"""The ``tk`` command line: parse options, call one library function per command, print tables.

Every error a user can cause is a ``TkError``: it ends as one line on stderr and a non-zero exit
code (2, or 1 for a failed parity check). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from tk.errors import TkError, UsageError

ENGINE_NAMES = ("eager", "compile", "torch", "aoti", "onnx", "trt")  # tk.runtime.ENGINES, without importing torch
FORMAT_NAMES = ("torch", "onnx", "aoti", "trt", "all")
PRECISIONS = ("fp32", "fp16", "bf16", "int8")


class TkGroup(click.Group):
    """Turns ``TkError`` and click's usage errors into one line and an exit code.

    ``--debug`` keeps the traceback of a ``TkError``.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:  # bad option values, missing arguments, unknown commands
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TkError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=TkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks and torch's own logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """tk: export PyTorch models to static graphs, prove parity, make them fast."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    _setup_logging(debug)


def _setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    tk_log = logging.getLogger("tk")
    tk_log.handlers[:] = [handler]
    tk_log.setLevel(logging.DEBUG if debug else logging.INFO)
    tk_log.propagate = False
    if not debug:
        for noisy in ("torch", "torch.utils.cpp_extension", "onnxscript", "onnx_ir"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        import warnings

        warnings.filterwarnings("ignore")


def _console() -> Any:
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=140)  # pipes and CI logs get whole rows


# ---------------------------------------------------------------------------------------- models
def model_options(fn: Any) -> Any:
    fn = click.option("--size", default=None, help="Model size: tiny, small or base (default: small).")(fn)
    fn = click.option(
        "--input",
        "inputs",
        multiple=True,
        metavar="NAME:DTYPE:SHAPE[:LOW-HIGH]",
        help="Describe an input of a user model, e.g. input_ids:int64:2x128:0-30522 (repeatable).",
    )(fn)
    return fn


def _build(name: str, size: str | None, inputs: tuple[str, ...]) -> Any:
    from tk.models import build_model

    if ":" in name and size:
        raise UsageError(f"--size applies to built-in models, not to {name!r}")
    if ":" not in name and inputs:
        raise UsageError(f"--input describes a user model's inputs; {name!r} is a built-in model with its own")
    return build_model(name, size=size, input_descriptions=inputs)


@cli.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models_cmd(as_json: bool) -> None:
    """List the built-in models with their inputs and sizes."""
    from rich.table import Table

    from tk.models import entries

    rows = []
    for entry in entries().values():
        if entry.available():
            spec = entry.build("tiny")
            inputs = "\n".join(f"{s.name} {s.dtype} ({', '.join(map(str, s.shape))})" for s in spec.signature.inputs)
        else:
            inputs = entry.requires or "unavailable"
        rows.append(
            {"name": entry.name, "sizes": list(entry.sizes), "inputs": inputs, "description": entry.description}
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="tk models (any package.module:callable works too)")
    for column in ("model", "sizes", "inputs (size tiny)", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], ", ".join(row["sizes"]), row["inputs"], row["description"])
    _console().print(table)


# ----------------------------------------------------------------------------------------- train
@cli.command("train")
@click.argument("model")
@model_options
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: the task's, e.g. 300).")
@click.option("--batch-size", type=int, default=None, help="Samples per step (default: the task's).")
@click.option("--lr", type=float, default=None, help="Learning rate (default: the task's).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for weights and data.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--compile", "use_compile", is_flag=True, help="Train under torch.compile.")
@click.option(
    "--mode", type=click.Choice(["default", "reduce-overhead", "max-autotune"]), default="default", show_default=True
)
@click.option("--dynamic/--no-dynamic", default=None, help="torch.compile dynamic shapes (default: torch decides).")
@click.option("--fullgraph", is_flag=True, help="Fail on any graph break instead of splitting the graph.")
@click.option("--backend", default="inductor", show_default=True, help="torch.compile backend.")
@click.option("--compare", is_flag=True, help="Train eager and compiled from the same start and compare speed.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Checkpoint path (default: runs/MODEL-SIZE.safetensors).",
)
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON."
)
def train_cmd(
    model: str,
    size: str | None,
    inputs: tuple[str, ...],
    steps: int | None,
    batch_size: int | None,
    lr: float | None,
    seed: int,
    device: str,
    use_compile: bool,
    mode: str,
    dynamic: bool | None,
    fullgraph: bool,
    backend: str,
    compare: bool,
    out: Path | None,
    json_path: Path | None,
) -> None:
    """Train MODEL on its synthetic task and save a safetensors checkpoint."""
    from tk.models.train import CompileOptions

    options = CompileOptions(mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)
    kwargs = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "device": device}
    if compare:
        _train_compare(model, size, inputs, options, kwargs, json_path)
        return
    spec = _build(model, size, inputs)
    result = _train_with_progress(spec, kwargs, options if use_compile else None)
    from tk.fileio import atomic_write_json
    from tk.models.checkpoint import save_checkpoint
    from tk.versions import library_versions

    out = out or Path("runs") / f"{spec.name}-{spec.size}.safetensors"
    meta = {**spec.reference(), "train": result.summary(), "versions": library_versions()}
    save_checkpoint(spec.module, out, meta)
    _print_train([result])
    click.echo(f"checkpoint: {out} (+ {out.name}.json)")
    if json_path:
        atomic_write_json(json_path, meta)


def _train_with_progress(spec: Any, kwargs: dict[str, Any], options: Any) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tk.models.train import train

    total = kwargs["steps"] or (spec.task.steps if spec.task else 1)
    label = "compiled" if options is not None else "eager"
    with Progress(
        TextColumn(f"train {spec.name} ({label})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.1f} steps/s"),
        TimeElapsedColumn(),
        console=_console(),
        transient=False,
    ) as progress:
        task_id = progress.add_task("train", total=total, loss=float("nan"), rate=0.0)
        import time

        start = time.perf_counter()

        def on_step(step: int, loss: float) -> None:
            elapsed = time.perf_counter() - start
            progress.update(task_id, completed=step, loss=loss, rate=step / elapsed if elapsed else 0.0)

        return train(spec, compile_options=options, on_step=on_step, **kwargs)


def _print_train(results: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="training")
    for column in (
        "loop",
        "steps",
        "first loss",
        "final loss",
        "val loss",
        "val acc",
        "first step s",
        "steps/s",
        "graphs",
        "breaks",
        "recompiles",
    ):
        table.add_column(column, justify="right")
    for r in results:
        acc = "-" if r.val_accuracy is None else f"{r.val_accuracy:.3f}"
        compiled = [str(r.graphs), str(r.graph_breaks), str(r.recompilations)] if r.compiled else ["-", "-", "-"]
        table.add_row(
            "compiled" if r.compiled else "eager",
            str(r.steps),
            f"{r.first_loss:.4f}",
            f"{r.final_loss:.4f}",
            f"{r.val_loss:.4f}",
            acc,
            f"{r.first_step_s:.2f}",
            f"{r.steps_per_s:.1f}",
            *compiled,
        )
    _console().print(table)
    for r in results:
        for reason in r.graph_break_reasons:
            click.echo(f"graph break: {reason}")


def _train_compare(
    model: str, size: str | None, inputs: tuple[str, ...], options: Any, kwargs: dict[str, Any], json_path: Path | None
) -> None:
    from tk.fileio import atomic_write_json

    eager_spec = _build(model, size, inputs)
    compiled_spec = _build(model, size, inputs)
    compiled_spec.module.load_state_dict(eager_spec.module.state_dict())
    eager = _train_with_progress(eager_spec, kwargs, None)
    compiled = _train_with_progress(compiled_spec, kwargs, options)
    _print_train([eager, compiled])
    speedup = compiled.steps_per_s / eager.steps_per_s
    click.echo(
        f"compiled over eager after warm-up: {speedup:.2f}x steps/s (compile and first step took {compiled.first_step_s:.1f} s)"
    )
    if json_path:
        atomic_write_json(
            json_path,
            {
                "model": eager_spec.reference(),
                "eager": eager.summary(),
                "compiled": compiled.summary(),
                "speedup": speedup,
            },
        )


# ---------------------------------------------------------------------------------------- export
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


@cli.command("export")
@click.argument("model")
@model_options
@click.option(
    "--format",
    "formats",
    multiple=True,
    type=click.Choice(FORMAT_NAMES),
    help="torch, onnx, aoti, trt or all (repeatable; default onnx).",
)
@click.option(
    "--checkpoint", type=click.Path(path_type=Path), default=None, help="Weights from `tk train` (safetensors)."
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Artifact directory (default: artifacts/MODEL-SIZE)."
)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option(
    "--dynamic/--static", default=True, show_default=True, help="Dynamic dimensions, or every size fixed at its opt."
)
@click.option("--batch", default=None, metavar="MIN:OPT:MAX", help="Range of the batch dimension, e.g. 1:8:64.")
@click.option("--seq", default=None, metavar="MIN:OPT:MAX", help="Range of the sequence dimension, e.g. 1:128:512.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=MIN:OPT:MAX", help="Range of any other named dimension.")
@click.option("--opset", type=int, default=None, help="ONNX opset (default 20; at least 18).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--no-check", is_flag=True, help="Skip the export-time parity check (the manifest says unchecked).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance of the check (default: by precision).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance of the check (default: by precision).")
@click.option("--trt-workspace", type=float, default=4.0, show_default=True, help="TensorRT workspace limit, GiB.")
@click.option(
    "--trt-opt-level",
    type=click.IntRange(0, 5),
    default=3,
    show_default=True,
    help="TensorRT builder optimization level.",
)
@click.option(
    "--trt-hardware-compat",
    type=click.Choice(["ampere+", "same-compute-capability", "none"]),
    default="ampere+",
    show_default=True,
)
@click.option(
    "--trt-timing-cache",
    type=click.Path(path_type=Path),
    default=None,
    help="TensorRT timing cache file, reused across builds (default: ~/.cache/tk/trt-timing.cache).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the manifest's check as JSON here.",
)
def export_cmd(
    model: str,
    size: str | None,
    inputs: tuple[str, ...],
    formats: tuple[str, ...],
    checkpoint: Path | None,
    out: Path | None,
    precision: str,
    dynamic: bool,
    batch: str | None,
    seq: str | None,
    dims: tuple[str, ...],
    opset: int | None,
    device: str,
    no_check: bool,
    rtol: float | None,
    atol: float | None,
    trt_workspace: float,
    trt_opt_level: int,
    trt_hardware_compat: str,
    trt_timing_cache: Path | None,
    json_path: Path | None,
) -> None:
    """Export MODEL to static-graph artifacts and check each against PyTorch."""
    from tk.export import ExportOptions, export

    if opset is not None and opset < 18:
        raise UsageError(f"--opset: expected 18 or newer, got {opset}")
    spec = _build(model, size, inputs)
    options = ExportOptions(
        formats=formats or ("onnx",),
        precision=precision,
        dynamic=dynamic,
        dims=_parse_dims(batch, seq, dims),
        opset=opset,
        device=device,
        check=not no_check,
        rtol=rtol,
        atol=atol,
        checkpoint=checkpoint,
        trt_workspace_gb=trt_workspace,
        trt_optimization_level=trt_opt_level,
        trt_hardware_compatibility=trt_hardware_compat,
        trt_timing_cache=trt_timing_cache,
    )
    out = out or Path("artifacts") / (f"{spec.name}-{spec.size}" if spec.size else spec.name.replace(":", "-"))
    from tk.errors import ParityError

    try:
        result = export(spec, out, options)
    except ParityError:
        from tk.manifest import read_manifest

        _print_check_reports(read_manifest(out).check)
        raise
    if result.manifest.check:
        _print_check_reports(result.manifest.check)
    click.echo(f"artifact: {out} ({result.manifest.status})")
    if json_path:
        from tk.fileio import atomic_write_json

        atomic_write_json(json_path, result.manifest.check)


# --------------------------------------------------------------------------------------- inspect
@cli.command("inspect")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def inspect_cmd(artifact: Path, as_json: bool) -> None:
    """Summarize an artifact's manifest (and verify every file's hash)."""
    from tk.manifest import manifest_bytes, verify_artifact

    manifest = verify_artifact(artifact)
    if as_json:
        click.echo(manifest_bytes(manifest).decode().rstrip())
        return
    model = manifest.model
    click.echo(f"artifact   {artifact}  status: {manifest.status}  (files verified)")
    click.echo(
        f"model      {model['name']}"
        + (f" size {model['size']}" if model.get("size") else "")
        + f"  precision {manifest.precision}  device {manifest.device}"
    )
    if model.get("checkpoint_sha256"):
        click.echo(f"checkpoint sha256 {model['checkpoint_sha256'][:16]}…")
    dims = ", ".join(f"{d.name} {d.min}:{d.opt}:{d.max}" for d in manifest.signature.dims.values())
    click.echo(f"dims       {dims or 'none'}")
    for label, specs in (("input", manifest.signature.inputs), ("output", manifest.signature.outputs)):
        for s in specs:
            click.echo(f"{label:<10} {s.name}: {s.dtype}[{', '.join(map(str, s.shape))}]")
    for entry in manifest.files:
        click.echo(f"file       {entry.path:<28} {entry.role:<10} {_size(entry.size):>9}  sha256 {entry.sha256[:12]}…")
    for fmt, info in manifest.formats.items():
        extra = ", ".join(f"{k}={v}" for k, v in info.items() if k != "file")
        click.echo(f"format     {fmt}: {info.get('file', '')}" + (f" ({extra})" if extra else ""))
    click.echo("versions   " + ", ".join(f"{k} {v}" for k, v in manifest.versions.items()))
    if manifest.timings:
        click.echo("timings    " + ", ".join(f"{k} {v:.1f} s" for k, v in manifest.timings.items()))
    for fmt, report in manifest.check.items():
        worst_abs = max((o["max_abs"] for o in report["outputs"]), default=0.0)
        worst_rel = max((o["max_rel"] for o in report["outputs"]), default=0.0)
        verdict = "passed" if report["passed"] else "FAILED"
        click.echo(
            f"check      {fmt}: {verdict}, max abs {worst_abs:.2e}, max rel {worst_rel:.2e} over {len(report['shapes'])} shapes (rtol {report['rtol']:g}, atol {report['atol']:g})"
        )


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_check_reports(reports: dict[str, dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="parity against PyTorch eager")
    for column in ("engine", "output", "max abs", "max rel", "cosine", "SQNR dB", "NaN", "Inf", "result"):
        table.add_column(column, justify="right" if column not in ("engine", "output", "result") else "left")
    for engine, report in reports.items():
        rows = list(report["outputs"])
        if report.get("batch_invariance"):
            rows.append(report["batch_invariance"])
        for o in rows:
            sqnr = "inf" if o["sqnr_db"] is None else f"{o['sqnr_db']:.1f}"
            result = "pass" if o["passed"] else f"FAIL: {o['problem']}"
            table.add_row(
                engine,
                o["name"],
                f"{o['max_abs']:.2e}",
                f"{o['max_rel']:.2e}",
                f"{o['cosine']:.6f}",
                sqnr,
                str(o["nan"]),
                str(o["inf"]),
                result,
            )
    _console().print(table)
    tol = next(iter(reports.values()), None)
    if tol:
        click.echo(f"tolerance: rtol {tol['rtol']:g}, atol {tol['atol']:g} ({tol['precision']})")


# ------------------------------------------------------------------------- infer / check / bench
def engine_options(fn: Any) -> Any:
    fn = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)(fn)
    fn = click.option(
        "--provider",
        default=None,
        help="onnxruntime execution provider, e.g. CPUExecutionProvider (default: the best available).",
    )(fn)
    fn = click.option(
        "--threads", type=int, default=None, help="Threads for onnxruntime and torch (default: all cores)."
    )(fn)
    fn = click.option(
        "--mode",
        type=click.Choice(["default", "reduce-overhead", "max-autotune"]),
        default="default",
        show_default=True,
        help="torch.compile mode of the compile engine.",
    )(fn)
    fn = click.option("--cuda-graph", is_flag=True, help="Replay TensorRT calls through a CUDA graph.")(fn)
    fn = click.option("--allow-failed", is_flag=True, help="Open an artifact whose export-time check failed.")(fn)
    fn = click.option(
        "--trust-model-code",
        is_flag=True,
        help="Let eager/compile rebuild a user model (package.module:callable) named in the manifest: runs its code.",
    )(fn)
    return fn


def _engine_kwargs(
    name: str,
    provider: str | None,
    threads: int | None,
    mode: str,
    cuda_graph: bool,
    trust_model_code: bool = False,
    spinning: bool = True,
) -> dict[str, Any]:
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads: expected 1 or more, got {threads}")
        import torch

        torch.set_num_threads(threads)
    if name == "onnx":
        return {"provider": provider, "threads": threads, "spinning": spinning}
    if name == "compile":
        return {"mode": mode, "trust_model_code": trust_model_code}
    if name == "eager":
        return {"trust_model_code": trust_model_code}
    if name == "trt":
        return {"cuda_graph": cuda_graph}
    return {}


def _open(artifact: Path, name: str, device: str, allow_failed: bool, manifest: Any, **kw: Any) -> Any:
    from tk.runtime import load

    return load(
        artifact, name, device=device, allow_failed=allow_failed, manifest=manifest, **_engine_kwargs(name, **kw)
    )


def _engine_list(text: str, manifest: Any, device: str, *, include_baselines: bool) -> list[str]:
    from tk.runtime import ENGINES, available_engines

    if text in ("all", "auto"):
        names = available_engines(manifest, device)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in ENGINES]
        if unknown:
            raise UsageError(
                f"--engine: unknown {', '.join(unknown)}; expected names from {', '.join(ENGINES)}, or all"
            )
    if include_baselines:
        names = [b for b in ("eager", "compile") if b not in names] + names
    return names


@cli.command("infer")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--engine",
    "engine_name",
    type=click.Choice([*ENGINE_NAMES, "auto"]),
    default="onnx",
    show_default=True,
    help="Engine to run; auto picks the fastest one here whose parity passes.",
)
@click.option(
    "--inputs",
    "inputs_path",
    type=click.Path(path_type=Path),
    default=None,
    help=".npz (one array per input) or .npy (single-input models).",
)
@click.option(
    "--random", "random_samples", type=int, default=None, help="Make N valid random samples instead of reading a file."
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Where to write the outputs (.npz).")
@click.option(
    "--batch-size", type=int, default=None, help="Samples per engine call (default: the batch dimension's opt size)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random.")
@engine_options
def infer_cmd(
    artifact: Path,
    engine_name: str,
    inputs_path: Path | None,
    random_samples: int | None,
    out: Path,
    batch_size: int | None,
    seed: int,
    device: str,
    provider: str | None,
    threads: int | None,
    mode: str,
    cuda_graph: bool,
    allow_failed: bool,
    trust_model_code: bool,
) -> None:
    """Run an artifact over every sample of an input file, in batches, and save the outputs."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tk.manifest import verify_artifact
    from tk.runtime.batching import infer_file

    if (inputs_path is None) == (random_samples is None):
        raise UsageError("expected exactly one of --inputs FILE or --random N")
    if random_samples is not None and random_samples < 1:
        raise UsageError(f"--random: expected 1 or more samples, got {random_samples}")
    manifest = verify_artifact(artifact)
    opts = {
        "provider": provider,
        "threads": threads,
        "mode": mode,
        "cuda_graph": cuda_graph,
        "trust_model_code": trust_model_code,
    }
    if engine_name == "auto":
        from tk.runtime import available_engines
        from tk.runtime.auto import choose_engine

        batch_dim = manifest.signature.dims.get("batch")
        batch = batch_size or (batch_dim.opt if batch_dim else 1)
        choice = choose_engine(
            artifact,
            manifest,
            batch_size=batch,
            device=device,
            engine_options={n: _engine_kwargs(n, **opts) for n in available_engines(manifest, device)},
            allow_failed=allow_failed,
        )
        click.echo(f"auto: chose {choice.engine}, the {choice.reason}", err=True)
        engine_name = choice.engine
    with _open(artifact, engine_name, device, allow_failed, manifest, **opts) as engine:
        with Progress(
            TextColumn(f"infer {engine_name}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=_console(),
        ) as progress:
            task_id = progress.add_task("infer", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(task_id, completed=done, total=total)

            result = infer_file(
                engine,
                out,
                inputs=inputs_path,
                random=random_samples,
                batch_size=batch_size,
                seed=seed,
                progress=on_progress,
            )
    rate = result.samples / result.seconds if result.seconds else float("inf")
    click.echo(
        f"{result.samples} samples in {result.batches} batches, {result.seconds:.2f} s ({rate:.1f} samples/s) -> {result.out}"
    )
    for label, counts in (("inputs", result.nonfinite_inputs), ("outputs", result.nonfinite_outputs)):
        for name, count in counts.items():
            if count:
                click.echo(f"warning: {count} NaN/Inf values in {label[:-1]} {name!r}", err=True)


@cli.command("check")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--engine",
    "engine_text",
    default="all",
    show_default=True,
    help="Engine to compare with eager, or all that this machine can run.",
)
@click.option(
    "--inputs",
    "inputs_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Compare on this file's samples (.npz/.npy).",
)
@click.option(
    "--samples",
    type=int,
    default=None,
    help="Compare on N random samples (default: random inputs at min, opt, max and an odd size).",
)
@click.option("--batch-size", type=int, default=None, help="Samples per call with --inputs/--samples.")
@click.option("--rtol", type=float, default=None, help="Relative tolerance (default: the artifact's precision).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (default: the artifact's precision).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the reports as JSON.")
@engine_options
def check_cmd(
    artifact: Path,
    engine_text: str,
    inputs_path: Path | None,
    samples: int | None,
    batch_size: int | None,
    rtol: float | None,
    atol: float | None,
    seed: int,
    json_path: Path | None,
    device: str,
    provider: str | None,
    threads: int | None,
    mode: str,
    cuda_graph: bool,
    allow_failed: bool,
    trust_model_code: bool,
) -> None:
    """Compare an artifact's engines with the PyTorch model, output by output; exit 1 on a failure."""
    from tk.check import check_engines, reference_runs, report_from_outputs
    from tk.errors import ParityError
    from tk.export.check import shapes_to_check
    from tk.fileio import atomic_write_json
    from tk.manifest import verify_artifact
    from tk.runtime.batching import BatchRunner
    from tk.runtime.inputs import count_nonfinite, random_inputs, read_inputs
    from tk.tolerances import artifact_tolerance

    if inputs_path is not None and samples is not None:
        raise UsageError("expected at most one of --inputs FILE and --samples N")
    manifest = verify_artifact(artifact)
    names = [n for n in _engine_list(engine_text, manifest, device, include_baselines=False) if n != "eager"]
    if not names:
        raise UsageError(f"no engine to compare: the artifact holds {', '.join(e.role for e in manifest.files)}")
    rtol, atol, min_sqnr = artifact_tolerance(manifest.precision, manifest.model, rtol=rtol, atol=atol)
    opts = {
        "provider": provider,
        "threads": threads,
        "mode": mode,
        "cuda_graph": cuda_graph,
        "trust_model_code": trust_model_code,
    }
    reports = {}
    with _open(artifact, "eager", device, allow_failed, manifest, **opts) as reference:
        feeds = None
        if inputs_path is not None:
            feeds = read_inputs(inputs_path, reference.inputs)
        elif samples is not None:
            if samples < 1:
                raise UsageError(f"--samples: expected 1 or more, got {samples}")
            feeds = random_inputs(reference.inputs, reference.dims, samples, seed=seed)
        if feeds is not None:
            for name, count in count_nonfinite(feeds).items():
                if count:
                    click.echo(f"warning: {count} NaN/Inf values in input {name!r}", err=True)
            ref_out = BatchRunner(reference, batch_size).run(feeds)
        else:  # random inputs across the ranges; the reference runs once for every engine
            shapes = shapes_to_check(manifest.signature.dims)
            runs = reference_runs(reference, shapes, seed=seed)
        for name in names:
            with _open(artifact, name, device, allow_failed, manifest, **opts) as candidate:
                if feeds is None:
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
                else:
                    cand_out = BatchRunner(candidate, batch_size).run(feeds)
                    samples_run = int(next(iter(feeds.values())).shape[0])
                    report = report_from_outputs(
                        name,
                        ref_out,
                        cand_out,
                        precision=manifest.precision,
                        rtol=rtol,
                        atol=atol,
                        min_sqnr_db=min_sqnr,
                        shapes=[{"samples": samples_run}],
                    )
            reports[name] = report.to_json()
    _print_check_reports(reports)
    if json_path:
        atomic_write_json(json_path, reports)
    failed = [name for name, r in reports.items() if not r["passed"]]
    if failed:
        raise ParityError(f"parity failed for {', '.join(failed)} (rtol {rtol:g}, atol {atol:g})")
    click.echo(f"parity passed for {', '.join(reports)}")


@cli.command("bench")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--engine",
    "engine_text",
    default="all",
    show_default=True,
    help="Comma-separated engines, all, or auto (all whose parity passes, and which one auto picks); eager and compile are always added as baselines.",
)
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--seconds", type=float, default=None, help="Time budget per engine and batch size (default 2 s).")
@click.option("--iters", type=int, default=None, help="Timed calls per engine and batch size (instead of --seconds).")
@click.option(
    "--seq", type=int, default=None, help="Sequence length for models with a seq dimension (default: its opt)."
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the results and the machine's description as JSON.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Write a PNG of latency and throughput against batch size.",
)
@engine_options
def bench_cmd(
    artifact: Path,
    engine_text: str,
    batch_sizes: str,
    seconds: float | None,
    iters: int | None,
    seq: int | None,
    json_path: Path | None,
    plot_path: Path | None,
    device: str,
    provider: str | None,
    threads: int | None,
    mode: str,
    cuda_graph: bool,
    allow_failed: bool,
    trust_model_code: bool,
) -> None:
    """Measure every engine side by side (interleaved) at several batch sizes."""
    from contextlib import ExitStack

    from tk.bench import measure, render_table, save_json, save_plot
    from tk.manifest import verify_artifact

    try:
        sizes_list = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise UsageError(
            f"--batch-sizes: expected comma-separated integers such as 1,8,32, got {batch_sizes!r}"
        ) from None
    if not sizes_list or min(sizes_list) < 1:
        raise UsageError(f"--batch-sizes: expected positive integers, got {batch_sizes!r}")
    if seconds is not None and iters is not None:
        raise UsageError("expected at most one of --seconds and --iters")
    manifest = verify_artifact(artifact)
    names = _engine_list(engine_text, manifest, device, include_baselines=True)
    other_sizes = {"seq": seq} if seq is not None else None
    opts = {
        "provider": provider,
        "threads": threads,
        "mode": mode,
        "cuda_graph": cuda_graph,
        "trust_model_code": trust_model_code,
        # spinning onnxruntime threads would keep the 2 cores from the engine timed next: off when interleaving
        "spinning": len(names) == 1,
    }
    choices = []
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(_open(artifact, name, device, allow_failed, manifest, **opts)) for name in names
        }
        candidates = None
        if engine_text == "auto":  # only engines whose parity passes compete
            from tk.runtime.auto import check_candidates, default_shape

            shape = default_shape(
                manifest, manifest.signature.dims["batch"].opt if "batch" in manifest.signature.dims else 1, other_sizes
            )
            candidates = check_candidates(engines["eager"], engines, manifest, shape)
            engines = {c.engine: engines[c.engine] for c in candidates if c.passed}
        report = measure(
            engines,
            sizes_list,
            seconds=seconds,
            iters=iters,
            sizes=other_sizes,
            progress=lambda line: click.echo(line, err=True),
        )
        report.settings["engines"] = {name: engine.settings() for name, engine in engines.items()}
    _console().print(render_table(report))
    if candidates is not None:
        from tk.runtime.auto import pick

        for batch in sorted({row.batch_size for row in report.rows}):
            choice = pick(candidates, report.rows, batch)
            choices.append(choice.to_json())
            click.echo(f"auto at batch {batch}: {choice.reason}")
        report.settings["auto"] = choices
    if json_path:
        save_json(report, json_path)
        click.echo(f"json: {json_path}")
    if plot_path:
        save_plot(report, plot_path)
        click.echo(f"plot: {plot_path}")


def main() -> None:
    cli(obj={})


if __name__ == "__main__":
    main()
