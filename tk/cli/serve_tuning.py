"""``tk serve --config FILE`` (a settings file) and ``tk serve --tune`` (a bounded load test that writes one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from tk.limits import MAX_THREADS, MAX_TUNE_REQUESTS

_TUNING_OPTIONS = [  # --config and the --tune flags, in their --help order
    click.option(
        "--config",
        "config_file",
        type=click.Path(path_type=Path, dir_okay=False),
        default=None,
        help="Start from this JSON settings file (what --tune writes); flags given on the command line win.",
    ),
    click.option("--tune", is_flag=True, help="Load-test a grid of settings on loopback, write the best, and exit."),
    click.option("--p99-ms", type=float, default=100.0, show_default=True, help="--tune: p99 latency budget, in ms."),
    click.option(
        "--tune-batch", default="1,8,32", show_default=True, help="--tune: max batch sizes to try (comma list)."
    ),
    click.option(
        "--tune-delay-ms",
        default="0,5",
        show_default=True,
        help="--tune: batch delays to try, in ms (comma list; a max batch of 1 is tried at the smallest only).",
    ),
    click.option(
        "--tune-replicas",
        default=None,
        help="--tune: replica counts to try (comma list; default 1 up to the CPUs at --cpus-per-replica).",
    ),
    click.option(
        "--tune-requests",
        type=click.IntRange(1, MAX_TUNE_REQUESTS),
        default=200,
        show_default=True,
        help=f"--tune: requests per point (at most {MAX_TUNE_REQUESTS}; their memory counts against --max-memory).",
    ),
    click.option(
        "--tune-clients",
        type=click.IntRange(1, MAX_THREADS),
        default=16,
        show_default=True,
        help="--tune: concurrent clients (threads).",
    ),
    click.option(
        "--tune-samples",
        default="1",
        show_default=True,
        help="--tune: samples per request, N or A-B (each request's count drawn from A to B): the sizes your "
        "clients send. Above 1, a max batch of 1 is the point with batching off.",
    ),
    click.option(
        "--tune-seq",
        default=None,
        metavar="N|A-B",
        help="--tune: tokens per sample, N or A-B (each request's length drawn from A to B; default the "
        "artifact's opt). Requests of different lengths never share an engine call.",
    ),
    click.option(
        "--tune-budget-s",
        type=float,
        default=300.0,
        show_default=True,
        help="--tune: no point starts after this many seconds (the rest are reported skipped).",
    ),
    click.option(
        "--tune-out",
        type=click.Path(path_type=Path, dir_okay=False),
        default=Path("tk-serve.json"),
        show_default=True,
        help="--tune: where to write the recommended settings (read back with --config).",
    ),
]


def tuning_options(command: Any) -> Any:
    """``--config`` and the ``--tune`` flags of ``tk serve``."""
    for option in reversed(_TUNING_OPTIONS):
        command = option(command)
    return command


# settings-file keys whose flag has another name
_FLAG_OF = {"request_timeout_s": "request_timeout", "engine_threads": "threads"}


def with_settings(config: Any, path: Path | None) -> Any:
    """``config`` with a settings file's values wherever the command line left the default."""
    from click.core import ParameterSource

    from tk.serve.config import apply_settings, read_settings

    if path is None:
        return config
    context = click.get_current_context()
    given = {
        key: value
        for key, value in read_settings(path).items()
        if context.get_parameter_source(_FLAG_OF.get(key, key)) in (ParameterSource.DEFAULT, None)
    }
    return apply_settings(config, given)


def _numbers(flag: str, text: str, kind: type) -> list[Any]:
    from tk.errors import UsageError

    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected a comma list of numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: expected at least one value, got {text!r}")
    return values


