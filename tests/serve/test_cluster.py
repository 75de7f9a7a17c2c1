"""``tk serve --address``: joining a Ray cluster that runs on its own (``ray start --head``) and
leaving it running, with Serve stopped only if tk started it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")

from tk.serve.app import ServeConfig, start, stop
from tk.serve.ingress import free_ports

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(monkeypatch):
    """A one-node Ray cluster started with Ray's own command line, stopped afterwards (its temp
    directory short: Ray's socket paths must fit in 107 bytes; token authentication off on both
    sides, where a real cluster hands its token to the driver)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="tkray", dir="/tmp")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    (gcs_port,) = free_ports(1)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    subprocess.run(
        [ray_cli, "start", "--head", f"--port={gcs_port}", "--num-cpus=2", "--include-dashboard=false",
         f"--temp-dir={temp}"],
        check=True, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{gcs_port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_joins_a_cluster_and_leaves_it_running(exported, cluster):
    import ray

    art = exported("transformer", ("onnx",))
    (port,) = free_ports(1)
    running = start(ServeConfig(str(art.root), port=port, options={"threads": 1}), address=cluster)
    try:
        assert not running.connection.local and running.owns_serve  # joined; Serve was not running there
        body = json.dumps(
            {
                "inputs": [
                    {"name": "input_ids", "shape": [2, 3], "datatype": "INT64", "data": [1, 2, 3, 4, 5, 6]},
                    {"name": "attention_mask", "shape": [2, 3], "datatype": "INT64", "data": [1] * 6},
                ]
            }
        ).encode()
        request = urllib.request.Request(f"{running.url}/v2/models/transformer/infer", data=body)
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert json.loads(reply.read())["outputs"][0]["shape"] == [2, 2]
    finally:
        stop(running)
    assert not ray.is_initialized()  # this process left the cluster
    ray.init(address=cluster, log_to_driver=False)  # which still runs, without Serve
    try:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        assert "SERVE_CONTROLLER_ACTOR" not in names, names
    finally:
        ray.shutdown()
