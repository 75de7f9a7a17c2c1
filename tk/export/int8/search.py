"""The int8 search: which units (layers, modules, an IR's products) leave int8 so that the model keeps its
SQNR floor. Written once for every int8 writer, in the shape of NNCF's accuracy control: an evaluator with
cached references (``tk.export.int8.evaluator``), a ranker, and one rounds policy.

- The ranker: each unit's sensitivity, the model's SQNR on the calibration batches with that unit alone in
  int8 (``one_at_a_time_sqnr_db``, measured once), and its cost, its multiply-adds on the first calibration
  batch (counted once, for the speed gate's ``Int8Share``).
- The rounds (``exclude_costliest``): the most sensitive units leave first, 1, 2, 4... more a round, until the
  model clears the floor plus ``MARGIN_DB``; the round that clears it is bisected back to the fewest that
  do. A round stops at its first batch under the target. Where the judge is slow (a program run in PyTorch,
  an IR compiled per candidate) the rounds judge a screen of the batches and the set they keep is judged on
  every batch after (``screened_exclusion``). Between rounds, the speed gate (``ExportOptions.int8_gate``)
  is told the most the search can still keep int8, and may end it.
- The adapter (``Int8Units``), one per format: what its units are and its model with some of them left out.

``tk debug precision`` bisects modules with the same evaluator (``minimize``, ``refine``: no ranking there).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from tk.errors import CannotWinError, ConversionError, first_line
from tk.export.context import ExportContext, Int8Share
from tk.export.int8.evaluator import Evaluator

# a quantized graph's judged batches must clear the floor by this much: the check runs other batches (fresh
# random ones, or the check's samples where the search judged calibration samples held aside)
MARGIN_DB = 2.0
SCREEN_EVERY = 4  # screened_exclusion's rounds judge the calibration batches and every 4th held-out one

log = logging.getLogger("tk.export")


def int8_floor_db(ctx: ExportContext) -> float:
    """The SQNR floor of the int8 exclusion search: ``--min-sqnr``, else int8's row of ``MIN_SQNR_DB``."""
    from tk.tolerances import MIN_SQNR_DB

    return ctx.options.min_sqnr_db if ctx.options.min_sqnr_db is not None else MIN_SQNR_DB["int8"]


def int8_gate(ctx: ExportContext, fmt: str) -> Callable[[Any], None] | None:
    """What format ``fmt``'s int8 writer calls with its all-int8 model before an exclusion search (and with
    an ``Int8Share`` during and after it): ``ctx.options.int8_gate`` asked for ``fmt``, raising
    ``CannotWinError`` with its reason."""
    gate = ctx.options.int8_gate
    if gate is None:
        return None

    def ask(model: Any) -> None:
        reason = gate(fmt, model)
        if reason:
            raise CannotWinError(f"{fmt} int8: {reason}")

    return ask


def require_int8_layers(int8: int, quantizable: int, fmt: str) -> None:
    """Fail an int8 export in which no layer stayed int8 (it would be a float32 artifact called int8);
    log how many did otherwise."""
    if quantizable and int8 == 0:
        from tk.formats.aoti import runs_natively

        other = "--precision bf16" if runs_natively("bf16") else "float32 (this CPU has no bf16 dot products)"
        raise ConversionError(
            f"--precision int8 --format {fmt}: no layer stayed int8 (all {quantizable} were left out, below the "
            "SQNR floor or by --keep-fp32), so the artifact would not be int8; calibrate with real inputs "
            "(--calibrate FILE; tk optimize: --data FILE), train the model, accept a lower floor (--min-sqnr DB; "
            f"tk optimize: a lower --accuracy) or export {other}"
        )
    log.info("export int8   %d of %d layers int8", int8, quantizable)


class Int8Units(Protocol):
    """A format's adapter: the units its search may leave out of int8, and its model with some left out."""

    units: list[str]  # in the model's order
    noun: str  # how the log names them: "modules", "layers", "units"
    excluded_dtype: str  # what a left-out unit runs in ("fp32", "bf16"; the log says it)

    def without(self, excluded: Sequence[str]) -> Any:
        """The int8 model with ``excluded`` out of int8 (a candidate the evaluator's runner runs)."""
        ...

    def only(self, unit: str) -> Any:
        """The model with ``unit`` alone in int8."""
        ...

    def unit_macs(self) -> dict[str, int]:
        """Each unit's multiply-adds on the first calibration batch."""
        ...


