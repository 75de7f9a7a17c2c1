"""The memory budget: how many bytes ``tk`` may allocate for what a user hands it.

Inputs read from files, random samples, the shapes a check runs at and the models rebuilt from a
manifest are all sized against one budget before anything is allocated, so a zip bomb, a huge
declared shape or a crafted config ends in one line instead of a machine out of memory. Default:
half of the machine's physical memory; ``TK_MAX_MEMORY`` (or ``tk --max-memory``) changes it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

from tk.errors import ResourceError, UsageError

ENV = "TK_MAX_MEMORY"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

# The largest counts tk takes from a user. A flag's click range and a settings file's check (tk serve
# --config) read the same constant, so that a file cannot ask for what the flag refuses.
MAX_THREADS = 1024  # --threads, engine_threads: 100000 threads crashed onnxruntime and torch (segfault) or hung
MAX_TUNE_REQUESTS = 100_000  # tk serve --tune-requests, per grid point: at 1 ms a request, 100 s a point


def parse_size(text: str) -> int:
    """``512M``, ``8G``, ``1.5g`` or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not match:
        raise UsageError(f"memory size: expected a number of bytes with an optional K, M, G or T, got {text!r}")
    value = float(match[1]) * _UNITS[match[2]]
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"memory size: expected at least 1 byte, got {text!r}")
    return int(value)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a modest machine
        return 8 << 30


def memory_budget() -> int:
    """Bytes ``tk`` may allocate for one input, shape or model: ``TK_MAX_MEMORY``, else half the RAM."""
    text = os.environ.get(ENV)
    return parse_size(text) if text else physical_memory() // 2


def require_within_budget(nbytes: float, what: str) -> None:
    """Raise ``ResourceError`` naming ``what`` when ``nbytes`` exceeds the budget."""
    budget = memory_budget()
    if not math.isfinite(nbytes) or nbytes > budget:
        raise ResourceError(
            f"{what} would need {_human(nbytes)}, over tk's memory budget of {_human(budget)}; "
            f"use smaller sizes, or raise the budget with --max-memory or {ENV}"
        )


def _human(nbytes: float) -> str:
    if not math.isfinite(nbytes):
        return "an unbounded amount"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def module_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers (on the meta device too: nothing is read)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def extrapolated_bytes(measure: Callable[[int | None], int], layers: object) -> int:
    """The bytes of a model of ``layers`` identical layers, from ``measure(1)`` and ``measure(2)`` (a
    build at that many layers; ``measure(None)``: the config as it is), so that a config asking for a
    million layers costs two small builds rather than a million. Where the count is small, not an
    int, or the other fields must agree with it (a build at 1 or 2 layers fails), the whole config
    is measured."""
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 2:
        try:
            one, two = measure(1), measure(2)
        except Exception:  # the config's other fields depend on the layer count
            return measure(None)
        return one + max(0, two - one) * (layers - 1)
    return measure(None)
