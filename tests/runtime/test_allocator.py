"""glibc's malloc keeps what a call frees (tk.runtime.allocator) where asked, unless the user chose otherwise."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tk.errors import UsageError
from tk.runtime import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# an 8 MiB block: glibc maps it apart by default (over 128 KiB); kept, it comes from the heap and, freed, stays
# there. tk is imported only where it is asked to act: importing torch first could move glibc's own threshold.
PROBE = """
import ctypes, json, sys
if sys.argv[1] == "untouched":
    state = "untouched"
else:
    from tk.runtime.allocator import keep_freed_memory
    state = keep_freed_memory(asked=sys.argv[1] == "asked")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_long]
block = libc.malloc(8 << 20)
top = libc.sbrk(0)
in_heap = top - (64 << 20) < block < top
libc.free(block)
print(json.dumps({"state": state, "in_heap": in_heap, "heap_kept": libc.sbrk(0) == top}))
"""
MAPPED_APART = {"in_heap": False, "heap_kept": True}


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("TK_MALLOC", "LD_PRELOAD", "GLIBC_TUNABLES")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: this platform's C library is not glibc")
def test_asked_a_large_block_comes_from_the_heap_and_stays_after_free() -> None:
    assert _probe("untouched") == {"state": "untouched", **MAPPED_APART}  # mapped apart, unmapped
    for kept in (_probe("asked"), _probe("library", TK_MALLOC="keep")):
        assert kept["state"].startswith("kept (mmap threshold 32 MiB")
        assert kept["in_heap"] and kept["heap_kept"]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: this platform's C library is not glibc")
def test_a_library_call_not_asked_leaves_malloc_as_it_found_it() -> None:
    assert _probe("library") == {"state": allocator.NOT_ASKED, **MAPPED_APART}


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: this platform's C library is not glibc")
def test_the_users_choice_is_left_alone() -> None:
    assert _probe("asked", TK_MALLOC="system") == {"state": "system (TK_MALLOC=system)", **MAPPED_APART}
    told = _probe("asked", MALLOC_TRIM_THRESHOLD_="1000000")
    assert told == {"state": "system (the environment sets MALLOC_TRIM_THRESHOLD_)", **MAPPED_APART}
    tuned = _probe("asked", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")
    assert tuned == {"state": "system (the environment sets GLIBC_TUNABLES)", **MAPPED_APART}


def test_a_preloaded_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator._configure("keep") == "preloaded (/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)"


def test_an_unknown_choice_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_state", None)  # undecided, as in a fresh process
    monkeypatch.setenv("TK_MALLOC", "off")
    with pytest.raises(UsageError, match=r"^TK_MALLOC must be keep or system; got 'off'$"):
        allocator.keep_freed_memory()


def test_the_command_line_keeps_freed_memory_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from tk.cli import cli

    monkeypatch.delenv("TK_MALLOC", raising=False)
    assert CliRunner().invoke(cli, ["models"]).exit_code == 0
    assert os.environ["TK_MALLOC"] == "keep"
    monkeypatch.setenv("TK_MALLOC", "system")
    assert CliRunner().invoke(cli, ["models"]).exit_code == 0
    assert os.environ["TK_MALLOC"] == "system"


def test_an_engine_says_what_its_process_malloc_runs_with(exported) -> None:
    from tk.runtime import load

    with load(exported("mlp", ("onnx",)).root, "onnx") as engine:
        said = engine.settings()["malloc"]
    assert said == allocator.keep_freed_memory() and said.startswith(("kept", "system", "preloaded", "mmap"))
