"""A real ``tk serve`` on loopback, probed as an attacker would: Ray's sockets, request sizes, and
random bodies (hypothesis). One server for the module: Ray starts slowly on 2 cores."""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import signal
import urllib.error
import urllib.request
from datetime import timedelta

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
psutil = pytest.importorskip("psutil")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.serve.conftest import ServeProcess, free_port  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0
MODEL = "transformer"


@pytest.fixture(scope="module")
def server(exported, tmp_path_factory):
    """``tk serve`` as its own process (its own Ray instance): (process, port, request limit)."""
    art = exported("transformer", ("onnx",))
    port = free_port()
    serve = ServeProcess(tmp_path_factory.mktemp("hardening"))
    env = {"TK_RAY_NODE_IP": ""}  # the default: loopback
    with serve.running(str(art.root), "--port", str(port), "--max-batch", "8", "--threads", "1", env=env) as process:
        limit = int(re.search(r"max request (\d+) bytes", serve.text())[1])
        process.log_text = serve.text  # for the last test, which stops it
        yield process, port, limit


def request(port: int, body: bytes | None, headers: dict[str, str] | None = None, path: str | None = None):
    url = f"http://127.0.0.1:{port}{path or f'/v2/models/{MODEL}/infer'}"
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def good_body(batch: int = 2) -> bytes:
    ids = list(range(1, 3 * batch + 1))
    return json.dumps(
        {
            "inputs": [
                {"name": "input_ids", "shape": [batch, 3], "datatype": "INT64", "data": ids},
                {"name": "attention_mask", "shape": [batch, 3], "datatype": "INT64", "data": [1] * len(ids)},
            ]
        }
    ).encode()


def strict_json(body: bytes):
    def refuse(name):
        raise AssertionError(f"bare {name} in a reply: {body[:200]!r}")

    return json.loads(body, parse_constant=refuse)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_every_socket_of_tk_serve_and_its_ray_listens_on_loopback(server):
    process, port, _ = server
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    listening = []
    for proc in tree:
        try:
            connections = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(name, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet"} <= names, listening  # the test saw Ray itself, not just the HTTP port
    assert any(p == port for _, _, p in listening)
    exposed = [entry for entry in listening if not is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_the_replicas_run_at_normal_priority_not_rays_nice_15(server):
    """At Ray's default nice 15, two busy loops beside tk serve kept its replicas from answering for over two
    minutes (this module's server did not start); its local Ray now starts its workers at nice 0."""
    process, _, _ = server
    workers = {}
    for proc in psutil.Process(process.pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
            if title.startswith("ray::"):  # Ray's worker processes: actors, the replicas among them
                workers[title[:60]] = proc.nice()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert any("replica" in title.lower() for title in workers), workers
    assert set(workers.values()) == {0}, workers


def test_an_oversized_request_is_413_before_its_body_is_read(server):
    _, port, limit = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:  # a 10 TB Content-Length and no body at all: the answer cannot wait for the body
        conn.putrequest("POST", f"/v2/models/{MODEL}/infer")
        conn.putheader("Content-Length", str(10**13))
        conn.endheaders()
        reply = conn.getresponse()
        status, body = reply.status, reply.read()
    finally:
        conn.close()
    assert status == 413 and "over this server's limit" in strict_json(body)["error"]
    status, body = request(port, b" " * (limit + 1))
    assert status == 413 and str(limit) in strict_json(body)["error"]
    status, body = request(port, good_body())
    assert status == 200 and strict_json(body)["outputs"][0]["shape"] == [2, 2]


def test_deep_nesting_many_dims_and_non_finite_values_are_400s(server):
    _, port, _ = server
    for depth, code in ((40_000, 400), (100_000, 413)):  # 100,000 deep is over this server's size limit
        deep = b'{"inputs": [{"name": "input_ids", "data": ' + b"[" * depth + b"]" * depth + b"}]}"
        status, body = request(port, deep)
        assert status == code, (depth, status, body[:200])
        assert ("nested too deeply" if code == 400 else "over this server's limit") in strict_json(body)["error"]
    header = json.dumps(
        {
            "inputs": [
                {"name": "input_ids", "shape": [1] * 65, "datatype": "INT64", "parameters": {"binary_data_size": 8}},
                {"name": "attention_mask", "shape": [1, 1], "datatype": "INT64", "parameters": {"binary_data_size": 8}},
            ]
        }
    ).encode()
    blob = np.ones(2, np.int64).tobytes()
    status, body = request(port, header + blob, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "expected rank 2" in strict_json(body)["error"]
    for value in ("NaN", "Infinity", "1e39", str(2**63)):
        bad = good_body(1).replace(b'"data": [1, 2, 3]', b'"data": [1, 2, ' + value.encode() + b"]")
        status, body = request(port, bad)
        assert status == 400, (value, body)
        strict_json(body)


# -- random bodies ---------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["input_ids", "attention_mask", "x"]) | JSON_VALUES,
        "shape": st.lists(st.integers(-2, 2**40), max_size=70) | JSON_VALUES,
        "datatype": st.sampled_from(["INT64", "FP32", "BOOL", "BYTES"]) | JSON_VALUES,
        "data": st.lists(st.integers(-(2**64), 2**64) | st.floats(), max_size=12) | JSON_VALUES,
        "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-8, 2**40) | JSON_VALUES}) | JSON_VALUES,
    },
)
REQUESTS = st.fixed_dictionaries(
    {"inputs": st.lists(FIELDS, max_size=3) | JSON_VALUES},
    optional={"outputs": JSON_VALUES, "parameters": JSON_VALUES, "id": JSON_VALUES},
)


@st.composite
def bodies(draw) -> tuple[bytes, dict[str, str]]:
    kind = draw(st.sampled_from(["json", "binary", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=256)), {}
    header = json.dumps(draw(REQUESTS)).encode()  # NaN and Infinity included: Python writes them
    if kind == "json":
        return header, {}
    tail = draw(st.binary(max_size=128))
    length = draw(st.sampled_from([str(len(header)), str(len(header) + len(tail) + 1), "0", "-1", "x"]))
    return header + tail, {"Inference-Header-Content-Length": length}


@pytest.fixture(scope="module")
def baseline(server):
    _, port, _ = server
    status, body = request(port, good_body())
    assert status == 200
    return body


@settings(
    max_examples=60,
    deadline=timedelta(seconds=TIMEOUT_S),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(case=bodies())
def test_random_bodies_get_200_or_4xx_and_the_server_answers_the_same_after(server, baseline, case):
    _, port, _ = server
    body, headers = case
    status, reply = request(port, body, headers)
    assert status == 200 or 400 <= status < 500, (status, reply[:300], body[:300])
    if status != 200:  # every error is strict JSON (a 200 may be binary, asked for by the request)
        strict_json(reply)
    status, again = request(port, good_body())
    assert status == 200 and again == baseline


def test_ctrl_c_after_all_this_ends_it_with_exit_0(server):
    """Last in the module (pytest runs a file's tests in order): after the probes above, SIGINT ends this
    ``tk serve`` (the default ingress; test_model_server stops one behind HAProxy) with exit 0."""
    process, _, _ = server
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0
    assert "stopped" in process.log_text()
