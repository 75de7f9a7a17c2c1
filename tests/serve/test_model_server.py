"""The replica's logic without Ray: checks, grouping, padding a static batch, and each request's own rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import UsageError
from tk.serve.app import ModelServer, ServeConfig, resolve
from tk.serve.protocol import InferRequest
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance

ROOT = Path(__file__).resolve().parents[2]


def request_of(feeds) -> InferRequest:
    n = len(next(iter(feeds.values())))
    return InferRequest(feeds, n, ["logits"], {"logits": False}, shape_key=tuple(a.shape[1:] for a in feeds.values()))


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_a_batch_of_requests_gives_each_its_own_rows(exported, eager_outputs, dynamic):
    art = exported("transformer", ("onnx",), dynamic=dynamic)
    rtol, atol, _ = artifact_tolerance(art.manifest.precision, art.manifest.model)
    server = ModelServer(resolve(ServeConfig(str(art.root), engine="onnx", options={"threads": 1})))
    sig = art.manifest.signature
    seqs = [16] if not dynamic else [16, 16, 9, 16, 9]
    sizes = [1, 3, 2, 1, 1]  # 8 samples at most: fits the static batch, so a static group is padded
    requests = [
        request_of(random_feeds(sig.inputs, {"batch": b, "seq": s}, seed=i))
        for i, (b, s) in enumerate(zip(sizes, seqs * 5, strict=False))
    ]
    if not dynamic:
        requests = requests[:3]  # 6 samples: padded to the static batch of 8
    results = server.compute(requests)
    for request, result in zip(requests, results, strict=True):
        assert not isinstance(result, Exception), result
        expected = eager_outputs(art.spec, request.feeds)["logits"]
        assert result["logits"].shape == expected.shape == (request.samples, 2)
        np.testing.assert_allclose(result["logits"], expected, rtol=rtol, atol=atol)


def test_resolve_refuses_what_the_artifact_cannot_take(exported):
    art = exported("transformer", ("onnx",))
    assert resolve(ServeConfig(str(art.root))).max_batch == art.manifest.signature.dims["batch"].max
    with pytest.raises(UsageError, match="batch max is 64"):
        resolve(ServeConfig(str(art.root), max_batch=65))
    with pytest.raises(UsageError, match="--max-queue"):
        resolve(ServeConfig(str(art.root), max_queue=0))
    with pytest.raises(UsageError, match="--replicas"):
        resolve(ServeConfig(str(art.root), replicas=0))
    with pytest.raises(UsageError, match="--request-timeout: expected a finite number of seconds"):
        resolve(ServeConfig(str(art.root), request_timeout_s=float("nan")))


def test_serve_command_refuses_bad_options_in_one_line(exported):
    art = exported("transformer", ("onnx",))
    result = CliRunner().invoke(cli, ["serve", str(art.root), "--max-batch", "100"])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "batch max is 64" in errors[0], result.stderr


def test_deploy_triton_command(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    result = CliRunner().invoke(cli, ["deploy", "triton", str(art.root), "--out", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    assert "transformer: onnxruntime_onnx, max_batch_size 64, 2 input(s), 1 output(s)" in result.stdout
    assert (tmp_path / "repo" / "transformer" / "config.pbtxt").is_file()


def test_import_tk_and_the_protocol_need_no_ray():
    code = (
        "import sys, tk, tk.cli, tk.serve, tk.serve.protocol, tk.serve.app, tk.serve.triton, tk.serve.data; "
        "print(sorted(m for m in ('ray', 'tritonclient', 'prometheus_client') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.slow
def test_serve_command_answers_and_stops_on_ctrl_c(exported, tmp_path):
    """``tk serve`` in its own process (its own Ray instance): ready, answers, SIGINT ends it with exit 0."""
    import json
    import os
    import signal
    import socket
    import time
    import urllib.request

    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
    art = exported("transformer", ("onnx",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "serve.err", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "tk", "serve", str(art.root), "--port", str(port), "--threads", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops" not in (tmp_path / "serve.err").read_text():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.err").read_text()
            time.sleep(0.5)
        body = json.dumps(
            {
                "inputs": [
                    {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]},
                    {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
                ]
            }
        ).encode()
        url = f"http://127.0.0.1:{port}/v2/models/transformer/infer"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=30) as reply:
            assert json.loads(reply.read())["outputs"][0]["shape"] == [1, 2]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert "stopped" in (tmp_path / "serve.err").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_resolve_refuses_what_a_replica_could_not_open(exported):
    art = exported("transformer", ("onnx",))
    with pytest.raises(UsageError, match="artifact has no aoti file"):
        resolve(ServeConfig(str(art.root), engine="aoti"))
    with pytest.raises(UsageError, match="threads must be a positive integer"):
        resolve(ServeConfig(str(art.root), options={"threads": 0}))
    with pytest.raises(UsageError, match="--max-delay-ms: expected a finite"):
        resolve(ServeConfig(str(art.root), max_delay_ms=float("nan")))
