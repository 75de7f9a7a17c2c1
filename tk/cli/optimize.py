"""``tk optimize``: the fastest artifact that keeps the user's accuracy, chosen and proven here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tk.cli.common import build, console, model_options, path_option, task_option
from tk.errors import ParityError, UsageError
from tk.registries import DEVICES

if TYPE_CHECKING:
    from tk.workflows.optimize.table import Row


def _split(flag: str, text: str | None) -> tuple[str, ...] | None:
    """``--flag a,b`` -> ("a", "b"); not given -> None (every one). Given empty, it is refused: it would
    otherwise read as every one."""
    if text is None:
        return None
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts:
        raise UsageError(f"{flag}: expected comma-separated names, got {text!r}")
    return parts


def _size_or_range(name: str, text: str | None) -> tuple[int | None, Any]:
    """``--batch 32`` (time at 32; the model's range widened to hold it) or ``--batch 1:32:64`` (time at the opt)."""
    from tk.spec import Dim

    if text is None:
        return None, None
    if ":" in text:
        dim = Dim.parse(name, text)
        return dim.opt, dim
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--{name}: expected a size N (1 or more) or MIN:OPT:MAX, got {text!r}")
    return int(text), None


def _dims_and_sizes(batch: str | None, seq: str | None, dims: tuple[str, ...]) -> tuple[dict, dict]:
    from tk.cli.artifact import _parse_dims

    ranges = _parse_dims(None, None, dims)
    sizes: dict[str, int] = {}
    for name, text in (("batch", batch), ("seq", seq)):
        size, dim = _size_or_range(name, text)
        if size is not None:
            sizes[name] = size
        if dim is not None:
            ranges[name] = dim
    return ranges, sizes


@click.command("optimize")
@click.argument("model")
@model_options
@task_option
@path_option("--checkpoint", help="Weights from `tk train`.")
@click.option("--accuracy", default=None, metavar="SPEC",
              help="What must hold against the float32 model, comma-separated: sqnr>=DB, cosine>=X, top1>=PCT, "
              "max_abs<=X (default sqnr>=35).")  # fmt: skip
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Your samples: half calibrates int8, half judges (held out, and cut or padded to each shape of "
              "the range). .npz/.npy like tk infer --inputs (a 'labels' "
              "array makes top1 an accuracy), or for hf:DIR models texts its tokenizer reads (.txt, one per line; "
              ".jsonl with \"text\" and an optional \"label\"). Default: synthetic token ids and padding masks of mixed "
              "lengths.")  # fmt: skip
@click.option("--batch", default=None, metavar="N|MIN:OPT:MAX", help="Batch to time at (N, or a range timed at OPT).")
@click.option("--seq", default=None, metavar="N|MIN:OPT:MAX", help="Sequence length to time at (N, or a range).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=MIN:OPT:MAX", help="Range of any other dimension.")
@click.option("--time-budget", type=float, default=None, metavar="MIN",
              help="Start no new candidate after this many minutes (the rest: skipped, budget).")  # fmt: skip
@click.option("--keep", type=click.Choice(["best", "all"]), default="best", show_default=True,
              help="all: also the other passing candidates' artifacts, under OUT/candidates.")  # fmt: skip
@click.option("--formats", default=None, metavar="F[,F...]", help="Only these formats (default: every one).")
@click.option("--precisions", default=None, metavar="P[,P...]", help="Only these precisions: fp32,bf16,fp16,int8.")
@click.option("--candidates", "names", default=None, metavar="NAME[,NAME...]",
              help='Only these candidates, by the names the table shows (e.g. "onnx fp32,onnx int8 dynamic").')  # fmt: skip
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True)
@click.option("--seconds", type=float, default=2.0, show_default=True, help="Timing budget per candidate, seconds.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where candidate artifacts are cached for re-runs (default: OUT/.candidates).")  # fmt: skip
@click.option("--wait-quiet", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="Before timing, wait up to this long for the load average to drop to the core count; rows timed "
              "above it are marked busy either way.")  # fmt: skip
@click.option("--no-peaks", is_flag=True, help="Skip measuring the matmul peaks (no share-of-peak column).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Artifact directory for the winner.")
@click.option("--force", is_flag=True, help="Replace an --out artifact that also holds other files, deleting them "
              "(a directory that is not a tk artifact is never replaced).")  # fmt: skip
