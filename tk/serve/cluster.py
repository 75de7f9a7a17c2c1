"""Ray for ``tk serve`` and ``tk infer --ray``: start a local instance or join a cluster, and undo
only what was done here.

A caller that already holds a Ray connection (a test, a notebook) keeps it: ``connect`` then
changes nothing and ``disconnect`` leaves it open. Environment variables for Ray's workers
(``env_vars``) travel as the job's runtime environment, so they reach the actors this job creates
(Serve's controller, proxies and replicas when this job starts Serve) without touching this
process's own environment.

A local instance listens on the loopback address only (127.0.0.1: GCS, raylet, object manager,
workers, the dashboard and runtime-env agents and the metrics export port), since nothing outside
this machine needs to reach it. Ray resolves a node address of 127.0.0.1 given to ``ray.init`` to the
machine's outward address (``resolve_ip_for_localhost``) unless its cluster mode is off, which is
what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does (read once, when Ray is imported); with the node
address on loopback, Ray's gRPC servers and agents bind 127.0.0.1 instead of every interface.
``TK_RAY_NODE_IP`` (an address of this machine) starts it on that address instead, for a user who
wants other machines to reach it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

log = logging.getLogger("tk.serve")
_told: list[bool] = []  # the warning of while_local_ray_lives was logged

NODE_IP_ENV = "TK_RAY_NODE_IP"
LOOPBACK = "127.0.0.1"
_CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_WORKER_NICENESS_ENV = "RAY_worker_niceness"  # Ray's config of its workers' nice value (default 15)


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
    node_ip = os.environ.get(NODE_IP_ENV) or None
    with _replicas_at_normal_priority():
        if node_ip is not None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address=node_ip, **common)
        else:
            with _loopback_only():
                ray.init(num_cpus=num_cpus, include_dashboard=False, **common)
    return RayConnection(connected=True, local=True)


@contextlib.contextmanager
def _replicas_at_normal_priority() -> Iterator[None]:
    """The local instance's workers (tk serve's replicas) run at nice 0, not Ray's default 15: at 15 any
    ordinary process starves them (the kernel's weights give a nice-15 process about 3% of a core beside
    one busy loop at nice 0; beside two, the serve tests crawled and timed out). Ray's processes read the
    setting when they start; the variable is restored after."""
    before = os.environ.get(_WORKER_NICENESS_ENV)
    if before is None:  # a user's own setting wins
        os.environ[_WORKER_NICENESS_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_WORKER_NICENESS_ENV, None)


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """Ray's node address is 127.0.0.1 for the instance started inside (its processes inherit the
    setting at start); both settings are restored after."""
    from ray._private import ray_constants

    before_env = os.environ.get(_CLUSTER_MODE_ENV)
    before_constant = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_MODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # the value Ray read at import, when this process imported it first
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_constant
        if before_env is None:
            os.environ.pop(_CLUSTER_MODE_ENV, None)
        else:
            os.environ[_CLUSTER_MODE_ENV] = before_env


def keep_replica_grpc_on_loopback() -> None:
    """In a Serve replica on a loopback node: bind the replica's inter-deployment gRPC server to
    127.0.0.1, not ``[::]``.

    Ray Serve 2.60 starts that server on every interface, hard-coded
    (``ray.serve._private.replica``: ``add_port_to_grpc_server(self._server, "[::]:0")``, after the
    deployment's constructor), with no setting to change it; its clients dial the node's address, which
    is 127.0.0.1 here. A Ray without that helper is left as it is."""
    import ray

    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "_tk_loopback", False):
        return
    if ray.util.get_node_ip_address() != LOOPBACK:
        return

    def on_loopback(server: object, address: str) -> int:
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    on_loopback._tk_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_loopback


def serve_is_running() -> bool:
    """Whether Ray Serve's controller already runs on the connected cluster."""
    import ray

    return any(a["name"] == "SERVE_CONTROLLER_ACTOR" for a in ray.util.list_named_actors(all_namespaces=True))


def while_local_ray_lives(call: Callable[[], object], connection: RayConnection, poll_s: float = 0.2) -> bool:
    """Run ``call`` (a Serve call that waits on Ray: ``serve.delete``, ``serve.shutdown``) unless the local
    Ray instance this process started dies meanwhile; returns whether it finished.

    A signal to the whole process group (``kill -TERM -- -PGID``, ``timeout``) ends the GCS and raylet
    that ``connect`` started with this process: Serve's controller is gone, and the call would wait for its
    answer for ever (``tk serve`` hung in ``serve.delete``). On a cluster, or a connection of the caller's,
    the call just runs."""
    if not connection.local:
        call()
        return True
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    worker = threading.Thread(target=run, name="tk-ray-call", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(poll_s)
        if worker.is_alive() and not local_ray_alive():
            if not _told:  # once: every later call finds Ray gone too
                log.warning(
                    "Ray's GCS or raylet ended before tk could stop Serve (a signal to the whole process group?)"
                )
                _told.append(True)
            return False
    if failure:
        raise failure[0]
    return True


def local_ray_alive() -> bool:
    """Whether the GCS and raylet this process started are still running (True where there are none)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    return all(info.process.poll() is None for kind in ("gcs_server", "raylet") for info in processes.get(kind, []))


def disconnect(connection: RayConnection) -> None:
    """Leave Ray if ``connect`` joined it (a local instance stops with it; a cluster keeps running)."""
    import ray

    if connection.connected and ray.is_initialized():
        ray.shutdown()
