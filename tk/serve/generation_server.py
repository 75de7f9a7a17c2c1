"""``tk serve`` on a decoder artifact: one replica's generation requests -> the running decode batch -> tokens.

``GenerationServer`` opens the artifact (verified as every served artifact is), warms the engine up at
batch 1 and at its largest batch, and decodes every request in one running batch
(``tk.serve.generation_scheduler``). ``GenerationHandler`` answers Triton's generate extension
(``POST /v2/models/NAME/generate``, ``generate_stream`` as server-sent events), OpenAI's
``POST /v1/completions`` (streamed when asked) and ``GET /v1/models``, and the routes every served model
answers (health, metadata, statistics, metrics). ``tk.serve.generation_protocol`` reads the requests.

A streamed reply is a ``Reply`` whose ``stream`` gives the events; when the client goes away the web
framework stops reading it, which closes the token stream and takes the row out of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tk.errors import TkError, UsageError, first_line
from tk.manifest import verify_artifact
from tk.runtime.choice import open_engine
from tk.runtime.decode_batch import DecodeBatch, Row
from tk.runtime.generation import CacheLayout
from tk.serve.config import ServeConfig
from tk.serve.generation_protocol import (
    GenerationRequest,
    Limits,
    TextStream,
    openai_error,
    parse_completion,
    parse_triton_generate,
    sse,
)
from tk.serve.generation_scheduler import GenerationScheduler
from tk.serve.metrics import GenerationMetrics, Metrics
from tk.serve.model_server import SERVER_METADATA, Board, Reply, Routes, read_body
from tk.serve.protocol import RequestTooLarge, UnsupportedEncoding, decoded_body, json_body, model_metadata
from tk.serve.stats import InferenceStats

EVENT_STREAM = "text/event-stream"


class GenerationServer:
    """One replica's decoder: the engine, its running batch, the tokenizer (an ``hf:DIR`` model's, if any)."""

    def __init__(self, config: ServeConfig, replica: str | None = None) -> None:
        self.config = config
        self.name = str(config.name)
        self.manifest = verify_artifact(config.artifact)
        generation = self.manifest.generation
        self.engine = open_engine(config.artifact, config.engine, manifest=self.manifest).load()
        self.layout = CacheLayout.from_generation(generation)
        self.tokenizer = _tokenizer(self.manifest)
        self.eos = generation.get("eos_token_id")
        max_rows = int(config.max_batch or 1)
        self.limits = Limits(
            vocab_size=int(generation["vocab_size"]),
            slots=self.layout.slots,
            max_new_tokens=int(config.max_tokens or self.layout.slots - 1),
            max_prompts=max_rows,
        )
        kept = self.engine.kept_cache(own_request=True) if self.engine.keeps_cache else None  # steps run on any thread
        self.batch = DecodeBatch(
            self._step, self.layout, max_rows, pad_id=generation.get("pad_token_id") or 0, kept=kept
        )
        self.replica = replica or f"pid{os.getpid()}"
        self.metrics = Metrics(self.name, self.replica)
        self.generation_metrics = GenerationMetrics(self.metrics)
        self.stats = InferenceStats()
        self.scheduler = GenerationScheduler(self.batch, on_call=self._called, on_cancel=self._cancelled)
        self.metadata = model_metadata(self.manifest, self.name, f"tk_{config.engine.name}")
        self.model_config = {"name": self.name, "platform": f"tk_{config.engine.name}", "max_batch_size": max_rows,
                             "parameters": {"decoupled": {"string_value": "true"}}}  # fmt: skip
        self._checked: set[bool] = set()
        self.engine.generate([[0]] * max_rows, max_new_tokens=2)  # warm at the largest batch, then at 1
        self.engine.generate([[0]], max_new_tokens=2)

    def _step(self, feeds: Mapping[str, Any]) -> Mapping[str, Any]:
        decode = int(feeds["input_ids"].shape[1]) == 1
        first = decode not in self._checked  # the feeds' checks once per kind of step
        self._checked.add(decode)
        return self.engine.run(feeds, check=first)

    def _called(self, kind: str, rows: int, seconds: float) -> None:
        self.stats.executed(rows, 0, int(seconds * 1e9))
        self.generation_metrics.called(kind, rows, seconds, self.scheduler.active)

    def _cancelled(self, rows: int) -> None:
        self.generation_metrics.left(rows, self.scheduler.active)

    def answered(self, code: int, arrived: float, request: Any = None) -> None:
        self.metrics.answered(code)
        self.stats.request(ok=code == 200, total_ns=int((time.perf_counter() - arrived) * 1e9))

    def repository_index(self) -> list[dict[str, str]]:
        return [{"name": self.name, "version": "1", "state": "READY"}]

    def rows(self, request: GenerationRequest) -> list[Row]:
        stops = set(request.stop_ids) | ({self.eos} if self.eos is not None else set())
        return [Row(p, request.max_new_tokens, request.sampling, frozenset(stops)) for p in request.prompts]


def _tokenizer(manifest: Any) -> Any:
    """The tokenizer of an ``hf:DIR`` decoder's directory; None for a model without one."""
    from tk.runtime.prompts import tokenizer_of

    try:
        return tokenizer_of(manifest, "tk serve")
    except UsageError:
        return None


