"""What the serve tests share: a free port, the app on a local Ray instance, ``tk serve`` as its own process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    from tk.serve.ingress import free_ports

    return free_ports(1)[0]


@contextmanager
def app_on_local_ray(art: Any, **settings: Any) -> Iterator[Any]:
    """Serve ``art`` with the onnx engine (1 thread a replica) on a free port, on a local Ray instance
    that tk starts with 2 CPUs; yield the resolved ``ServeConfig``, stop it all after."""
    from tk.runtime.choice import EngineChoice
    from tk.serve.config import ServeConfig
    from tk.serve.lifecycle import start, stop

    config = ServeConfig(
        str(art.root), engine=EngineChoice("onnx", options={"threads": 1}), port=free_port(), **settings
    )
    running = start(config, num_cpus=2)
    try:
        yield running.config
    finally:
        stop(running)


class ServeProcess:
    """``tk serve`` in a subprocess of the repository's code, its stderr in ``log``."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = tmp_path / "serve.err"

    @contextmanager
    def running(
        self, *args: str, env: dict[str, str] | None = None, new_session: bool = False
    ) -> Iterator[subprocess.Popen]:
        """Start ``tk serve ARGS`` (``new_session``: as the leader of its own process group), wait until it
        says it is ready (300 s at most); kill it if still running after."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        with open(self.log, "w+") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "tk", "serve", *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=new_session,
            )
            try:
                deadline = time.monotonic() + 300  # a watchdog: Ray starts slowly on a busy machine
                while "Ctrl-C stops" not in self.text():
                    assert process.poll() is None and time.monotonic() < deadline, self.text()
                    time.sleep(0.5)
                yield process
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    def text(self) -> str:
        return self.log.read_text()

    @staticmethod
    def infer_shape(port: int, batch: int) -> list[int]:
        """The logits' shape for a JSON request of ``batch`` 3-token samples."""
        ids = list(range(1, 3 * batch + 1))
        body = json.dumps(
            {
                "inputs": [
                    {"name": "input_ids", "shape": [batch, 3], "datatype": "INT64", "data": ids},
                    {"name": "attention_mask", "shape": [batch, 3], "datatype": "INT64", "data": [1] * len(ids)},
                ]
            }
        ).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/transformer/infer", data=body)
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())["outputs"][0]["shape"]


@pytest.fixture
def serve_process(tmp_path: Path) -> ServeProcess:
    return ServeProcess(tmp_path)


async def drained(server: Any, seconds: float = 60.0) -> None:
    """Until the decode batch is empty (a watchdog, not a timing: a busy machine only takes longer)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while server.batch.rows and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
