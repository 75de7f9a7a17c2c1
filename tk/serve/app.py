"""``tk serve``: an artifact behind Ray Serve, speaking KServe v2 over HTTP, with dynamic batching.

One deployment answers every route (``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/NAME``,
``/v2/models/NAME/ready``, ``/v2/models/NAME/infer``, ``/metrics``). Each replica opens the
artifact once through ``tk.runtime.load`` (which verifies every file's sha256 and the manifest's
signature) and warms the engine up in its constructor, so Ray Serve routes nothing to it before
it is ready.

Requests are parsed and checked in ``__call__`` (a bad one is answered 400 there and never
reaches the engine), then queued for ``tk.serve.batcher.Batcher``, which batches as Triton's
scheduler does: a batch forms when the engine is free, from the requests queued by then, up to
``max_batch`` samples (a request with several samples counts as several), waiting at most
``max_delay_ms`` past the oldest request's arrival while it is below that. Requests whose
non-batch shapes agree share one engine call; a batch below the artifact's batch minimum (a
static batch) is padded by repeating its last sample, and each request gets exactly its own rows
back. Ray Serve's ``max_queued_requests`` turns a full queue
into an immediate 503. Metrics are Prometheus text from ``prometheus_client``, kept per replica
and answered summed over every replica (``tk.serve.stats``).

Triton's HTTP extensions that its clients call are served too: the model configuration
(``GET /v2/models/NAME/config``, the ``ModelConfig`` that ``tk deploy triton`` writes, as JSON),
statistics (``GET /v2/models/NAME/stats``, ``GET /v2/models/stats``, summed over replicas) and
the repository index (``POST /v2/repository/index``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import InputError, TkError, UsageError, first_line
from tk.manifest import verify_artifact
from tk.runtime.choice import EngineChoice, open_engine
from tk.runtime.inputs import sample_dim
from tk.serve.batcher import Batcher
from tk.serve.cluster import (
    RayConnection,
    connect,
    disconnect,
    keep_replica_grpc_on_loopback,
    serve_is_running,
    while_local_ray_lives,
)
from tk.serve.ingress import check_ingress, free_ports, ingress_env, require_free_port
from tk.serve.protocol import (
    InferRequest,
    NonFiniteOutputError,
    RequestTooLarge,
    UnsupportedEncoding,
    check_model_name,
    declared_length,
    decoded_body,
    default_model_name,
    encode_infer_response,
    error_body,
    json_body,
    max_request_bytes,
    model_metadata,
    parse_infer_request,
    too_large,
)
from tk.serve.reaper import reap, watch
from tk.serve.stats import InferenceStats, Pusher, merge, merge_metrics, remove_board, triton_stats
from tk.serve.triton import config_json, served_config
from tk.signing import explicit_policy
from tk.spec import random_feeds

log = logging.getLogger(__name__)

APP_NAME = "tk-serve"
DEFAULT_PORT = 8000
MIN_SHARE = 1e-4  # the finest fraction of a CPU or GPU Ray schedules


@dataclass(frozen=True)
class ServeConfig:
    """What ``tk serve`` runs. ``None`` means the default, resolved by ``resolve``."""

    artifact: str
    engine: EngineChoice = field(default_factory=EngineChoice)  # one engine name, device, options, failure policy
    name: str | None = None  # model name in URLs (default: the manifest's model name)
    host: str = "127.0.0.1"  # address the HTTP proxy binds
    port: int = DEFAULT_PORT
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_batch: int | None = None  # samples per engine call (default: the artifact's batch max)
    batching: bool = True  # False: each request runs alone, as soon as the engine is free
    max_delay_ms: float = 0.0  # longest wait past the oldest request for a batch below max_batch to fill
    max_queue: int = 64  # requests waiting for a replica before 503s (-1: unbounded)
    max_ongoing: int | None = None  # requests a replica holds at once (default: 2 x max_batch, at least 8)
    request_timeout_s: float = 20.0  # the proxy answers an error past this (while a replica restarts, say): no hangs
    ingress: str = "proxy"  # or haproxy (tk.serve.ingress)
    max_request_bytes: int | None = None  # larger bodies get 413 unread (default: the largest valid request)


def resolve(config: ServeConfig) -> ServeConfig:
    """Check ``config`` against the artifact and fill in its defaults; raises ``UsageError``."""
    manifest = verify_artifact(config.artifact)
    require_batch_first_outputs(manifest.signature)
    batch = manifest.signature.dims.get(sample_dim(manifest.signature.inputs))
    limit = batch.max if batch is not None else None
    max_batch = config.max_batch if config.max_batch is not None else (limit or 8)
    if max_batch < 1:
        raise UsageError(f"--max-batch: expected 1 or more, got {max_batch}")
    if not (math.isfinite(config.request_timeout_s) and config.request_timeout_s > 0):
        raise UsageError(
            f"--request-timeout: expected a finite number of seconds above 0, got {config.request_timeout_s}"
        )
    if limit is not None and max_batch > limit:
        raise UsageError(f"--max-batch {max_batch}: this artifact's batch max is {limit}; use at most {limit}")
    if config.replicas < 1:
        raise UsageError(f"--replicas: expected 1 or more, got {config.replicas}")
    if not (math.isfinite(config.max_delay_ms) and config.max_delay_ms >= 0):
        raise UsageError(f"--max-delay-ms: expected a finite 0 or more, got {config.max_delay_ms}")
    for flag, share in (
        ("--cpus-per-replica", config.cpus_per_replica),
        ("--gpus-per-replica", config.gpus_per_replica),
    ):
        if not (math.isfinite(share) and (share == 0 or share >= MIN_SHARE)):  # Ray refuses finer fractions
            raise UsageError(f"{flag}: expected 0 or a finite {MIN_SHARE:g} or more, got {share}")
    # what a replica's load would refuse (engine missing here, format absent, failed check, a bad option),
    # refused now in one line: constructing the engine runs those checks and loads nothing
    open_engine(config.artifact, config.engine, manifest=manifest)
    if config.max_queue < -1 or config.max_queue == 0:
        raise UsageError(f"--max-queue: expected 1 or more (or -1 for unbounded), got {config.max_queue}")
    if not 0 < config.port < 65536:
        raise UsageError(f"--port: expected 1 to 65535, got {config.port}")
    ingress = check_ingress(config.ingress)
    name = check_model_name(config.name) if config.name is not None else default_model_name(manifest)
    max_ongoing = config.max_ongoing or max(8, 2 * max_batch)
    sig = manifest.signature
    max_bytes = config.max_request_bytes
    if max_bytes is None:
        max_bytes = max_request_bytes(sig.inputs, sig.dims, max_batch)
    elif max_bytes < 1:
        raise UsageError(f"--max-request-bytes: expected 1 or more, got {max_bytes}")
    # onnxruntime's idle threads spin by default; in a server they take the cores from the ingress
    # and the event loop between requests (one client, small Transformer at seq 16, haproxy ingress:
    # 6.8 ms served with spinning, 4.2 ms without, engine alone 1.7-2.3 ms)
    engine = config.engine.with_defaults({"spinning": False}, [config.engine.name])
    engine = engine.replace(trust=explicit_policy(engine.trust))  # replicas may not share this process's settings
    return ServeConfig(
        **{
            **config.__dict__,
            "artifact": str(Path(config.artifact).resolve()),
            "name": name,
            "max_batch": max_batch,
            "max_ongoing": max_ongoing,
            "max_request_bytes": max_bytes,
            "engine": engine,
            "ingress": ingress,
        }
    )


def require_batch_first_outputs(signature: Any) -> None:
    """``UsageError`` unless every output holds the inputs' batch dimension first: a batch's outputs are
    split back into each request's own rows along axis 0."""
    batch = sample_dim(signature.inputs)
    for spec in signature.outputs:
        if not spec.shape or spec.shape[0] != batch:
            raise UsageError(
                f"tk serve: expected every output to hold the batch dimension {batch!r} first (each request gets "
                f"its own rows of it), got output {spec.name!r} of shape {list(spec.shape)}"
            )


