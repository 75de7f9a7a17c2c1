"""``tk serve --address``: joining a Ray cluster that runs on its own (``ray start --head --block``) and
leaving it running, with Serve stopped only if tk started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")

from tk.serve.ingress import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.fits(seconds=60)]  # 48 s on a 2-core AVX2 EPYC


@pytest.fixture
def cluster():
    """A one-node Ray cluster started with Ray's own command line (``ray start --head --block``, in
    its own process group, which the teardown ends: no other Ray on the machine is touched). Its
    temp directory is short (Ray's socket paths must fit in 107 bytes); token authentication is off
    on both sides, where a real cluster hands its token to the driver."""
    temp = tempfile.mkdtemp(prefix="tkray", dir="/tmp")
    (gcs_port,) = free_ports(1)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={gcs_port}",
         "--num-cpus=2", "--include-dashboard=false", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{gcs_port}"
        deadline = time.monotonic() + 120
        while subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "status", f"--address={address}"],
            env=env, capture_output=True, timeout=60,
        ).returncode:  # fmt: skip
            assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # --block: Ray stops the processes it started
        try:  # it took 34 s to stop gracefully after a Serve application had run; the test needs nothing of it
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_joins_a_cluster_and_leaves_it_running(exported, cluster, serve_process):
    """``tk serve --address`` in its own process (Ray's token setting is process-wide state): it joins,
    answers, stops on Ctrl-C; the cluster still runs afterwards, without Serve."""
    art = exported("transformer", ("onnx",))
    (port,) = free_ports(1)
    env = {"RAY_AUTH_MODE": "disabled"}
    args = (str(art.root), "--address", cluster, "--port", str(port), "--threads", "1")
    with serve_process.running(*args, env=env) as process:
        assert serve_process.infer_shape(port, batch=2) == [2, 2]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0, serve_process.text()
    probe = (  # the cluster still answers, and Serve (started by tk serve) is gone from it
        f"import ray; ray.init(address={cluster!r}, log_to_driver=False); "
        "print(sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SERVE_CONTROLLER_ACTOR" not in done.stdout, done.stdout
