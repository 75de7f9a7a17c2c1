"""glibc's malloc told to keep the memory one engine call frees for the next call.

PyTorch's CPU tensors (eager, ``torch.compile``, exported programs, AOTInductor packages) are ``malloc``'d
and freed on every call. With glibc's defaults a block over the mmap threshold is mapped and unmapped each
time, and the top of the heap is given back to the kernel once 128 KiB of it is free, so every call pays
page faults for memory it just returned (what that cost transformers' MiniLM in a fresh process:
benchmarks/history.md). Either setting alone is slower than the defaults (setting one turns off glibc's
own adjustment of the mmap threshold), so both are set or neither. This is
what PyTorch's CPU tuning guides do by preloading jemalloc or tcmalloc, done in-process with
``mallopt``; the process keeps the memory of its largest call instead of returning it.

It changes the whole process, so a library call does it only where asked: ``TK_MALLOC=keep`` (which
``tk``'s command line sets for its own process, unless the user set ``TK_MALLOC``), or a caller that owns
its process asking (``keep_freed_memory(asked=True)``: the benchmarks). Left alone where the user chose:
``TK_MALLOC=system``, any of glibc's ``MALLOC_`` variables or ``glibc.malloc.`` tunables
(``GLIBC_TUNABLES``) in the environment, or another allocator preloaded (``LD_PRELOAD``). Not glibc
(macOS, musl): nothing to set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

from tk.errors import UsageError

log = logging.getLogger("tk.runtime")

ENV = "TK_MALLOC"  # "keep": keep freed memory (tk's command line sets it); "system": leave glibc's malloc alone
CHOICES = ("keep", "system")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's top is given back only past 2 GiB free
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc", "tbbmalloc")
NOT_ASKED = f"system (a library call leaves malloc as it is: {ENV}=keep keeps freed memory)"

_lock = threading.Lock()
_state: str | None = None  # what ``keep_freed_memory`` decided, once per process


def keep_freed_memory(asked: bool = False) -> str:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring) where ``TK_MALLOC=keep``
    or the caller ``asked``, unless the user chose otherwise; returns what this process's malloc runs with,
    for an engine's ``settings()``."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        choice = os.environ.get(ENV, "").strip().lower()
        if choice and choice not in CHOICES:
            raise UsageError(f"{ENV} must be {' or '.join(CHOICES)}; got {os.environ[ENV]!r}")
        if not choice and not asked:
            return NOT_ASKED  # not decided: a later call that is asked may still keep
        _state = _configure(choice)
        log.debug("tk: malloc %s", _state)
        return _state


def _configure(choice: str) -> str:
    if choice == "system":
        return f"system ({ENV}=system)"
    chosen = [name for name in os.environ if name.startswith("MALLOC_")]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"system (the environment sets {', '.join(sorted(chosen))})"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in PRELOADED):
        return f"preloaded ({preload})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system (not glibc)"
    libc = ctypes.CDLL(None)  # the process's own C library: mallopt is glibc's
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "system (mallopt refused the mmap threshold)"
    if not libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):  # never seen; the mmap threshold alone is slower
        return f"mmap threshold {MMAP_THRESHOLD >> 20} MiB only (mallopt refused the trim threshold)"
    return f"kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold 2 GiB)"
