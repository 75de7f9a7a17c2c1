"""Ray for ``tk serve`` and ``tk infer --ray``: start a local instance or join a cluster, and undo
only what was done here.

A caller that already holds a Ray connection (a test, a notebook) keeps it: ``connect`` then
changes nothing and ``disconnect`` leaves it open. Environment variables for Ray's workers
(``env_vars``) travel as the job's runtime environment, so they reach the actors this job creates
(Serve's controller, proxies and replicas when this job starts Serve) without touching this
process's own environment.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RayConnection:
    connected: bool  # ray.init was called here (False: the caller's connection was reused)
    local: bool  # the Ray instance itself was started here, and stops with disconnect


def connect(
    *, address: str | None = None, num_cpus: int | None = None, env_vars: Mapping[str, str] | None = None
) -> RayConnection:
    """Join the cluster at ``address``, or start a local Ray instance (``num_cpus``: Ray's CPU count,
    default all); reuse a connection this process already has."""
    import ray

    if ray.is_initialized():
        return RayConnection(connected=False, local=False)
    common = {
        "logging_level": logging.WARNING,
        "log_to_driver": False,
        "runtime_env": {"env_vars": dict(env_vars)} if env_vars else None,
    }
    if address:
        ray.init(address=address, **common)
        return RayConnection(connected=True, local=False)
    ray.init(num_cpus=num_cpus, include_dashboard=False, **common)
    return RayConnection(connected=True, local=True)


def serve_is_running() -> bool:
    """Whether Ray Serve's controller already runs on the connected cluster."""
    import ray

    return any(a["name"] == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))


def disconnect(connection: RayConnection) -> None:
    """Leave Ray if ``connect`` joined it (a local instance stops with it; a cluster keeps running)."""
    import ray

    if connection.connected and ray.is_initialized():
        ray.shutdown()