class GenerationHandler(Routes):
    """One replica's HTTP requests to a decoder."""

    server_metadata: ClassVar[dict[str, Any]] = {
        **SERVER_METADATA,
        "extensions": [*SERVER_METADATA["extensions"], "generate"],
    }

    def __init__(self, server: GenerationServer, board: Board | None = None) -> None:
        self.server: GenerationServer = server
        self.board = board
        self.max_bytes = int(server.config.max_request_bytes or 1)

    async def handle(
        self, method: str, path: str, headers: Mapping[str, str], stream: Callable[[], AsyncIterator[bytes]]
    ) -> Reply:
        arrived = time.perf_counter()
        from tk.serve.model_server import route

        kind = route(self.server.name, method, path)
        if kind == "openai_models":
            return Reply(json_body({"object": "list", "data": [self._openai_model()]}))
        if kind not in ("generate", "generate_stream", "completions"):
            if kind == "infer":
                return self._error(400, f"{self.server.name!r} is a decoder: POST .../generate or /v1/completions "
                                   "to generate; /infer runs one step of no use alone", arrived)  # fmt: skip
            return await self._other(kind, method, path)
        openai = kind == "completions"
        try:
            body = decoded_body(await read_body(headers, stream, self.max_bytes), headers, self.max_bytes)
            if openai:
                model, request = parse_completion(body, self.server.limits, self.server.tokenizer)
                if model is not None and model != self.server.name:
                    return self._openai_error(404, f"model {model!r:.60} not found; this server serves "
                                              f"{self.server.name!r}", arrived)  # fmt: skip
            else:
                request = parse_triton_generate(
                    body, self.server.limits, self.server.tokenizer, kind.endswith("stream")
                )
        except (RequestTooLarge, UnsupportedEncoding, TkError) as exc:
            code = 413 if isinstance(exc, RequestTooLarge) else 415 if isinstance(exc, UnsupportedEncoding) else 400
            if openai:
                return self._openai_error(code, first_line(exc), arrived)
            return self._error(code, first_line(exc), arrived)
        if openai:
            return await (self._completion_stream if request.stream else self._completion)(request, arrived)
        return await (self._triton_stream if request.stream else self._triton)(request, arrived)

    def _openai_model(self) -> dict[str, Any]:
        return {"id": self.server.name, "object": "model", "created": 0, "owned_by": "tk"}

    def _openai_error(self, code: int, message: str, arrived: float) -> Reply:
        self.server.answered(code, arrived)
        self._changed()
        return Reply(openai_error(message, code), status=code)

    # -- replies -------------------------------------------------------------------------------
    async def _collect(
        self, request: GenerationRequest, arrived: float
    ) -> tuple[list[list[int]], list[str], list[str]]:
        """Every choice's tokens, text and finish reason, once all have ended."""
        count = len(request.prompts)
        tokens: list[list[int]] = [[] for _ in range(count)]
        texts, finish = [""] * count, ["length"] * count
        async with contextlib.aclosing(generation_events(self.server, request, arrived)) as events:
            async for event in events:
                texts[event.index] += event.text
                tokens[event.index].append(event.token)
                if event.finish is not None:
                    finish[event.index] = event.finish
        return tokens, texts, finish

    async def _triton(self, request: GenerationRequest, arrived: float) -> Reply:
        try:
            tokens, texts, finish = await self._collect(request, arrived)
        except Exception as exc:
            return self._error(500, f"engine failed: {first_line(exc)}", arrived)
        self._ok(arrived, tokens)
        return Reply(json_body(self._triton_event(tokens[0], texts[0], finish[0])))

    def _triton_event(self, tokens: list[int], text: str, finish: str | None) -> dict[str, Any]:
        event: dict[str, Any] = {"model_name": self.server.name, "model_version": "1"}
        if self.server.tokenizer is not None:
            event["text_output"] = text
        event["output_ids"] = tokens
        if finish is not None:
            event["finish_reason"] = finish
        return event

    async def _triton_stream(self, request: GenerationRequest, arrived: float) -> Reply:
        async def events() -> AsyncIterator[bytes]:
            count = 0
            try:
                async with contextlib.aclosing(generation_events(self.server, request, arrived)) as running:
                    async for event in running:
                        count += 1
                        yield sse(self._triton_event([event.token], event.text, event.finish))
            except Exception as exc:  # the status line is gone: Triton sends the error as an event
                self._count_end(500, arrived)
                yield sse({"error": f"engine failed: {first_line(exc)}"})
                return
            self._ok(arrived, [[0] * count])

        return Reply(b"", media_type=EVENT_STREAM, stream=events(), headers=_STREAM_HEADERS)

    async def _completion(self, request: GenerationRequest, arrived: float) -> Reply:
        try:
            tokens, texts, finish = await self._collect(request, arrived)
        except Exception as exc:
            return self._openai_error(500, f"engine failed: {first_line(exc)}", arrived)
        self._ok(arrived, tokens)
        choices = [
            {"index": i, "text": texts[i], "logprobs": None, "finish_reason": finish[i], "token_ids": tokens[i]}
            for i in range(len(tokens))
        ]
        reply = {**self._completion_head(), "choices": choices, "usage": _usage(request, tokens)}
        return Reply(json_body(reply))

    async def _completion_stream(self, request: GenerationRequest, arrived: float) -> Reply:
        head = self._completion_head()

        async def events() -> AsyncIterator[bytes]:
            tokens: list[list[int]] = [[] for _ in request.prompts]
            try:
                async with contextlib.aclosing(generation_events(self.server, request, arrived)) as running:
                    async for event in running:
                        tokens[event.index].append(event.token)
                        choice = {"index": event.index, "text": event.text, "logprobs": None,
                                  "finish_reason": event.finish, "token_ids": [event.token]}  # fmt: skip
                        yield sse({**head, "choices": [choice]})
            except Exception as exc:
                self._count_end(500, arrived)
                yield sse(json.loads(openai_error(f"engine failed: {first_line(exc)}", 500)))
                return
            if request.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(request, tokens)})
            yield sse("[DONE]")
            self._ok(arrived, tokens)

        return Reply(b"", media_type=EVENT_STREAM, stream=events(), headers=_STREAM_HEADERS)

    def _completion_head(self) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.name}  # fmt: skip

    def _ok(self, arrived: float, tokens: list[list[int]]) -> None:
        self.server.generation_metrics.generated(sum(map(len, tokens)))
        self._count_end(200, arrived)

    def _count_end(self, code: int, arrived: float) -> None:
        self.server.answered(code, arrived)
        self._changed()


