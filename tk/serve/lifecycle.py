"""``tk serve``'s process lifecycle: start Ray and Serve with the app, wait until it answers, stop it
on Ctrl-C or SIGTERM, and undo only what was started here.

``start`` starts a local Ray instance (or joins one with ``address``), Serve, and the app; with the
HAProxy ingress it gives HAProxy its own ports and a state folder, watched by ``tk.serve.reaper``'s
process so that an HAProxy outlives nobody. ``stop`` deletes the app (Serve waits for the requests
in flight), then shuts down Serve and Ray where ``start`` started them (a joined cluster, or a
caller's Ray, keeps running), removes the statistics board and HAProxy's files. ``serve_forever`` is
``tk serve``: start, block until a signal, stop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.errors import UsageError, first_line
from tk.serve.cluster import RayConnection, connect, disconnect, serve_is_running, while_local_ray_lives
from tk.serve.config import ServeConfig, require_room, resolve
from tk.serve.deployment import APP_NAME, run_app
from tk.serve.ingress import free_ports, ingress_env, require_free_port
from tk.serve.reaper import reap, watch
from tk.serve.stats import remove_board


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
        run_app(config)
        _wait_until_ready(running)
    except BaseException:
        _shutdown(running)
        raise
    return running


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


def redeploy(config: ServeConfig, timeout_s: float = 60.0) -> None:
    """Replace the running app by one deployed with ``config`` (resolved) and wait until it answers on
    loopback (``tk serve --tune``'s points, the load test's batching off)."""
    from ray import serve

    serve.delete(APP_NAME)
    run_app(config)
    if not ready_within(f"http://127.0.0.1:{config.port}", timeout_s):
        raise UsageError(f"serve: expected the redeployed app to answer on port {config.port} within {timeout_s:g} s")


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
