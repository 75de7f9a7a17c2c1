"""What several commands share: the console, model and engine options, the parity table."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from tk.errors import UsageError
from tk.limits import MAX_THREADS
from tk.registries import DEVICES, HF_TASKS


def console() -> Any:
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=140)  # pipes and CI logs get whole rows


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


def option_group(name: str, make: Callable[..., Any], *options: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A decorator that adds ``options`` to a command and hands it ``name=make(**their values)`` in their place,
    so that a command with many flags takes one object; the options keep their order in ``--help``."""

    def probe() -> None:  # decorated only to learn the options' parameter names
        pass

    learnt: Any = probe
    for option in options:
        learnt = option(learnt)
    names = [param.name for param in learnt.__click_params__]

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            values = {key: kwargs.pop(key) for key in names}
            return fn(**kwargs, **{name: make(**values)})

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


SEED = click.IntRange(0, 2**32 - 1)  # what numpy's and torch's generators take from every caller


def path_option(*decls: str, help: str) -> Any:
    """An optional file or directory option (``--json``, ``--golden``...): a ``Path``, default ``None``."""
    return click.option(*decls, type=click.Path(path_type=Path), default=None, help=help)


def refuse_writes_into(artifact: Path, **outputs: Path | None) -> None:
    """Refuse (one line) an output path inside the artifact a command reads: ``--json ART/manifest.json``
    or ``--save-golden ART/weights.safetensors`` replaced the artifact's own files and broke it. Keyword
    names are the flags (``save_golden`` for ``--save-golden``)."""
    root = artifact.resolve()
    for name, path in outputs.items():
        if path is None:
            continue
        where = path.resolve()
        if where == root or root in where.parents:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: expected a path outside the artifact {artifact}, got {path}")


def task_option(fn: Any) -> Any:
    return click.option(
        "--task",
        type=click.Choice(HF_TASKS),
        default=None,
        help="Task of an hf:DIR model (default: feature-extraction).",
    )(fn)


def build(
    name: str,
    size: str | None,
    inputs: tuple[str, ...],
    task: str | None = None,
    seed: int = 0,
    cache_len: int | None = None,
) -> Any:
    from tk.models import build_model

    return build_model(name, size=size, input_descriptions=inputs, task=task, seed=seed, cache_len=cache_len)


def size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_check_reports(reports: dict[str, dict[str, Any]], title: str = "parity against PyTorch eager") -> None:
    from rich.table import Table

    from tk.text import printable, table_cell

    table = Table(title=title)
    floors = any(o.get("floor_ratio") is not None for r in reports.values() for o in _report_rows(r))
    columns = ("engine", "output", "max abs", "max rel", "cosine", "SQNR dB", *(["x floor"] if floors else []),
               "NaN", "Inf", "result")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right" if column not in ("engine", "output", "result") else "left")
    for engine, report in reports.items():
        for o in _report_rows(report):
            sqnr = "inf" if o["sqnr_db"] is None else f"{o['sqnr_db']:.1f}"
            result = "pass" if o["passed"] else f"FAIL: {o['problem']}"
            ratio = o.get("floor_ratio")
            floor = [f"{ratio:.1f}" if isinstance(ratio, (int, float)) else "-"] if floors else []
            table.add_row(table_cell(engine), table_cell(o["name"]), f"{o['max_abs']:.2e}", f"{o['max_rel']:.2e}",
                          f"{o['cosine']:.6f}", sqnr, *floor, str(o["nan"]), str(o["inf"]), table_cell(result))  # fmt: skip
    console().print(table)
    tol = next(iter(reports.values()), None)
    if tol:
        click.echo(f"tolerance: rtol {tol['rtol']:g}, atol {tol['atol']:g} ({tol['precision']})")
        for name, (rtol, atol) in tol.get("tolerances", {}).items():
            click.echo(printable(f"tolerance of {name}: rtol {rtol:g}, atol {atol:g}"))
    skipped = {
        o["name"]: o["padding_skipped"] for r in reports.values() for o in r["outputs"] if o.get("padding_skipped")
    }
    if skipped:
        counts = ", ".join(f"{n} of {name}" for name, n in skipped.items())
        click.echo(printable(f"not compared: the values at padding positions (attention mask 0): {counts}"))


def _report_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's output rows, its batch-invariance probe last."""
    return [*report["outputs"], *([report["batch_invariance"]] if report.get("batch_invariance") else [])]


class RegistryChoice(click.Choice):
    """A ``click.Choice`` of a registry's names (``tk.registries``) read when a command parses, not at import:
    a format or an engine registered later (a plugin, a test's throwaway format) is a choice too."""

    def __init__(self, registry: Mapping[str, Any], extra: Sequence[str] = ()) -> None:
        self.registry, self.extra = registry, tuple(extra)
        super().__init__(list(self.choices))

    @property  # type: ignore[override]
    def choices(self) -> list[str]:
        return [*self.registry, *self.extra]

    @choices.setter
    def choices(self, _: Any) -> None:  # click.Choice.__init__ assigns it: the registry is the source
        pass


