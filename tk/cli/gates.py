"""The CI gates of ``tk check`` and ``tk bench``: --save-baseline, --baseline, --margin, --max-slowdown, --any-cpu,
--allow-missing, --junit.

``check_gates`` and ``bench_gates`` add the flags to a command and hand it one object
(``gates``) instead; with ``--baseline`` they first put the baseline's recipe (seed, samples,
input files; batch sizes and sizes for bench) in place of the options the user did not set, and
refuse the ones that contradict it. After the run, ``gates.finish(...)`` prints the before/after
table, writes the baseline and the JUnit file, and fails (exit 1) on a regression. A run given
``--junit`` always ends with that file written: where it stops before ``finish`` wrote it (any
error once the options are parsed), the file holds one error case saying why.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from tk.cli.common import console, path_option, refuse_writes_into


def _given(name: str) -> bool:
    """Whether the user set the option ``name`` (on the command line or through the environment)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


# check's option names -> a recipe's fields
CHECK_RECIPE = {
    "seed": "seed",
    "samples": "samples",
    "batch_size": "batch_size",
    "reference": "reference",
    "inputs_path": "inputs",
    "golden_path": "golden",
}


@dataclass
class CheckGates:
    save_baseline: Path | None = None
    baseline: Path | None = None
    margins: Any = None  # Margins, parsed from --margin before the check runs
    junit: Path | None = None
    recipe: dict[str, Any] = field(default_factory=dict)  # the check's options that make its inputs
    loaded: Any = None  # the AccuracyBaseline read from ``baseline``
    allow_missing: bool = False  # a baseline row this run could not run is skipped, not failed
    junit_written: bool = False

    def finish(self, result: Any) -> None:
        """Judge ``result`` (a ``CheckResult``) against the baseline, write the files, raise on a failure."""
        from tk.errors import UsageError
        from tk.workflows.baseline import render_gate
        from tk.workflows.baseline_accuracy import accuracy_baseline, accuracy_gate, recipe_of, save_accuracy_baseline
        from tk.workflows.junit import write_junit

        gate = accuracy_gate(result, self.loaded, self.margins, allow_missing=self.allow_missing)
        if self.loaded is not None:
            console().print(render_gate(gate, f"accuracy against the baseline {self.baseline}"))
        if self.junit is not None:
            write_junit(self.junit, "tk.check", gate.verdicts)
            self.junit_written = True
            click.echo(f"junit: {self.junit}")
        if self.save_baseline is not None:
            if result.passed and gate.passed:
                shapes = next(iter(result.reports.values())).shapes if result.reports else []
                recipe = recipe_of(**self.recipe, shapes=shapes)
                first = next(iter(result.reports.values()), None)
                artifact = {"precision": first.precision if first else None}
                save_accuracy_baseline(self.save_baseline, accuracy_baseline(result, recipe, artifact))
                click.echo(f"baseline: {self.save_baseline}")
            else:
                what = "the check" if not result.passed else "the comparison with --baseline"
                click.echo(f"baseline not saved to {self.save_baseline}: {what} failed", err=True)
        result.raise_if_failed()
        if gate.unmatched is not None:
            raise UsageError(gate.unmatched)
        gate.raise_if_failed()
        if self.loaded is not None:
            judged = sum(v.limit is not None and v.status == "pass" for v in gate.verdicts)
            click.echo(f"baseline: {judged} figures within their margins")


