"""``tk models`` and ``tk train``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tk.cli.common import SEED, build, console, model_options, option_group, path_option
from tk.errors import UsageError, first_line
from tk.registries import DEVICES


@click.command("models")
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
    console().print(table)


# ----------------------------------------------------------------------------------------- train
def _compile_options(mode: str, dynamic: bool | None, fullgraph: bool, backend: str) -> Any:
    """``tk train``'s torch.compile flags as one ``CompileOptions`` (imported only when a command runs)."""
    from tk.models.train import CompileOptions

    return CompileOptions(mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)


@click.command("train")
@click.argument("model")
@model_options
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: the task's, e.g. 300).")
@click.option("--batch-size", type=int, default=None, help="Samples per step (default: the task's).")
@click.option("--lr", type=float, default=None, help="Learning rate (default: the task's).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for weights and data.")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--compile", "use_compile", is_flag=True, help="Train under torch.compile.")
@option_group(
    "compile_options",
    _compile_options,
    click.option(
        "--mode",
        type=click.Choice(["default", "reduce-overhead", "max-autotune"]),
        default="default",
        show_default=True,
    ),
    click.option("--dynamic/--no-dynamic", default=None, help="torch.compile dynamic shapes (default: torch decides)."),
    click.option("--fullgraph", is_flag=True, help="Fail on any graph break instead of splitting the graph."),
    click.option("--backend", default="inductor", show_default=True, help="torch.compile backend."),
)
@click.option("--compare", is_flag=True, help="Train eager and compiled from the same start and compare speed.")
@path_option("--out", help="Checkpoint path (default: runs/MODEL-SIZE.safetensors).")
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the results as JSON."
)
@click.option(
    "--samples", "samples_path", type=click.Path(path_type=Path), default=None,
    help="Also write held-out samples of the task (.npz, with labels for a classifier) for tk optimize --data.",
)  # fmt: skip
@click.option("--samples-count", type=int, default=64, show_default=True, help="How many --samples to write.")
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
    compile_options: Any,
    compare: bool,
    out: Path | None,
    json_path: Path | None,
    samples_path: Path | None,
    samples_count: int,
) -> None:
    """Train MODEL on its synthetic task and save a safetensors checkpoint."""
    if use_compile or compare:
        _require_compile_backend(compile_options.backend)
    kwargs = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "device": device}
    if compare:
        if out is not None or samples_path is not None:
            option = "--out" if out is not None else "--samples"
            raise UsageError(
                f"{option}: --compare trains two copies to compare their speed and saves no checkpoint; drop one"
            )
        _train_compare(model, size, inputs, compile_options, kwargs, json_path)
        return
    spec = build(model, size, inputs, seed=seed)
    out = out or Path("runs") / f"{spec.name}-{spec.size}.safetensors"
    _refuse_artifact_parent(out)
    samples = None
    if samples_path is not None:  # before training: a bad count or a model without a task fails at once
        from tk.models.train import task_samples

        _refuse_artifact_parent(samples_path, "--samples")
        samples = task_samples(spec, samples_count, seed=seed)
    result = _train_with_progress(spec, kwargs, compile_options if use_compile else None)
    _save_training(spec, result, out, json_path, samples_path, samples)


def _require_compile_backend(backend: str) -> None:
    import torch

    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise UsageError(
            "--backend: expected a torch.compile backend such as inductor, eager or aot_eager "
            f"(torch.compiler.list_backends()), got {backend!r}"
        )


def _save_training(
    spec: Any, result: Any, out: Path, json_path: Path | None, samples_path: Path | None, samples: Any
) -> None:
    """The checkpoint with its JSON sidecar (the model, the training's summary, the library versions), the
    held-out samples, and the same JSON at ``json_path``."""
    from tk.fileio import atomic_write_json
    from tk.models.checkpoint import save_checkpoint
    from tk.versions import library_versions

    meta = {**spec.reference(), "train": result.summary(), "versions": library_versions()}
    save_checkpoint(spec.module, out, meta)
    _print_train([result])
    click.echo(f"checkpoint: {out} (+ {out.name}.json)")
    if samples is not None and samples_path is not None:
        from tk.runtime.batching import save_npz

        save_npz(samples_path, samples)
        count = next(iter(samples.values())).shape[0]
        click.echo(f"samples: {samples_path} ({count} held-out samples of the task: tk optimize --data {samples_path})")
    if json_path:
        atomic_write_json(json_path, meta)