@dataclass(frozen=True)
class RoundsPolicy:
    """How a format's search runs its rounds (each format keeps what it measured)."""

    max_rounds: int  # rounds of 1, 2, 4... units more before the check reports the SQNR
    screened: bool  # rounds judge a screen of the batches (a slow judge), the kept set every batch after
    asks_before_ranking: bool  # the speed gate is asked with the lightest unit out before the costs
    asks_after_search: bool = False  # ...and with what the search kept (the aoti writer, before its compile)
    margin_db: float = MARGIN_DB


def int8_share(
    macs: dict[str, int], units: Sequence[str], excluded: Iterable[str], *, bound: bool = False
) -> Int8Share:
    """What is left int8 of ``units`` once ``excluded`` are not: units, and their share of the multiply-adds."""
    left_out = set(excluded)
    kept = [n for n in units if n not in left_out]
    total = sum(macs.get(n, 0) for n in units)
    share = sum(macs.get(n, 0) for n in kept) / total if total else 0.0
    return Int8Share(len(kept), len(units), share, bound=bound)


def one_at_a_time_sqnr_db(units: Int8Units, evaluator: Evaluator) -> dict[str, float]:
    """Each unit's sensitivity: the model's worst SQNR on ``evaluator``'s batches with that unit alone in int8.
    It replaced the cheaper cost of each unit's own output (one pass), which ranked so much worse that the
    aoti search kept far fewer modules int8 (benchmarks/history.md, "the speed gate and the aoti ranking")."""
    return {name: evaluator.sqnr_db(units.only(name)) for name in units.units}


class Ranker:
    """The units' sensitivity (``one_at_a_time_sqnr_db``) and cost (multiply-adds, counted at the speed gate's
    first question), and the gate's questions in their terms."""

    def __init__(self, units: Int8Units, share_gate: Callable[[Int8Share], None] | None = None) -> None:
        self.units = units
        self.share_gate = share_gate
        self._macs: dict[str, int] | None = None

    def sensitivity(self, evaluator: Evaluator) -> dict[str, float]:
        return one_at_a_time_sqnr_db(self.units, evaluator)

    def macs(self) -> dict[str, int]:
        """Each unit's multiply-adds; all 0 where the model cannot be counted (the gate is then not asked)."""
        if self._macs is None:
            try:
                self._macs = dict(self.units.unit_macs())
            except Exception as exc:  # the gate saves time; a model it cannot count is still searched
                log.info("export int8   the speed gate is not asked: %s", first_line(exc))
                self._macs = dict.fromkeys(self.units.units, 0)
        return self._macs

    def counted(self) -> bool:
        return self.share_gate is not None and any(self.macs().values())

    def ask(self, excluded: Sequence[str], *, bound: bool = True) -> None:
        """The speed gate, with what is left int8 once ``excluded`` are out (``bound``: the most the search
        can still keep); it may end the search (``CannotWinError``)."""
        if self.share_gate is not None and self.counted():
            self.share_gate(int8_share(self.macs(), self.units.units, excluded, bound=bound))

    def ask_lightest_out(self) -> None:
        """The search leaves one unit out at least: at best the lightest, asked before the costs (a model
        built and judged per unit: 25-40 s of the small Transformer's onnx export, ~22 s of its aoti one)."""
        if len(self.units.units) > 1 and self.counted():
            macs = self.macs()
            self.ask([min(self.units.units, key=lambda name: macs.get(name, 0))])


@dataclass
class Exclusions:
    """What a search found: the units left out, costliest first, and the model without them."""

    excluded: list[str]
    costs: dict[str, float]  # unit -> the model's SQNR with it alone in int8
    model: Any  # the model without ``excluded`` (None: no round ran)
    sqnr_db: float | None  # its worst SQNR on the batches that judged it last (None: no round ran)