def engine_choice(
    *, default: str = "onnx", choices: Sequence[str] | click.Choice | None = None, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--engine`` and every engine flag, handed to the command as one ``choice: EngineChoice``.

    ``choices``: the engine names the command takes (``None``: free text, such as all or onnx,torch).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            from tk.runtime.choice import EngineChoice  # torch: only once a command runs

            values = {key: kwargs.pop(key) for key in ENGINE_FLAGS}
            choice = EngineChoice(
                name=kwargs.pop("engine"),
                device=kwargs.pop("device"),
                allow_failed=kwargs.pop("allow_failed"),
                options={key: None if value is False and key in SWITCHES else value for key, value in values.items()},
                trust=trust_policy(),
            )
            return fn(*args, choice=choice, **kwargs)

        engine = click.option(
            "--engine",
            type=choices if isinstance(choices, click.Choice) or choices is None else click.Choice(list(choices)),
            default=default,
            show_default=True,
            help=help,
        )
        for option in reversed((engine, *ENGINE_OPTIONS, trust_options)):
            command = option(command)
        return command

    return decorate


ENGINE_FLAGS = ("provider", "threads", "streams", "mode", "dynamic", "cuda_graph", "trust_model_code")  # by name
SWITCHES = ("cuda_graph", "trust_model_code")  # flags that are on or not given: off means "not given"
ENGINE_OPTIONS = (
    click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True),
    click.option(
        "--provider",
        default=None,
        help="onnxruntime execution provider, e.g. CPUExecutionProvider (default: the best available).",
    ),
    click.option(
        "--threads",
        type=click.IntRange(1, MAX_THREADS),
        default=None,
        help="Threads for onnxruntime, OpenVINO and torch (default: all cores).",
    ),
    click.option(
        "--streams",
        type=click.IntRange(1, MAX_THREADS),
        default=None,
        help="OpenVINO: run a batch as this many requests at once, each on its share of the rows and cores "
        "(default: one call).",
    ),
    click.option(
        "--mode",
        type=click.Choice(["default", "reduce-overhead", "max-autotune"]),
        default=None,
        help="torch.compile mode of the compile engine (default: default).",
    ),
    click.option(
        "--dynamic/--static",
        "dynamic",
        default=None,
        help="compile engine: one graph for every input shape (--dynamic, the default), or one graph per shape "
        "(--static: recompiles for each new shape, each specialized to it).",
    ),
    click.option(
        "--cuda-graph",
        is_flag=True,
        help="On CUDA, capture each input shape once into a CUDA graph and replay it (eager, torch, aoti, trt; "
        "compile: Inductor's own graphs under reduce-overhead).",
    ),
    click.option("--allow-failed", is_flag=True, help="Open an artifact whose export-time check failed."),
    click.option(
        "--trust-model-code",
        is_flag=True,
        help="Let eager/compile rebuild a user model (package.module:callable) named in the manifest: runs its code.",
    ),
)


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta[f"tk.{param.name}"] = value
    return value


def _remember_keys(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """``--public-key`` files, each read as a PEM public key now: a named key that cannot be used is an
    error whether or not the command meets native code (docs/security.md), never skipped."""
    from tk.errors import TkError
    from tk.keys import check_public_key_file

    for path in value or ():
        try:
            check_public_key_file(Path(path))
        except TkError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc
    return _remember(ctx, param, value)


def public_key_option(fn: Any) -> Any:
    """``--public-key FILE`` (repeatable); read it with ``trust_policy()``."""
    return click.option(
        "--public-key",
        "public_keys",
        multiple=True,
        type=click.Path(path_type=Path, dir_okay=False),
        callback=_remember_keys,
        expose_value=False,
        help="Trust artifacts signed by this PEM public key (repeatable), besides your own key, $TK_TRUSTED_KEYS "
        "and the trusted-keys directory (docs/security.md).",
    )(fn)


def trust_options(fn: Any) -> Any:
    """``--public-key FILE`` (repeatable) and ``--trust-artifact-code``; read them with ``trust_policy()``."""
    fn = public_key_option(fn)
    fn = click.option(
        "--trust-artifact-code",
        is_flag=True,
        callback=_remember,
        expose_value=False,
        help="Load native code (aoti, trt) from this artifact even if no key you trust signed it: runs its code.",
    )(fn)
    return fn


def trust_policy() -> Any:
    """The ``TrustPolicy`` of the running command's ``--public-key`` and ``--trust-artifact-code``."""
    from tk.signing import TrustPolicy

    meta = click.get_current_context().meta
    return TrustPolicy(tuple(meta.get("tk.public_keys") or ()), bool(meta.get("tk.trust_artifact_code")))
