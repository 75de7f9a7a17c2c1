"""``tk serve`` on a decoder, on a local Ray instance over loopback HTTP: concurrent streaming clients get
the tokens ``tk generate`` gives, OpenAI's streamed completions end in ``[DONE]``, and a client that hangs
up mid-stream takes its sequence out of the decode batch (seen in the server's own metrics)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request

import pytest
from click.testing import CliRunner

pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import app_on_local_ray
from tk.cli import cli
from tk.runtime import load

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The small built-in decoder (random weights, 256 slots) for onnx, served with a batch of 8."""
    out = tmp_path_factory.mktemp("decoder-http") / "decoder"
    result = CliRunner().invoke(cli, ["export", "decoder", "--size", "small", "--format", "onnx", "--out", str(out)])
    assert result.exit_code == 0, result.output
    with app_on_local_ray(type("Art", (), {"root": out}), max_batch=8, request_timeout_s=120.0) as config:
        yield out, config


def post(config, path, body):
    connection = http.client.HTTPConnection("127.0.0.1", config.port, timeout=TIMEOUT_S)
    connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    return connection, connection.getresponse()


def events(response):
    """The JSON of each server-sent event, as it arrives."""
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


def metrics(config) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{config.port}/metrics", timeout=TIMEOUT_S) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("kind")
    }


def test_eight_streaming_clients_get_the_tokens_of_tk_generate(served):
    art, config = served
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(8)]
    got: dict[int, list] = {}

    def client(index):
        connection, response = post(config, f"/v2/models/{config.name}/generate_stream",
                                    {"input_ids": prompts[index], "max_tokens": 32, "temperature": 0})  # fmt: skip
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        got[index] = list(events(response))
        connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    with load(art, engine="onnx") as engine:
        for index, prompt in enumerate(prompts):
            tokens = [t for e in got[index] for t in e["output_ids"]]
            assert tokens == engine.generate([prompt], max_new_tokens=32, stop_ids=[]).tokens[0], index
            assert got[index][-1]["finish_reason"] == "length"


def test_openai_streaming_over_http_ends_with_done(served):
    _, config = served
    connection, response = post(config, "/v1/completions",
                                {"model": config.name, "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                 "stream": True})  # fmt: skip
    received = list(events(response))
    connection.close()
    assert received[-1] == "[DONE]" and len(received) == 6  # five tokens (the last with the ending), [DONE]
    assert received[-2]["choices"][0]["finish_reason"] == "length"
    connection, response = post(config, "/v1/completions", {"prompt": [1] * 250, "max_tokens": 10})
    assert response.status == 400 and "context is 256 tokens" in json.loads(response.read())["error"]["message"]


def test_a_client_that_hangs_up_leaves_the_batch(served):
    _, config = served
    before = metrics(config).get("tk_cancelled_sequences_total", 0.0)
    connection, response = post(config, f"/v2/models/{config.name}/generate_stream",
                                {"input_ids": [1, 2, 3], "max_tokens": 250, "temperature": 0})  # fmt: skip
    first = next(events(response))
    assert len(first["output_ids"]) == 1
    connection.sock.close()  # hang up mid-stream
    connection.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = metrics(config)
        if now.get("tk_cancelled_sequences_total", 0.0) > before and now.get("tk_active_sequences") == 0:
            break
        time.sleep(0.2)
    assert now.get("tk_cancelled_sequences_total", 0.0) == before + 1, now
    assert now.get("tk_active_sequences") == 0