def check_gates(fn: Any) -> Any:
    """Add the check's gate flags; the command gets ``gates: CheckGates`` and, with --baseline, its recipe's options."""

    @functools.wraps(fn)
    def wrapper(
        *,
        save_baseline_path: Path | None,
        baseline_path: Path | None,
        margins: tuple[str, ...],
        allow_missing: bool,
        junit_path: Path | None,
        **kwargs: Any,
    ) -> Any:
        from tk.workflows.baseline_accuracy import parse_margins

        gates = CheckGates(save_baseline_path, baseline_path, junit=junit_path, allow_missing=allow_missing)
        with _junit_on_error(gates, "tk.check", kwargs.get("artifact")):
            _refuse_without_baseline(baseline_path, margin=bool(margins), allow_missing=allow_missing)
            gates.margins = parse_margins(margins)
            if baseline_path is not None:
                from tk.workflows.baseline_accuracy import load_accuracy_baseline, resolve_recipe

                gates.loaded = load_accuracy_baseline(baseline_path)
                given = {f: kwargs[name] for name, f in CHECK_RECIPE.items() if name in kwargs and _given(name)}
                resolved = resolve_recipe(gates.loaded.recipe, given)
                kwargs.update({name: resolved[f] for name, f in CHECK_RECIPE.items() if name in kwargs})
            gates.recipe = {f: kwargs.get(name) for name, f in CHECK_RECIPE.items() if name in kwargs}
            return fn(gates=gates, **kwargs)

    options = [
        path_option(
            "--save-baseline",
            "save_baseline_path",
            help="Record each engine's accuracy figures per output and the inputs' recipe here (JSON), for --baseline.",
        ),
        path_option(
            "--baseline",
            "baseline_path",
            help="Recompute the figures on the recipe of this baseline file and fail (exit 1) where one falls below it by more than its --margin.",
        ),
        click.option(
            "--margin",
            "margins",
            multiple=True,
            metavar="FIGURE=VALUE",
            help="How far a figure may fall below the baseline (repeatable). Defaults: max_abs=1.5 "
            "(× the baseline, plus its atol; max_abs=F:ATOL sets both), sqnr=1 (dB), cosine=1e-4, top1=0.5 (points).",
        ),
        ALLOW_MISSING,
        path_option(
            "--junit",
            "junit_path",
            help="Write one JUnit test case per engine × output × figure here (XML); a run that fails before "
            "comparing writes one error case.",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


@dataclass
class BenchGates:
    save_baseline: Path | None = None
    baseline: Path | None = None
    max_slowdown: float | None = None
    any_cpu: bool = False
    junit: Path | None = None
    loaded: Any = None  # the SpeedBaseline read from ``baseline``
    allow_missing: bool = False  # a baseline row this run did not measure is skipped, not failed
    junit_written: bool = False

    def finish(self, report: Any) -> None:
        """Judge ``report`` (a ``BenchReport``) against the baseline, write the files, raise on a slowdown."""
        from tk.errors import UsageError
        from tk.workflows.baseline import render_gate
        from tk.workflows.baseline_speed import (
            DEFAULT_MAX_SLOWDOWN_PCT,
            save_speed_baseline,
            speed_baseline,
            speed_gate,
        )
        from tk.workflows.junit import write_junit

        gate = speed_gate(
            report,
            self.loaded,
            max_slowdown_pct=DEFAULT_MAX_SLOWDOWN_PCT if self.max_slowdown is None else self.max_slowdown,
            any_cpu=self.any_cpu,
            allow_missing=self.allow_missing,
        )
        if self.loaded is not None:
            console().print(render_gate(gate, f"speed-up over eager against the baseline {self.baseline}"))
        else:
            for note in gate.notes:
                click.echo(note, err=True)
        if self.junit is not None:
            write_junit(self.junit, "tk.bench", gate.verdicts)
            self.junit_written = True
            click.echo(f"junit: {self.junit}")
        if self.save_baseline is not None and not gate.passed:
            click.echo(f"baseline not saved to {self.save_baseline}: the comparison with --baseline failed", err=True)
        elif self.save_baseline is not None:
            busy = [n for n in gate.notes if n.startswith("busy machine")]
            if busy:
                click.echo(f"warning: recording a baseline on a {busy[0]}", err=True)
            save_speed_baseline(self.save_baseline, speed_baseline(report))
            click.echo(f"baseline: {self.save_baseline}")
        if gate.unmatched is not None:
            raise UsageError(gate.unmatched)
        gate.raise_if_failed()


def bench_gates(fn: Any) -> Any:
    """Add the bench's gate flags; the command gets ``gates: BenchGates`` and, with --baseline, its batch sizes and sizes."""

    @functools.wraps(fn)
    def wrapper(
        *,
        save_baseline_path: Path | None,
        baseline_path: Path | None,
        max_slowdown: float | None,
        any_cpu: bool,
        allow_missing: bool,
        junit_path: Path | None,
        **kwargs: Any,
    ) -> Any:
        gates = BenchGates(
            save_baseline_path, baseline_path, max_slowdown, any_cpu, junit_path, allow_missing=allow_missing
        )
        with _junit_on_error(gates, "tk.bench", kwargs.get("artifact")):
            _refuse_without_baseline(
                baseline_path, max_slowdown=max_slowdown is not None, any_cpu=any_cpu, allow_missing=allow_missing
            )
            if baseline_path is not None:  # everything the gate would refuse, refused before any timing
                gates.loaded = _speed_baseline_for(baseline_path, max_slowdown, any_cpu, kwargs)
            return fn(gates=gates, **kwargs)

    options = [
        path_option(
            "--save-baseline",
            "save_baseline_path",
            help="Record each engine's speed-up over eager (same run) per batch size and this CPU here (JSON), for --baseline.",
        ),
        path_option(
            "--baseline",
            "baseline_path",
            help="Compare the speed-ups with this baseline file's (its batch sizes and sizes unless given); "
            "fail (exit 1) on a slowdown beyond --max-slowdown. A busy machine is reported, not judged.",
        ),
        click.option(
            "--max-slowdown",
            type=float,
            default=None,
            metavar="PCT",
            help="How much lower than the baseline's a speed-up may be, in percent (default 10).",
        ),
        click.option("--any-cpu", is_flag=True, help="Accept a baseline measured on another CPU."),
        ALLOW_MISSING,
        path_option(
            "--junit",
            "junit_path",
            help="Write one JUnit test case per engine × batch size here (XML); a run that fails before comparing "
            "writes one error case.",
        ),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def _speed_baseline_for(path: Path, max_slowdown: float | None, any_cpu: bool, kwargs: dict[str, Any]) -> Any:
    """The speed baseline at ``path``, refused (one line) where the run could not be compared with it; its
    batch sizes, ``--seq`` and ``--io`` put in ``kwargs`` where the user left them out."""
    from tk.errors import UsageError
    from tk.measure.hardware import machine_description
    from tk.workflows.baseline_speed import check_max_slowdown, load_speed_baseline, refuse_other_cpu

    if max_slowdown is not None:
        check_max_slowdown(max_slowdown)
    loaded = load_speed_baseline(path)
    refuse_other_cpu(loaded, machine_description(), any_cpu=any_cpu)
    settings = loaded.settings
    if "batch_sizes" in kwargs and not _given("batch_sizes") and settings.get("batch_sizes"):
        kwargs["batch_sizes"] = ",".join(str(b) for b in settings["batch_sizes"])
    recorded = {"seq": (settings.get("sizes") or {}).get("seq"), "io": settings.get("io")}
    for name, value in recorded.items():
        if name not in kwargs or value is None:
            continue
        if _given(name) and kwargs[name] != value:
            raise UsageError(
                f"--baseline: measured with --{name} {value}, this run asks for --{name} {kwargs[name]}: "
                "not comparable; drop the option or record a new baseline"
            )
        kwargs[name] = value
    return loaded


ALLOW_MISSING = click.option(
    "--allow-missing",
    is_flag=True,
    help="With --baseline: skip, instead of failing, what the baseline holds and this run did not run "
    "(an engine left out as untrusted or unavailable, an output, a batch size).",
)


def _refuse_without_baseline(baseline: Path | None, **flags: bool) -> None:
    """One line for a flag that only applies to ``--baseline`` given without it."""
    from tk.errors import UsageError

    given = ["--" + name.replace("_", "-") for name, value in flags.items() if value]
    if baseline is None and given:
        verb = "applies" if len(given) == 1 else "apply"
        raise UsageError(f"{' and '.join(given)} {verb} to --baseline FILE, and no --baseline was given")


@contextlib.contextmanager
def _junit_on_error(gates: CheckGates | BenchGates, suite: str, artifact: Path | None) -> Iterator[None]:
    """With ``--junit``: a run that stops before its gate wrote the file (a damaged baseline, an artifact
    that does not load, an interrupt) leaves one error case there, never an earlier run's passing file."""
    if gates.junit is None:
        yield
        return
    if artifact is not None:
        refuse_writes_into(artifact, junit=gates.junit)  # before anything: the error case must not land there
    try:
        yield
    except (Exception, KeyboardInterrupt) as exc:
        if not gates.junit_written:
            _write_error_case(gates.junit, suite, exc)
        raise


def _write_error_case(path: Path, suite: str, exc: BaseException) -> None:
    from tk.errors import TkError, first_line
    from tk.workflows.junit import write_junit_error

    if isinstance(exc, TkError):
        message = str(exc)
    elif isinstance(exc, KeyboardInterrupt):
        message = "interrupted"
    else:  # a bug in tk: the traceback follows on stderr
        message = f"{type(exc).__name__}: {first_line(exc)}"
    with contextlib.suppress(OSError):  # a --junit path that cannot be written: the run's own error is the news
        write_junit_error(path, suite, message)