class Metrics:
    """The Prometheus metrics of one replica (its own registry, labelled with the replica)."""

    def __init__(self, model: str, replica: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        labels = {"model": model, "replica": replica}
        names = list(labels)
        self.requests = Counter(
            "tk_requests", "Inference requests answered, by HTTP status code", [*names, "code"], registry=self.registry
        )
        self.errors = Counter(
            "tk_errors", "Inference requests answered with an error", [*names, "code"], registry=self.registry
        )
        buckets_batch = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch = Histogram(
            "tk_batch_samples", "Samples per engine call", names, buckets=buckets_batch, registry=self.registry
        ).labels(**labels)
        self.batch_requests = Histogram(
            "tk_batch_requests", "Requests per batch", names, buckets=buckets_batch, registry=self.registry
        ).labels(**labels)
        seconds = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
        self.queue = Histogram(
            "tk_queue_seconds",
            "Time a request waited for its batch to start",
            names,
            buckets=seconds,
            registry=self.registry,
        ).labels(**labels)
        self.compute = Histogram(
            "tk_compute_seconds", "Engine time per call", names, buckets=seconds, registry=self.registry
        ).labels(**labels)
        self._labels = labels

    def answered(self, code: int) -> None:
        self.requests.labels(**self._labels, code=str(code)).inc()
        if code >= 400:
            self.errors.labels(**self._labels, code=str(code)).inc()

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ModelServer:
    """One replica: the engine, the request checks, the batching and the routes (plain class; the
    Ray Serve deployment wraps it in ``deployment``)."""

    def __init__(self, config: ServeConfig) -> None:
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
        self.replica = _replica_id()
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
        """Which handler a request goes to: live, ready, server, model, model_ready, infer, config,
        stats, all_stats, index, metrics, or missing (missing_model, missing_version)."""
        parts = [p for p in path.split("/") if p]
        if parts == ["metrics"] and method == "GET":
            return "metrics"
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
            if parts[2] != self.name:
                return "missing_model"
            if not rest and method == "GET":
                return "model"
            if rest == ["ready"] and method == "GET":
                return "model_ready"
            if rest == ["infer"] and method == "POST":
                return "infer"
            if rest in (["config"], ["stats"]) and method == "GET":
                return rest[0]
        return "missing"

    def repository_index(self) -> list[dict[str, str]]:
        """Triton's ``POST /v2/repository/index`` reply: the one model, ready."""
        return [{"name": self.name, "version": "1", "state": "READY"}]


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:  # outside a Serve replica (a test of the plain class)
        return f"pid{os.getpid()}"


def deployment(config: ServeConfig) -> Any:
    """The Ray Serve application for ``config`` (resolved), ready for ``serve.run``."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    max_batch = int(config.max_batch or 1)
    delay_s = config.max_delay_ms / 1000.0
    batching = config.batching
    max_bytes = int(config.max_request_bytes or 1)

    @serve.deployment(
        name="tk-model",
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.cpus_per_replica, "num_gpus": config.gpus_per_replica},
        max_ongoing_requests=int(config.max_ongoing or 8),
        max_queued_requests=config.max_queue,
        graceful_shutdown_timeout_s=30.0,
        health_check_period_s=2.0,
    )
    class TkModel:
        def __init__(self, config: ServeConfig) -> None:
            keep_replica_grpc_on_loopback()
            self.server = ModelServer(config)
            server = self.server
            self.batcher = Batcher(server.compute, max_batch, delay_s, size=lambda request: request.samples)
            self.pusher = Pusher(server.replica, server.stats, lambda: server.metrics.text()[0])
            self.pusher.push(wait=True)  # on the board before the first request, so every replica is counted

        def __del__(self) -> None:
            pusher = getattr(self, "pusher", None)
            if pusher is not None:
                pusher.close()

        async def __call__(self, request: Request) -> Response:
            arrived = time.perf_counter()
            server = self.server
            kind = server.route(request.method, request.url.path)
            if kind != "infer":
                return await _answer_other(kind, request, server, self.pusher)
            try:
                body = decoded_body(await _read_body(request, max_bytes), request.headers, max_bytes)
                parsed = server.parse(body, request.headers)
            except RequestTooLarge as exc:
                return self._error(413, first_line(exc), arrived)
            except UnsupportedEncoding as exc:
                return self._error(415, first_line(exc), arrived)
            except TkError as exc:
                return self._error(400, first_line(exc), arrived)
            parsed.enqueued = time.perf_counter()
            if batching:
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
            self.pusher.changed()
            return Response(body, headers=headers, media_type=headers["content-type"])

        def _error(self, code: int, message: str, arrived: float) -> Response:
            self.server.answered(code, arrived)
            self.pusher.changed()
            return Response(error_body(message), status_code=code, media_type="application/json")

    return TkModel.bind(config)


SERVER_METADATA = {
    "name": "tk",
    "version": "1",
    "extensions": ["binary_tensor_data", "statistics", "model_configuration", "model_repository"],
}


async def _answer_other(kind: str, request: Any, server: ModelServer, pusher: Pusher) -> Any:
    """The reply to every route but infer: health, metadata, Triton's extensions, metrics, 404s."""
    from starlette.responses import Response

    def json_reply(content: Any) -> Any:
        return Response(json_body(content), media_type="application/json")

    if kind in ("live", "ready", "model_ready"):
        # a replica takes traffic only once its engine is open and warm, so answering is being ready
        return json_reply({"live": True} if kind == "live" else {"ready": True})
    if kind == "server":
        return json_reply(SERVER_METADATA)
    if kind == "model":
        return json_reply(server.metadata)
    if kind == "config":
        return json_reply(server.model_config)
    if kind == "index":
        return json_reply(server.repository_index())
    if kind in ("stats", "all_stats", "metrics"):
        snapshots, texts = await asyncio.to_thread(pusher.read)
        if kind == "metrics":
            return Response(merge_metrics(texts), media_type=server.metrics.text()[1])
        return json_reply(triton_stats(server.name, merge(snapshots)))
    what = {
        "missing_model": f"unknown model; this server serves {server.name!r}",
        "missing_version": "unknown model version; this server serves version 1",
    }
    server.metrics.answered(404)  # not an inference: Triton's statistics do not count it
    message = what.get(kind, f"no route {request.method} {request.url.path}")
    return Response(error_body(message), status_code=404, media_type="application/json")


async def _read_body(request: Any, limit: int) -> bytes:
    """The request's body, or ``RequestTooLarge`` as soon as it is known to exceed ``limit`` bytes:
    from its Content-Length before reading anything, else while reading (a chunked body, or one
    longer than it said), so an oversized body is never held whole, let alone parsed."""
    length = declared_length(request.headers)
    if length is not None and length > limit:
        raise too_large(length, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class RunningServer:
    """What ``start`` started: the resolved config and the Ray connection ``stop`` undoes."""

    config: ServeConfig
    connection: RayConnection
    owns_serve: bool  # Serve was started by start, and stop shuts it down
    state_dir: Path | None = None  # HAProxy's files on this machine, removed by stop
    haproxy_ports: dict[str, int] = field(default_factory=dict)  # HAProxy's stats and metrics ports here
    watcher: Any = None  # tk.serve.reaper's process: stops HAProxy if this process ends without stop

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"http://{host}:{self.config.port}"


def start(config: ServeConfig, *, address: str | None = None, num_cpus: int | None = None) -> RunningServer:
    """Start (or join, with ``address``) Ray, then Serve with the app; returns once every replica is
    ready and the server answers on its port. Stop it with ``stop``.

    The ingress's settings reach Ray only when this call connects: a process already connected to
    Ray (or a cluster whose Serve already runs) serves through the ingress Ray was started with."""
    import ray
    from ray import serve

    config = resolve(config)
    if not address and not ray.is_initialized():  # a Ray instance of our own: its proxy will bind this port
        require_free_port(config.host, config.port)
    ports, state_dir, watcher = None, None, None
    if config.ingress == "haproxy" and not address:  # on a cluster, HAProxy's ports and files are each node's
        ports = dict(zip(("stats", "metrics", "fallback"), free_ports(3), strict=True))
        state_dir = Path(tempfile.mkdtemp(prefix="tk-haproxy-"))
        watcher = watch(os.getpid(), state_dir)
    try:
        connection = connect(address=address, num_cpus=num_cpus, env_vars=ingress_env(config.ingress, ports, state_dir))
    except BaseException:
        _remove_haproxy(state_dir, watcher)
        raise
    # Serve that runs already (another app on the cluster) stays when we stop; Serve we start goes with us
    owns_serve = connection.local or not serve_is_running()
    running = RunningServer(config, connection, owns_serve, state_dir, ports or {}, watcher)
    try:
        if connection.local:  # Serve would wait forever for replicas this machine cannot place
            require_room(config, ray.cluster_resources())
        serve.start(
            http_options={"host": config.host, "port": config.port, "request_timeout_s": config.request_timeout_s}
        )
        serve.run(deployment(config), name=APP_NAME, route_prefix="/")
        _wait_until_ready(running)
    except BaseException:
        _shutdown(running)
        raise
    return running


def require_room(config: ServeConfig, resources: Mapping[str, float]) -> None:
    """``UsageError`` unless ``config``'s replicas fit ``resources`` (Ray's ``cluster_resources()``)."""
    for flag, share, kind in (
        ("--cpus-per-replica", config.cpus_per_replica, "CPU"),
        ("--gpus-per-replica", config.gpus_per_replica, "GPU"),
    ):
        needed, present = config.replicas * share, float(resources.get(kind, 0.0))
        if needed > present + 1e-9:
            raise UsageError(
                f"--replicas {config.replicas} x {flag} {share:g}: expected at most {present:g} {kind}s in all "
                f"(what this machine's Ray has), got {needed:g}; use fewer replicas or a smaller share"
            )


def _wait_until_ready(running: RunningServer, timeout_s: float = 30.0) -> None:
    """``/v2/health/ready`` answers 200 on the server's port (HAProxy takes a moment to learn of a
    new replica), or one line saying it did not."""
    if not ready_within(running.url, timeout_s):
        raise UsageError(
            f"tk serve: expected {running.url}/v2/health/ready to answer within {timeout_s:g} s, it did not"
        )


def ready_within(url: str, timeout_s: float) -> bool:
    """Whether ``URL/v2/health/ready`` answers 200 within ``timeout_s`` seconds (asked at least once)."""
    import http.client
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as reply:
                if reply.status == 200:
                    return True
        except (OSError, http.client.HTTPException):  # refused, reset, 503 (URLError), or no HTTP (BadStatusLine)
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def stop(running: RunningServer) -> None:
    """Delete the app (Serve waits for the requests in flight); stop Serve and Ray only where ``start``
    started them (a joined cluster, or a caller's Ray, keeps running)."""
    from ray import serve

    try:
        while_local_ray_lives(lambda: serve.delete(APP_NAME), running.connection)
    finally:
        _shutdown(running)


def _shutdown(running: RunningServer) -> None:
    from ray import serve

    try:
        if running.owns_serve:
            while_local_ray_lives(serve.shutdown, running.connection)
    finally:
        with contextlib.suppress(Exception):  # the statistics board goes with the app
            while_local_ray_lives(remove_board, running.connection)
        while_local_ray_lives(lambda: disconnect(running.connection), running.connection)
        _remove_haproxy(running.state_dir, running.watcher)


def _remove_haproxy(state_dir: Path | None, watcher: Any) -> None:
    """HAProxy's files, and any HAProxy Serve's shutdown left running; then the watcher is not needed."""
    if state_dir is not None:
        reap(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
    if watcher is not None:
        watcher.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=5)


def serve_forever(
    config: ServeConfig,
    *,
    address: str | None = None,
    on_ready: Callable[[RunningServer], None] | None = None,
    poll_s: float = 1.0,
) -> None:
    """``tk serve``: start, call ``on_ready(running)``, block until Ctrl-C, then stop cleanly."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"tk serve needs Ray Serve: pip install 'tk[serve]' ({first_line(exc)})") from exc
    running = start(config, address=address)
    previous = _stop_on_signals()
    try:
        if on_ready is not None:
            on_ready(running)
        while True:
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop(running)


def _stop_on_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise KeyboardInterrupt while serving (a shell's background job ignores
    SIGINT, a service manager sends SIGTERM); returns the handlers to restore."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, interrupt)
    return previous


__all__ = [
    "APP_NAME",
    "InputError",
    "ModelServer",
    "RunningServer",
    "ServeConfig",
    "deployment",
    "resolve",
    "serve_forever",
    "start",
    "stop",
]
