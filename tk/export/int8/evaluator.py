"""The int8 search's evaluator: the float model's outputs on each judged batch, computed once, and how far a
candidate's outputs are from them (SQNR in dB, as the export check judges int8).

One evaluator serves every int8 writer (and ``tk debug precision``); what differs is how a format runs its
float model and a candidate, a ``Runner``: the PT2E program in PyTorch (``tk.export.aoti.int8``), a QDQ graph
in onnxruntime (``tk.export.onnx.static_int8``), an IR compiled by OpenVINO (``tk.export.openvino.writer``).

A batch's reference is computed when it is first judged, once for an evaluator and all its subsets: a
search whose rounds judge a screen of the batches, a candidate under the target on its first batch, or a
gate that ends the export never runs the float model on the rest (on the small Transformer the 44 judged
batches' references took ~19 s of the aoti export; a session per batch, every batch before the first
verdict, had been most of its onnx int8 export: benchmarks/history.md, "The int8 search's judge").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tk.parity import worst_sqnr_db

Outputs = list[np.ndarray]


class Runner(Protocol):
    """How a format runs its float model and a candidate on one batch."""

    def reference(self, batch: Any) -> Outputs:
        """The float model's outputs on ``batch``."""
        ...

    def candidate(self, model: Any) -> Callable[[Any], Outputs]:
        """A function that runs ``model`` (a candidate: a program, a graph, an IR) on a batch."""
        ...

    def shape(self, batch: Any) -> tuple[int, ...]:
        """The first input's shape in ``batch`` (the logs name a batch by it)."""
        ...


class FeedsRunner:
    """A runner for batches of named arrays (an input name -> array dict) whose float model and candidates
    are opened the same way (an onnxruntime session, a compiled IR): ``open(model)`` gives the function that
    runs one on a batch; the float model's is opened at the first reference asked, once."""

    def __init__(self, model: Any) -> None:
        self.model = model  # the float model
        self.float_run: Callable[[Any], Outputs] | None = None

    def open(self, model: Any) -> Callable[[Any], Outputs]:
        raise NotImplementedError

    def reference(self, batch: Any) -> Outputs:
        if self.float_run is None:
            self.float_run = self.open(self.model)
        return self.float_run(batch)

    def candidate(self, model: Any) -> Callable[[Any], Outputs]:
        return self.open(model)

    def shape(self, batch: Any) -> tuple[int, ...]:
        return tuple(next(iter(batch.values())).shape)


@dataclass
class Evaluator:
    """Reference outputs on ``all_batches`` (computed when first judged, shared with subsets), and the SQNR
    of candidates against them. The last call's verdict is kept: ``worst_sqnr_db`` and ``worst_shape`` (its
    worst batch), ``judged_sqnr_db`` (each batch it judged), ``stopped_at`` (the batch it stopped at under
    its target, -1 where it ran them all) and ``first_worst`` (the worst of its first ``judge_first``)."""

    runner: Runner
    all_batches: list[Any]
    indices: list[int]  # this evaluator's batches, as indices of ``all_batches``
    references: dict[int, Outputs]  # by index of ``all_batches``; shared with subsets
    worst_shape: tuple[int, ...] = ()
    worst_sqnr_db: float = math.inf
    judged_sqnr_db: list[float] = field(default_factory=list)
    stopped_at: int = -1
    first_worst: float = math.inf
    # the last candidate run and its runner's function, shared with subsets (a candidate judged on a
    # screen, then on the rest, is prepared once: the aoti judge's copy of a program takes a while)
    _prepared: list[Any] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, runner: Runner, batches: Iterable[Any]) -> Evaluator:
        batches = list(batches)
        return cls(runner, batches, list(range(len(batches))), {})

    @property
    def batches(self) -> list[Any]:
        return [self.all_batches[i] for i in self.indices]

    def subset(self, indices: Iterable[int]) -> Evaluator:
        """An evaluator of some of this one's batches (by position here), with the same references."""
        chosen = [self.indices[i] for i in indices]
        return Evaluator(self.runner, self.all_batches, chosen, self.references, _prepared=self._prepared)

    def reference(self, index: int) -> Outputs:
        """The float model's outputs on ``all_batches[index]``."""
        if index not in self.references:
            self.references[index] = self.runner.reference(self.all_batches[index])
        return self.references[index]

    def outputs_on(self, candidate: Any, index: int) -> Outputs:
        """``candidate``'s outputs on ``all_batches[index]``."""
        if not self._prepared or self._prepared[0] is not candidate:
            self._prepared[:] = [candidate, self.runner.candidate(candidate)]
        return self._prepared[1](self.all_batches[index])

    def sqnr_on(self, candidate: Any, index: int) -> float:
        """``candidate``'s worst SQNR over the outputs on ``all_batches[index]``."""
        return worst_sqnr_db([self.reference(index)], [self.outputs_on(candidate, index)])

    def sqnr_db(self, candidate: Any, *, target_db: float | None = None, judge_first: int = 0) -> float:
        """The worst SQNR over the batches; with ``target_db``, the first batch under it ends the judging
        once the first ``judge_first`` are judged (the candidate fails whatever the rest would say)."""
        targets = None if target_db is None else [target_db] * len(self.indices)
        self.headroom_db(candidate, targets, judge_first=judge_first)
        return self.worst_sqnr_db

    def per_batch(self, candidate: Any) -> list[float]:
        self.headroom_db(candidate, None)
        return list(self.judged_sqnr_db)

    def headroom_db(
        self,
        candidate: Any,
        targets: Sequence[float] | None,
        *,
        judge_first: int = 0,
        held_to: Callable[[int], float] | None = None,
        known: dict[int, float] | None = None,
    ) -> float:
        """The least SQNR - target over the batches (``targets``: one per batch; None: no targets, and the
        result is the worst SQNR), stopping at the first batch under its target once the first
        ``judge_first`` batches are judged. ``held_to(index)``: on a batch under its target, a lower target
        that batch is held to instead (of ``all_batches[index]``), asked only there. ``known``:
        ``candidate``'s SQNR on batches (by index of ``all_batches``) judged before, used instead of
        running it there again; the batches judged now are added."""
        headroom, self.worst_sqnr_db, self.stopped_at = math.inf, math.inf, -1
        self.judged_sqnr_db = []
        for i, index in enumerate(self.indices):
            sqnr = self._judged_on(candidate, index, known)
            self.judged_sqnr_db.append(sqnr)
            if sqnr < self.worst_sqnr_db:
                self.worst_sqnr_db, self.worst_shape = sqnr, self.runner.shape(self.all_batches[index])
            if targets is None:
                headroom = min(headroom, sqnr)
                continue
            target = targets[i]
            if sqnr < target and held_to is not None:
                target = min(target, held_to(index))
            headroom = min(headroom, sqnr - target)
            if headroom < 0 and i + 1 >= judge_first:
                self.stopped_at = i
                break
        self.first_worst = min(self.judged_sqnr_db[:judge_first], default=math.inf)
        return headroom

    def _judged_on(self, candidate: Any, index: int, known: dict[int, float] | None) -> float:
        if known is not None and index in known:
            return known[index]
        sqnr = self.sqnr_on(candidate, index)
        if known is not None:
            known[index] = sqnr
        return sqnr
