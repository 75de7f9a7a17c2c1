"""``tk debug locate`` and ``tk debug precision``: where an engine diverges, and what to keep in float32."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from tk.cli.common import SEED, console, path_option, public_key_option, trust_options, trust_policy
from tk.text import printable, table_cell

# both commands rebuild the float32 model (their reference) from the manifest
TRUST_MODEL_CODE = click.option(
    "--trust-model-code", is_flag=True, help="Rebuild a user model (package.module:callable): runs its code."
)


@click.group("debug")
def debug_group() -> None:
    """When parity fails: find the module where it starts, and the modules to keep in float32."""


def _num(x: float | None, fmt: str = ".2e") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def _abs(value: float, nonfinite: int) -> str:
    return "NaN/Inf" if nonfinite else _num(value)  # the finite part's error would hide the NaN


@debug_group.command("locate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--engine", default="onnx", show_default=True, help="The engine whose graph is read: torch, aoti or onnx."
)  # checked by tk.workflows.debug.locate.READERS, which imports torch: not at the command line's import
@path_option("--inputs", "inputs_path", help="Inputs file (.npz/.npy; .txt/.jsonl texts for hf:DIR).")
@click.option("--samples", type=int, default=None, help="N random samples (default: one batch at the opt sizes).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--rtol", type=float, default=None, help="Relative tolerance (default: the artifact's precision).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (default: the artifact's precision).")
@click.option("--top", type=int, default=10, show_default=True, help="Rows of the table of largest error growth.")
@path_option("--json", "json_path", help="Write every module's row.")
@TRUST_MODEL_CODE
@trust_options
def locate_cmd(
    artifact: Path,
    engine: str,
    inputs_path: Path | None,
    samples: int | None,
    seed: int,
    rtol: float | None,
    atol: float | None,
    top: int,
    json_path: Path | None,
    trust_model_code: bool,
) -> None:
    """Compare ENGINE's intermediate values with the float32 model's, module by module."""
    from tk.fileio import atomic_write_json
    from tk.workflows.debug.locate import locate

    result = locate(
        artifact,
        engine,
        inputs=inputs_path,
        samples=samples,
        seed=seed,
        rtol=rtol,
        atol=atol,
        trust_model_code=trust_model_code,
        trust=trust_policy(),
    )
    click.echo(f"locate {engine} ({result.precision}) via {result.via}")
    for note in result.notes:
        click.echo(printable(f"note: {note}"))
    first = result.first
    if first is None:
        click.echo(f"every compared module ({len(result.rows)}) is within rtol {result.rtol:g}, atol {result.atol:g}")
    else:
        click.echo(
            printable(
                f"first divergence: {first.module} ({first.kind}), module {first.order + 1} of {len(result.rows)} "
                f"in execution order: max abs {_abs(first.max_abs, first.nonfinite)}, max rel {_num(first.max_rel)}, "
                f"{first.nonfinite} NaN/Inf"
            )
        )
    console().print(_growth_table(result, top))
    for out in result.engine_outputs:
        verdict = "pass" if out.passed else f"FAIL: {out.problem}"
        click.echo(
            printable(f"engine {engine} output {out.name}: max abs {_abs(out.max_abs, out.nan + out.inf)}, {verdict}")
        )
    if json_path:
        atomic_write_json(json_path, result.to_json())
        click.echo(f"json: {json_path}")


def _growth_table(result: Any, top: int) -> Any:
    """The ``top`` modules of a ``locate`` result where the error grows most, for people (rich)."""
    from rich.table import Table

    table = Table(title=f"modules where the error grows most (rtol {result.rtol:g}, atol {result.atol:g})")
    for column in ("#", "module", "type", "max abs", "max rel", "SQNR dB", "NaN/Inf", "growth", "result"):
        table.add_column(column, justify="left" if column in ("module", "type", "result") else "right")
    for row in result.worst_growth(top):
        table.add_row(
            str(row.order + 1),
            table_cell(row.module),  # names from the model or the artifact's graph
            table_cell(row.kind),
            _abs(row.max_abs, row.nonfinite),
            _num(row.max_rel),
            _num(row.sqnr_db, ".1f"),
            str(row.nonfinite),
            _num(row.growth, ".3g") + ("x" if math.isfinite(row.growth) else ""),
            "pass" if row.passed else "FAIL",
        )
    return table


@debug_group.command("precision")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--seed", type=SEED, default=0, show_default=True)
@path_option("--json", "json_path", help="Write the search as JSON.")
@TRUST_MODEL_CODE
@public_key_option
def precision_cmd(artifact: Path, seed: int, json_path: Path | None, trust_model_code: bool) -> None:
    """Find a small set of modules that, kept in float32, make an fp16/bf16/int8 artifact's check pass."""
    from tk.fileio import atomic_write_json
    from tk.workflows.debug.precision import find_fp32_modules

    result = find_fp32_modules(artifact, seed=seed, trust_model_code=trust_model_code, trust=trust_policy())

    def line(label: str, trial: object) -> str:
        t = trial  # a Trial
        sqnr = "-" if t.sqnr_db is None else f"{t.sqnr_db:.1f} dB"  # type: ignore[attr-defined]
        verdict = "pass" if t.passed else "FAIL"  # type: ignore[attr-defined]
        return f"{label:<7} max abs {_num(t.max_abs)}, SQNR {sqnr}, {t.nonfinite} NaN/Inf: {verdict}"  # type: ignore[attr-defined]

    click.echo(f"judged by {result.judged_by}")
    click.echo(line("before", result.before))
    if not result.keep:
        click.echo("the check already passes: nothing to keep in float32")
    else:
        click.echo(
            f"keep in float32: {', '.join(result.keep)} ({len(result.keep)} of {result.candidates} modules, "
            f"{result.trials} trials, {result.seconds:.1f} s)"
        )
        click.echo(line("after", result.after))
        click.echo(f"apply it: {result.command}")
    if json_path:
        atomic_write_json(json_path, result.to_json())
        click.echo(f"json: {json_path}")


COMMANDS = (debug_group,)
