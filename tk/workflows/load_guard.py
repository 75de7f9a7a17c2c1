"""A load guard around every timing: wait for a quiet machine, else say the numbers were taken on a busy one.

Other processes on a few cores make every timing wrong, and not alike: OpenMP-threaded PyTorch
suffers far more than onnxruntime when another process takes a core, which can turn ratios
between engines upside down (issue 22 has the numbers). The guard reads the 1-minute load average before and after each row. Before, while it is above the
core count, it waits (polling) up to ``wait_quiet_s`` seconds; either reading above the cores
marks the row ``busy``. The benchmark's own threads count in the load too (up to one per core:
hence "above", not "at", the core count), and the average lags by about a minute, so a mark is a
warning to read with the numbers, not proof.

    guard = LoadGuard(wait_quiet_s=30)
    with guard.row() as mark:
        times = interleave(calls, iters=20)
    mark.busy, mark.to_json()

or in one call: ``result, mark = quiet_or_marked(lambda: interleave(calls, iters=20), guard)``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from tk.errors import UsageError

DEFAULT_WAIT_QUIET_S = 0.0  # tk bench marks busy rows but does not wait unless asked (--wait-quiet)
POLL_S = 5.0  # seconds between readings while waiting for a quiet machine

T = TypeVar("T")


def one_minute_load() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@dataclass
class LoadMark:
    """What the guard saw around one row."""

    cores: int  # the load average's scale: the machine's CPU count
    before: float | None  # 1-minute load average when timing started (after any wait)
    after: float | None = None  # and when it ended
    waited_s: float = 0.0  # how long the guard waited for a quiet machine

    @property
    def busy(self) -> bool:
        """Whether either reading was above the core count: other work competed for the cores."""
        return any(v is not None and v > self.cores for v in (self.before, self.after))

    def to_json(self) -> dict[str, Any]:
        def rounded(v: float | None) -> float | None:
            return None if v is None else round(v, 2)

        return {
            "load_before": rounded(self.before),
            "load_after": rounded(self.after),
            "cores": self.cores,
            "waited_s": round(self.waited_s, 2),
            "busy": self.busy,
        }


class LoadGuard:
    """Reads the load around each row; waits up to ``wait_quiet_s`` for it to drop to the core count.

    ``read_load``, ``sleep`` and ``clock`` are the system's unless given (tests inject them);
    ``cores`` defaults to ``os.cpu_count()``, the count the load average is measured against.
    """

    def __init__(
        self,
        wait_quiet_s: float = DEFAULT_WAIT_QUIET_S,
        *,
        cores: int | None = None,
        read_load: Callable[[], float | None] = one_minute_load,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        if not wait_quiet_s >= 0:
            raise UsageError(f"--wait-quiet: expected 0 or more seconds, got {wait_quiet_s}")
        self.wait_quiet_s, self.poll_s = wait_quiet_s, poll_s
        self.cores = cores or os.cpu_count() or 1
        self.read_load, self.sleep, self.clock = read_load, sleep, clock

    def wait(self) -> LoadMark:
        """Read the load, waiting while it is above the cores and the wait budget lasts."""
        start = self.clock()
        load = self.read_load()
        while load is not None and load > self.cores:
            left = self.wait_quiet_s - (self.clock() - start)
            if left <= 0:
                break
            self.sleep(min(self.poll_s, left))
            load = self.read_load()
        return LoadMark(self.cores, load, waited_s=self.clock() - start)

    @contextmanager
    def row(self) -> Iterator[LoadMark]:
        """Wait for a quiet machine (within the budget), run the block, then read the load again."""
        mark = self.wait()
        try:
            yield mark
        finally:
            mark.after = self.read_load()


def quiet_or_marked(timing: Callable[[], T], guard: LoadGuard | None = None) -> tuple[T, LoadMark]:
    """Run ``timing`` under ``guard`` (a default one: no wait): its result and the load mark of its row."""
    with (guard or LoadGuard()).row() as mark:
        result = timing()
    return result, mark
