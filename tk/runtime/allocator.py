"""glibc's malloc told to keep the memory one engine call frees for the next call.

PyTorch's CPU tensors (eager, ``torch.compile``, exported programs, AOTInductor packages) are ``malloc``'d
and freed on every call. With glibc's defaults a block over the mmap threshold is mapped and unmapped each
time, and the top of the heap is given back to the kernel once 128 KiB of it is free, so every call pays
page faults for memory it just returned (what that cost transformers' MiniLM in a fresh process:
benchmarks/history.md). Either setting alone is slower than the defaults (setting one turns off glibc's
own adjustment of the mmap threshold), so both are set or neither. This is
what PyTorch's CPU tuning guides do by preloading jemalloc or tcmalloc, done in-process with
``mallopt``; the process keeps the memory of its largest call instead of returning it.

Left alone where the user chose: ``TK_MALLOC=system``, glibc's ``MALLOC_*_`` settings in the environment, or
another allocator preloaded (``LD_PRELOAD``). Not glibc (macOS, musl): nothing to set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading

log = logging.getLogger("tk.runtime")

ENV = "TK_MALLOC"  # "system": leave glibc's malloc as it is
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's top is given back only past 2 GiB free
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc", "tbbmalloc")

_lock = threading.Lock()
_state: str | None = None  # what ``keep_freed_memory`` found or did, once per process


def keep_freed_memory() -> str:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring), unless the user chose
    otherwise; returns what this process's malloc runs with, for an engine's ``settings()``."""
    global _state
    with _lock:
        if _state is None:
            _state = _configure()
            log.debug("tk: malloc %s", _state)
        return _state


def _configure() -> str:
    if os.environ.get(ENV, "").strip().lower() == "system":
        return f"system ({ENV}=system)"
    chosen = [name for name in GLIBC_ENV if name in os.environ]
    if chosen:
        return f"system (the environment sets {', '.join(chosen)})"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in PRELOADED):
        return f"preloaded ({preload})"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system (not glibc)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "system (mallopt refused the thresholds)"
    return f"kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold 2 GiB)"
