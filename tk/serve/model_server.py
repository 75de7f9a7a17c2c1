"""The model server of ``tk serve``: one replica's requests -> batcher -> engine -> replies, without Ray.

``ModelServer`` opens the artifact once through ``tk.runtime.load`` (which verifies every file's
sha256 and the manifest's signature) and warms the engine up in its constructor, so nothing is
routed to it before it is ready. ``RequestHandler`` answers every route (``/v2/health/live``,
``/v2/health/ready``, ``/v2/models/NAME``, ``/v2/models/NAME/ready``, ``/v2/models/NAME/infer``,
``/metrics`` and Triton's extensions) with a ``Reply`` that any web framework can send;
``tk.serve.deployment`` runs both as a Ray Serve deployment.

Requests are parsed and checked before they are queued (a bad one is answered 400 and never
reaches the engine), then queued for ``tk.serve.batcher.Batcher``, which batches as Triton's
scheduler does: a batch forms when the engine is free, from the requests queued by then, up to
``max_batch`` samples (a request with several samples counts as several), waiting at most
``max_delay_ms`` past the oldest request's arrival while it is below that. Requests whose
non-batch shapes agree share one engine call; a batch below the artifact's batch minimum (a
static batch) is padded by repeating its last sample, and each request gets exactly its own rows
back. Metrics are Prometheus text (``tk.serve.metrics``) and statistics Triton's
(``tk.serve.stats``), each kept per replica and answered summed over every replica on the board.

Triton's HTTP extensions that its clients call are served too: the model configuration
(``GET /v2/models/NAME/config``, the ``ModelConfig`` that ``tk deploy triton`` writes, as JSON),
statistics (``GET /v2/models/NAME/stats``, ``GET /v2/models/stats``, summed over replicas) and
the repository index (``POST /v2/repository/index``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from tk.errors import TkError, first_line
from tk.manifest import verify_artifact
from tk.runtime.choice import open_engine
from tk.runtime.inputs import sample_dim
from tk.serve.batcher import Batcher
from tk.serve.config import ServeConfig
from tk.serve.metrics import Metrics, merge_metrics
from tk.serve.protocol import (
    InferRequest,
    NonFiniteOutputError,
    RequestTooLarge,
    UnsupportedEncoding,
    declared_length,
    decoded_body,
    encode_infer_response,
    error_body,
    json_body,
    model_metadata,
    parse_infer_request,
    too_large,
)
from tk.serve.stats import InferenceStats, merge, triton_stats
from tk.serve.triton import config_json, served_config
from tk.spec import random_feeds

log = logging.getLogger(__name__)

SERVER_METADATA = {
    "name": "tk",
    "version": "1",
    "extensions": ["binary_tensor_data", "statistics", "model_configuration", "model_repository"],
}


class ModelServer:
    """One replica's engine side: the engine, the request checks, the grouping into engine calls and
    the routes (``RequestHandler`` takes HTTP requests to it; ``tk.serve.deployment`` runs both in Ray
    Serve). ``replica``: the name its metrics carry (default ``pid<this process>``)."""

    def __init__(self, config: ServeConfig, replica: str | None = None) -> None:
        self.config = config
        self.name = str(config.name)
        self.manifest = verify_artifact(config.artifact)
        self.engine = open_engine(config.artifact, config.engine, manifest=self.manifest).load()
        self.specs = self.engine.inputs
        self.batch_dim = sample_dim(self.specs)
        limits = self.engine.dims.get(self.batch_dim)
        self.min_batch = limits.min if limits is not None else 1
        self.max_batch = int(config.max_batch or 1)
        self.metadata = model_metadata(self.manifest, self.name, f"tk_{config.engine.name}")
        self.replica = replica or f"pid{os.getpid()}"
        self.metrics = Metrics(self.name, self.replica)
        self.stats = InferenceStats()
        self.model_config = self._model_config()
        self._engine_lock = threading.Lock()
        self._warm_up()

    def _model_config(self) -> dict[str, Any]:
        """Triton's JSON model configuration of what this server serves (empty without tritonclient)."""
        try:
            message = served_config(
                self.manifest,
                name=self.name,
                engine=self.config.engine.name,
                replicas=self.config.replicas,
                max_batch=self.max_batch,
                batching=self.config.batching,
                max_delay_ms=self.config.max_delay_ms,
            )
        except TkError:  # no tritonclient: the route answers what it can
            return {"name": self.name, "platform": f"tk_{self.config.engine.name}", "max_batch_size": self.max_batch}
        return config_json(message)

    def answered(self, code: int, arrived: float, request: InferRequest | None = None) -> None:
        """Count one answered request in the metrics and Triton's statistics (``arrived``: perf_counter)."""
        self.metrics.answered(code)
        total = int((time.perf_counter() - arrived) * 1e9)
        if code == 200 and request is not None:
            self.stats.request(ok=True, total_ns=total, **{f"{k}_ns": v for k, v in request.phase_ns.items()})
        else:
            self.stats.request(ok=False, total_ns=total)

    def _warm_up(self) -> None:
        """Run the engine at batch 1 and at the max batch (opt sizes otherwise) before serving."""
        sizes = self.manifest.signature.opt_sizes()
        for batch in sorted({max(1, self.min_batch), max(self.max_batch, self.min_batch)}):
            sizes[self.batch_dim] = batch
            self.engine.run(random_feeds(self.specs, sizes, seed=batch))

    # -- requests ------------------------------------------------------------------------------
    def parse(self, body: bytes, headers: Mapping[str, str]) -> InferRequest:
        return parse_infer_request(body, headers, self.specs, self.engine.outputs, self.engine.dims, self.max_batch)

    def compute(self, requests: list[InferRequest]) -> list[dict[str, np.ndarray] | Exception]:
        """Run a batch of checked requests: one engine call per group of equal non-batch shapes."""
        self.metrics.batch_requests.observe(len(requests))
        results: list[dict[str, np.ndarray] | Exception] = [RuntimeError("not run")] * len(requests)
        groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.shape_key, []).append(index)
        for indices in groups.values():
            members = [requests[i] for i in indices]
            try:
                outputs, input_ns, infer_ns, began = self._run_group(members)
            except Exception as exc:  # one failed call fails its own requests only
                log.exception("engine call failed")
                for i in indices:
                    results[i] = exc
                continue
            start = 0
            for i, request in zip(indices, members, strict=True):
                # queued: from the batcher's queue until the engine began on it, but for gathering its inputs
                # (the engine's lock and earlier groups of the same batch included)
                queue_ns = max(0, int((began - request.enqueued) * 1e9) - input_ns)
                self.metrics.queue.observe(queue_ns / 1e9)
                request.phase_ns |= {"queue": queue_ns, "input": input_ns, "infer": infer_ns}
                stop = start + request.samples
                results[i] = {
                    name: value[start:stop] for name, value in outputs.items()
                }  # views: the engine's arrays are fresh
                start = stop
        return results

    def _run_group(self, members: list[InferRequest]) -> tuple[dict[str, np.ndarray], int, int, float]:
        """The group's outputs, the ns spent gathering its inputs and in the engine, and when the
        engine began (``perf_counter``)."""
        gathering = time.perf_counter()
        count = sum(r.samples for r in members)
        feeds = {}
        for spec in self.specs:
            parts = [r.feeds[spec.name] for r in members]
            if count < self.min_batch:  # a static (or high-minimum) batch: repeat the last sample
                parts.append(np.repeat(parts[-1][-1:], self.min_batch - count, axis=0))
            feeds[spec.name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self.metrics.batch.observe(count)
        gathered = time.perf_counter()
        with self._engine_lock:
            started = time.perf_counter()
            outputs = self.engine.run(feeds, check=False)  # every request was checked in parse
            finished = time.perf_counter()
            self.metrics.compute.observe(finished - started)
        input_ns, infer_ns = int((gathered - gathering) * 1e9), int((finished - started) * 1e9)
        self.stats.executed(max(count, self.min_batch), input_ns, infer_ns, samples=count)
        return {name: np.asarray(value) for name, value in outputs.items()}, input_ns, infer_ns, started

    def route(self, method: str, path: str) -> str:
        return route(self.name, method, path)

    def repository_index(self) -> list[dict[str, str]]:
        """Triton's ``POST /v2/repository/index`` reply: the one model, ready."""
        return [{"name": self.name, "version": "1", "state": "READY"}]


def route(name: str, method: str, path: str) -> str:
    """Which handler a request goes to: live, ready, server, model, model_ready, infer, generate,
    generate_stream, config, stats, all_stats, index, metrics, completions, openai_models, or missing
    (missing_model, missing_version)."""
    parts = [p for p in path.split("/") if p]
    if parts == ["metrics"] and method == "GET":
        return "metrics"
    if parts == ["v1", "completions"] and method == "POST":
        return "completions"
    if parts == ["v1", "models"] and method == "GET":
        return "openai_models"
    if parts[:1] != ["v2"]:
        return "missing"
    if parts == ["v2", "models", "stats"] and method == "GET":
        return "all_stats"
    if parts == ["v2", "repository", "index"] and method == "POST":
        return "index"
    if parts in (["v2", "health", "live"], ["v2", "health", "ready"]) and method == "GET":
        return parts[-1]
    if parts == ["v2"] and method == "GET":
        return "server"
    if len(parts) >= 3 and parts[1] == "models":
        rest = parts[3:]
        if len(rest) >= 2 and rest[0] == "versions":
            if rest[1] != "1":
                return "missing_version"
            rest = rest[2:]
        if parts[2] != name:
            return "missing_model"
        if not rest and method == "GET":
            return "model"
        if rest == ["ready"] and method == "GET":
            return "model_ready"
        if rest in (["infer"], ["generate"], ["generate_stream"]) and method == "POST":
            return rest[0]
        if rest in (["config"], ["stats"]) and method == "GET":
            return rest[0]
    return "missing"


@dataclass(frozen=True)
class Reply:
    """An HTTP reply as any web framework sends it (``tk.serve.deployment`` makes starlette's of it)."""

    body: bytes
    status: int = 200
    media_type: str = "application/json"
    headers: dict[str, str] | None = None  # None: the framework's own (length, media type)
    stream: AsyncIterator[bytes] | None = None  # a streamed body (server-sent events): sent as it comes, not ``body``


class Board(Protocol):
    """Where every replica's counts meet (``tk.serve.stats.Pusher`` under Ray Serve)."""

    def changed(self) -> None: ...  # this replica's counts changed

    def read(self) -> tuple[list[dict[str, Any]], list[bytes]]: ...  # every replica's snapshot and metrics text


class Served(Protocol):
    """What the routes every model answers need of a server (``ModelServer``, or
    ``tk.serve.generation_server.GenerationServer``)."""

    name: str
    metadata: dict[str, Any]
    model_config: dict[str, Any]
    metrics: Metrics
    stats: InferenceStats

    def answered(self, code: int, arrived: float, request: Any = None) -> None: ...

    def repository_index(self) -> list[dict[str, str]]: ...


class Routes:
    """The replies every served model gives besides its inferences: health, metadata, Triton's extensions,
    metrics, 404s. ``board``: where every replica's counts meet; None for a server alone."""

    server: Served
    board: Board | None
    server_metadata: ClassVar[dict[str, Any]] = SERVER_METADATA

    def _error(self, code: int, message: str, arrived: float) -> Reply:
        self.server.answered(code, arrived)
        self._changed()
        return Reply(error_body(message), status=code)

    def _changed(self) -> None:
        if self.board is not None:
            self.board.changed()

    async def _counts(self) -> tuple[list[dict[str, Any]], list[bytes]]:
        """Every replica's statistics snapshot and metrics text."""
        if self.board is None:  # a server alone: its own counts are every replica's
            return [self.server.stats.snapshot()], [self.server.metrics.text()[0]]
        return await asyncio.to_thread(self.board.read)

    async def _other(self, kind: str, method: str, path: str) -> Reply:
        """The reply to every route but the model's own inferences."""
        server = self.server
        if kind in ("live", "ready", "model_ready"):
            # a replica takes traffic only once its engine is open and warm, so answering is being ready
            return Reply(json_body({"live": True} if kind == "live" else {"ready": True}))
        replies = {"server": self.server_metadata, "model": server.metadata, "config": server.model_config}
        if kind in replies:
            return Reply(json_body(replies[kind]))
        if kind == "index":
            return Reply(json_body(server.repository_index()))
        if kind in ("stats", "all_stats", "metrics"):
            snapshots, texts = await self._counts()
            if kind == "metrics":
                return Reply(merge_metrics(texts), media_type=server.metrics.text()[1])
            return Reply(json_body(triton_stats(server.name, merge(snapshots))))
        what = {
            "missing_model": f"unknown model; this server serves {server.name!r}",
            "missing_version": "unknown model version; this server serves version 1",
            **self._not_here(),
        }
        server.metrics.answered(404)  # not an inference: Triton's statistics do not count it
        return Reply(error_body(what.get(kind, f"no route {method} {path}")), status=404)

    def _not_here(self) -> dict[str, str]:
        """Routes of another kind of model, and why this one does not answer them."""
        why = f"{self.server.name!r} is no decoder: it has no generation entry points; POST .../infer"
        return {"generate": why, "generate_stream": why, "completions": why}


class RequestHandler(Routes):
    """One replica's HTTP requests: route, read and check the body, batch, run, reply. ``board``: where
    every replica's counts meet; None for a server alone, whose own counts are all there are."""

    def __init__(self, server: ModelServer, board: Board | None = None) -> None:
        config = server.config
        self.server: ModelServer = server
        self.board = board
        self.batching = config.batching
        self.max_bytes = int(config.max_request_bytes or 1)
        delay_s = config.max_delay_ms / 1000.0
        self.batcher = Batcher(server.compute, server.max_batch, delay_s, size=lambda request: request.samples)

    async def handle(
        self, method: str, path: str, headers: Mapping[str, str], stream: Callable[[], AsyncIterator[bytes]]
    ) -> Reply:
        """The reply to one request; ``stream()`` gives its body's chunks (called for an inference only)."""
        arrived = time.perf_counter()
        kind = self.server.route(method, path)
        if kind != "infer":
            return await self._other(kind, method, path)
        try:
            body = decoded_body(await read_body(headers, stream, self.max_bytes), headers, self.max_bytes)
            parsed = self.server.parse(body, headers)
        except RequestTooLarge as exc:
            return self._error(413, first_line(exc), arrived)
        except UnsupportedEncoding as exc:
            return self._error(415, first_line(exc), arrived)
        except TkError as exc:
            return self._error(400, first_line(exc), arrived)
        return await self._infer(parsed, arrived)

    async def _infer(self, parsed: InferRequest, arrived: float) -> Reply:
        server = self.server
        parsed.enqueued = time.perf_counter()
        if self.batching:
            result = await self.batcher.submit(parsed)
        else:
            (result,) = await asyncio.to_thread(server.compute, [parsed])
        if isinstance(result, Exception):
            return self._error(500, f"engine failed: {first_line(result)}", arrived)
        encoding = time.perf_counter()
        try:
            body, headers = encode_infer_response(server.name, parsed, result)
        except NonFiniteOutputError as exc:
            return self._error(500, first_line(exc), arrived)
        parsed.phase_ns["output"] = int((time.perf_counter() - encoding) * 1e9)
        server.answered(200, arrived, parsed)
        self._changed()
        return Reply(body, headers=headers, media_type=headers["content-type"])


async def read_body(headers: Mapping[str, str], stream: Callable[[], AsyncIterator[bytes]], limit: int) -> bytes:
    """The request's body, or ``RequestTooLarge`` as soon as it is known to exceed ``limit`` bytes:
    from its Content-Length before reading anything, else while reading (a chunked body, or one
    longer than it said), so an oversized body is never held whole, let alone parsed."""
    length = declared_length(headers)
    if length is not None and length > limit:
        raise too_large(length, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)
