"""Which candidates one export writes, and in which order the groups go (``tk optimize``'s write stage).

One precision and setting is one capture for its formats; each int8 format goes alone (each runs its
own search). The order lets the precision race (``precision_race``) and the speed gate skip groups that
cannot win: reduced floats before float32, and where int8 leads, the likeliest int8 winner before both.
"""

from __future__ import annotations

from typing import Any

from tk.workflows.optimize.candidates import Candidate, writer_of

REDUCED_FLOATS = ("bf16", "fp16")


def export_groups(tried: list[Candidate], *, reduced_first: bool = False) -> dict[Any, list[Candidate]]:
    """The candidates written by one export each: one precision and setting (one capture for its formats),
    but each int8 format alone: each quantizes with its own search, and a failing member of a shared
    group is retried one format at a time, which would run the others' searches again. Groups keep
    ``tried``'s order but for the int8 formats, which go in their writers' ``int8_rank`` (the likeliest
    winner first, so the speed gate can skip a later search that cannot beat it); with ``reduced_first`` the
    reduced float precisions (``REDUCED_FLOATS``) go before float32, whose groups the precision race may
    then skip (``tk.workflows.optimize.precision_race``; where int8 leads, ``int8_before_fp32`` moves the
    aoti int8 group before them too)."""

    def rank(candidate: Candidate) -> int:
        return writer_of(candidate.format).int8_rank if candidate.precision == "int8" else 0

    groups: dict[Any, list[Candidate]] = {}
    precisions = list(dict.fromkeys(c.precision for c in tried))
    if reduced_first:
        precisions.sort(key=lambda p: p not in REDUCED_FLOATS)  # stable: float32 and int8 keep their order
    for candidate in sorted(tried, key=lambda c: (precisions.index(c.precision), rank(c))):
        alone = candidate.format if candidate.precision == "int8" else None
        groups.setdefault((candidate.group, alone), []).append(candidate)
    return groups


def int8_before_fp32(groups: dict[Any, list[Candidate]]) -> dict[Any, list[Candidate]]:
    """``groups`` with the first int8 group (the likeliest winner: ``export_groups`` puts int8 formats in their
    writers' ``int8_rank``) moved before the first float32 group (``PrecisionRace.int8_leads``)."""
    order = list(groups.items())
    int8 = next((i for i, (_, m) in enumerate(order) if m[0].precision == "int8"), None)
    first_fp32 = next((i for i, (_, m) in enumerate(order) if m[0].precision == "fp32"), None)
    if int8 is None or first_fp32 is None or int8 < first_fp32:
        return groups
    order.insert(first_fp32, order.pop(int8))
    return dict(order)


def compiled_probes(tried: list[Candidate]) -> list[str]:
    """The int8 formats among ``tried`` whose all-int8 probe costs a compile (``Writer.int8_probe_compiles``)."""
    return sorted({c.format for c in tried if c.precision == "int8" and writer_of(c.format).int8_probe_compiles})
