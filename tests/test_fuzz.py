"""Bounded fuzzing of what users hand tk: manifests, input files and argument lists.

Every case must end in exit code 0, 1 (a parity failure) or 2 with exactly one ``error:`` line,
never a traceback, within a per-case time limit, without reading a file outside the artifact
(a secret file beside it never shows up in any output) and without running code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tk.cli import cli
from tk.export import ExportOptions
from tk.manifest import _canonical
from tk.models import build_model
from tk.workflows.export import export

CASE_SECONDS = 60
FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SECRET = "tk-fuzz-secret-7f3a"


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    torch.manual_seed(0)
    export(build_model("transformer", size="tiny"), root / "base", ExportOptions(formats=("onnx",)))
    (root / "secret.txt").write_text(SECRET * 100)
    return root


@contextlib.contextmanager
def time_limit(seconds: int):
    def expired(*_):
        raise TimeoutError(f"case ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def invoke(args: list[str], root: Path) -> None:
    with time_limit(CASE_SECONDS):
        result = CliRunner().invoke(cli, args)
    output = result.stdout + result.stderr
    assert not isinstance(result.exception, TimeoutError), args
    assert "Traceback" not in output and (result.exception is None or isinstance(result.exception, SystemExit)), (
        args,
        output,
        result.exception,
    )
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, output)
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == (0 if result.exit_code == 0 else 1), (args, result.stderr)
    assert SECRET not in output
    assert not (root / "pwned").exists()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**15), 10**15) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["../secret.txt", "/etc/passwd", "../../secret.txt", "model.onnx", "weights"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)  # fmt: skip


def paths_of(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from paths_of(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from paths_of(value, (*prefix, i))


@FUZZ
@given(data=st.data())
def test_fuzzed_manifests_end_in_one_line(fuzz_root, data):
    case = fuzz_root / "case"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(fuzz_root / "base", case)
    manifest = json.loads((case / "manifest.json").read_text())
    targets = [p for p in paths_of(manifest) if p and p[0] not in ("checksum", "hmac")]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(targets))
        node = manifest
        for key in path[:-1]:
            node = node[key]
        with contextlib.suppress(KeyError, IndexError, TypeError):
            node[path[-1]] = data.draw(JSON_VALUES)
    manifest.pop("checksum", None)
    manifest["checksum"] = hashlib.sha256(_canonical(manifest)).hexdigest()  # as an attacker would
    (case / "manifest.json").write_text(json.dumps(manifest))
    command = data.draw(st.sampled_from(["inspect", "check", "infer"]))
    args = {"inspect": [], "check": ["--engine", "onnx"], "infer": ["--random", "3", "--out", str(fuzz_root / "o.npz")]}
    invoke(["--max-memory", "2G", command, str(case), *args[command]], fuzz_root)


ARRAYS = st.builds(
    lambda dtype, shape, fill: np.full(shape, fill).astype(dtype),
    st.sampled_from(["int64", "int32", "float32", "float64", "bool", "uint8"]),
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    st.sampled_from([0, 1, -1, 999, 1000, 10**9, float("nan")]),
)


@FUZZ
@given(
    names=st.lists(st.sampled_from(["input_ids", "attention_mask", "x", ""]), min_size=0, max_size=3, unique=True),
    arrays=st.lists(ARRAYS, min_size=3, max_size=3),
)
def test_fuzzed_input_files_end_in_one_line(fuzz_root, names, arrays):
    path = fuzz_root / "inputs.npz"
    np.savez(path, **{name or "arr_0": array for name, array in zip(names, arrays, strict=False)})
    invoke(["infer", str(fuzz_root / "base"), "--inputs", str(path), "--out", str(fuzz_root / "o.npz")], fuzz_root)


OPTION_VALUES = st.sampled_from(["nan", "inf", "-1", "0", "1", "3", str(10**11), "", "x" * 300, "1:2:3", "auto", "all"])


@FUZZ
@given(
    command=st.sampled_from(["check", "bench", "infer", "inspect"]),
    options=st.lists(
        st.tuples(
            st.sampled_from(
                ["--rtol", "--atol", "--samples", "--batch-size", "--seconds", "--iters", "--seq",
                 "--batch-sizes", "--threads", "--random", "--engine", "--seed"]
            ),
            OPTION_VALUES,
        ),
        max_size=3,
    ),
)  # fmt: skip
@pytest.mark.fits(seconds=60)  # 43 s on the 2-core AMX Xeon
def test_fuzzed_arguments_end_in_one_line(fuzz_root, command, options):
    args = [command, str(fuzz_root / "base")]
    for name, value in options:
        args += [name, value]
    if command == "infer":
        args += ["--out", str(fuzz_root / "o.npz")]
    if command == "bench" and "--iters" not in args and "--seconds" not in args:
        args += ["--iters", "2"]
    invoke(["--max-memory", "2G", *args], fuzz_root)
