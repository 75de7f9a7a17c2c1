"""The load guard's decisions, with an injected load reader and clock (no real waiting).

tests/conftest.py gives every guard built without readers a quiet machine (``load_guard.system``); the
tests of the system's readers pass them explicitly, and none asserts what they read, only that they read.
"""

from __future__ import annotations

import pytest

from tk.measure import load_guard
from tk.measure.load_guard import LoadGuard, LoadMark, cpu_seconds, one_minute_load, quiet_or_marked


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def guard(readings: list[float | None], wait: float, clock: FakeClock, cores: int = 2) -> LoadGuard:
    values = iter(readings)
    return LoadGuard(
        wait, cores=cores, read_load=lambda: next(values), read_cpu=None, sleep=clock.sleep, clock=clock, poll_s=5
    )


def test_a_quiet_machine_is_timed_at_once_and_not_marked():
    clock = FakeClock()
    result, mark = quiet_or_marked(lambda: 42, guard([1.5, 2.0], 30, clock))
    assert result == 42 and clock.sleeps == []
    assert (mark.before, mark.after, mark.waited_s, mark.busy) == (1.5, 2.0, 0.0, False)  # at the cores: not above


def test_a_busy_machine_is_waited_for_until_it_is_quiet():
    clock = FakeClock()
    with guard([5.0, 4.0, 1.0, 1.2], 30, clock).row() as mark:
        pass
    assert clock.sleeps == [5, 5] and mark.waited_s == 10
    assert (mark.before, mark.after, mark.busy) == (1.0, 1.2, False)


def test_the_wait_is_bounded_then_the_row_is_marked_busy():
    clock = FakeClock()
    with guard([5.0] * 10, 12, clock).row() as mark:
        pass
    assert clock.sleeps == [5, 5, 2] and mark.waited_s == 12
    assert mark.busy and mark.to_json() == {
        "load_before": 5.0, "load_after": 5.0, "cores": 2, "waited_s": 12.0, "others_cores": None, "busy": True,
    }  # fmt: skip


def test_without_a_wait_budget_a_busy_row_is_marked_at_once():
    clock = FakeClock()
    _, mark = quiet_or_marked(lambda: None, guard([3.0, 1.0], 0, clock))
    assert clock.sleeps == [] and mark.busy and mark.before == 3.0


def test_load_rising_during_the_row_marks_it():
    clock = FakeClock()
    _, mark = quiet_or_marked(lambda: None, guard([0.5, 6.5], 0, clock, cores=4))
    assert mark.busy and mark.cores == 4


def test_no_load_average_means_no_mark_and_no_wait():
    clock = FakeClock()
    _, mark = quiet_or_marked(lambda: None, guard([None, None], 30, clock))
    assert not mark.busy and clock.sleeps == []
    assert not LoadMark(2, None).busy


def test_the_real_readers_run_without_waiting():
    clock = FakeClock()
    real = LoadGuard(0, read_load=one_minute_load, read_cpu=cpu_seconds, sleep=clock.sleep, clock=clock)
    _, mark = quiet_or_marked(lambda: None, real)
    assert mark.cores >= 1 and clock.sleeps == [] and mark.waited_s == 0.0  # no budget: never waits, busy or not
    assert (mark.before is None) is (mark.after is None) is (one_minute_load() is None)


def test_a_guard_built_without_readers_reads_load_guard_system_at_each_reading(monkeypatch):
    """The seam of tests/conftest.py: ``load_guard.system``'s readers reach guards built anywhere, before or after."""
    built_before = LoadGuard(0, cores=2)
    _, mark = quiet_or_marked(lambda: None, built_before)  # the suite's quiet machine
    assert (mark.before, mark.after, mark.others_cores, mark.busy) == (0.0, 0.0, 0.0, False)
    clock, cpu = FakeClock(), FakeCpu()
    monkeypatch.setattr(load_guard.system, "load", lambda: 7.0)
    monkeypatch.setattr(load_guard.system, "cpu", cpu)
    for guard in (built_before, LoadGuard(0, cores=2)):
        with guard.row() as mark:
            cpu.run(1.0, own_cores=0.0, other_cores=1.0, clock=clock)  # others' CPU second, on the fake counter
        assert mark.before == mark.after == 7.0 and mark.busy and (mark.others_cores or 0.0) > 0


