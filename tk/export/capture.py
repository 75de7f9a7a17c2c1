"""torch.export capture: one full graph with ``Dim`` ranges, or one clear error naming the cause."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tk.errors import CaptureError, first_line
from tk.spec import Dim, Signature, dim_flag

T = TypeVar("T")

log = logging.getLogger("tk.export")

MAX_NARROWINGS = 2  # captures again with torch.export's suggested ranges, each round narrowing more
_SUGGESTED_DIM = re.compile(r"^\s*(\w+) = Dim\('\w+'(?:, min=(\d+))?(?:, max=(\d+))?\)\s*$", re.MULTILINE)
_GUARD = re.compile(
    r"Not all values of (?P<dim>\w+) = (?P<source>L\['\w+'\]\.size\(\)\[\d+\]) in the specified range "
    r"(?P<range>.+?) satisfy the generated guard (?P<guard>.+?)\.?$",
    re.MULTILINE,
)
_SPECIALIZED = re.compile(r"marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)")


def dynamic_shapes_for(signature: Signature, dims: dict[str, Dim]) -> tuple[dict[int, torch.export.Dim], ...]:
    """``torch.export`` dynamic shapes, one dict per input; static dimensions are left out."""
    export_dims = {
        name: torch.export.Dim(name, min=dim.min, max=dim.max) for name, dim in dims.items() if not dim.static
    }
    shapes = []
    for spec in signature.inputs:
        shapes.append(
            {axis: export_dims[d] for axis, d in enumerate(spec.shape) if isinstance(d, str) and d in export_dims}
        )
    return tuple(shapes)


def capture_error_message(exc: BaseException, dims: dict[str, Dim] | None = None) -> str:
    """One line: the cause, the dimension that was specialized or the ranges torch.export suggests (as the
    flags that set them, given ``dims``), and the user's source line."""
    text = str(exc)
    special = _SPECIALIZED.search(text)
    if special:
        return (
            f"dimension {special[1]!r} was meant to be dynamic but the model specialized it to the constant "
            f"{special[2]}; export it with --static, or change the model so the size is not fixed" + _where(text)
        )
    cause = first_line(exc)
    if "Constraints violated" in cause:
        cause = _violated_constraint(text, cause, dims or {})
    return f"torch.export could not capture the model as one graph ({type(exc).__name__}): {cause}{_where(text)}"


def _violated_constraint(text: str, cause: str, dims: dict[str, Dim]) -> str:
    """A range torch.export could not hold: the guard the model's code needs, with the dimension's name in
    it, and the flag of torch.export's suggested range (or what to try where it suggests none)."""
    cause = cause.split("!")[0]
    guards = list(_GUARD.finditer(text))
    if guards:
        first = guards[0]
        needs = " and ".join(dict.fromkeys(g["guard"].replace(g["source"], g["dim"]) for g in guards))
        cause += f": the model's code needs {needs}, not true for every {first['dim']} in {first['range']}"
    suggested = suggested_dims(text, dims)
    if suggested:
        flags = " ".join(dim_flag(d.name, f"{d.min}:{d.opt}:{d.max}") for d in suggested.values())
        return f"{cause}; export with {flags}"
    name = guards[0]["dim"] if guards else None
    return f"{cause}; export {dim_flag(name) if name else 'the dimension'} in a range where it holds, or --static"


def suggested_dims(text: str, dims: dict[str, Dim]) -> dict[str, Dim]:
    """The ranges torch.export's "Suggested fixes" give for dimensions of ``dims`` (``seq = Dim('seq', min=3,
    max=128)``), each narrowed within the range asked for and keeping its opt size (the size traced, so
    inside any range the trace suggests); empty where it suggests none it can hold."""
    fixes = text.partition("Suggested fixes:")[2]
    narrowed: dict[str, Dim] = {}
    for name, low, high in _SUGGESTED_DIM.findall(fixes):
        dim = dims.get(name)
        if dim is None or dim.static:
            continue
        low_, high_ = max(dim.min, int(low or dim.min)), min(dim.max, int(high or dim.max))
        if low_ <= dim.opt <= high_ and (low_, high_) != (dim.min, dim.max):
            narrowed[name] = Dim(name, low_, dim.opt, high_)
    return narrowed


def _where(text: str) -> str:
    """The last user frame torch names (``File "...", line N, in fn`` plus its code), if any."""
    lines = text.splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.strip().startswith('File "')]
    if not frames:
        return ""
    i = frames[-1]
    where = lines[i].strip()
    code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
    return f" at {where}" + (f": {code}" if code else "")


def _export_args(module: nn.Module, signature: Signature, dims: dict[str, Dim]) -> tuple:
    dynamic_shapes: tuple = dynamic_shapes_for(signature, dims)
    if _takes_var_positional(module):
        dynamic_shapes = (dynamic_shapes,)  # forward(*args): the shapes of args form one entry
    return dynamic_shapes


