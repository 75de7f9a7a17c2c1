"""Load against a running ``tk serve`` over Triton's HTTP protocol (``tritonclient.http``).

``send_requests`` sends a list of requests from concurrent clients (request ``i`` from client
``i % clients``, each with its own connection), each with its index as the request id, and keeps
what came back by the id the server answered with, so lost, duplicated and mismatched replies can
be counted. ``tk serve --tune`` and ``scripts/load_test.py`` both load the server through it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TIMEOUT_S = 60.0  # connection and network timeout of each client


@dataclass
class LoadResult:
    replies: dict[int, np.ndarray] = field(default_factory=dict)  # request id -> the kept output
    latencies: dict[int, float] = field(default_factory=dict)  # request index -> seconds, answered requests
    failures: dict[int, str] = field(default_factory=dict)  # request index -> the error
    duplicates: int = 0  # replies whose id had already come back
    wall_s: float = 0.0  # from the first client's start to the last one's end

    @property
    def answered(self) -> int:
        return len(self.latencies)


def datatype(array: np.ndarray) -> str:
    """The Triton datatype of ``array`` (``INT64``, ``FP32``, ...)."""
    from tritonclient.utils import np_to_triton_dtype

    return str(np_to_triton_dtype(array.dtype))


def infer_inputs(feeds: Mapping[str, np.ndarray]) -> list[Any]:
    """``feeds`` as ``tritonclient.http.InferInput``s, the data set."""
    import tritonclient.http as http

    inputs = []
    for name, array in feeds.items():
        entry = http.InferInput(name, list(array.shape), datatype(array))
        entry.set_data_from_numpy(array)
        inputs.append(entry)
    return inputs


def client(port: int) -> Any:
    import tritonclient.http as http

    return http.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)


def send_requests(
    port: int,
    model: str,
    requests: Sequence[Mapping[str, np.ndarray]],
    clients: int,
    *,
    keep: str | None = None,
    deadline: float | None = None,
) -> LoadResult:
    """Send ``requests`` from ``clients`` threads to ``model`` on loopback ``port``.

    ``keep``: the output kept per reply (by the id it came back with); ``deadline`` (a
    ``time.monotonic()`` value): no request starts after it. A request that fails is counted, not raised.
    """
    result = LoadResult()
    lock = threading.Lock()

    def work(c: int) -> None:
        connection = client(port)
        for i in range(c, len(requests), clients):
            if deadline is not None and time.monotonic() > deadline:
                return
            inputs = infer_inputs(requests[i])
            started = time.perf_counter()
            try:
                reply = connection.infer(model, inputs, request_id=str(i))
                seconds = time.perf_counter() - started
                rid = int(reply.get_response()["id"])
                with lock:
                    result.duplicates += rid in result.replies
                    result.replies[rid] = reply.as_numpy(keep) if keep is not None else np.empty(0)
                    result.latencies[i] = seconds
            except Exception as exc:  # counted as failed (lost)
                with lock:
                    result.failures[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - started
    return result


def health_latency_ms(port: int, count: int) -> float:
    """Median latency of ``GET /v2/health/live`` (HTTP proxy and replica, no engine) over one connection."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    times = []
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        connection.close()
    return statistics.median(times)