def tune_command(
    config: Any,
    *,
    p99_ms: float,
    tune_batch: str,
    tune_delay_ms: str,
    tune_replicas: str | None,
    tune_requests: int,
    tune_clients: int,
    tune_samples: str,
    tune_seq: str | None,
    tune_budget_s: float,
    tune_out: Path,
) -> None:
    import os

    from rich.console import Console

    from tk.serve.config import write_settings
    from tk.serve.load.tune import TuneGrid, parse_range, recommended_settings, tune

    cpus = os.cpu_count() or 1
    replicas = (
        _numbers("--tune-replicas", tune_replicas, int)
        if tune_replicas
        else list(range(1, max(1, int(cpus // _share(config.cpus_per_replica))) + 1))
    )
    samples = parse_range("--tune-samples", tune_samples)
    seq = parse_range("--tune-seq", tune_seq) if tune_seq is not None else None
    grid = TuneGrid(
        _numbers("--tune-batch", tune_batch, int), _numbers("--tune-delay-ms", tune_delay_ms, float), replicas
    )

    result = tune(
        config,
        grid,
        p99_ms=p99_ms,
        requests=tune_requests,
        clients=tune_clients,
        samples=samples,
        seq=seq,
        budget_s=tune_budget_s,
        cpus=cpus,
        on_point=_say_point,
    )
    Console(width=140).print(_points_table(result, f"{tune_clients} clients, {_traffic(samples, seq)}", p99_ms))
    settings = recommended_settings(result, config)
    write_settings(tune_out, settings)
    verdict = "" if result.within_budget else f" (no point met p99 <= {p99_ms:g} ms: lowest p99 chosen)"
    click.echo(
        f"recommended: {', '.join(f'{k} {v}' for k, v in settings.items())}{verdict}; wrote {tune_out} "
        f"(tk serve ARTIFACT --config {tune_out})"
    )


def _say_point(point: Any) -> None:
    """One line on stderr per grid point, as the tune measures it."""
    click.echo(
        f"replicas {point.replicas} x {point.engine_threads or 'default'} threads, "
        + (f"max batch {point.max_batch}, delay {point.max_delay_ms:g} ms: " if point.batching else "batching off: ")
        + f"{point.samples_per_s:.1f} samples/s, p99 {point.p99_ms:.1f} ms, {point.failed} failed",
        err=True,
    )


def _points_table(result: Any, load: str, p99_ms: float) -> Any:
    """The tune's points for people (rich), the best marked; ``load``: the clients and traffic, in words."""
    from rich.table import Table

    table = Table(title=f"tk serve --tune: {load}, p99 budget {p99_ms:g} ms")
    columns = ("replicas", "threads", "max batch", "delay ms", "requests", "failed", "samples/s", "p50 ms", "p99 ms")
    for column in (*columns, "fits"):
        table.add_column(column, justify="right")
    for p in result.points:
        batch, delay = (str(p.max_batch), f"{p.max_delay_ms:g}") if p.batching else ("off", "-")
        if p.skipped is not None:
            table.add_row(
                str(p.replicas),
                str(p.engine_threads or "-"),
                batch,
                delay,
                "-",
                "-",
                "-",
                "-",
                "-",
                f"skipped: {p.skipped}",
            )
            continue
        mark = ("yes" if p.fits else "no") + (" <- best" if p is result.best else "")
        table.add_row(
            str(p.replicas), str(p.engine_threads or "-"), batch, delay, str(p.requests),
            str(p.failed),
            f"{p.samples_per_s:.1f}", f"{p.p50_ms:.1f}", f"{p.p99_ms:.1f}", mark,
        )  # fmt: skip
    return table


def _traffic(samples: tuple[int, int], seq: tuple[int, int] | None) -> str:
    """What the tune sent, in words: "requests of 1-4 samples, 16-128 tokens"."""

    def span(bounds: tuple[int, int]) -> str:
        return f"{bounds[0]}-{bounds[1]}" if bounds[0] < bounds[1] else str(bounds[0])

    words = "single-sample requests" if samples == (1, 1) else f"requests of {span(samples)} samples"
    return words + (f", {span(seq)} tokens" if seq is not None else "")


def _share(cpus_per_replica: float) -> float:
    """The CPUs a replica is counted at when ``--tune-replicas`` is not given: its share, or a whole CPU
    where it asks for none (replicas of no CPUs would otherwise fit without end)."""
    return cpus_per_replica if cpus_per_replica > 0 else 1.0
