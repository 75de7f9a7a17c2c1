"""Inductor's ``freezing`` as each compile asks, whatever compiled before it in the process.

Two process-wide states of Inductor decide what a frozen compile does, not the config it is given:

- ``torch.compile(..., options={"freezing": True})`` does not freeze (torch 2.14): Dynamo decides
  whether the weights become constants from the process-wide ``torch._inductor.config.freezing`` when
  it traces (pytorch/pytorch#139272), before the options apply. ``inductor_freezing`` sets it around
  the calls that may trace.
- With ``freezing``, Inductor hands float linears and convolutions to oneDNN's packed kernels when
  ``cpp.weight_prepack`` is on. But it registers its freezing patterns once a process
  (``freezing_patterns.lazy_init``), the packing among them only if ``cpp.weight_prepack`` is on at
  that first freezing compile: afterwards the config no longer decides. An int8 package whose
  left-out layers should run unpacked in float32 came out packed after a frozen float32 compile in
  the same process, and a frozen float32 package unpacked after such an int8 one.
  ``float_weight_packing`` makes the config decide again for the compiles inside it: it registers the
  packing where the first compile left it out, and sets it aside (then puts it back) where a compile
  asks for none.

These are Inductor's private registries (torch 2.14); where one is missing, the compile runs as
Inductor's own state has it and ``packing_registry_missing`` says why (``tests/export/test_inductor_freezing.py``
fails where they change shape). ``inductor_freezing`` and ``config.patch(freezing=...)`` (AOTInductor's
``inductor_configs``) both set the same process-wide flag: the two overlapping in threads can leave it
as the other found it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import CodeType
from typing import Any

import torch

_LOCK = threading.RLock()
_FREEZING_LOCK = threading.Lock()
_freezing_holders = 0
_freezing_before = False


@contextlib.contextmanager
def inductor_freezing() -> Iterator[None]:
    """``torch._inductor.config.freezing`` on for the ``torch.compile`` calls inside (where Dynamo
    reads it). Overlapping holders in several threads share it and the last one out puts back what it
    was; a compile in another thread meanwhile freezes too."""
    global _freezing_holders, _freezing_before
    from torch._inductor import config

    with _FREEZING_LOCK:
        if _freezing_holders == 0:
            _freezing_before = config.freezing
            config.freezing = True
        _freezing_holders += 1
    try:
        yield
    finally:
        with _FREEZING_LOCK:
            _freezing_holders -= 1
            if _freezing_holders == 0:
                config.freezing = _freezing_before


def packing_registry_missing() -> str | None:
    """Why Inductor's float weight packing cannot be set per compile in this torch, or None."""
    try:
        from torch._inductor.fx_passes import freezing_patterns, mkldnn_fusion
    except ImportError as exc:
        return f"torch._inductor has no freezing patterns here ({exc})"
    if not torch._C._has_mkldnn:
        return "this torch build has no oneDNN, so Inductor packs nothing"
    needed = [
        (freezing_patterns, "pass_patterns"),
        (freezing_patterns, "lazy_init"),
        (mkldnn_fusion, "_mkldnn_weight_pack_init"),
    ]
    missing = [f"{module.__name__}.{name}" for module, name in needed if not hasattr(module, name)]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    registers = getattr(freezing_patterns, "register_freezing_graph_pattern", None)
    if registers is None or getattr(mkldnn_fusion, "register_freezing_graph_pattern", None) is not registers:
        return f"torch {torch.__version__}'s mkldnn_fusion registers its freezing patterns some other way"
    return None


_handlers: frozenset[CodeType] = frozenset()


