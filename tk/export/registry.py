"""The format writers named in ``tk.registries.FORMATS``, and which formats each setting applies to.

Nothing here names a format: a writer says what it takes (its ``Options`` fields, each set by one
``tk export`` flag), what it provides and what it requires (``tk.export.base``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tk.errors import BackendUnavailableError, UsageError
from tk.export.base import Writer, given, shapes
from tk.registries import FORMATS as REGISTRY

log = logging.getLogger("tk.export")

FORMATS = tuple(REGISTRY)  # the names at import; the functions below read the registry itself


def writer(fmt: str) -> Writer:
    """The writer object of format ``fmt`` (``"module:OBJECT"`` in ``tk.registries.FORMATS``)."""
    module, _, name = REGISTRY[fmt].partition(":")
    return getattr(importlib.import_module(module), name or "WRITER")


def format_unavailable_reason(fmt: str, device: str, precision: str = "fp32") -> str | None:
    """Why ``fmt`` cannot be written here for ``device`` at ``precision``; None when it can."""
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU, and torch finds none"
    w = writer(fmt)
    if precision not in w.precisions:
        takers = [f for f in REGISTRY if precision in writer(f).precisions]
        return f"--precision {precision} is written for the {_listing(takers)} formats only"
    return w.unavailable_reason(device, precision)


def writer_options_reason(fmt: str, options: Any, device: str, precision: str) -> str | None:
    """Why the writer of ``fmt`` refuses ``options`` for ``device`` at ``precision`` (its ``validate``), or None."""
    from tk.export.context import ExportOptions

    try:
        writer(fmt).validate(options, ExportOptions(formats=(fmt,), device=device, precision=precision))
    except UsageError as exc:
        return str(exc)
    return None


def _listing(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def resolve_formats(
    requested: tuple[str, ...], device: str, precision: str = "fp32"
) -> tuple[list[str], dict[str, str]]:
    """Formats to write, in registry order, and the ones ``all`` skips with the reason."""
    wanted: list[str] = []
    skipped: dict[str, str] = {}
    for fmt in requested:
        if fmt == "all":
            for name in REGISTRY:
                reason = format_unavailable_reason(name, device, precision)
                if reason is None:
                    wanted.append(name)
                else:
                    skipped[name] = reason
        elif fmt in REGISTRY:
            reason = format_unavailable_reason(fmt, device, precision)
            if reason is not None:
                raise BackendUnavailableError(f"--format {fmt}: {reason}")
            wanted.append(fmt)
        else:
            raise UsageError(f"--format: expected one of {', '.join(REGISTRY)} or all, got {fmt!r}")
    return [f for f in REGISTRY if f in wanted], skipped


def _named(requested: Iterable[str]) -> list[str]:
    names = list(requested)
    return list(REGISTRY) if "all" in names else [f for f in REGISTRY if f in names]


def _applies(fmt: str, field_name: str, named: list[str]) -> bool:
    """Whether ``fmt``'s setting ``field_name`` changes an export of the ``named`` formats: ``fmt`` is
    one of them, or the setting shapes a product that one of them requires."""
    if fmt in named:
        return True
    product = shapes(writer(fmt).Options, field_name)
    return product is not None and any(product in writer(f).requires for f in named)


def settings_from_flags(requested: Iterable[str], flags: Mapping[str, Any]) -> dict[str, Any]:
    """Per format, its options dataclass holding the values of ``flags`` (flag -> value, None when
    not given) that it declares and that apply to the ``requested`` formats. A given flag that
    applies to none of them is refused in one line."""
    named = _named(requested)
    values: dict[str, dict[str, Any]] = {}
    placed: set[str] = set()
    for fmt in REGISTRY:
        for f in dataclasses.fields(writer(fmt).Options):
            flag = f.metadata.get("flag")
            if flags.get(flag) in (None, ()) or not _applies(fmt, f.name, named):
                continue
            values.setdefault(fmt, {})[f.name] = flags[flag]
            placed.add(flag)
    for flag, value in flags.items():
        if value not in (None, ()) and flag not in placed:
            raise UsageError(_not_applying(flag, named))
    return {fmt: writer(fmt).Options(**kw) for fmt, kw in values.items()}


def _not_applying(flag: str, named: list[str]) -> str:
    takers = [
        fmt for fmt in REGISTRY if any(f.metadata.get("flag") == flag for f in dataclasses.fields(writer(fmt).Options))
    ]
    return f"{flag}: applies to --format {' or '.join(takers) or 'none'} only; this export writes {', '.join(named)}"


def resolve_settings(
    requested: tuple[str, ...], settings: Mapping[str, Any], skipped: Mapping[str, str]
) -> dict[str, Any]:
    """Every format's options: those in ``settings``, checked to apply to ``requested``, else its defaults.
    Settings of a format that ``all`` skipped are only warned about."""
    named = _named(requested)
    resolved: dict[str, Any] = {}
    for fmt, options in settings.items():
        if fmt not in REGISTRY:
            raise UsageError(f"settings: expected format names ({', '.join(REGISTRY)}), got {fmt!r}")
        expected = writer(fmt).Options
        if not isinstance(options, expected):
            raise UsageError(f"settings[{fmt!r}]: expected {expected.__name__}, got {type(options).__name__}")
        for name, flag in given(options).items():
            if fmt in skipped:
                log.warning("export %-6s %s ignored: %s is not written (%s)", fmt, flag, fmt, skipped[fmt])
            elif not _applies(fmt, name, named):
                raise UsageError(_not_applying(flag, named))
    for fmt in REGISTRY:
        resolved[fmt] = settings.get(fmt) or writer(fmt).Options()
    return resolved


def in_use(formats: list[str]) -> list[str]:
    """The formats written, and those providing a product one of them requires, in registry order."""
    needed = {p for f in formats for p in writer(f).requires}
    return [f for f in REGISTRY if f in formats or needed & set(writer(f).provides)]
