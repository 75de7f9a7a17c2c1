"""``tk serve`` on a decoder without Ray: continuous batching (``tk.runtime.decode_batch``), the scheduler,
Triton's generate extension and OpenAI's completions (``tk.serve.generation_server``), driven in this
process on a real onnxruntime engine of the tiny built-in decoder. The Ray deployment over HTTP is in
test_generation_http.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from click.testing import CliRunner

from tests.serve.conftest import drained
from tk.cli import cli
from tk.runtime import EngineChoice, load
from tk.runtime.decode_batch import DecodeBatch, Row
from tk.runtime.generation import CacheLayout, Sampling
from tk.runtime.registry import available_engines
from tk.serve.config import ServeConfig, resolve
from tk.serve.generation_server import GenerationHandler, GenerationServer


def body_of(value: object):
    data = value if isinstance(value, bytes) else json.dumps(value).encode()

    async def stream():
        yield data

    return stream


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """The tiny decoder (random weights, 64 slots) exported for onnx and openvino (whose IR keeps the cache)."""
    out = tmp_path_factory.mktemp("serve-decoder") / "decoder"
    formats = ["--format", "onnx"] + (["--format", "openvino"] if "openvino" in available_engines() else [])
    result = CliRunner().invoke(cli, ["export", "decoder", "--size", "tiny", *formats, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def engine(decoder):
    with load(decoder, engine="onnx") as opened:
        yield opened


def expected_tokens(engine, prompt, new_tokens, sampling=None):
    """What ``tk generate`` gives for ``prompt`` alone."""
    return engine.generate([prompt], max_new_tokens=new_tokens, sampling=sampling, stop_ids=[]).tokens[0]


@pytest.fixture
def handler(decoder):
    config = resolve(ServeConfig(str(decoder), engine=EngineChoice("onnx", options={"threads": 1})))
    return GenerationHandler(GenerationServer(config))


@pytest.mark.parametrize(("name", "kept_cache"), [("onnx", False), ("openvino", True), ("openvino", False)])
def test_rows_joining_and_leaving_the_batch_get_the_tokens_each_would_get_alone(decoder, name, kept_cache):
    """24 prompts of 1-19 tokens wanting 1-39 new ones, admitted at random between steps into a batch of 8
    with a cache of 64 slots: the cache must move, and every row's tokens are still its own. OpenVINO's IR keeps
    its cache: the batch decodes on it and takes it back where rows join or leave (``kept_cache``), or hands it
    the static cache at every step (its ``run``, the artifact's step signature)."""
    if name not in available_engines():
        pytest.skip(f"engine {name} is not installed")
    engine = load(decoder, engine=name)
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(1, 20))] for _ in range(24)]
    wanted = [rng.randrange(1, 40) for _ in prompts]
    kept = engine.kept_cache(own_request=True) if engine.keeps_cache and kept_cache else None
    batch = DecodeBatch(engine.run, CacheLayout.from_generation(engine.manifest.generation), max_rows=8, kept=kept)
    rows = [Row(p, n) for p, n in zip(prompts, wanted, strict=True)]
    waiting, most = list(rows), 0
    while waiting or batch.rows:
        taken = []
        while waiting and rng.random() < 0.5 and batch.room_for([*taken, waiting[0]]):
            taken.append(waiting.pop(0))
        if taken or not batch.rows:
            batch.admit(taken or [waiting.pop(0)])
        else:
            batch.step()
        most = max(most, len(batch.rows))
        batch.drop([r for r in batch.rows if r.finish])
    assert batch.moves > 0 and most > 1
    for row, prompt, new in zip(rows, prompts, wanted, strict=True):
        assert len(row.tokens) == new and row.finish == "length"
        assert row.tokens == expected_tokens(engine, prompt, new)


@pytest.fixture(params=["onnx", "openvino"])
def any_handler(request, decoder):
    """A handler on each engine: onnx runs the artifact's step, openvino keeps the cache in its IR."""
    if request.param not in available_engines():
        pytest.skip(f"engine {request.param} is not installed")
    config = resolve(ServeConfig(str(decoder), engine=EngineChoice(request.param, options={"threads": 1})))
    return GenerationHandler(GenerationServer(config))


