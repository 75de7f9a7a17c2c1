"""``tk serve``'s Ray Serve deployment: the model server (``tk.serve.model_server``) in each replica.

One deployment answers every route. Each replica builds its ``ModelServer`` (engine opened and warmed
up) in its constructor, so Ray Serve routes nothing to it before it is ready, and puts its counts on
the statistics board (``tk.serve.stats``) before the first request, so every replica is counted.
Ray Serve's ``max_queued_requests`` turns a full queue into an immediate 503.

Ray, Ray Serve and starlette are imported inside the functions: importing this module stays light.
"""

from __future__ import annotations

from typing import Any

from tk.serve.cluster import keep_replica_grpc_on_loopback
from tk.serve.config import ServeConfig
from tk.serve.model_server import ModelServer, RequestHandler
from tk.serve.stats import Pusher

APP_NAME = "tk-serve"


def deployment(config: ServeConfig) -> Any:
    """The Ray Serve application for ``config`` (resolved), ready for ``serve.run``."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse

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
            server = _server(config, _replica_id())
            self.server = server
            self.pusher = Pusher(server.replica, server.stats, lambda: server.metrics.text()[0])
            self.handler = _handler(server, self.pusher)
            self.pusher.push(wait=True)  # on the board before the first request, so every replica is counted

        def __del__(self) -> None:
            pusher = getattr(self, "pusher", None)
            if pusher is not None:
                pusher.close()

        async def __call__(self, request: Request) -> Response:
            reply = await self.handler.handle(request.method, request.url.path, request.headers, request.stream)
            if reply.stream is not None:  # server-sent events; Serve cancels the stream when the client goes away
                return StreamingResponse(reply.stream, status_code=reply.status, headers=reply.headers,
                                         media_type=reply.media_type)  # fmt: skip
            return Response(reply.body, status_code=reply.status, headers=reply.headers, media_type=reply.media_type)

    return TkModel.bind(config)


def _server(config: ServeConfig, replica: str) -> Any:
    """The replica's server: a decoder's ``GenerationServer`` or every other model's ``ModelServer``."""
    if config.max_tokens is not None:  # resolve sets it for decoders only
        from tk.serve.generation_server import GenerationServer

        return GenerationServer(config, replica=replica)
    return ModelServer(config, replica=replica)


def _handler(server: Any, board: Pusher) -> Any:
    if isinstance(server, ModelServer):
        return RequestHandler(server, board=board)
    from tk.serve.generation_server import GenerationHandler

    return GenerationHandler(server, board=board)


def run_app(config: ServeConfig) -> None:
    """Deploy the app for ``config`` (resolved) on the running Serve, at ``/``."""
    from ray import serve

    serve.run(deployment(config), name=APP_NAME, route_prefix="/")


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:  # outside a Serve replica
        return ""  # the model server names itself by its process