def _packing_handlers() -> frozenset[CodeType]:
    """The code of the pattern handlers ``_mkldnn_weight_pack_init`` registers (oneDNN's float packing, and
    the reshape and bias recovery and int8 weight-only concat patterns Inductor registers with it), found
    once a process by having it register them into passes of our own: the modules that register freezing
    patterns are pointed at those passes meanwhile (under ``_LOCK``, after the process's own registration),
    so a compile in another thread meanwhile still sees every pattern the process registered."""
    global _handlers
    if _handlers:
        return _handlers
    from torch._inductor import fx_passes
    from torch._inductor.fx_passes import freezing_patterns, mkldnn_fusion
    from torch._inductor.pattern_matcher import PatternMatcherPass, register_graph_pattern

    ours: list[Any] = []

    def register_in_ours(pattern: Any, *args: Any, pass_number: int = 0, **kwargs: Any) -> Any:
        while pass_number > len(ours) - 1:
            ours.append(PatternMatcherPass())
        return register_graph_pattern(pattern, *args, pass_dict=ours[pass_number], **kwargs)

    original = freezing_patterns.register_freezing_graph_pattern
    # the modules under fx_passes that took Inductor's registration function by name (mkldnn_fusion, quantization)
    registering = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith(fx_passes.__name__ + ".")
        and getattr(module, "register_freezing_graph_pattern", None) is original
    ]
    for module in registering:
        module.register_freezing_graph_pattern = register_in_ours
    try:
        _register_packing(mkldnn_fusion)  # nothing where oneDNN is switched off: then found at a later call
    finally:
        for module in registering:
            module.register_freezing_graph_pattern = original
    _handlers = frozenset(code for entries in _entry_lists(ours) for entry in entries if (code := _handler(entry)))
    return _handlers


def _register_packing(mkldnn_fusion: Any) -> None:
    # the function itself, past its once-a-process cache (which only lazy_init's own call goes through)
    init = mkldnn_fusion._mkldnn_weight_pack_init
    getattr(init, "__wrapped__", init)()


def _entry_lists(passes: list[Any]) -> Iterator[list[Any]]:
    for matcher in passes:
        yield from matcher.patterns.values()


def _handler(entry: Any) -> CodeType | None:
    return getattr(getattr(entry, "handler", None), "__code__", None)


def register_float_weight_packing() -> None:
    """Have Inductor's float weight packing registered where the process's ``cpp.weight_prepack`` is on
    (as its first frozen compile registers it then), for a compile that comes later, such as
    ``torch.compile``'s: an earlier frozen compile that asked for none may have left it out."""
    from torch._inductor import config

    if packing_registry_missing() is not None or not config.cpp.weight_prepack:
        return
    with _LOCK:
        _registered_lists(True)


def _registered_lists(packing: bool) -> tuple[list[list[Any]], bool]:
    """The freezing passes' entry lists, after the process's one registration, with the packing
    registered if ``packing``; and whether the packing is registered."""
    from torch._inductor import config
    from torch._inductor.fx_passes import freezing_patterns, mkldnn_fusion

    with config.patch({"cpp.weight_prepack": packing}):
        freezing_patterns.lazy_init()  # the process's one registration, if no compile made it yet
    handlers = _packing_handlers()  # after it: its registrations go to the process's passes
    lists = list(_entry_lists(freezing_patterns.pass_patterns))
    registered = any(_handler(entry) in handlers for entries in lists for entry in entries)
    if packing and not registered and torch.backends.mkldnn.is_available():
        _register_packing(mkldnn_fusion)
        return list(_entry_lists(freezing_patterns.pass_patterns)), True
    return lists, registered


@contextlib.contextmanager
def float_weight_packing(enabled: bool) -> Iterator[None]:
    """Freezing compiles inside pack float weights for oneDNN if and only if ``enabled`` (what their
    ``cpp.weight_prepack`` says). Such compiles run one at a time; a ``torch.compile`` in another
    thread at that moment sees the same registry. Patterns registered meanwhile (torchao's int8
    ones, at its first quantization) are kept."""
    if packing_registry_missing() is not None:
        yield
        return
    with _LOCK:
        lists, registered = _registered_lists(enabled)
        handlers = _packing_handlers()
        set_aside = [(entries, list(entries)) for entries in lists] if registered and not enabled else []
        for entries, whole in set_aside:
            entries[:] = [entry for entry in whole if _handler(entry) not in handlers]
        try:
            yield
        finally:
            for entries, whole in set_aside:
                kept = {id(entry) for entry in whole}
                entries[:] = whole + [entry for entry in entries if id(entry) not in kept]