_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _usage(request: GenerationRequest, tokens: list[list[int]]) -> dict[str, int]:
    prompt = sum(map(len, request.prompts))
    completion = sum(map(len, tokens))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Event:
    """One step of one choice: its new token, the new text, and why the choice ended (None while it goes on)."""

    index: int
    token: int
    text: str
    finish: str | None


async def generation_events(
    server: GenerationServer, request: GenerationRequest, arrived: float
) -> AsyncIterator[Event]:
    """Every choice's tokens as the running batch chooses them; a choice's last token carries why it ended.
    Closing the iterator early (the client went away) cancels every row still running."""
    rows = server.rows(request)
    texts = [TextStream(server.tokenizer, request.stop) for _ in rows]
    streams = [server.scheduler.stream(row) for row in rows]
    waiting: dict[asyncio.Future[tuple[int, str | None]], int] = {}

    def wait_for(index: int) -> None:
        waiting[asyncio.ensure_future(streams[index].__anext__())] = index

    try:
        for index in range(len(rows)):
            wait_for(index)
        first = True
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: waiting[f]):
                index = waiting.pop(future)
                try:
                    token, finished = future.result()
                except StopAsyncIteration:  # a row's last token carries its ending: its stream ends after it
                    continue
                if first:
                    server.generation_metrics.first_token(time.perf_counter() - arrived)
                    first = False
                piece = texts[index].push(token)
                ended = "stop" if texts[index].stopped else finished  # a stop string, or ended in the batch
                if ended is not None:  # the last token carries the ending, as OpenAI's and Triton's streams do
                    await streams[index].aclose()  # after a stop string: the row leaves the batch
                    yield Event(index, token, piece + texts[index].finish(), ended)
                    continue
                yield Event(index, token, piece, None)
                wait_for(index)
    finally:
        for future in waiting:
            future.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
