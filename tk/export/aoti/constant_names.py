"""One original name for each constant of an AOTInductor package, so the engine can move them all.

A package records each constant under two names: its own (unique) and the "original" one, the
parameter's fully qualified name. Constants Inductor makes up while lowering carry the name they were
made with: the int8 lowering makes an ``x_scale`` and an ``x_zp`` for every quantized linear, so one
package holds nine ``x_scale``. torch's runner hands constants back by original name only
(``extract_constants_map``), so ``tk.runtime.aoti_package`` cannot move a package with repeated names
onto cache lines: one constant left behind would point into the block it frees. ``unique_constant_names``
records every repeat under its own name instead: the first constant made under a name keeps it (a
model's parameter or buffer is made once, so update by name still finds it), the copies Inductor makes
later (a per-channel zero point used twice, the int8 lowering's scales) carry their own.

This wraps ``GraphLowering.allocate_non_dup_const_name``, Inductor's private method (torch 2.14), while
a tk compile runs (a compile in another thread meanwhile gets unique names too: only the names of the
constants Inductor made up differ); ``tests/export/test_aoti_int8.py`` checks a package's names are unique.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

_LOCK = threading.Lock()
_holders = 0
_original: Callable[..., str] | None = None


@contextlib.contextmanager
def unique_constant_names() -> Iterator[None]:
    """Inside, every constant a compile makes up under a name another one already carries is recorded
    under its own unique name. Holders in several threads share the wrapper; the last one out removes it."""
    global _holders, _original
    from torch._inductor.graph import GraphLowering

    with _LOCK:
        if _holders == 0:
            _original = GraphLowering.allocate_non_dup_const_name
            GraphLowering.allocate_non_dup_const_name = _renaming(_original)  # type: ignore[method-assign]
        _holders += 1
    try:
        yield
    finally:
        with _LOCK:
            _holders -= 1
            if _holders == 0:
                GraphLowering.allocate_non_dup_const_name = _original  # type: ignore[method-assign]
                _original = None


def _renaming(allocate: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(allocate)
    def allocate_unique(graph: Any, name: str | None, data: Any) -> str:
        own = allocate(graph, name, data)
        original = graph.allocated_constant_name.get(own)
        if original is None or original == own:
            return own
        if any(other != own and seen == original for other, seen in graph.allocated_constant_name.items()):
            graph.allocated_constant_name[own] = own  # the first holder keeps the original name
            _keep_first_value(graph, original, own)
        return own

    return allocate_unique


def _keep_first_value(graph: Any, original: str, own: str) -> None:
    """AOTInductor writes a constant's value as it was before tracing, kept in the program's meta under
    its original name: the renamed constant keeps that value under its new one, so the package's bytes
    are what they were."""
    from torch._inductor.utils import get_cloned_parameter_buffer_name

    meta = getattr(getattr(graph, "module", None), "meta", None)
    first = get_cloned_parameter_buffer_name(original)
    if isinstance(meta, dict) and first in meta:
        meta[get_cloned_parameter_buffer_name(own)] = meta[first]
