"""The ``tk`` command line: parse options, call one library function per command, print.

Every error a user can cause is a ``TkError``: it ends as one line on stderr and a non-zero exit
code (2, or 1 for a failed parity check). ``--debug`` shows the traceback instead. Each command
lives in a module of this package; this one holds the group and registers them.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import click

from tk.errors import TkError
from tk.text import printable


def echo_error(message: object) -> None:
    """One ``error:`` line on stderr; what a manifest, a baseline or an option put in it is shown escaped
    (``tk.text.printable``): a terminal never obeys an escape sequence quoted in an error."""
    click.echo(f"error: {printable(message)}", err=True)


class TkGroup(click.Group):
    """Turns ``TkError`` and click's usage errors into one line and an exit code.

    ``--debug`` keeps the traceback of a ``TkError``.
    """

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:  # bad option values, missing arguments, unknown commands
            echo_error(exc.format_message())
            sys.exit(exc.exit_code)
        except click.Abort:
            echo_error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with warnings.catch_warnings():  # torch's and onnx's warnings stay out of tk's output
                warnings.simplefilter("ignore")  # (``--debug`` turns them back on, inside this block)
                return super().invoke(ctx)
        except TkError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            echo_error(exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            echo_error("interrupted")
            ctx.exit(130)
        except BrokenPipeError:  # the reader went away (`tk inspect A | head -1`): stop quietly, as a shell tool does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
            ctx.exit(141)  # 128 + SIGPIPE, what the shell reports for a tool killed by the closed pipe
        except OSError as exc:  # a path the user gave that the OS refuses (too long, no permission, …)
            if ctx.obj and ctx.obj.get("debug"):
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            echo_error(f"{where}{exc.strerror or exc}")
            ctx.exit(2)


@click.group(cls=TkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks and torch's own logs.")
@click.option(
    "--max-memory",
    default=None,
    metavar="SIZE",
    help="Memory tk may allocate for inputs, shapes and models it is handed, e.g. 8G "
    "(default: $TK_MAX_MEMORY, else half the machine's memory).",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, max_memory: str | None) -> None:
    """tk: export PyTorch models to static graphs, prove parity, make them fast."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if max_memory is not None:
        from tk.limits import ENV, parse_size

        os.environ[ENV] = str(parse_size(max_memory))  # the command line is the process: its budget
    # the command line owns its process: its engines keep the memory a call frees (tk.runtime.allocator)
    os.environ.setdefault("TK_MALLOC", "keep")
    if not debug:
        # torch's own logs (its W-prefixed lines: deprecations at import, symbolic-shape notes) are set up
        # from TORCH_LOGS when torch is first imported, after this; the user's own TORCH_LOGS wins
        os.environ.setdefault("TORCH_LOGS", "-all")
    _setup_logging(debug)
    if debug:
        warnings.simplefilter("default")


class _PrintableFormatter(logging.Formatter):
    """tk's log lines (notes naming engines, files, outputs) with escape sequences shown, not obeyed."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record), keep_newlines=True)


def _setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrintableFormatter("%(message)s"))
    tk_log = logging.getLogger("tk")
    tk_log.handlers[:] = [handler]
    tk_log.setLevel(logging.DEBUG if debug else logging.INFO)
    tk_log.propagate = False
    if not debug:  # the command line is the application: it decides what libraries may print
        for noisy in ("torch", "torch.utils.cpp_extension", "onnxscript", "onnx_ir"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizer logs every node on the root logger


def main() -> None:
    cli(obj={})


def _register() -> None:
    from tk.cli import artifact, debug, generate, optimize, run, serve, sign, train

    for command in (
        *train.COMMANDS,
        *artifact.COMMANDS,
        *run.COMMANDS,
        *generate.COMMANDS,
        *debug.COMMANDS,
        *optimize.COMMANDS,
        *serve.COMMANDS,
        *sign.COMMANDS,
    ):
        cli.add_command(command)


_register()

if __name__ == "__main__":
    main()
