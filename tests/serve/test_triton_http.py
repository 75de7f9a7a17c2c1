"""Triton's own clients against a real ``tk serve`` (2 replicas, local Ray on loopback, one per module):
``tritonclient.http`` metadata, model configuration, statistics summed over both replicas, the
repository index and infer; ``/metrics`` summed over replicas; and ``perf_analyzer`` at concurrency
1 and 4 where its binary runs here.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
http = pytest.importorskip("tritonclient.http", reason="needs tritonclient (pip install 'tk[serve]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.conftest import run_each_in_thread  # noqa: E402
from tests.serve.conftest import app_on_local_ray  # noqa: E402
from tk.errors import UsageError  # noqa: E402
from tk.serve.load.clients import client as load_client  # noqa: E402
from tk.serve.load.clients import infer_inputs  # noqa: E402
from tk.serve.load.perf_analyzer import find_perf_analyzer, run_perf_analyzer  # noqa: E402
from tk.serve.protocol import model_metadata  # noqa: E402
from tk.serve.triton import TRITON_TYPES, config_json, served_config  # noqa: E402
from tk.spec import random_feeds  # noqa: E402
from tk.tolerances import artifact_tolerance  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
MODEL = "transformer"


@pytest.fixture(scope="module")
def server(exported):
    art = exported("transformer", ("onnx",))
    with app_on_local_ray(art, replicas=2, cpus_per_replica=1, max_batch=8, max_delay_ms=2) as config:
        yield art, config


def client(config):
    return load_client(config.port)


def model_stats(config, settled=None) -> dict:
    """The model's statistics; with ``settled`` (a predicate), read again for up to 10 s until it
    holds: other replicas' counts land within a push interval, later on a loaded machine."""
    deadline = time.monotonic() + 10
    while True:
        (entry,) = client(config).get_inference_statistics(MODEL)["model_stats"]
        if settled is None or settled(entry) or time.monotonic() > deadline:
            return entry
        time.sleep(0.2)


def test_metadata_config_and_index(server):
    art, config = server
    c = client(config)
    assert c.get_model_metadata(MODEL) == model_metadata(art.manifest, MODEL, "tk_onnx")
    got = c.get_model_config(MODEL)
    expected = config_json(
        served_config(art.manifest, name=MODEL, engine="onnx", replicas=2, max_batch=8, batching=True, max_delay_ms=2)
    )
    assert got == expected
    # what Triton's clients read from it: names, types, dims without the batch, the batch limit
    assert got["max_batch_size"] == 8 and got["platform"] == "onnxruntime_onnx"
    assert got["instance_group"][0]["count"] == 2
    assert got["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    for entry, spec in zip(got["input"], art.manifest.signature.inputs, strict=True):
        assert entry["name"] == spec.name and entry["data_type"] == TRITON_TYPES[spec.dtype]
        assert entry["dims"] == [-1]  # (batch, seq): seq is dynamic, the batch is left out
    assert c.get_model_repository_index() == [{"name": MODEL, "version": "1", "state": "READY"}]
    assert c.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "statistics",
        "model_configuration",
        "model_repository",
    ]


