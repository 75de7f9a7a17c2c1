"""The one timing loop: rounds, budgets and untimed calls between the timed ones (fake times, no timing judged)."""

from __future__ import annotations

import gc

import pytest

from tk.measure.load_guard import LoadGuard
from tk.measure.timing import CallTime, interleave, interleave_calls, ms, timed


def fake(label: str, seconds: float, log: list[str]):
    def call() -> CallTime:
        log.append(label)
        return CallTime(seconds)

    return call


def test_every_round_calls_each_timer_once_in_a_seeded_order_with_the_between_calls():
    log: list[str] = []
    times = interleave(
        {"a": fake("a", 0.1, log), "b": fake("b", 0.2, log)}, iters=6, between=[lambda: log.append("peak")]
    )
    assert [len(times["a"]), len(times["b"])] == [6, 6] and times["b"][0].total_s == 0.2
    rounds = [log[i : i + 3] for i in range(0, len(log), 3)]
    assert len(rounds) == 6 and all(sorted(r) == ["a", "b", "peak"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds
    again: list[str] = []
    interleave(
        {"a": fake("a", 0.1, again), "b": fake("b", 0.2, again)}, iters=6, between=[lambda: again.append("peak")]
    )
    assert again == log  # seeded


def test_a_budget_stops_the_rounds_but_not_before_the_minimum():
    log: list[str] = []
    timers = {"a": fake("a", 1.0, log), "b": fake("b", 1.0, log)}
    assert len(interleave(timers, seconds=2.0, min_rounds=3)["a"]) == 3  # budget 4 s spent after 2 rounds
    assert len(interleave(timers, seconds=3.0, min_rounds=1)["a"]) == 3  # budget 6 s
    assert len(interleave(timers, seconds=100.0, iters=2)["a"]) == 2  # iters first
    assert gc.isenabled()
    with pytest.raises(ValueError, match="expected iters or seconds"):
        interleave(timers)


def test_timed_reads_wall_and_cpu_time():
    call = timed(lambda: sum(range(1000)))
    result = call()
    assert result.total_s > 0 and result.cpu_s is not None and result.cpu_s >= 0


def test_interleave_calls_warms_up_then_times_plain_calls_under_the_guard():
    log: list[str] = []
    guard = LoadGuard(0, cores=2, read_load=iter([1.0, 3.0]).__next__, read_cpu=None)
    calls = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    times, mark = interleave_calls(calls, iters=4, guard=guard, between=[lambda: log.append("peak")], warmup=2)
    assert log[:4] == ["a", "a", "b", "b"] and log[4:].count("peak") == 4 and log.count("a") == 6
    assert [len(times["a"]), len(times["b"])] == [4, 4] and all(t.cpu_s is not None for t in times["a"])
    assert (mark.before, mark.after, mark.busy) == (1.0, 3.0, True)
    assert ms([0.001, 0.003, 0.002]) == 2.0


def test_blocks_run_each_call_in_a_row_and_rotate_the_order():
    from tk.measure.timing import time_in_blocks

    calls: list[str] = []
    between: list[int] = []
    times = time_in_blocks({n: (lambda n=n: calls.append(n)) for n in "abc"}, rounds=3, block=2, order=list("abc"),
                           between=[lambda: between.append(1)])  # fmt: skip
    assert {n: len(t) for n, t in times.items()} == {"a": 6, "b": 6, "c": 6}
    # one untimed call opens each block; rotated, and reversed every other round, so each call follows both others
    assert "".join(calls) == "aaabbbccc" + "aaacccbbb" + "cccaaabbb"
    assert len(between) == 9
