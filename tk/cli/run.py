"""``tk infer``, ``tk check`` and ``tk bench``: run an artifact's engines, compare them, time them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tk.cli.common import (
    SEED,
    RegistryChoice,
    console,
    engine_choice,
    path_option,
    print_check_reports,
    refuse_writes_into,
)
from tk.cli.gates import BenchGates, CheckGates, bench_gates, check_gates
from tk.errors import UsageError
from tk.registries import ENGINES
from tk.text import printable

if TYPE_CHECKING:
    from tk.runtime.choice import EngineChoice


@click.command("infer")
@click.argument("artifact", type=click.Path(path_type=Path))
@path_option(
    "--inputs",
    "inputs_path",
    help=".npz (one array per input), .npy (single-input models), or for hf:DIR artifacts a .txt/.jsonl of texts.",
)
@click.option(
    "--random", "random_samples", type=int, default=None, help="Make N valid random samples instead of reading a file."
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Where to write the outputs (.npz).")
@click.option(
    "--batch-size", type=int, default=None, help="Samples per engine call (default: the batch dimension's opt size)."
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of --random.")
@click.option("--ray", "use_ray", is_flag=True, help="Run a directory of shards on Ray Data; --out is a directory.")
@click.option("--address", default=None, help="With --ray: join this Ray cluster (default: a local Ray instance).")
@click.option("--actors", type=int, default=2, show_default=True, help="With --ray: actors, each with one engine.")
@engine_choice(
    choices=RegistryChoice(ENGINES, ("auto",)),
    help="Engine to run; auto picks the fastest one here whose parity passes.",
)
def infer_cmd(
    artifact: Path,
    inputs_path: Path | None,
    random_samples: int | None,
    out: Path,
    batch_size: int | None,
    seed: int,
    use_ray: bool,
    address: str | None,
    actors: int,
    choice: EngineChoice,
) -> None:
    """Run an artifact over every sample of an input file, in batches, and save the outputs.

    With --ray, --inputs is a directory of shards (.npz, .npy, .parquet) and --out a directory
    that gets one .npz per shard.
    """
    refuse_writes_into(artifact, out=out)
    if use_ray:
        _infer_ray(artifact, choice, inputs_path, out, batch_size, address, actors)
        return
    if address is not None:
        raise UsageError("--address applies to --ray")
    result = _infer_here(artifact, choice, out, inputs_path, random_samples, batch_size, seed)
    rate = result.samples / result.seconds if result.seconds else float("inf")
    click.echo(
        f"{result.samples} samples in {result.batches} batches, {result.seconds:.2f} s ({rate:.1f} samples/s) -> {result.out}"
    )
    for label_text, counts in (("input", result.nonfinite_inputs), ("output", result.nonfinite_outputs)):
        for name, count in counts.items():
            if count:
                click.echo(f"warning: {count} NaN/Inf values in {label_text} {name!r}", err=True)


def _infer_here(
    artifact: Path,
    choice: EngineChoice,
    out: Path,
    inputs_path: Path | None,
    random_samples: int | None,
    batch_size: int | None,
    seed: int,
) -> Any:
    """``infer_artifact`` in this process, with a progress bar that names the engine (``auto``'s pick once made)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tk.workflows.infer import infer_artifact

    label = {"name": choice.name}

    def on_choice(choice: Any) -> None:
        click.echo(f"auto: chose {choice.engine}, the {choice.reason}", err=True)
        label["name"] = choice.engine

    progress = Progress(
        TextColumn("infer {task.fields[engine]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(),
    )
    task_id = None

    def on_progress(done: int, total: int) -> None:
        nonlocal task_id
        if task_id is None:
            progress.start()
            task_id = progress.add_task("infer", total=total, engine=label["name"])
        progress.update(task_id, completed=done, total=total)

    try:
        return infer_artifact(
            artifact,
            choice,
            out,
            inputs=inputs_path,
            random=random_samples,
            batch_size=batch_size,
            seed=seed,
            on_choice=on_choice,
            progress=on_progress,
        )
    finally:
        progress.stop()


def _infer_ray(
    artifact: Path,
    choice: EngineChoice,
    inputs_path: Path | None,
    out: Path,
    batch_size: int | None,
    address: str | None,
    actors: int,
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tk.serve.data import infer_ray

    if inputs_path is None:
        raise UsageError("--ray: expected --inputs DIR, a directory of shards")
    progress = Progress(
        TextColumn(f"infer --ray {choice.name} shards"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(),
    )
    task_id = progress.add_task("shards", total=None)
    with progress:
        result = infer_ray(
            artifact,
            choice,
            inputs_path,
            out,
            actors=actors,
            batch_size=batch_size,
            address=address,
            progress=lambda done, total: progress.update(task_id, completed=done, total=total),
        )
    click.echo(
        f"{result.samples} samples in {result.shards} shards on {actors} actor(s), {result.wall_seconds:.2f} s "
        f"({result.samples / result.wall_seconds:.1f} samples/s) -> {result.out}"
    )


@click.command("check")
@click.argument("artifact", type=click.Path(path_type=Path))
@path_option(
    "--inputs", "inputs_path", help="Compare on this file's samples (.npz/.npy; .txt/.jsonl texts for hf:DIR)."
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
@click.option("--seed", type=SEED, default=0, show_default=True)
@path_option("--json", "json_path", help="Write the reports as JSON.")
@click.option(
    "--reference",
    default="eager",
    show_default=True,
    type=RegistryChoice(ENGINES),
    help="Engine the others are compared with (eager: the PyTorch model).",
)
@path_option(
    "--golden",
    "golden_path",
    help="Compare with this golden file's inputs and outputs instead (the model is not rebuilt).",
)
@path_option(
    "--save-golden",
    "save_golden_path",
    help="Save the inputs, the reference's outputs and the tolerances here (.npz with JSON meta).",
)
@click.option("--tol", "tols", multiple=True, metavar="NAME=RTOL:ATOL", help="Tolerance of one output (repeatable).")
@check_gates
@engine_choice(
    default="all",
    help="Engine to compare with eager, all that this machine can run, or auto (the one tk optimize recommended, "
    "else all).",
)
def check_cmd(
    artifact: Path,
    inputs_path: Path | None,
    samples: int | None,
    batch_size: int | None,
    rtol: float | None,
    atol: float | None,
    seed: int,
    json_path: Path | None,
    reference: str,
    golden_path: Path | None,
    save_golden_path: Path | None,
    tols: tuple[str, ...],
    choice: EngineChoice,
    gates: CheckGates,
) -> None:
    """Compare an artifact's engines with the PyTorch model (or --reference, --golden), output by output; exit 1 on a failure."""
    refuse_writes_into(
        artifact, json=json_path, save_golden=save_golden_path, save_baseline=gates.save_baseline, junit=gates.junit
    )
    from tk.fileio import atomic_write_json
    from tk.workflows.check import check_artifact
    from tk.workflows.golden import parse_tolerances

    result = check_artifact(
        artifact,
        choice,
        inputs=inputs_path,
        samples=samples,
        batch_size=batch_size,
        rtol=rtol,
        atol=atol,
        seed=seed,
        reference=reference,
        golden=golden_path,
        save_golden=save_golden_path,
        tolerances=parse_tolerances(tols),
    )
    reports = _print_check_result(result)
    if save_golden_path:
        click.echo(f"golden: {save_golden_path}")
    if json_path:
        atomic_write_json(json_path, reports)
    gates.finish(result)
    click.echo(f"parity passed for {', '.join(result.reports)}")


def _print_check_result(result: Any) -> dict[str, Any]:
    """A ``CheckResult``'s warnings and notes (stderr), its reports' table and top-1 agreements; the reports as JSON."""
    for name, count in result.nonfinite_inputs.items():
        if count:
            click.echo(f"warning: {count} NaN/Inf values in input {name!r}", err=True)
    if result.exported_on_samples:
        click.echo(
            f"note: the export check of {', '.join(result.exported_on_samples)} ran your samples across the shape "
            "range (tk optimize --data, tk export --check-inputs); this check runs random inputs, which can judge "
            "differently: --inputs FILE compares on yours",
            err=True,
        )
    reports = result.to_json()
    against = next(iter(result.reports.values())).reference
    print_check_reports(reports, title=f"parity against {'PyTorch eager' if against == 'eager' else against}")
    for engine, report in result.reports.items():
        for out in report.outputs:
            if out.top1_rate is not None:
                click.echo(
                    printable(f"top-1 agreement {engine} {out.name}: {out.top1_rate:.1%} of {out.top1_total} samples")
                )
    for engine, generated in result.generation.items():
        click.echo(f"generation {engine}: {'passed' if generated.passed else 'FAILED'}, {generated.summary()}")
    if result.generation:
        reports = {**reports, "generation": {e: g.to_json() for e, g in result.generation.items()}}
    return reports


@click.command("bench")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--batch-sizes", default=None, help="Comma-separated batch sizes (default 1,8,32; decoders 1,4).")
@click.option("--seconds", type=float, default=None, help="Time budget per engine and batch size (default 2 s).")
@click.option("--iters", type=int, default=None, help="Timed calls per engine and batch size (instead of --seconds).")
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed calls per engine and batch size.")
@click.option(
    "--baselines/--no-baselines",
    default=True,
    show_default=True,
    help="Add eager and compile beside the engines asked for.",
)
@click.option(
    "--io",
    type=click.Choice(["host", "device"]),
    default="host",
    show_default=True,
    help="host: inputs start in (pinned) host memory and outputs are copied back, copies timed; "
    "device: inputs already on the engine's device and outputs stay there (like trtexec --noDataTransfers).",
)
@click.option(
    "--seq", type=int, default=None, help="Sequence length for models with a seq dimension (default: its opt)."
)
@click.option("--prompt-len", type=int, default=None, help="Decoders: prompt tokens (default: the seq opt size).")
@click.option("--new-tokens", type=int, default=None, help="Decoders: tokens generated per round (default 32).")
@click.option("--compiled-rival", is_flag=True, help="Decoders from hf:DIR: also time transformers' generate with its "
              "static cache under torch.compile (compiled in the warm-up, which takes minutes on a CPU).")  # fmt: skip
@path_option("--json", "json_path", help="Write the results and the machine's description as JSON.")
@path_option("--plot", "plot_path", help="Write a PNG of latency and throughput against batch size.")
@click.option(
    "--roofline",
    is_flag=True,
    help="Measure this machine's matrix-product rate at the model's linear shapes (the artifact's precision) "
    "between the engines' calls, and show each engine's share of its median.",
)
@click.option(
    "--wait-quiet",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Wait up to this long before each batch size for the 1-minute load average to drop to the core count; "
    "rows timed above it are marked busy either way.",
)
@bench_gates
@engine_choice(
    default="all",
    help="Comma-separated engines, all, or auto (all whose parity passes, and which one auto picks); eager and compile are always added as baselines.",
)
def bench_cmd(
    artifact: Path,
    batch_sizes: str | None,
    seconds: float | None,
    iters: int | None,
    warmup: int,
    baselines: bool,
    io: str,
    seq: int | None,
    prompt_len: int | None,
    new_tokens: int | None,
    compiled_rival: bool,
    json_path: Path | None,
    plot_path: Path | None,
    roofline: bool,
    wait_quiet: float,
    choice: EngineChoice,
    gates: BenchGates,
) -> None:
    """Measure every engine side by side (interleaved) at several batch sizes.

    A decoder is timed generating (--prompt-len, --new-tokens, --iters rounds): time to first token, tokens/s."""
    refuse_writes_into(artifact, json=json_path, plot=plot_path, save_baseline=gates.save_baseline, junit=gates.junit)
    from tk.manifest import verify_artifact
    from tk.workflows.artifact_bench import bench_artifact, parse_batch_sizes
    from tk.workflows.bench import render_table, save_json, save_plot

    decoder = bool(verify_artifact(artifact).generation)
    given = _given_flags(seconds, seq, plot_path, roofline, wait_quiet, io, baselines, gates, prompt_len, new_tokens,
                         compiled_rival)  # fmt: skip
    _refuse_flags_of_the_other_kind(decoder, given)
    if decoder:
        _bench_decoder(artifact, choice, batch_sizes, prompt_len, new_tokens or 32, iters, warmup, json_path,
                       compiled_rival)  # fmt: skip
        return
    report, choices = bench_artifact(
        artifact,
        choice,
        batch_sizes=parse_batch_sizes(batch_sizes or "1,8,32"),
        seconds=seconds,
        iters=iters,
        warmup=warmup,
        io=io,
        baselines=baselines,
        sizes={"seq": seq} if seq is not None else None,
        progress=lambda line: click.echo(line, err=True),
        roofline=roofline,
        wait_quiet=wait_quiet,
    )
    console().print(render_table(report))
    for choice in choices:
        click.echo(f"auto at batch {choice.batch_size}: {choice.reason}")
    if json_path:
        save_json(report, json_path)
        click.echo(f"json: {json_path}")
    if plot_path:
        save_plot(report, plot_path)
        click.echo(f"plot: {plot_path}")
    gates.finish(report)


def _given_flags(seconds: float | None, seq: int | None, plot_path: Path | None, roofline: bool, wait_quiet: float,
                 io: str, baselines: bool, gates: BenchGates, prompt_len: int | None, new_tokens: int | None,
                 compiled_rival: bool) -> dict[str, bool]:  # fmt: skip
    """Which of the flags only one kind of benchmark takes were given."""
    return {"--seconds": seconds is not None, "--seq": seq is not None, "--plot": plot_path is not None,
            "--roofline": roofline, "--wait-quiet": wait_quiet > 0, "--io device": io != "host",
            "--no-baselines": not baselines, "--save-baseline": gates.save_baseline is not None,
            "--baseline": gates.baseline is not None, "--junit": gates.junit is not None,
            "--prompt-len": prompt_len is not None, "--new-tokens": new_tokens is not None,
            "--compiled-rival": compiled_rival}  # fmt: skip


DECODER_FLAGS = ("--prompt-len", "--new-tokens", "--compiled-rival")  # what only the generation benchmark takes


def _refuse_flags_of_the_other_kind(decoder: bool, given: dict[str, bool]) -> None:
    """One line for flags ``tk bench`` would drop: a decoder's generation benchmark takes no call-timing flags
    or gates, and the call benchmark no generation flags (a dropped ``--junit`` is a gate that does not gate)."""
    if decoder:
        wrong = [flag for flag, on in given.items() if on and flag not in DECODER_FLAGS]
        if wrong:
            raise UsageError(f"{', '.join(wrong)}: not taken by a decoder's generation benchmark (--batch-sizes, "
                             "--prompt-len, --new-tokens, --compiled-rival, --iters, --warmup, --engine and --json "
                             "are)")  # fmt: skip
    elif any(given[flag] for flag in DECODER_FLAGS):
        raise UsageError(
            "--prompt-len, --new-tokens and --compiled-rival apply to a decoder artifact; this one has one entry point"
        )


def _bench_decoder(
    artifact: Path,
    choice: EngineChoice,
    batch_sizes: str | None,
    prompt_len: int | None,
    new_tokens: int,
    iters: int | None,
    warmup: int,
    json_path: Path | None,
    compiled_rival: bool = False,
) -> None:
    """``tk bench`` of a decoder artifact: ``tk.workflows.generation_bench``'s table, and its JSON envelope."""
    from tk.measure.results import BenchRun
    from tk.workflows.artifact_bench import parse_batch_sizes
    from tk.workflows.generation_bench import bench_generation, render_generation

    run = BenchRun("tk bench generation")
    report = bench_generation(
        artifact,
        choice,
        batch_sizes=parse_batch_sizes(batch_sizes or "1,4"),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        rounds=iters or 5,
        warmup=min(warmup, 1),
        compiled_rival=compiled_rival,
        progress=lambda line: click.echo(line, err=True),
    )
    console().print(render_generation(report))
    if json_path:
        run.settings = report.settings
        run.write(report.to_json(), path=json_path)
        click.echo(f"json: {json_path}")


COMMANDS = (infer_cmd, check_cmd, bench_cmd)