def test_infer_matches_the_engine_and_statistics_count_every_replica(server, eager_outputs):
    art, config = server
    rtol, atol, _ = artifact_tolerance(art.manifest.precision, art.manifest.model)
    before = model_stats(config)
    clients, per_client = 6, 10
    requests = {
        (c, i): random_feeds(art.manifest.signature.inputs, {"batch": 1 + (c + i) % 3, "seq": 8}, seed=100 * c + i)
        for c in range(clients)
        for i in range(per_client)
    }
    results: dict = {}

    def work(c: int) -> None:
        cl = client(config)
        for i in range(per_client):
            results[(c, i)] = cl.infer(MODEL, infer_inputs(requests[(c, i)])).as_numpy("logits")

    errors = run_each_in_thread(work, clients, timeout=120)
    assert not errors, errors[:3]
    for key, feeds in requests.items():
        expected = eager_outputs(art.spec, feeds)["logits"]
        assert results[key].shape == expected.shape
        np.testing.assert_allclose(results[key], expected, rtol=rtol, atol=atol)
    sent, samples = len(requests), sum(f["input_ids"].shape[0] for f in requests.values())
    success = before["inference_stats"]["success"]["count"]
    after = model_stats(config, lambda s: s["inference_stats"]["success"]["count"] >= success + sent)
    inference = {
        k: after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"]
        for k in after["inference_stats"]
    }
    assert inference["success"] == sent and inference["fail"] == 0
    assert inference["queue"] == inference["compute_infer"] == inference["compute_output"] == sent
    assert after["inference_count"] - before["inference_count"] == samples
    executions = after["execution_count"] - before["execution_count"]
    assert 1 <= executions <= sent
    batched = sum(b["compute_infer"]["count"] for b in after["batch_stats"])
    assert batched == after["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in after["batch_stats"]) == after["inference_count"]
    assert after["name"] == MODEL and after["version"] == "1" and after["last_inference"] > 0
    assert after["inference_stats"]["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    # both replicas served (one replica's copy would hold only its share), and /v2/models/stats agrees
    import ray

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(replicas) == 2
    (every,) = client(config).get_inference_statistics()["model_stats"]
    assert every["inference_count"] == after["inference_count"]


def test_failed_requests_are_counted(server):
    art, config = server
    before = model_stats(config)["inference_stats"]["fail"]["count"]
    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 9, "seq": 8})  # over --max-batch 8
    with pytest.raises(Exception, match="at most 8 samples"):
        client(config).infer(MODEL, infer_inputs(feeds))
    after = model_stats(config, lambda s: s["inference_stats"]["fail"]["count"] > before)
    assert after["inference_stats"]["fail"]["count"] - before == 1


def test_compressed_requests_as_tritonclient_sends_them(server, eager_outputs):
    import gzip
    import json
    import urllib.error
    import urllib.request

    art, config = server
    rtol, atol, _ = artifact_tolerance(art.manifest.precision, art.manifest.model)
    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 2, "seq": 8}, seed=7)
    expected = eager_outputs(art.spec, feeds)["logits"]
    for algorithm in ("gzip", "deflate"):
        reply = client(config).infer(MODEL, infer_inputs(feeds), request_compression_algorithm=algorithm)
        np.testing.assert_allclose(reply.as_numpy("logits"), expected, rtol=rtol, atol=atol)
    body = json.dumps({"inputs": [
        {"name": n, "shape": list(a.shape), "datatype": "INT64", "data": a.reshape(-1).tolist()} for n, a in feeds.items()
    ]}).encode()  # fmt: skip
    url = f"http://127.0.0.1:{config.port}/v2/models/{MODEL}/infer"
    request = urllib.request.Request(url, data=gzip.compress(body), headers={"Content-Encoding": "br"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT_S)
    assert refused.value.code == 415
    assert json.loads(refused.value.read()) == {
        "error": "header Content-Encoding: expected gzip, deflate or identity, got 'br'"
    }


def test_metrics_sum_over_replicas(server):
    art, config = server
    import urllib.request

    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 1, "seq": 8})
    stats_before = model_stats(config)
    for _ in range(6):
        client(config).infer(MODEL, infer_inputs(feeds))
    success = stats_before["inference_stats"]["success"]["count"] + 6
    stats_after = model_stats(config, lambda s: s["inference_stats"]["success"]["count"] >= success)
    deadline = time.monotonic() + 10
    while True:  # every replica's last push has landed (the statistics show it): /metrics sums the same
        with urllib.request.urlopen(f"http://127.0.0.1:{config.port}/metrics", timeout=TIMEOUT_S) as reply:
            text = reply.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                assert "replica" not in s.labels  # one series for the model, not one per replica
                samples[(s.name, s.labels.get("code"))] = s.value
        if samples.get(("tk_requests_total", "200")) == success or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # the metrics and the statistics count the same requests: every replica's
    assert samples[("tk_requests_total", "200")] == stats_after["inference_stats"]["success"]["count"]
    assert samples[("tk_batch_samples_sum", None)] == stats_after["inference_count"]
    assert stats_after["inference_stats"]["success"]["count"] - stats_before["inference_stats"]["success"]["count"] == 6


