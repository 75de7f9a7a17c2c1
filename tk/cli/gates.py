"""The CI gates of ``tk check`` and ``tk bench``: --save-baseline, --baseline, --margin, --max-slowdown, --any-cpu, --junit.

``check_gates`` and ``bench_gates`` add the flags to a command and hand it one object
(``gates``) instead; with ``--baseline`` they first put the baseline's recipe (seed, samples,
input files; batch sizes and sizes for bench) in place of the options the user did not set, and
refuse the ones that contradict it. After the run, ``gates.finish(...)`` prints the before/after
table, writes the baseline and the JUnit file, and fails (exit 1) on a regression.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from tk.cli.common import console, path_option


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

    def finish(self, result: Any) -> None:
        """Judge ``result`` (a ``CheckResult``) against the baseline, write the files, raise on a failure."""
        from tk.errors import UsageError
        from tk.workflows.baseline import (
            accuracy_baseline,
            accuracy_gate,
            recipe_of,
            render_gate,
            save_accuracy_baseline,
        )
        from tk.workflows.junit import write_junit

        gate = accuracy_gate(result, self.loaded, self.margins)
        if self.loaded is not None:
            console().print(render_gate(gate, f"accuracy against the baseline {self.baseline}"))
        if self.junit is not None:
            write_junit(self.junit, "tk.check", gate.verdicts)
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
        junit_path: Path | None,
        **kwargs: Any,
    ) -> Any:
        from tk.errors import UsageError
        from tk.workflows.baseline import parse_margins

        if margins and baseline_path is None:
            raise UsageError("--margin applies to --baseline FILE")
        gates = CheckGates(save_baseline_path, baseline_path, parse_margins(margins), junit_path)
        if baseline_path is not None:
            from tk.workflows.baseline import load_accuracy_baseline, resolve_recipe

            gates.loaded = load_accuracy_baseline(baseline_path)
            given = {field_: kwargs[name] for name, field_ in CHECK_RECIPE.items() if name in kwargs and _given(name)}
            resolved = resolve_recipe(gates.loaded.recipe, given)
            kwargs.update({name: resolved[field_] for name, field_ in CHECK_RECIPE.items() if name in kwargs})
        gates.recipe = {field_: kwargs.get(name) for name, field_ in CHECK_RECIPE.items() if name in kwargs}
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
        path_option("--junit", "junit_path", help="Write one JUnit test case per engine × output × figure here (XML)."),
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

    def finish(self, report: Any) -> None:
        """Judge ``report`` (a ``BenchReport``) against the baseline, write the files, raise on a slowdown."""
        from tk.errors import UsageError
        from tk.workflows.baseline import (
            DEFAULT_MAX_SLOWDOWN_PCT,
            render_gate,
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
        )
        if self.loaded is not None:
            console().print(render_gate(gate, f"speed-up over eager against the baseline {self.baseline}"))
        else:
            for note in gate.notes:
                click.echo(note, err=True)
        if self.junit is not None:
            write_junit(self.junit, "tk.bench", gate.verdicts)
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
        junit_path: Path | None,
        **kwargs: Any,
    ) -> Any:
        from tk.errors import UsageError

        gates = BenchGates(save_baseline_path, baseline_path, max_slowdown, any_cpu, junit_path)
        if baseline_path is None and (max_slowdown is not None or any_cpu):
            raise UsageError("--max-slowdown and --any-cpu apply to --baseline FILE")
        if baseline_path is not None:  # everything the gate would refuse, refused before any timing
            from tk.workflows.baseline import check_max_slowdown, load_speed_baseline, refuse_other_cpu
            from tk.workflows.hardware import machine_description

            if max_slowdown is not None:
                check_max_slowdown(max_slowdown)
            gates.loaded = load_speed_baseline(baseline_path)
            refuse_other_cpu(gates.loaded, machine_description(), any_cpu=any_cpu)
            settings = gates.loaded.settings
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
        path_option("--junit", "junit_path", help="Write one JUnit test case per engine × batch size here (XML)."),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper
