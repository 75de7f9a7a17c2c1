"""The winner of an optimize run: the fastest candidate that kept the accuracy, a tie going to the most
accurate; and, where none won, why, in one line."""

from __future__ import annotations

import math

from tk.accuracy import METRICS, AccuracySpec
from tk.workflows.optimize.table import TIE, Row


def pick_winner(timed: list[Row], metric: str) -> Row:
    """The fastest of ``timed``, unless others ran within ``TIE`` of it: then the most accurate of
    those (by ``metric`` on the held-out samples), whose row says why. An int8 model with most layers
    left out runs within a percent or two of float32; a difference that size is the timing's noise on
    these machines (history.md), and no reason to ship the less accurate artifact."""
    fastest = min(timed, key=lambda r: r.p50_ms or math.inf)
    tied = [r for r in timed if (r.p50_ms or math.inf) <= (fastest.p50_ms or math.inf) * (1 + TIE)]
    lower_is_better = METRICS.get(metric) == "<="

    def accuracy(row: Row) -> float:
        value = row.accuracy.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return -math.inf
        return -float(value) if lower_is_better else float(value)

    winner = max(tied, key=lambda r: (accuracy(r), -(r.p50_ms or math.inf)))
    if winner is not fastest and accuracy(winner) > accuracy(fastest):
        tie = f"within {TIE:.0%} of {fastest.candidate}'s {fastest.p50_ms:.3g} ms (a tie) and more accurate"
        winner.reason = f"{winner.reason}; {tie}" if winner.reason else tie  # an int8 row keeps its layer count
    else:
        winner = fastest
    winner.winner = True
    return winner


def no_winner_reason(rows: list[Row], accuracy: AccuracySpec, tried: set[str], shown: int = 6) -> str:
    """Why no candidate won, in one line: those that failed the spec, or (none did) what became of each
    candidate ``tried`` (those this machine cannot run, or not asked for, are in the table)."""
    failed = [f"{r.candidate}: {r.reason}" for r in rows if r.status == "failed"]
    if failed:
        return f"no candidate keeps {accuracy}: " + "; ".join(failed)
    fates = [
        f"{r.candidate}: {r.status}" + (f" ({r.reason})" if r.reason else "") for r in rows if r.candidate in tried
    ]
    more = f"; and {len(fates) - shown} more" if len(fates) > shown else ""
    return f"no candidate to pick: none failed {accuracy}, and none passed and was timed ({'; '.join(fates[:shown])}{more})"
