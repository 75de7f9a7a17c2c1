"""The model server's HTTP side without Ray (``tk.serve.model_server.RequestHandler``): routes, the body
limit, the batcher, the engine and the replies with their counts, driven in this process on a real
onnxruntime engine. What the Ray deployment adds (replicas, the board, starlette) is in test_server.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tk.runtime import EngineChoice
from tk.serve.config import ServeConfig, resolve
from tk.serve.model_server import ModelServer, RequestHandler
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance


def body_of(*parts: bytes) -> Callable[[], AsyncIterator[bytes]]:
    async def stream() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return stream


def infer_body(feeds: dict[str, np.ndarray]) -> bytes:
    inputs = [
        {"name": name, "shape": list(a.shape), "datatype": "INT64", "data": a.reshape(-1).tolist()}
        for name, a in feeds.items()
    ]
    return json.dumps({"inputs": inputs}).encode()


@pytest.fixture
def served(exported):
    art = exported("transformer", ("onnx",))
    config = ServeConfig(str(art.root), engine=EngineChoice("onnx", options={"threads": 1}), max_delay_ms=50)
    server = ModelServer(resolve(config))
    return art, server, RequestHandler(server)


def test_concurrent_requests_share_one_engine_call_and_each_gets_its_own_rows(served, eager_outputs):
    art, server, handler = served
    rtol, atol, _ = artifact_tolerance(art.manifest.precision, art.manifest.model)
    feeds = [random_feeds(art.manifest.signature.inputs, {"batch": b, "seq": 16}, seed=b) for b in (1, 3, 2)]
    path = f"/v2/models/{server.name}/infer"

    async def send_all() -> list:
        # queued together: the first finds the engine free and nobody in flight, so the batch takes all three
        return await asyncio.gather(*(handler.handle("POST", path, {}, body_of(infer_body(f))) for f in feeds))

    replies = asyncio.run(send_all())
    for request, reply in zip(feeds, replies, strict=True):
        assert reply.status == 200 and reply.headers == {"content-type": "application/json"}, reply.body
        (output,) = json.loads(reply.body)["outputs"]
        got = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
        expected = eager_outputs(art.spec, request)["logits"]
        assert got.shape == expected.shape == (len(request["input_ids"]), 2)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    assert server.stats.inference_count == 6
    assert server.stats.execution_count == 1


def test_routes_refusals_and_the_counts_of_a_server_alone(served):
    _, server, handler = served
    name = server.name
    read: list[bool] = []

    def unread() -> AsyncIterator[bytes]:
        read.append(True)
        return body_of(b"{}")()

    async def exchange() -> dict[str, object]:
        infer = f"/v2/models/{name}/infer"
        oversized = {"Content-Length": str(handler.max_bytes + 1)}
        return {
            "ready": await handler.handle("GET", "/v2/health/ready", {}, unread),
            "model": await handler.handle("GET", f"/v2/models/{name}", {}, unread),
            "unknown": await handler.handle("GET", "/v2/models/nobody", {}, unread),
            "no route": await handler.handle("DELETE", "/v2", {}, unread),
            "too large": await handler.handle("POST", infer, oversized, unread),
            "encoding": await handler.handle("POST", infer, {"Content-Encoding": "br"}, body_of(b"x")),
            "bad": await handler.handle("POST", infer, {}, body_of(b'{"inputs": [', b"1]}")),
            "stats": await handler.handle("GET", f"/v2/models/{name}/stats", {}, unread),
            "metrics": await handler.handle("GET", "/metrics", {}, unread),
        }

    replies = asyncio.run(exchange())
    assert not read, "only an inference reads its body, and an oversized one is refused from its Content-Length"
    assert (replies["ready"].status, json.loads(replies["ready"].body)) == (200, {"ready": True})
    assert json.loads(replies["model"].body)["name"] == name
    assert replies["unknown"].status == 404
    assert json.loads(replies["unknown"].body) == {"error": f"unknown model; this server serves {name!r}"}
    assert json.loads(replies["no route"].body) == {"error": "no route DELETE /v2"}
    codes = {key: replies[key].status for key in ("too large", "encoding", "bad")}
    assert codes == {"too large": 413, "encoding": 415, "bad": 400}
    assert "over this server's limit" in json.loads(replies["too large"].body)["error"]
    (model,) = json.loads(replies["stats"].body)["model_stats"]
    assert model["inference_stats"]["fail"]["count"] == 3  # the refused inferences; 404s are no inferences
    assert model["inference_stats"]["success"]["count"] == model["inference_count"] == 0
    requests = {
        sample.labels["code"]: sample.value
        for family in text_string_to_metric_families(replies["metrics"].body.decode())
        for sample in family.samples
        if sample.name == "tk_requests_total"
    }
    assert requests == {"404": 2.0, "413": 1.0, "415": 1.0, "400": 1.0}