def test_eight_concurrent_streams_are_decoded_together_and_match_tk_generate(any_handler, engine):
    handler = any_handler
    server = handler.server
    assert server.batch.kept is None if server.engine.name == "onnx" else server.batch.kept is not None
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(2, 12))] for _ in range(8)]
    path = f"/v2/models/{server.name}/generate_stream"

    async def one(prompt):
        body = {"input_ids": prompt, "parameters": {"max_tokens": 24, "temperature": 0}}
        reply = await handler.handle("POST", path, {}, body_of(body))
        assert reply.status == 200 and reply.media_type == "text/event-stream"
        events = [json.loads(chunk.decode().removeprefix("data: ")) async for chunk in reply.stream]
        return events

    async def every():
        return await asyncio.gather(*(one(p) for p in prompts))

    for prompt, events in zip(prompts, asyncio.run(every()), strict=True):
        tokens = [t for e in events for t in e["output_ids"]]
        assert tokens == expected_tokens(engine, prompt, 24)
        assert len(events) == 24 and events[-1]["finish_reason"] == "length"
        assert all("finish_reason" not in e for e in events[:-1])
    assert max(server.scheduler.counts.rows_per_step) > 1  # decode steps ran several clients' rows together
    assert server.scheduler.active == 0 and not server.batch.rows


def test_triton_generate_and_openai_completions_reply_with_the_tokens(handler, engine):
    server = handler.server
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45]]

    async def send():
        triton = await handler.handle("POST", f"/v2/models/{server.name}/generate", {},
                                      body_of({"input_ids": prompts[0], "max_tokens": 5, "temperature": 0}))  # fmt: skip
        openai = await handler.handle("POST", "/v1/completions", {},
                                      body_of({"model": server.name, "prompt": prompts, "max_tokens": 6,
                                               "temperature": 0}))  # fmt: skip
        streamed = await handler.handle("POST", "/v1/completions", {},
                                        body_of({"prompt": prompts[1], "max_tokens": 4, "temperature": 0,
                                                 "stream": True, "stream_options": {"include_usage": True}}))  # fmt: skip
        chunks = [c.decode() async for c in streamed.stream]
        models = await handler.handle("GET", "/v1/models", {}, body_of(b""))
        return triton, openai, chunks, models

    triton, openai, chunks, models = asyncio.run(send())
    assert json.loads(triton.body) == {
        "model_name": server.name, "model_version": "1", "output_ids": expected_tokens(engine, prompts[0], 5),
        "finish_reason": "length",
    }  # fmt: skip
    reply = json.loads(openai.body)
    assert reply["object"] == "text_completion" and reply["model"] == server.name
    assert [c["token_ids"] for c in reply["choices"]] == [expected_tokens(engine, p, 6) for p in prompts]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    assert chunks[-1] == "data: [DONE]\n\n"
    events = [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == expected_tokens(engine, prompts[1], 4)
    assert events[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]] == [None, None, None, "length"]
    assert json.loads(models.body)["data"][0]["id"] == server.name


