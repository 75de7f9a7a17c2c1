"""Issue 45, item 10: tk serve's limits hold for settings files and --tune as for flags, a gzip body is
decoded whole or refused, and OpenVINO's load errors keep their cause. Nothing here starts Ray: each
refusal comes before it (a subprocess with a timeout, so that a regression fails instead of serving)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.conftest import rehash, requires
from tk.errors import InputError, IntegrityError, ResourceError, UsageError
from tk.limits import MAX_THREADS, MAX_TUNE_REQUESTS
from tk.serve.config import read_settings
from tk.serve.load.tune import TuneGrid, tune
from tk.serve.protocol import decoded_body

ROOT = Path(__file__).resolve().parents[1]


def run_tk(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TK_MAX_MEMORY", None)
    return subprocess.run(
        [sys.executable, "-m", "tk", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ------------------------------------------------------------------------- settings files share the flags' caps
def test_a_settings_file_is_held_to_the_flags_caps(tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    for threads in (MAX_THREADS + 1, 2048, 0, -1):
        path.write_text(json.dumps({"engine_threads": threads}))
        with pytest.raises(UsageError, match=f"engine_threads: expected 1 to {MAX_THREADS} \\(as --threads\\), got"):
            read_settings(path)
    path.write_text(json.dumps({"engine_threads": MAX_THREADS}))
    assert read_settings(path) == {"engine_threads": MAX_THREADS}


def test_serve_refuses_a_config_over_the_threads_cap_before_starting(exported, tmp_path: Path) -> None:
    """The issue's case: ``--config {"engine_threads": 2048}`` ran a replica of 2,085 threads."""
    root = exported("mlp", ("torch",)).root
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"engine_threads": 2048}))
    line = one_error_line(run_tk("serve", root, "--engine", "torch", "--config", config))
    assert f"engine_threads: expected 1 to {MAX_THREADS} (as --threads), got 2048" in line
    flag = run_tk("serve", root, "--engine", "torch", "--threads", "2048")
    assert flag.returncode == 2 and "2048 is not in the range 1<=x<=1024" in flag.stderr


# ------------------------------------------------------------------------- gzip bodies: one stream, whole
@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", gzip.compress(b'{"inputs": []}') + gzip.compress(b'{"inputs": [1]}')),  # a second member
        ("gzip", gzip.compress(b'{"inputs": []}') + b"trailing garbage"),
        ("deflate", zlib.compress(b'{"inputs": []}') + b"\0"),
    ],
)
def test_a_compressed_body_with_anything_after_its_stream_is_a_400(encoding: str, body: bytes) -> None:
    """``decoded_body`` is what tk serve's replicas decode every body with; an ``InputError`` is answered 400."""
    with pytest.raises(
        InputError, match=f"Content-Encoding {encoding}: expected one compressed stream, got \\d+ bytes"
    ):
        decoded_body(body, {"Content-Encoding": encoding}, 10_000)
    whole = zlib.compress(b'{"inputs": []}') if encoding == "deflate" else gzip.compress(b'{"inputs": []}')
    assert decoded_body(whole, {"Content-Encoding": encoding}, 10_000) == b'{"inputs": []}'


# ------------------------------------------------------------------------- --tune-requests: bounded, budgeted
def test_tune_requests_are_bounded_and_budgeted_before_anything_starts(exported, monkeypatch) -> None:
    from tk.serve.config import ServeConfig

    base = ServeConfig(artifact=str(exported("mlp", ("torch",)).root))
    grid = TuneGrid([1], [0.0], [1])
    with pytest.raises(UsageError, match=f"--tune-requests: expected at most {MAX_TUNE_REQUESTS} per point"):
        tune(base, grid, p99_ms=100.0, requests=MAX_TUNE_REQUESTS + 1)
    monkeypatch.setenv("TK_MAX_MEMORY", "8M")  # 100000 requests' bookkeeping alone is about 49 MiB
    with pytest.raises(ResourceError, match=f"--tune-requests {MAX_TUNE_REQUESTS} \\(the tune's load\\) would need"):
        tune(base, grid, p99_ms=100.0, requests=MAX_TUNE_REQUESTS)


def test_tune_requests_through_the_command_line(exported) -> None:
    root = exported("mlp", ("torch",)).root
    over = run_tk("serve", root, "--engine", "torch", "--tune", "--tune-requests", str(MAX_TUNE_REQUESTS + 1))
    assert over.returncode == 2 and f"{MAX_TUNE_REQUESTS + 1} is not in the range" in over.stderr
    budget = run_tk("--max-memory", "8M", "serve", root, "--engine", "torch", "--tune", "--tune-requests", "100000")
    assert "over tk's memory budget of 8.0 MiB" in one_error_line(budget)


# ------------------------------------------------------------------------- OpenVINO errors keep their cause
@requires(openvino=True)
def test_an_ir_openvino_cannot_read_is_one_line_that_names_the_cause(exported, copy_of) -> None:
    """OpenVINO's message starts with lines that say only where C++ threw ("Exception from
    src/inference/src/cpp/core.cpp:105:"); the line quoted is the one saying what is wrong."""
    from tk.formats.openvino import XML
    from tk.runtime import load
    from tk.signing import sign_artifact

    root = copy_of(exported("mlp", ("openvino",)).root, "unknown-op")
    xml = (root / XML).read_text()
    assert 'type="MatMul"' in xml
    rehash(root, {XML: xml.replace('type="MatMul"', 'type="FrobnicateOp"', 1).encode()})
    sign_artifact(root)  # signed by the user's own key: the IR is trusted, and still does not load
    with pytest.raises(IntegrityError) as info:
        load(root, "openvino").load()
    message = str(info.value)
    assert "doesn't contain the operation with type: FrobnicateOp" in message, message
    assert "core.cpp" not in message and "\n" not in message