def exported_program_from_module(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    signature: Signature,
    dims: dict[str, Dim],
) -> torch.export.ExportedProgram:
    """Capture ``module`` (in eval mode) with torch.export; dimensions in ``dims`` keep their ranges."""
    if not isinstance(module, torch.fx.GraphModule):  # a program's module is in eval mode and refuses eval()
        module.eval()
    dynamic_shapes = _export_args(module, signature, dims)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = _without_partial_graph(
                lambda: torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
            )
    except Exception as exc:  # torch.export raises many types; all are capture failures
        raise CaptureError(capture_error_message(exc, dims)) from exc
    return program


def exported_program_in_range(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    signature: Signature,
    dims: dict[str, Dim],
) -> tuple[torch.export.ExportedProgram, dict[str, Dim]]:
    """``exported_program_from_module``, and the ranges the program holds: where torch.export finds that the
    model does not take a dimension's whole range (BART's attention mask needs ``seq`` >= 3) and suggests a
    narrower one, the capture runs again with it (each narrowing logged). A capture that still fails says
    which flags it tried."""
    held = dict(dims)
    for attempt in range(MAX_NARROWINGS + 1):
        try:
            return exported_program_from_module(module, example_inputs, signature, held), held
        except CaptureError as exc:
            narrowed = suggested_dims(str(exc.__cause__), held) if attempt < MAX_NARROWINGS else {}
            if not narrowed:
                if held == dims:
                    raise
                tried = " ".join(dim_flag(n, f"{d.min}:{d.opt}:{d.max}") for n, d in held.items() if d != dims[n])
                raise CaptureError(f"{exc} (captured again with {tried}, torch.export's suggestion)") from exc
            for name, dim in narrowed.items():
                log.info(
                    "export capture %s: the model takes %d..%d of %d..%d (torch.export); the artifact holds %s",
                    name,
                    dim.min,
                    dim.max,
                    held[name].min,
                    held[name].max,
                    dim_flag(name, f"{dim.min}:{dim.opt}:{dim.max}"),
                )
            held = {**held, **narrowed}
    raise AssertionError("unreachable")  # the loop returns or raises


def _without_partial_graph(call: Callable[[], T]) -> T:
    """``call()`` (a capture), without the partial graph torch.export prints to stderr (once per wrapper)
    before it raises a failed capture's error (``print(e.partial_fx_graph)``, whatever the logging
    settings): the error and the capture report say what failed. Anything else printed is passed on."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            return call()
    except Exception as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        if graph is not None:
            printed = io.StringIO(printed.getvalue().replace(f"{graph}\n", ""))  # printed once per wrapper
        raise
    finally:
        sys.stderr.write(printed.getvalue())


def _takes_var_positional(module: nn.Module) -> bool:
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


# ------------------------------------------------------------------------------ capture reports
_SOURCE = re.compile(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]")
_BOUND = re.compile(r"^(Eq|Ne)\((\w+), (-?\d+)\)$|^(\w+) (<=|<|>=|>) (-?\d+)$|^(-?\d+) (<=|<|>=|>) (\w+)$")


def write_capture_report(
    path: Path,
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    signature: Signature,
    dims: dict[str, Dim],
    error: BaseException,
) -> Path:
    """Run ``torch.export.draft_export`` on the model that failed to export and write what it found.

    The report (Markdown) names each failing operator or guard, the user's source line, and for
    a dimension the code specialised, the ``Dim`` range or change that fixes it. Returns ``path``.
    """
    from tk.fileio import atomic_write_bytes

    cause = error.__cause__ or error
    lines = ["# tk export: torch.export could not capture the model", "", f"**Error:** {error}", ""]
    lines += _specialization_fix(cause)
    failures, names, trouble = _draft_export_failures(module, example_inputs, signature, dims)
    lines += trouble
    if failures:
        lines += [f"## What `torch.export.draft_export` found ({len(failures)} issue(s))", ""]
    for i, failure in enumerate(failures, 1):
        lines += _failure_section(i, failure, names, signature)
    lines += ["## torch.export's own message", "", "```", *str(cause).strip().splitlines()[:60], "```", ""]
    atomic_write_bytes(path, "\n".join(lines).encode())
    return path


def _specialization_fix(cause: BaseException) -> list[str]:
    """The report's Fix section where the model's code fixes a dimension to one size, else nothing."""
    special = _SPECIALIZED.search(str(cause))
    if not special:
        return []
    name, value = special[1], int(special[2])
    return [
        "## Fix",
        "",
        f"- the model's code fixes dimension `{name}` to {value} (see the source line below): export with "
        f"`{dim_flag(name, f'{value}:{value}:{value}')}` (or `--static`), or change that line so it does not assume the size "
        f"(for example `x.reshape(x.shape[0], -1)` instead of a literal {value})",
        "",
    ]


def _draft_export_failures(
    module: nn.Module, example_inputs: tuple[torch.Tensor, ...], signature: Signature, dims: dict[str, Dim]
) -> tuple[list[Any], dict[Any, str], list[str]]:
    """``torch.export.draft_export``'s failures, the file names its frames index, and the report's lines
    where draft_export itself fails (then no failures)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # draft_export logs every issue (and graphs) as warnings; the report has them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft = _without_partial_graph(
                lambda: torch.export.draft_export(
                    module, example_inputs, dynamic_shapes=_export_args(module, signature, dims), strict=False
                )
            )
        failures = list(draft._report.failures)  # draft_export's report: its documented way to read failures
        from torch._logging.structured import INTERN_TABLE

        # frames name files by an index into torch's process-wide string table; the report holds
        # only the entries new to this call, so a second export in one process needs the table
        names = {index: name for name, index in INTERN_TABLE.items()} | dict(draft._report.str_to_filename)
    except Exception as exc:  # draft_export fails in its own ways; the torch.export error below still explains
        return [], {}, [f"`torch.export.draft_export` failed as well: {type(exc).__name__}: {first_line(exc)}", ""]
    finally:
        logging.disable(previous)
    return failures, names, []