def test_seeded_sampling_matches_tk_generate_with_the_same_seed(handler, engine):
    sampling = Sampling(temperature=0.8, top_k=20, seed=7)

    async def send():
        body = {"input_ids": [1, 2, 3], "max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 7}
        return await handler.handle("POST", f"/v2/models/{handler.server.name}/generate", {}, body_of(body))

    reply = asyncio.run(send())
    assert json.loads(reply.body)["output_ids"] == expected_tokens(engine, [1, 2, 3], 12, sampling)


@pytest.mark.parametrize(
    "path, body, code, message",
    [
        ("generate", b"{not json", 400, "malformed JSON"),
        ("generate", {"input_ids": [1], "colour": 1}, 400, "'colour'"),
        ("generate", {"input_ids": [1], "text_input": "a"}, 400, "exactly one of text_input"),
        ("generate", {"text_input": "hello"}, 400, "needs the model's tokenizer"),
        ("generate", {"input_ids": [64]}, 400, "token ids in [0, 64)"),
        ("generate", {"input_ids": [1] * 60, "max_tokens": 10}, 400, "context is 64 tokens"),
        ("generate", {"input_ids": [1], "max_tokens": 0}, 400, "max_tokens: expected an integer in [1, 63]"),
        ("generate", {"input_ids": [1], "temperature": "hot"}, 400, "temperature: expected a number"),
        ("infer", {"inputs": []}, 400, "is a decoder"),
        ("/v1/completions", {"prompt": [1], "n": 2}, 400, "n: not supported"),
        ("/v1/completions", {"prompt": [1], "logprobs": 3}, 400, "logprobs: not supported"),
        ("/v1/completions", {"prompt": [[1]] * 9}, 400, "expected 1 to 8 prompts"),
        ("/v1/completions", {"prompt": [1], "stop": "x"}, 400, "stop strings need the model's tokenizer"),
        ("/v1/completions", {"model": "other", "prompt": [1]}, 404, "model 'other' not found"),
    ],
)
def test_bad_requests_are_one_line_and_never_reach_the_engine(handler, path, body, code, message):
    server = handler.server
    url = path if path.startswith("/") else f"/v2/models/{server.name}/{path}"
    reply = asyncio.run(handler.handle("POST", url, {}, body_of(body)))
    assert reply.status == code, reply.body
    error = json.loads(reply.body)["error"]
    text = error["message"] if isinstance(error, dict) else error
    assert message in text and "\n" not in text
    assert server.scheduler.counts.prefills == 0


def test_a_client_that_goes_away_leaves_the_batch(handler):
    server = handler.server

    async def go_away():
        body = {"input_ids": [1, 2], "max_tokens": 60, "temperature": 0}
        reply = await handler.handle("POST", f"/v2/models/{server.name}/generate_stream", {}, body_of(body))
        stream = reply.stream
        first = await stream.__anext__()
        await stream.aclose()  # what the web framework does when the client disconnects
        await drained(server)  # the worker drops the row before its next step
        return first

    first = asyncio.run(go_away())
    assert len(json.loads(first.decode().removeprefix("data: "))["output_ids"]) == 1
    assert server.scheduler.counts.cancelled == 1 and not server.batch.rows and server.scheduler.active == 0
    assert server.scheduler.counts.tokens < 60


def test_a_reader_slower_than_the_batch_gets_every_token_and_the_ending_on_the_last(handler, engine):
    """The batch runs on while a client reads slowly: every token reaches it, and the ending rides on the token
    it belongs to (not on one read while the row had already ended further on)."""
    server = handler.server

    async def slow():
        body = {"input_ids": [4, 5, 6], "max_tokens": 12, "temperature": 0}
        reply = await handler.handle("POST", f"/v2/models/{server.name}/generate_stream", {}, body_of(body))
        events = []
        async for chunk in reply.stream:
            events.append(json.loads(chunk.decode().removeprefix("data: ")))
            if len(events) == 1:
                await drained(server)  # let the batch finish the row before reading on
        return events

    events = asyncio.run(slow())
    assert [t for e in events for t in e["output_ids"]] == expected_tokens(engine, [4, 5, 6], 12)
    assert [e.get("finish_reason") for e in events] == [None] * 11 + ["length"]


def test_serve_flags_a_decoder_does_not_take_or_takes_out_of_range_are_one_line(decoder, tmp_path):
    from tk.errors import UsageError

    tune = CliRunner().invoke(cli, ["serve", str(decoder), "--tune"])
    assert tune.exit_code == 2 and "--tune: expected a one-call model" in tune.stderr and "Traceback" not in tune.output
    with pytest.raises(UsageError, match=r"^--max-tokens: expected 1 to 63 \(the artifact's cache holds 64 slots"):
        resolve(ServeConfig(str(decoder), max_tokens=64))
    mlp = tmp_path / "mlp"
    assert CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--out", str(mlp)]).exit_code == 0
    with pytest.raises(UsageError, match=r"^--max-tokens: expected a decoder artifact, found 'mlp'"):
        resolve(ServeConfig(str(mlp), max_tokens=8))
