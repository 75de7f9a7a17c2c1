"""A load guard around every timing: wait for a quiet machine, else say the numbers were taken on a busy one.

Other processes on a few cores make every timing wrong, and not alike: OpenMP-threaded PyTorch
suffers far more than onnxruntime when another process takes a core, which can turn ratios
between engines upside down (issue 22 has the numbers). The guard reads the 1-minute load average before and after each row. Before, while it is above the
core count, it waits (polling) up to ``wait_quiet_s`` seconds; either reading above the cores
marks the row ``busy``. The benchmark's own threads count in the load too (up to one per core:
hence "above", not "at", the core count), and the average lags by about a minute, so a mark is a
warning to read with the numbers, not proof.

The lag makes the average count this process's own work of the minute before (an export, a
quantizer's calibration) as if it were another's: a row timed right after such work read above the
cores on a machine where nothing else ran. Where the system's CPU time can be read (Linux's
``/proc/stat``), the guard also measures, over the row and over each wait, the CPU time other processes
used (the machine's busy time, the hypervisor's steal included, minus this process's own): a load
above the cores marks the row busy only when others used more than ``OTHERS_BUSY_CORES`` of a core
while it ran, and the wait ends once they use less. The load average does not count the hypervisor's
steal, so others over ``OTHERS_ALONE_BUSY_CORES`` mark the row busy whatever the load reads: in one
``tk optimize`` run on a 2-core VM, with the load at 1.6 and others (steal) at 0.87 of a core, the
OpenMP-threaded packages ran 2-5x slower than in the next minute while onnxruntime did not, and the
speed gate let a search run that cost 163 s and could not win.

    guard = LoadGuard(wait_quiet_s=30)
    with guard.row() as mark:
        times = interleave(calls, iters=20)
    mark.busy, mark.to_json()

or in one call: ``result, mark = quiet_or_marked(lambda: interleave(calls, iters=20), guard)``.

A guard built without readers reads the machine through ``system`` (the load average and
``/proc/stat``). A test that replaces its readers (``tests/conftest.py`` gives every test a quiet
machine) decides what every guard of the code under test sees, so no verdict depends on what
else runs beside the tests; a test of the readers themselves passes them explicitly.
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
OTHERS_BUSY_CORES = 0.25  # other processes' CPU (in cores) above which a row with a high load is busy
OTHERS_ALONE_BUSY_CORES = 0.5  # ... above which a row is busy whatever the load average reads

T = TypeVar("T")


def one_minute_load() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, steal included; this process's own CPU seconds,
    its reaped children's included), or None where ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system + own.children_user + own.children_system


@dataclass
class SystemReaders:
    """Where a ``LoadGuard`` built without ``read_load``/``read_cpu`` reads the machine (``system``)."""

    load: Callable[[], float | None] = one_minute_load
    cpu: Callable[[], tuple[float, float] | None] = cpu_seconds


system = SystemReaders()


def system_load() -> float | None:
    """``system.load()``, looked up at each reading: the default ``read_load``."""
    return system.load()


def system_cpu() -> tuple[float, float] | None:
    """``system.cpu()``, looked up at each reading: the default ``read_cpu``."""
    return system.cpu()


def others_cores(start: tuple[float, float] | None, end: tuple[float, float] | None, seconds: float) -> float | None:
    """The cores other processes kept busy between two ``cpu_seconds`` readings ``seconds`` apart."""
    if start is None or end is None or seconds <= 0:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / seconds)


@dataclass
class LoadMark:
    """What the guard saw around one row."""

    cores: int  # the load average's scale: the machine's CPU count
    before: float | None  # 1-minute load average when timing started (after any wait)
    after: float | None = None  # and when it ended
    waited_s: float = 0.0  # how long the guard waited for a quiet machine
    others_cores: float | None = None  # cores other processes kept busy during the row (None: not measurable)

    @property
    def busy(self) -> bool:
        """Whether other work competed for the cores: either reading above the core count, and (where
        it was measured) other processes busy on more than ``OTHERS_BUSY_CORES`` while the row ran; or
        others (steal included) on more than ``OTHERS_ALONE_BUSY_CORES``, whatever the load read."""
        if self.others_cores is not None and self.others_cores > OTHERS_ALONE_BUSY_CORES:
            return True
        high = any(v is not None and v > self.cores for v in (self.before, self.after))
        return high and (self.others_cores is None or self.others_cores > OTHERS_BUSY_CORES)

    def to_json(self) -> dict[str, Any]:
        def rounded(v: float | None) -> float | None:
            return None if v is None else round(v, 2)

        return {
            "load_before": rounded(self.before),
            "load_after": rounded(self.after),
            "cores": self.cores,
            "waited_s": round(self.waited_s, 2),
            "others_cores": rounded(self.others_cores),
            "busy": self.busy,
        }


class LoadGuard:
    """Reads the load around each row; waits up to ``wait_quiet_s`` for it to drop to the core count.

    ``read_load``, ``read_cpu`` (None: the load average alone decides), ``sleep`` and ``clock`` are
    the system's unless given (tests inject them; the readers default to ``system``'s); ``cores``
    defaults to ``os.cpu_count()``, the count the load average is measured against.
    """

    def __init__(
        self,
        wait_quiet_s: float = DEFAULT_WAIT_QUIET_S,
        *,
        cores: int | None = None,
        read_load: Callable[[], float | None] = system_load,
        read_cpu: Callable[[], tuple[float, float] | None] | None = system_cpu,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        if not wait_quiet_s >= 0:
            raise UsageError(f"--wait-quiet: expected 0 or more seconds, got {wait_quiet_s}")
        self.wait_quiet_s, self.poll_s = wait_quiet_s, poll_s
        self.cores = cores or os.cpu_count() or 1
        self.read_load, self.sleep, self.clock = read_load, sleep, clock
        self.read_cpu = read_cpu or (lambda: None)

    def wait(self) -> LoadMark:
        """Read the load, waiting while it is above the cores (and others use the CPU, where that is
        measured over each poll) and the wait budget lasts."""
        start = self.clock()
        load = self.read_load()
        others: float | None = None
        while load is not None and load > self.cores and (others is None or others > OTHERS_BUSY_CORES):
            left = self.wait_quiet_s - (self.clock() - start)
            if left <= 0:
                break
            before, polled = self.read_cpu(), self.clock()
            self.sleep(min(self.poll_s, left))
            others = others_cores(before, self.read_cpu(), self.clock() - polled)
            load = self.read_load()
        return LoadMark(self.cores, load, waited_s=self.clock() - start)

    @contextmanager
    def row(self) -> Iterator[LoadMark]:
        """Wait for a quiet machine (within the budget), run the block, then read the load again and
        what the other processes used while it ran."""
        mark = self.wait()
        cpu, started = self.read_cpu(), self.clock()
        try:
            yield mark
        finally:
            mark.after = self.read_load()
            mark.others_cores = others_cores(cpu, self.read_cpu(), self.clock() - started)


def quiet_or_marked(timing: Callable[[], T], guard: LoadGuard | None = None) -> tuple[T, LoadMark]:
    """Run ``timing`` under ``guard`` (a default one: no wait): its result and the load mark of its row."""
    with (guard or LoadGuard()).row() as mark:
        result = timing()
    return result, mark