def _failure_section(i: int, failure: Any, filenames: dict[Any, str], signature: Signature) -> list[str]:
    data = failure.data
    kind = failure.failure_type.name if hasattr(failure.failure_type, "name") else str(failure.failure_type)
    title = {
        "DATA_DEPENDENT_ERROR": "a branch or size that depends on the input's values",
        "GUARD_ADDED": "a guard on a dimension's size",
        "CONSTRAINT_VIOLATION_ERROR": "a dimension marked dynamic that the code fixes",
        "MISMATCHED_FAKE_KERNEL": "an operator whose fake (meta) kernel disagrees with the real one",
    }.get(kind, kind.lower().replace("_", " "))
    out = [f"### {i}. {kind}: {title}", ""]
    if data.get("op"):
        out.append(f"- operator: `{data['op']}`")
    if data.get("expr"):
        out.append(f"- expression torch could not decide or had to assume: `{data['expr']}`")
    where = _user_frame(data.get("user_stack"), filenames)
    if where:
        out.append(f"- source: {where}")
    sources = {
        sym: (m[1], int(m[2]))
        for sym, src in dict(data.get("symbol_to_sources") or {}).items()
        if (m := _SOURCE.search(str(src)))
    }
    for fix in _dim_fixes(str(data.get("expr", "")), sources, signature):
        out.append(f"- fix: {fix}")
    if kind == "DATA_DEPENDENT_ERROR":
        out.append(
            "- fix: a Python `if` on a tensor's value cannot be one static graph; use `torch.where` (both "
            "branches computed), `torch.cond`, or move the decision out of `forward`"
        )
    out.append("")
    return out


def _user_frame(stack: Any, filenames: dict[Any, str]) -> str:
    """The innermost frame of the user's code: ``file:line in function: code``."""
    frames = [f for f in (stack or []) if isinstance(f, dict)]
    torch_dir = str(Path(torch.__file__).parent)
    for frame in reversed(frames):
        name = filenames.get(frame.get("filename"), str(frame.get("filename")))
        if name.startswith(torch_dir):
            continue
        return f"`{name}`, line {frame.get('line')}, in `{frame.get('name')}`: `{str(frame.get('loc', '')).strip()}`"
    return ""


def _dim_fixes(expr: str, sources: dict[str, tuple[str, int]], signature: Signature) -> list[str]:
    """For a guard on a named dimension: the range (``--batch``/``--dim``) or change that satisfies it."""
    m = _BOUND.match(expr.strip())
    if not m:
        return []
    if m[1]:
        op, sym, value = ("==" if m[1] == "Eq" else "!="), m[2], int(m[3])
    elif m[4]:
        op, sym, value = m[5], m[4], int(m[6])
    else:
        flip = {"<=": ">=", "<": ">", ">=": "<=", ">": "<"}
        op, sym, value = flip[m[8]], m[9], int(m[7])
    if sym not in sources:
        return []
    input_name, axis = sources[sym]
    spec = next((s for s in signature.inputs if s.name == input_name), None)
    dim = spec.shape[axis] if spec is not None and axis < len(spec.shape) else None
    if not isinstance(dim, str):
        return []
    if op == "==":
        return [
            f"the code fixes dimension {dim!r} (axis {axis} of input {input_name!r}) to {value}: export with "
            f"{dim_flag(dim, f'{value}:{value}:{value}')} (or --static), or change that line so it does not assume the size "
            f"(for example `x.reshape(x.shape[0], -1)` instead of a literal {value})"
        ]
    if op in ("<=", "<"):
        top = value if op == "<=" else value - 1
        return [
            f"dimension {dim!r} must stay at most {top} for this code: export with {dim_flag(dim, f'1:{min(top, 8)}:{top}')}"
        ]
    if op in (">=", ">"):
        low = value if op == ">=" else value + 1
        return [
            f"dimension {dim!r} must be at least {low} for this code: export with {dim_flag(dim, f'{low}:{low}:{max(low, 64)}')}"
        ]
    return [f"the code cannot handle dimension {dim!r} equal to {value}: choose a range that excludes it"]