def _no_phase(name: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def search_exclusions(
    units: Int8Units,
    evaluator: Evaluator,
    floor_db: float,
    calibration: int,
    policy: RoundsPolicy,
    *,
    share_gate: Callable[[Int8Share], None] | None = None,
    held_to: Callable[[int], float] | None = None,
    phase: Callable[[str], AbstractContextManager[None]] = _no_phase,
) -> Exclusions:
    """The units of an int8 model under ``floor_db + policy.margin_db`` that leave int8 until it clears it.

    ``evaluator`` judges every batch (the first ``calibration`` are the calibration batches, which rank the
    units); ``share_gate``: the speed gate's questions (``Ranker.ask``), asked as ``policy`` says and after
    each round under the target; ``held_to``: ``Evaluator.headroom_db``'s (the aoti writer's bf16 check);
    ``phase(name)``: a context the search's steps run in ("gate", "costs", "rounds"), to time them."""
    ranker = Ranker(units, share_gate)
    if policy.asks_before_ranking and share_gate is not None and len(units.units) > 1:
        with phase("gate"):
            ranker.ask_lightest_out()
    with phase("costs"):
        costs = ranker.sensitivity(evaluator.subset(range(calibration)))
    target = floor_db + policy.margin_db
    at_least = ranker.ask if share_gate is not None else None
    with phase("rounds"):
        found = _Rounds(units, evaluator, target, policy, at_least, held_to).run(costs, calibration)
    if policy.asks_after_search and share_gate is not None:
        with phase("gate"):
            ranker.ask(found.excluded, bound=False)
    return found


class _Rounds:
    """One search's rounds and what they remember across screens: the sets under the target on some screen
    (under it on any larger one too), each set's SQNR per batch judged so far (a set asked again once a
    batch joins the screen runs on that batch alone), and the models of the sets that passed a screen."""

    def __init__(
        self,
        units: Int8Units,
        evaluator: Evaluator,
        target: float,
        policy: RoundsPolicy,
        at_least: Callable[[list[str]], None] | None,
        held_to: Callable[[int], float] | None,
    ) -> None:
        self.units, self.evaluator, self.target, self.policy = units, evaluator, target, policy
        self.at_least, self.held_to = at_least, held_to
        self.costs: dict[str, float] = {}
        self.failed: set[frozenset[str]] = set()
        self.seen: dict[frozenset[str], dict[int, float]] = {}
        self.built: dict[frozenset[str], Any] = {}
        # this screen's passing sets: the bisection ends by asking again for the one it keeps
        self.passed: dict[frozenset[str], tuple[Any, float, float, tuple[int, ...]]] = {}
        self.model: Any = None  # the last judged set's model (the returned set's, at the end)
        self.screen = evaluator  # the evaluator that judged the returned set last: a screen's, or every batch's

    def run(self, costs: dict[str, float], calibration: int) -> Exclusions:
        self.costs = costs
        count = len(self.evaluator.batches)
        excluded, last, _ = screened_exclusion(
            count, calibration, self._search, self._judge_all, self.target, screened=self.policy.screened
        )
        if last is not None and last < self.target:
            log.warning(
                "export int8   %d of %d %s left out of int8 and a judged batch is still under its target "
                "(%.1f dB at %s): the export check decides",
                len(excluded), len(costs), self.units.noun, self.screen.worst_sqnr_db,
                "x".join(map(str, self.screen.worst_shape)),
            )  # fmt: skip
        sqnr = None if last is None else self.screen.worst_sqnr_db
        return Exclusions(excluded, costs, self.model, sqnr)

    def _search(self, screen: list[int]) -> tuple[list[str], float | None]:
        self.screen = self.evaluator.subset(screen)
        self.passed.clear()
        return exclude_costliest(
            self.costs, self._judge, self.target, self.policy.max_rounds, failed_before=self.failed,
            at_least=self.at_least,
        )  # fmt: skip

    def _judge(self, excluded: list[str]) -> float:
        """The screen's verdict on the model without ``excluded``: the target plus its least headroom."""
        judge, key = self.screen, frozenset(excluded)
        if key in self.passed:
            self.model, value, judge.worst_sqnr_db, judge.worst_shape = self.passed[key]
            return value
        self.model = self.built[key] if key in self.built else self.units.without(excluded)
        targets = [self.target] * len(judge.indices)
        headroom = judge.headroom_db(self.model, targets, held_to=self.held_to, known=self.seen.setdefault(key, {}))
        at = "x".join(map(str, judge.worst_shape))
        log.info(
            "export int8   %d %s %s: SQNR %.1f dB on %d batches%s",
            len(excluded), self.units.noun, self.units.excluded_dtype, judge.worst_sqnr_db, len(judge.indices),
            f" (a batch at {at} under its target: the rest not run)" if headroom < 0 else "",
        )  # fmt: skip
        if headroom >= 0:
            self.passed[key] = (self.model, self.target + headroom, judge.worst_sqnr_db, judge.worst_shape)
            self.built[key] = self.model
        return self.target + headroom

    def _judge_all(self, excluded: list[str]) -> tuple[float, int | None]:
        """The kept set on every batch: the screen's were judged on this very model by the round that kept
        it, so only the rest run (a third of the judge's batches on the small Transformer)."""
        screen = self.screen
        on_screen = set(screen.indices)
        rest = self.evaluator.subset(p for p, index in enumerate(self.evaluator.indices) if index not in on_screen)
        known = self.seen.setdefault(frozenset(excluded), {})
        targets = [self.target] * len(rest.indices)
        headroom = rest.headroom_db(self.model, targets, held_to=self.held_to, known=known)
        failed = rest.indices[len(rest.judged_sqnr_db) - 1]  # the batch it stopped at
        worst = min((screen.worst_sqnr_db, screen.worst_shape), (rest.worst_sqnr_db, rest.worst_shape))
        log.info(
            "export int8   %d %s %s: SQNR %.1f dB on all %d batches%s",
            len(excluded), self.units.noun, self.units.excluded_dtype, worst[0], len(self.evaluator.indices),
            "" if headroom >= 0 else f": batch {failed} "
            f"({'x'.join(map(str, self.evaluator.runner.shape(self.evaluator.all_batches[failed])))}) under the "
            "target joins the screen and the rounds run again",
        )  # fmt: skip
        if headroom >= 0:
            self.evaluator.worst_sqnr_db, self.evaluator.worst_shape = worst
            self.screen = self.evaluator
        return self.target + headroom, None if headroom >= 0 else failed


def exclude_costliest(
    costs: dict[str, float],
    judge: Callable[[list[str]], float],
    target_db: float,
    max_rounds: int,
    *,
    failed_before: set[frozenset[str]] | None = None,
    at_least: Callable[[list[str]], None] | None = None,
) -> tuple[list[str], float | None]:
    """Leave out the layers that cost the most signal, 1, 2, 4... more per round, until ``judge`` says
    the graph without them reaches ``target_db``. ``costs``: each layer's cost as an SQNR, lower is
    costlier (the graph's with only that layer quantized, in every int8 writer); ``judge(excluded)``
    quantizes everything else and returns the graph's SQNR, or any value under ``target_db`` when it fails.

    A round that reaches the target after leaving out several more layers is bisected back: the fewest
    of them that still reach it are kept out, so no layer leaves int8 that did not have to. The last
    ``judge`` call is always the returned set's (callers keep that call's graph).
    ``failed_before``: sets already found under the target by a judge of fewer batches (a screen's
    rounds, before a batch joined it: a set under the target on some batches is under it on more); they
    are not judged again but where the answer is returned, and the sets found under it are added.
    ``at_least(layers)``, after each round under the target with layers left to take: the fewest layers
    the search can still return (the returned set is always a longer prefix of the same ranking); it may
    end the search by raising (tk optimize's speed gate: the int8 left cannot win).
    Returns the excluded layers, costliest first, and the last SQNR (None when there was none to exclude)."""
    known = failed_before if failed_before is not None else set()

    def ask(layers: list[str], *, returned: bool = False) -> float:
        key = frozenset(layers)
        if key in known and not returned:
            return -math.inf
        value = judge(list(layers))
        if value < target_db:
            known.add(key)
        return value

    ranked = sorted(costs, key=costs.__getitem__)
    excluded: list[str] = []
    sqnr = None
    step = 1
    for round_ in range(max_rounds):
        if not ranked:
            break
        take, ranked = ranked[:step], ranked[step:]
        excluded.extend(take)
        sqnr = ask(excluded, returned=not ranked or round_ == max_rounds - 1)  # the last round's set is returned
        if sqnr >= target_db:
            return _fewest_that_pass(excluded, len(excluded) - len(take), sqnr, ask, target_db)
        if at_least is not None and ranked and round_ < max_rounds - 1:
            at_least([*excluded, ranked[0]])
        step *= 2
    return excluded, sqnr


def _fewest_that_pass(
    excluded: list[str], failed: int, sqnr: float, judge: Callable[[list[str]], float], target_db: float
) -> tuple[list[str], float]:
    """Bisect between ``failed`` layers out (under the target) and all of ``excluded`` (at it)."""
    passing, best = len(excluded), sqnr
    last_judged = passing
    while passing - failed > 1:
        middle = (failed + passing) // 2
        value = judge(excluded[:middle])
        last_judged = middle
        if value >= target_db:
            passing, best = middle, value
        else:
            failed = middle
    if last_judged != passing:
        best = judge(excluded[:passing])  # the caller keeps the last call's graph
    return excluded[:passing], best


def screened_exclusion(
    batches: int,
    calibration: int,
    search: Callable[[list[int]], tuple[list[str], float | None]],
    judge_all: Callable[[list[str]], tuple[float, int | None]],
    target_db: float,
    *,
    screened: bool = True,
) -> tuple[list[str], float | None, list[int]]:
    """``search(screen)`` (an ``exclude_costliest`` whose rounds judge only the batches ``screen`` indexes)
    on a screen of the ``batches`` judged ones: the first ``calibration`` (the calibration batches) and
    every ``SCREEN_EVERY``-th (every one where not ``screened``). The set it keeps is judged on every batch
    (``judge_all(excluded)``: the SQNR, and None where it holds, else the index of a batch under the
    target); a batch failing there joins the screen and the rounds run again. For writers whose judge is
    slow (the aoti package's runs the quantized program in PyTorch; OpenVINO's compiles each IR): a passing
    round runs every batch it is judged on. Returns the excluded layers, the last SQNR (None when there was
    none to exclude) and the batches it was judged on."""
    every = SCREEN_EVERY if screened else 1
    screen = [i for i in range(batches) if i < calibration or i % every == 0]
    while True:
        excluded, last = search(screen)
        if last is None or last < target_db or len(screen) == batches:
            return excluded, last, screen
        value, failed = judge_all(excluded)
        if failed is None:
            return excluded, value, list(range(batches))
        screen = sorted({*screen, failed})


def minimize(items: list[str], fixed: list[str], passes: Callable[[list[str]], bool]) -> list[str]:
    """A small subset S of ``items`` with ``passes(fixed + S)``, given ``passes(fixed + items)``: the
    bisection of ``tk debug precision``, which has no ranking of its units.

    Bisection: keep one half if it is enough, else each half with the other fixed.
    """
    if len(items) <= 1:
        return list(items)
    half = len(items) // 2
    a, b = items[:half], items[half:]
    if passes(fixed + a):
        return minimize(a, fixed, passes)
    if passes(fixed + b):
        return minimize(b, fixed, passes)
    kept_a = minimize(a, fixed + b, passes)
    kept_b = minimize(b, fixed + kept_a, passes)
    return kept_a + kept_b


def refine(chosen: list[str], children: dict[str, list[str]], passes: Callable[[list[str]], bool]) -> list[str]:
    """Replace each chosen unit (a module) by a subset of its children while ``passes`` still holds."""
    result = list(chosen)
    for module in chosen:
        kids = children.get(module, [])
        others = [m for m in result if m != module]
        if kids and passes(others + kids):
            smaller = refine(minimize(kids, others, passes), children, passes)
            result = others + smaller
    return result
