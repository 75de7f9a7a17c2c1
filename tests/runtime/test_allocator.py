"""glibc's malloc keeps what a call frees (tk.runtime.allocator), unless the user chose otherwise."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tk.runtime import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# an 8 MiB block: glibc maps it apart by default (over 128 KiB); kept, it comes from the heap and, freed, stays there
PROBE = """
import ctypes, json, sys
from tk.runtime.allocator import keep_freed_memory
state = keep_freed_memory() if sys.argv[1] == "kept" else "untouched"
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_long]
block = libc.malloc(8 << 20)
top = libc.sbrk(0)
in_heap = top - (64 << 20) < block < top
libc.free(block)
print(json.dumps({"state": state, "in_heap": in_heap, "heap_kept": libc.sbrk(0) == top}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("TK_MALLOC", "LD_PRELOAD")
    }
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: this platform's C library is not glibc")
def test_kept_a_large_block_comes_from_the_heap_and_stays_after_free() -> None:
    default = _probe("default")
    assert default == {"state": "untouched", "in_heap": False, "heap_kept": True}  # mapped apart, unmapped
    kept = _probe("kept")
    assert kept["state"].startswith("kept (mmap threshold 32 MiB")
    assert kept["in_heap"] and kept["heap_kept"]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: this platform's C library is not glibc")
def test_the_users_choice_is_left_alone() -> None:
    assert _probe("kept", TK_MALLOC="system")["state"] == "system (TK_MALLOC=system)"
    told = _probe("kept", MALLOC_TRIM_THRESHOLD_="1000000")
    assert told == {"state": "system (the environment sets MALLOC_TRIM_THRESHOLD_)", "in_heap": False,
                    "heap_kept": True}  # fmt: skip


def test_a_preloaded_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TK_MALLOC", *allocator.GLIBC_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator._configure() == "preloaded (/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)"


def test_an_engine_says_what_its_process_malloc_runs_with(exported) -> None:
    from tk.runtime import load

    with load(exported("mlp", ("onnx",)).root, "onnx") as engine:
        assert engine.settings()["malloc"] == allocator.keep_freed_memory()
