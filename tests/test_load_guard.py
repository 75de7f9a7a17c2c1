"""The load guard's decisions, with an injected load reader and clock (no real waiting)."""

from __future__ import annotations

import pytest

from tk.workflows.load_guard import LoadGuard, LoadMark, quiet_or_marked


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
    return LoadGuard(wait, cores=cores, read_load=lambda: next(values), sleep=clock.sleep, clock=clock, poll_s=5)


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
        "load_before": 5.0, "load_after": 5.0, "cores": 2, "waited_s": 12.0, "busy": True,
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


def test_the_real_reader_runs_without_waiting():
    _, mark = quiet_or_marked(lambda: None, LoadGuard(0))
    assert mark.cores >= 1 and mark.waited_s < 1.0


def test_the_guard_still_reads_after_a_failed_row():
    clock = FakeClock()
    readings = guard([0.5, 7.0], 0, clock)
    with pytest.raises(RuntimeError), readings.row() as mark:
        raise RuntimeError("timing failed")
    assert mark.after == 7.0