def optimize_cmd(model: str, size: str | None, inputs: tuple[str, ...], task: str | None, checkpoint: Path | None,
                 accuracy: str | None, data: Path | None, batch: str | None, seq: str | None, dims: tuple[str, ...],
                 time_budget: float | None, keep: str, formats: str | None, precisions: str | None, names: str | None,
                 device: str,
                 seconds: float, cache_dir: Path | None, wait_quiet: float, no_peaks: bool, out: Path,
                 force: bool) -> None:  # fmt: skip
    """Find the fastest artifact of MODEL on this machine that keeps --accuracy, and write it to --out."""
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize import OptimizeOptions, optimize

    if accuracy is not None and not accuracy.strip():
        raise UsageError(
            f"--accuracy: expected a spec such as sqnr>=35 (or no --accuracy for that default), got {accuracy!r}"
        )
    if accuracy is None or not accuracy.strip().startswith("agreement"):  # agreement>=X: a decoder's, checked later
        parse_accuracy(accuracy)  # a bad spec fails before the model is built
    if time_budget is not None and not (math.isfinite(time_budget) and time_budget > 0):
        raise UsageError(f"--time-budget: expected a finite number of minutes above 0, got {time_budget}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"--seconds: expected a finite number of seconds above 0, got {seconds}")
    spec = build(model, size, inputs, task)
    if spec.generation:
        dropped = {"--data": data is not None, "--batch": batch is not None, "--seq": seq is not None,
                   "--dim": bool(dims), "--time-budget": time_budget is not None, "--keep": keep != "best",
                   "--candidates": names is not None, "--device": device != "cpu", "--seconds": seconds != 2.0,
                   "--cache-dir": cache_dir is not None, "--wait-quiet": wait_quiet > 0, "--no-peaks": no_peaks}  # fmt: skip
        if any(dropped.values()):
            raise UsageError(
                f"{', '.join(f for f, on in dropped.items() if on)}: not taken by a decoder's optimize (it takes "
                "--checkpoint, --accuracy agreement>=X, --formats, --precisions, --out and --force)"
            )
        _optimize_decoder(spec, out, accuracy, checkpoint, formats, precisions, force)
        return
    ranges, sizes = _dims_and_sizes(batch, seq, dims)
    options = OptimizeOptions(
        accuracy=accuracy, data=data, sizes=sizes, dims=ranges, checkpoint=checkpoint, device=device,
        formats=_split("--formats", formats), precisions=_split("--precisions", precisions),
        candidates=_split("--candidates", names),
        time_budget_min=time_budget, keep=keep,
        cache_dir=cache_dir, seconds=seconds, peaks=not no_peaks, wait_quiet_s=wait_quiet, force=force,
    )  # fmt: skip
    try:
        result = _run_with_progress(spec, out, options, optimize)
    except ParityError as exc:
        if hasattr(exc, "result"):
            _print(exc.result)
        raise
    _print(result)
    _print_winner(result.winner, out)


def _print_winner(win: Row, out: Path) -> None:
    """The winner, with the engine settings it was timed at, and where its artifact, table and plot are."""
    busy = " (timed on a busy machine: the ratio is not this machine's)" if win.busy else ""
    settings = "".join(f", {k} {v}" for k, v in win.engine_options.items())
    click.echo(
        f"winner: {win.candidate} (engine {win.engine}{settings}), {win.p50_ms:.3g} ms, "
        f"{win.speedup:.2f}× eager fp32{busy}"
    )
    click.echo(f"artifact: {out} (tk.runtime.load({str(out)!r}) and --engine auto open {win.engine}{settings})")
    plot = out / "optimize.png"
    click.echo(
        f"table: {out / 'optimize.json'}  "
        + (f"plot: {plot}" if plot.is_file() else "plot: none (needs matplotlib: pip install 'tk[plot]')")
    )


def _optimize_decoder(spec: Any, out: Path, accuracy: str | None, checkpoint: Path | None, formats: str | None,
                      precisions: str | None, force: bool) -> None:  # fmt: skip
    """A decoder: candidates judged by greedy-token agreement and timed decoding (``tk.workflows.optimize.decoder``)."""
    from tk.workflows.optimize.decoder import DecoderOptimizeOptions, optimize_decoder, render_decoder

    options = DecoderOptimizeOptions(
        accuracy=accuracy, checkpoint=checkpoint, formats=_split("--formats", formats),
        precisions=_split("--precisions", precisions), force=force,
    )  # fmt: skip
    try:
        result = optimize_decoder(spec, out, options, lambda line: click.echo(line, err=True))
    except ParityError as exc:
        if hasattr(exc, "result"):
            console().print(render_decoder(exc.result))
        raise
    console().print(render_decoder(result))
    win = result.winner
    click.echo(
        f"winner: {win.candidate}, {win.decode_ms:.3g} ms a token at batch 1 ({win.speedup or 1:.2f}x float32), "
        f"greedy agreement {win.agreement:.1%}"
    )
    click.echo(f"artifact: {out} (table: {out / 'optimize.json'})")


def _run_with_progress(spec: Any, out: Path, options: Any, optimize: Any) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("optimize", total=1)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage[:60], completed=done, total=max(total, 1))

        return optimize(spec, out, options, progress)


def _print(result: Any) -> None:
    from tk.workflows.optimize.table import render

    record = result.record
    cpu = (record.get("timing") or {}).get("machine", {}).get("cpu", "this CPU")
    batch = ", ".join(f"{k} {v}" for k, v in record["sizes"].items())
    source = "synthetic" if record["data"] == "synthetic" else f"{Path(record['data']).name}'s"
    title = (
        f"tk optimize: {record['accuracy']} on {record['held_out_samples']} {source} held-out samples; "
        f"timed at {batch} on {cpu}"
    )
    console().print(render(result.rows, title))
    if record["data"] == "synthetic":
        click.echo(
            "judged on synthetic inputs, which may not behave like yours: --data FILE judges on your own samples "
            "(for hf:DIR models, a .txt of texts; for a built-in model, tk train --samples FILE writes its task's)"
        )
    cache = record["cache"]
    click.echo(f"cache: {cache['hits']} candidate artifacts reused, {cache['exports']} exported ({cache['dir']})")


COMMANDS = (optimize_cmd,)