def perf_analyzer_or_skip():
    try:
        return find_perf_analyzer()
    except UsageError as exc:
        pytest.skip(str(exc))


def test_perf_analyzer_runs_without_failures(server, tmp_path):
    art, config = server
    tool = perf_analyzer_or_skip()
    samples = [
        {name: a[0] for name, a in random_feeds(art.manifest.signature.inputs, {"batch": 1, "seq": 16}, seed=s).items()}
        for s in range(8)
    ]
    before = model_stats(config)
    rows, output = run_perf_analyzer(
        tool,
        f"127.0.0.1:{config.port}",
        MODEL,
        samples,
        [1, 4],
        out_dir=tmp_path,
        requests_per_window=40,
        stability_percent=100,  # on a shared machine: judge failures, not speed
    )
    assert [r.concurrency for r in rows] == [1, 4], output
    assert all(r.inferences_per_s > 0 for r in rows), output
    after = model_stats(config)
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"], output
    assert after["inference_stats"]["success"]["count"] > before["inference_stats"]["success"]["count"]


def test_load_test_measures_single_requests_with_perf_analyzer(server):
    art, config = server
    perf_analyzer_or_skip()
    from scripts.load_test import perf_analyzer_rows

    requests = [random_feeds(art.manifest.signature.inputs, {"batch": 1, "seq": 16}, seed=s) for s in range(8)]
    before = model_stats(config)
    rows = perf_analyzer_rows(config.port, requests, 4, True, requests_per_window=40, stability_percent=100)
    assert [(r["scenario"], r["concurrency"], r["client"]) for r in rows] == [
        ("single c=1", 1, "perf_analyzer"),
        ("single", 4, "perf_analyzer"),
    ]
    assert all(r["samples_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)
    after = model_stats(config)
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"]
    # the overhead is the client's average latency less the server's engine call, both of the same window
    for r in rows:
        assert r["avg_ms"] >= r["server_compute_ms"] >= r["server_infer_ms"] > 0
        assert r["overhead_avg_ms"] == pytest.approx(r["avg_ms"] - r["server_infer_ms"], abs=1e-9)
    # perf_analyzer's "Server Compute Infer" is the engine time tk's statistics count: over every window
    # (stabilizing ones included) the average engine call is the same order as the c=1 row's
    ran = {k: after["inference_stats"]["compute_infer"][k] - before["inference_stats"]["compute_infer"][k]
           for k in ("count", "ns")}  # fmt: skip
    engine_ms = ran["ns"] / ran["count"] / 1e6
    assert 0.25 * engine_ms <= rows[0]["server_infer_ms"] <= 4 * engine_ms, (engine_ms, rows[0])


def test_the_load_generator_keeps_each_reply_by_its_id(server):
    """tk.serve.load.clients (the load test's and --tune's clients) against this module's server: replies kept by
    the id they came back with and equal to eager; a wrong model name fails each request; one client's row."""
    from tk.runtime import load
    from tk.serve.load.clients import health_latency_ms, send_requests
    from tk.serve.load.scenarios import expected_outputs, make_requests, mismatches, one_client_row

    art, config = server
    mixed, single = make_requests(art.manifest.signature.inputs, 8, 10)
    with load(art.root, "eager") as eager:
        expected = expected_outputs(eager, mixed, max_batch=4)
    result = send_requests(config.port, MODEL, mixed, clients=3, keep="logits")
    assert sorted(result.replies) == list(range(10)) and not result.failures and result.duplicates == 0
    assert mismatches(result, expected, rtol=1e-4, atol=1e-5)[0] == 0
    unknown = send_requests(config.port, "no-such-model", single[:2], clients=1)
    assert len(unknown.failures) == 2 and not unknown.replies
    assert health_latency_ms(config.port, 3) > 0
    row = one_client_row(config.port, MODEL, art.root, single[:3], threads=1)
    assert row["requests"] == 3 and row["engine_p50_ms"] > 0 and row["health_p50_ms"] > 0