def test_the_guard_still_reads_after_a_failed_row():
    clock = FakeClock()
    readings = guard([0.5, 7.0], 0, clock)
    with pytest.raises(RuntimeError), readings.row() as mark:
        raise RuntimeError("timing failed")
    assert mark.after == 7.0


class FakeCpu:
    """``cpu_seconds`` readings: the machine's busy seconds and this process's, advanced by the test."""

    def __init__(self) -> None:
        self.machine = self.own = 0.0

    def __call__(self) -> tuple[float, float]:
        return self.machine, self.own

    def run(self, seconds: float, own_cores: float, other_cores: float, clock: FakeClock) -> None:
        clock.now += seconds
        self.own += own_cores * seconds
        self.machine += (own_cores + other_cores) * seconds


def cpu_guard(load: float, wait: float, clock: FakeClock, cpu: FakeCpu, sleeping_others: float = 0.0) -> LoadGuard:
    def sleep(seconds: float) -> None:  # while the guard waits, others use ``sleeping_others`` cores
        cpu.run(seconds, 0.0, sleeping_others, clock)
        clock.sleeps.append(seconds)

    return LoadGuard(wait, cores=2, read_load=lambda: load, read_cpu=cpu, sleep=sleep, clock=clock, poll_s=5)


def test_a_high_load_from_this_process_alone_is_not_busy():
    """The load average lags: this process's own work of the minute before reads as load above the
    cores, but no other process used the CPU while the row ran."""
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(2.6, 0, clock, cpu).row() as mark:
        cpu.run(4.0, own_cores=2.0, other_cores=0.1, clock=clock)
    assert mark.others_cores == pytest.approx(0.1) and not mark.busy
    assert mark.to_json()["others_cores"] == 0.1


def test_a_high_load_with_other_processes_on_the_cpu_is_busy():
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(2.6, 0, clock, cpu).row() as mark:
        cpu.run(4.0, own_cores=1.5, other_cores=0.8, clock=clock)
    assert mark.others_cores == pytest.approx(0.8) and mark.busy


def test_others_on_over_half_a_core_are_busy_whatever_the_load_reads():
    """The hypervisor's steal is not in the load average: 0.87 of a core of it read at load 1.6 on 2 cores."""
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(1.6, 0, clock, cpu).row() as mark:
        cpu.run(4.0, own_cores=1.1, other_cores=0.87, clock=clock)
    assert mark.others_cores == pytest.approx(0.87) and mark.busy
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(1.6, 0, clock, cpu).row() as mark:
        cpu.run(4.0, own_cores=1.6, other_cores=0.4, clock=clock)
    assert mark.others_cores == pytest.approx(0.4) and not mark.busy  # under half a core, at a quiet load


def test_the_wait_ends_once_other_processes_are_quiet_even_if_the_load_average_lags():
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(3.0, 60, clock, cpu, sleeping_others=0.05).row() as mark:
        cpu.run(1.0, own_cores=2.0, other_cores=0.0, clock=clock)
    assert clock.sleeps == [5] and mark.waited_s == 5 and not mark.busy
    clock, cpu = FakeClock(), FakeCpu()
    with cpu_guard(3.0, 12, clock, cpu, sleeping_others=1.0).row() as mark:
        cpu.run(1.0, own_cores=1.0, other_cores=1.0, clock=clock)
    assert clock.sleeps == [5, 5, 2] and mark.busy


def test_the_real_cpu_reader_reads_this_process():
    first = cpu_seconds()
    if first is None:
        pytest.skip("no /proc/stat on this system: the load average alone decides")
    sum(i * i for i in range(2_000_000))  # some CPU of this process's own
    second = cpu_seconds()
    assert second is not None and second[1] > first[1] and second[0] >= first[0]
