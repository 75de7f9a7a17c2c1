"""One timed engine call, the way trtexec times one: with or without the copies to and from the GPU.

``--io device``: inputs already live on the engine's device and outputs stay there, so only the
engine is timed. ``--io host``: inputs start in host memory (pinned on CUDA, so copies can run
asynchronously) and outputs are copied back into pinned buffers; on CUDA, events split each call
into host-to-device copy, compute and device-to-host copy. On the CPU both modes time the engine
call; ``device`` hands it torch tensors, ``host`` NumPy arrays (the command line's and files' kind).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IO_MODES = ("host", "device")


@dataclass
class CallTime:
    total_s: float  # wall clock of the whole call, device synchronized
    h2d_ms: float | None = None  # CUDA events; None on the CPU
    compute_ms: float | None = None
    d2h_ms: float | None = None


class CallTimer:
    """Times calls of ``engine`` on ``feeds`` (NumPy, as ``random_inputs`` makes them) in ``io`` mode.

    Buffers (device copies of the inputs, pinned input and output buffers) are made once here,
    not per call; the feeds are checked once, then every timed call skips the checks.
    """

    def __init__(self, engine: Any, feeds: dict[str, np.ndarray], io: str = "host") -> None:
        self.engine = engine
        self.io = io
        self.cuda = getattr(engine, "device", "cpu") == "cuda"
        engine.check_feeds(feeds)
        if self.cuda:  # made once: the timed calls allocate nothing of their own
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        if io == "device":
            self.feeds: dict[str, Any] = {
                k: torch.from_numpy(np.ascontiguousarray(v)).to(engine.device) for k, v in feeds.items()
            }
        elif self.cuda:
            self.host = {k: torch.from_numpy(np.ascontiguousarray(v)).pin_memory() for k, v in feeds.items()}
            self.feeds = {k: torch.empty_like(v, device=engine.device) for k, v in self.host.items()}
            self.outputs: dict[str, torch.Tensor] | None = None  # pinned, made at the first call
        else:
            self.feeds = feeds

    def __call__(self) -> CallTime:
        if not self.cuda:
            start = time.perf_counter()
            self.engine.run(self.feeds, check=False)
            return CallTime(time.perf_counter() - start)
        events = self.events
        torch.cuda.synchronize()
        start = time.perf_counter()
        events[0].record()
        if self.io == "host":
            for name, dev in self.feeds.items():
                dev.copy_(self.host[name], non_blocking=True)
        events[1].record()
        out = self.engine.run(self.feeds, check=False)
        events[2].record()
        if self.io == "host":
            if self.outputs is None:
                self.outputs = {k: torch.empty_like(v, device="cpu").pin_memory() for k, v in out.items()}
            for name, value in out.items():
                self.outputs[name].copy_(value, non_blocking=True)
        events[3].record()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        h2d, compute, d2h = (events[i].elapsed_time(events[i + 1]) for i in range(3))
        if self.io == "device":
            return CallTime(total, None, compute, None)
        return CallTime(total, h2d, compute, d2h)


def peak_gpu_memory_reset(cuda: bool) -> None:
    if cuda:
        torch.cuda.reset_peak_memory_stats()


def peak_gpu_memory_mb(cuda: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if cuda else None