def _refuse_artifact_parent(out: Path, option: str = "--out") -> None:
    """A checkpoint is never written into a tk artifact (its files are hashed: the artifact would break).
    An artifact is a directory whose ``manifest.json`` is tk's (other tools name files so too)."""
    for parent in out.resolve().parents:
        if _is_tk_manifest(parent / "manifest.json"):
            raise UsageError(f"{option}: expected a path outside a tk artifact, got {out} (inside {parent})")


def _is_tk_manifest(path: Path) -> bool:
    try:
        if not path.is_file() or path.stat().st_size > 64 * 2**20:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "format_version" in data and "checksum" in data and "files" in data


class _ProgressBar:
    """A rich progress bar for one training run; entering it gives the ``on_step`` callback."""

    def __init__(self, spec: Any, kwargs: dict[str, Any], compiled: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.total = kwargs["steps"] or (spec.task.steps if spec.task else 1)
        self.progress = Progress(
            TextColumn(f"train {spec.name} ({'compiled' if compiled else 'eager'})"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.1f} steps/s"),
            TimeElapsedColumn(),
            console=console(),
            transient=False,
        )

    def __enter__(self) -> Callable[[int, float], None]:
        self.progress.__enter__()
        task_id = self.progress.add_task("train", total=self.total, loss=float("nan"), rate=0.0)
        start = time.perf_counter()

        def on_step(step: int, loss: float) -> None:
            elapsed = time.perf_counter() - start
            self.progress.update(task_id, completed=step, loss=loss, rate=step / elapsed if elapsed else 0.0)

        return on_step

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)


def _train_with_progress(spec: Any, kwargs: dict[str, Any], options: Any) -> Any:
    from tk.models.train import train

    bar = _ProgressBar(spec, kwargs, options is not None)
    on_step = bar.__enter__()
    try:
        return train(spec, compile_options=options, on_step=on_step, **kwargs)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator says so in a RuntimeError
        if isinstance(exc, MemoryError) or "allocate" in str(exc):
            size = kwargs.get("batch_size") or "the task's default"
            raise UsageError(
                f"--batch-size {size}: a training batch needs more memory than this machine gives ({first_line(exc)})"
            ) from exc
        raise
    finally:
        bar.__exit__(None, None, None)


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
    console().print(table)
    for r in results:
        for reason in r.graph_break_reasons:
            click.echo(f"graph break: {reason}")


def _train_compare(
    model: str, size: str | None, inputs: tuple[str, ...], options: Any, kwargs: dict[str, Any], json_path: Path | None
) -> None:
    from tk.fileio import atomic_write_json
    from tk.models.train import compare_training

    bars: list[_ProgressBar] = []

    def on_start(spec: Any, compiled: bool) -> Callable[[int, float], None]:
        if bars:
            bars[-1].__exit__()  # one live display at a time
        bars.append(_ProgressBar(spec, kwargs, compiled))
        return bars[-1].__enter__()

    try:
        comparison = compare_training(
            lambda: build(model, size, inputs, seed=kwargs["seed"]), options, on_start=on_start, **kwargs
        )
    finally:
        if bars:
            bars[-1].__exit__()
    _print_train([comparison.eager, comparison.compiled])
    click.echo(
        f"compiled over eager after warm-up: {comparison.speedup:.2f}x steps/s "
        f"(compile and first step took {comparison.compiled.first_step_s:.1f} s)"
    )
    if json_path:
        atomic_write_json(json_path, comparison.to_json())


COMMANDS = (models_cmd, train_cmd)
