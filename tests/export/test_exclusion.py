"""The int8 exclusion search (tk.export.int8.search.exclude_costliest): costliest first, doubling, then
bisected back so no layer leaves int8 that did not have to; the last judge call is the returned set's."""

from __future__ import annotations

import pytest

from tk.export.int8.search import exclude_costliest

COSTS = {f"layer{i}": float(i) for i in range(10)}  # layer0 costs the most


def _judge_needing(count: int, calls: list[list[str]]):
    """A graph that reaches the target (30 dB) once its ``count`` costliest layers are out."""

    def judge(excluded: list[str]) -> float:
        calls.append(list(excluded))
        return 30.0 if all(f"layer{i}" in excluded for i in range(count)) else 20.0

    return judge


@pytest.mark.parametrize("needed", [1, 2, 5, 6, 9])
def test_the_fewest_costliest_layers_that_reach_the_target_are_left_out(needed: int) -> None:
    calls: list[list[str]] = []
    excluded, sqnr = exclude_costliest(COSTS, _judge_needing(needed, calls), 30.0, max_rounds=8)
    assert excluded == [f"layer{i}" for i in range(needed)] and sqnr == 30.0
    assert calls[-1] == excluded  # callers keep the last call's graph
    assert len(calls) <= 2 * len(COSTS).bit_length() + 1


def test_a_target_out_of_reach_returns_the_last_round() -> None:
    calls: list[list[str]] = []
    excluded, sqnr = exclude_costliest(COSTS, lambda e: calls.append(e) or 10.0, 30.0, max_rounds=3)
    assert excluded == ["layer0", "layer1", "layer2", "layer3", "layer4", "layer5", "layer6"] and sqnr == 10.0
    assert calls[-1] == excluded and len(calls) == 3


def test_after_each_round_under_the_target_the_fewest_it_can_still_return_is_told() -> None:
    """Rounds of 1, 3 and 7 layers fail (9 needed): the search can still return no fewer than 2, 4, 8."""
    told: list[list[str]] = []
    excluded, _ = exclude_costliest(COSTS, _judge_needing(9, []), 30.0, max_rounds=8, at_least=told.append)
    assert [len(t) for t in told] == [2, 4, 8] and excluded == [f"layer{i}" for i in range(9)]
    assert all(t == [f"layer{i}" for i in range(len(t))] for t in told)  # prefixes of the ranking
    assert len(excluded) >= len(told[-1])

    class Stop(Exception):
        pass

    def stop(layers: list[str]) -> None:
        raise Stop(len(layers))

    calls: list[list[str]] = []
    with pytest.raises(Stop):
        exclude_costliest(COSTS, _judge_needing(9, calls), 30.0, max_rounds=8, at_least=stop)
    assert calls == [["layer0"]]  # the search ended where it was told it cannot win
    told.clear()
    exclude_costliest(COSTS, lambda e: 10.0, 30.0, max_rounds=3, at_least=told.append)
    assert [len(t) for t in told] == [2, 4]  # not after the last round: its set is returned


@pytest.mark.parametrize("needed", [1, 5, 9])
def test_sets_under_the_target_on_a_smaller_screen_are_not_judged_again(needed: int) -> None:
    failed: set[frozenset[str]] = set()
    first: list[list[str]] = []
    excluded, _ = exclude_costliest(COSTS, _judge_needing(needed, first), 30.0, max_rounds=8, failed_before=failed)
    assert failed == {frozenset(c) for c in first if c[:needed] != [f"layer{i}" for i in range(needed)]}
    again: list[list[str]] = []  # a larger screen: the same sets fail, the kept one still passes
    assert exclude_costliest(COSTS, _judge_needing(needed, again), 30.0, max_rounds=8, failed_before=failed) == (
        excluded,
        30.0,
    )
    assert not {frozenset(c) for c in again} & {frozenset(c) for c in first if frozenset(c) in failed}
    assert again and again[-1] == excluded  # callers keep the last call's graph
    # out of reach: every round failed before, but the returned last round is judged again
    out: set[frozenset[str]] = set()
    exclude_costliest(COSTS, lambda e: 10.0, 30.0, max_rounds=3, failed_before=out)
    calls: list[list[str]] = []
    excluded, sqnr = exclude_costliest(COSTS, lambda e: calls.append(e) or 10.0, 30.0, max_rounds=3, failed_before=out)
    assert calls == [excluded] and len(excluded) == 7 and sqnr == 10.0


def test_screened_exclusion_judges_the_kept_set_on_every_batch_and_grows_the_screen_on_a_failure():
    from tk.export.int8.search import SCREEN_EVERY, screened_exclusion

    screens: list[list[int]] = []
    judged: list[list[str]] = []

    def search(screen: list[int]) -> tuple[list[str], float]:
        screens.append(screen)
        return (["a"], 40.0) if 7 not in screen else (["a", "b"], 41.0)  # batch 7 needs b out too

    def judge_all(excluded: list[str]) -> tuple[float, int | None]:
        judged.append(excluded)
        return (30.0, 7) if excluded == ["a"] else (38.5, None)

    excluded, last, seen = screened_exclusion(12, 2, search, judge_all, 37.0)
    assert screens[0] == [0, 1, *range(SCREEN_EVERY, 12, SCREEN_EVERY)] and 7 not in screens[0]
    assert screens[1] == sorted({*screens[0], 7})
    assert judged == [["a"], ["a", "b"]] and excluded == ["a", "b"]
    assert last == 38.5 and seen == list(range(12))  # every batch's SQNR, not the screen's
    # a search that fails on its screen is not judged on every batch
    assert screened_exclusion(12, 2, lambda screen: (["a"], 20.0), judge_all, 37.0)[1] == 20.0 and len(judged) == 2
