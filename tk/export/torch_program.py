"""torch.export capture: one full graph with ``Dim`` ranges, or one clear error naming the cause."""

from __future__ import annotations

import inspect
import re
import warnings

import torch
from torch import nn

from tk.errors import CaptureError, first_line
from tk.spec import Dim, Signature

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


def capture_error_message(exc: BaseException) -> str:
    """One line: the cause, the dimension that was specialized, and the user's source line."""
    text = str(exc)
    special = _SPECIALIZED.search(text)
    if special:
        return (
            f"dimension {special[1]!r} was meant to be dynamic but the model specialized it to the constant "
            f"{special[2]}; export it with --static, or change the model so the size is not fixed" + _where(text)
        )
    cause = first_line(exc)
    return f"torch.export could not capture the model as one graph ({type(exc).__name__}): {cause}{_where(text)}"


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


def exported_program_from_module(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    signature: Signature,
    dims: dict[str, Dim],
) -> torch.export.ExportedProgram:
    """Capture ``module`` (in eval mode) with torch.export; dimensions in ``dims`` keep their ranges."""
    module.eval()
    dynamic_shapes: tuple = dynamic_shapes_for(signature, dims)
    if _takes_var_positional(module):
        dynamic_shapes = (dynamic_shapes,)  # forward(*args): the shapes of args form one entry
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:  # torch.export raises many types; all are capture failures
        raise CaptureError(capture_error_message(exc)) from exc
    return program


def _takes_var_positional(module: nn.Module) -> bool:
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
