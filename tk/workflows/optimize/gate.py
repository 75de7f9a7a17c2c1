"""``tk optimize``'s speed gate: an int8 exclusion search runs only where its result could be the winner.

An int8 writer asks the gate (``ExportOptions.int8_gate``) with its all-int8 model before the exclusion
search that would return layers to float32: the costliest step of an optimize run (minutes on the
small Transformer; see benchmarks/history.md). The onnx and openvino writers ask as soon as the
all-int8 model is written, before judging it (their probes cost seconds: a session, a compile); the
aoti writer, whose probe is a package compile, asks only when that model misses the floor. The
gate times the all-int8 model beside every candidate that has passed so far (after the first
question, those an earlier question did not time at over ``SLOWER`` times its fastest), at the user's
batch and sequence, under the load guard, in blocks of consecutive calls as the ranking times them
(``tk.workflows.optimize.timing.time_in_turn``: one call of each in turn favours some runtimes over
others, OpenVINO most, benchmarks/history.md 2026-12-06), the passed candidates at their engine's
defaults and the all-int8 model also at each of its engine's ``tuned_options``, the fastest counting (the
ranking tries them too: OpenVINO's streams gained MiniLM 5-7% there, and a probe denied them could be
skipped where they would have won); a set of rounds that would skip is timed again, and the search is
skipped only when every set says so. Every layer the search returns to float32 makes the model
slower, not faster: the all-int8 model is the search's fastest result (the others may even run slower
than the format's float32 candidate: an aoti package of MiniLM with 1 of 36 layers int8 ran 1.41x aoti
fp32's time while Inductor packed its float32 linears, history.md). So when the all-int8 model is slower
than the fastest passed candidate by more than ``MARGIN``, the search cannot give the winner, and the
candidate is skipped with the numbers as its reason. On a busy machine (the guard's mark) the gate does not judge: the search runs.

The onnx, aoti and openvino writers ask again during their search (onnx and aoti also before ranking
their layers, with the lightest left out: the search leaves out one at least), after each round that stays under the
target, with the most the search can still keep in int8 (its result leaves out a longer prefix of the
same ranking), and the aoti writer once more after it, before compiling the package (a minute for
MiniLM), with the share it kept (``Int8Share``: of the all-int8 model's multiply-adds). Each layer's
int8 gain is taken as its share of what the all-int8 model gained over the format's own float
candidate in the precision its int8 model runs its left-out layers in (``int8_float_part``: float32 for
onnx and OpenVINO) in the probe's rounds (where it was left out of them, its time relative to the
fastest in an earlier question, scaled; where it never ran, the all-int8 model plus what its linears take longer at
float32's rate than int8's by the precision race; else the fastest passed candidate): at best
``all-int8 + (1 - share) x (float - all-int8)``. That leans to the optimistic side (each int8/float
boundary adds a quantize), so when even it is no faster than the fastest passed candidate (within
``TIE`` of a float32 one, which wins a tie: ``pick_winner``), the search stops or the package is not
compiled. MiniLM at ``cosine>=0.9999`` on the AVX2 EPYC: 1 of 36 layers kept. On the AVX512-VNNI Xeon
without bf16 (small Transformer), OpenVINO's all-int8 IR ran 124 ms against the aoti int8 package's 130
and OpenVINO fp32's 226; its search ran 3 minutes and kept 15 of 23 units int8, 136 ms: it loses.

A format in ``no_probe`` is not asked: ``tk optimize`` puts aoti there when its precision race found int8
products clearly faster than the fastest float precision's at the model's shapes
(``tk.workflows.optimize.precision_race``), where the all-int8 package's compile would only confirm that
the search may run; its after-search question then has no probe to judge by, and the package is compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.export.context import Int8Share
from tk.manifest import Manifest
from tk.measure.hardware import usable_cores
from tk.measure.load_guard import LoadGuard, quiet_or_marked
from tk.measure.timing import ms, time_in_blocks
from tk.runtime import engine_class, open_engine
from tk.runtime.inputs import random_inputs
from tk.workflows.optimize.candidates import Candidate, engine_for, writer_of
from tk.workflows.optimize.table import TIE, tuned_label
from tk.workflows.optimize.timing import BLOCK, quiet_choice

log = logging.getLogger("tk.optimize")

MARGIN = 0.05  # the all-int8 model must be this much slower than the fastest passed candidate to be skipped
# A candidate timed at more than this many times the fastest one in a previous question's rounds is not
# timed again: it cannot be the fastest in the next rounds (bursts on these VMs move a call by 30-40%,
# not 2x), and each of its calls is the slowest of the round. On the small Transformer (AVX512-BF16
# EPYC) that leaves 4 of 9 passed candidates (torch, aoti and both onnx fp32) out of the 2nd and 3rd questions.
SLOWER = 2.0
ROUNDS = 3  # rounds of BLOCK calls of every model in turn, after a warm-up call each
# Sets of ROUNDS a skip must hold in. The small Transformer's all-int8 aoti probe, four optimize runs on
# the AVX512-BF16 EPYC: 38.7, 50.3, 41.9 and 61.5 ms against 45-57 ms for the fastest candidate (the
# package itself ran 43-45 ms in each run's final timing): the last run's one set skipped a search
# that could have won. A second set costs seconds; a wrong skip loses the candidate.
SETS = 2
PROBE = "all-int8"


@dataclass
class SpeedGate:
    """Asked by the int8 writers of one optimize run; ``add`` each candidate that passes."""

    sizes: dict[str, int]  # where candidates are timed: batch, seq...
    device: str = "cpu"
    wait_quiet_s: float = 0.0
    passed: list[tuple[Candidate, Path, Manifest]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # each question's numbers, for optimize.json
    # formats whose all-int8 model is not timed, with the reason (the precision race's int8 rate: aoti's probe
    # is a package compile); their search runs
    no_probe: dict[str, str] = field(default_factory=dict)
    # what the model's linears take longer at float32's rate than at int8's, per call at ``sizes`` (the
    # precision race's rates): the float end of a format whose float candidate was never timed here
    products_gap_ms: float | None = None

    def add(self, candidate: Candidate, root: Path, manifest: Manifest) -> None:
        self.passed.append((candidate, root, manifest))

    def __call__(self, fmt: str, model: Any) -> str | None:
        """Why format ``fmt``'s search cannot give the winner, or None; ``model``: its all-int8 model
        (serialized ONNX, an ``openvino.Model``, or for aoti a function that compiles the package and
        returns its path, called only when there is something to compare it with)."""
        if self.device != "cpu" or not self.passed:
            return None
        if isinstance(model, Int8Share):
            return self._after_search(fmt, model)
        if fmt in self.no_probe:
            self.verdicts.append({"format": fmt, "probe": "not timed", "reason": self.no_probe[fmt], "skipped": False})
            log.info("optimize gate: %s: %s", fmt, self.no_probe[fmt])
            return None
        try:
            sets, load, probe_labels = self._time(fmt, model)
        except Exception as exc:  # a probe that cannot run here is no reason to skip: the search runs
            log.info("optimize gate: could not time the all-int8 %s model (%s); its search runs", fmt, exc)
            return None
        kept = min(range(len(sets)), key=lambda i: _ratio(sets[i]))  # the set of rounds most favourable to the probe
        p50 = sets[kept]
        best, ratio = _fastest(p50), _ratio(p50)
        where = " × ".join(f"{k} {v}" for k, v in self.sizes.items())
        verdict = {
            "format": fmt,
            "p50_ms": {k: round(v, 3) for k, v in p50.items()},
            "fastest_passed": best,
            "ratio": round(ratio, 3),
            "ratios": [round(_ratio(rounds), 3) for rounds in sets],
            "probe_timed_as": probe_labels[kept],
            **load,
            "skipped": not load["busy"] and ratio > 1 + MARGIN,
        }
        self.verdicts.append(verdict)
        log.info("optimize gate: %s all-int8 %.1f ms, %s %.1f ms at %s%s", fmt, p50[PROBE], best, p50[best], where,
                 " (busy machine: not judged)" if load["busy"] else "")  # fmt: skip
        if not verdict["skipped"]:
            return None
        return (
            f"cannot win here: with every layer int8 it ran {p50[PROBE]:.1f} ms at {where}, {ratio:.2f}× the "
            f"{p50[best]:.1f} ms of {best} in the same rounds: no layer left out of int8 would make it faster"
        )

    def _after_search(self, fmt: str, kept: Int8Share) -> str | None:
        """Why the search's result cannot win, judged on the format's all-int8 probe (None: no probe, or
        busy); ``kept.bound``: asked mid-search, with the most the search can still keep in int8."""
        probe = next((v for v in reversed(self.verdicts) if v["format"] == fmt and PROBE in v.get("p50_ms", {})), None)
        if probe is None or probe["busy"]:
            return None
        best = probe["fastest_passed"]
        fastest, all_int8 = probe["p50_ms"][best], probe["p50_ms"][PROBE]
        floats, measured = self._own_float_ms(fmt, probe, best)
        at_best = all_int8 + (1 - kept.share) * max(floats - all_int8, 0.0)
        float32 = any(c.name == best and c.precision == "fp32" for c, _, _ in self.passed)
        line = fastest / (1 + TIE) if float32 else fastest  # a float32 candidate wins a tie
        verdict = {
            "format": fmt,
            "during_search" if kept.bound else "after_search": {
                "int8_layers": kept.int8_layers, "layers": kept.layers, "share": round(kept.share, 4),
            },
            "at_best_ms": round(at_best, 3),
            "float_ms": round(floats, 3),
            "float_from": measured,
            "fastest_passed": best,
            "p50_ms": {best: fastest},
            "skipped": at_best >= line,
        }  # fmt: skip
        self.verdicts.append(verdict)
        log.info("optimize gate: %s search %s %d of %d layers int8 (%.0f%% of their multiply-adds): at best "
                 "%.1f ms against %s %.1f ms", fmt, "can keep at most" if kept.bound else "kept",
                 kept.int8_layers, kept.layers, 100 * kept.share, at_best, best, fastest)  # fmt: skip
        if not verdict["skipped"]:
            return None
        where = " × ".join(f"{k} {v}" for k, v in self.sizes.items())
        against = (
            f"within {TIE:.0%} of {best}'s {fastest:.1f} ms, which wins a tie"
            if float32
            else f"no faster than {best}'s {fastest:.1f} ms"
        )
        what = (
            f"its search must leave more layers out: at most {kept.int8_layers} of {kept.layers} int8"
            if kept.bound
            else f"its search kept {kept.int8_layers} of {kept.layers} layers int8"
        )
        return (
            f"cannot win here: {what} ({kept.share:.0%} of their multiply-adds), so at best {at_best:.1f} ms at "
            f"{where}, {against} (all-int8 {all_int8:.1f} ms in the same rounds, float {floats:.1f} ms {measured})"
        )

    def _own_float_ms(self, fmt: str, probe: dict[str, Any], best: str) -> tuple[float, str]:
        """What the layers left out of ``fmt``'s int8 model run at (as its float model of the precision
        ``int8_float_part`` names runs them): that candidate of its own in the probe's rounds; where that
        was not timed there (left out as over ``SLOWER`` times the fastest), its time over ``best``'s in
        the last quiet question that timed both, times ``best``'s here; where none ever was (float32
        skipped: the precision race), the all-int8 model plus ``products_gap_ms``; else ``best``'s own
        time (the optimistic side; also for a bf16 float part without its candidate: the gap is
        float32's). With where it came from. On the Xeon without AMX, OpenVINO's search
        for the small Transformer ran on with the fastest standing in (at best 71.8 ms against 78.4) and
        kept 13 of 23 layers int8 at 91.7 ms; on the AVX512-BF16 EPYC, MiniLM's ran 100 s with OpenVINO's
        bf16 IR standing in for the float32 its left-out layers run in (benchmarks/history.md)."""
        fastest = probe["p50_ms"][best]
        part = int8_float_part(fmt)
        names = [c.name for c, _, _ in self.passed if c.format == fmt and c.precision == part]
        own = [p50 for name in names if (p50 := probe["p50_ms"].get(name)) is not None]
        if own:
            return min(own), "in the same rounds"
        for verdict in reversed(self.verdicts):
            p50 = verdict.get("p50_ms", {})
            if verdict.get("busy") or PROBE not in p50 or best not in p50:
                continue
            earlier = [p50[name] / p50[best] for name in names if name in p50]
            if earlier:
                return min(earlier) * fastest, f"by its time over {best}'s in an earlier question"
        if self.products_gap_ms is not None and part == "fp32":  # the gap is float32's: no end for a bf16 part
            return probe["p50_ms"][PROBE] + self.products_gap_ms, "(all-int8 plus its products at float32's rate)"
        return fastest, f"{best}'s, standing in"

    def _time(self, fmt: str, model: Any) -> tuple[list[dict[str, float]], dict[str, Any], list[str]]:
        """Sets of rounds of each model's p50 (the all-int8 model's as its fastest setting), the load, and which
        setting of the all-int8 model was its fastest in each set."""
        batch = self.sizes.get("batch", 1)
        others = {k: v for k, v in self.sizes.items() if k != "batch"}
        with ExitStack() as stack:
            engines = {}
            for candidate, root, manifest in self._contenders():
                quiet = quiet_choice(candidate.engine, {}, self.device)  # as time_candidates opens them
                engines[candidate.name] = stack.enter_context(
                    open_engine(root, quiet, candidate.engine, manifest=manifest)
                )
            first = next(iter(engines.values())).load()
            feeds = random_inputs(first.inputs, first.dims, batch, seed=0, sizes=others)
            for engine in engines.values():
                engine.load().check_feeds(feeds)  # once: the timed calls skip the checks
            calls: dict[str, Callable[[], object]] = {
                name: (lambda e=engine: e.run(feeds, check=False)) for name, engine in engines.items()
            }
            probes = _probes(fmt, model, feeds, first, batch)
            calls.update(probes)
            for call in calls.values():
                call()  # compiled, and its requests made, before any block
            sets: list[dict[str, float]] = []
            probe_labels: list[str] = []
            load = {"busy": False, "others_cores": 0.0}
            while len(sets) < SETS:  # a skip must hold in every set: one burst of the VM is not a verdict
                times, mark = quiet_or_marked(
                    lambda: time_in_blocks(calls, rounds=ROUNDS, block=BLOCK, order=list(calls)),
                    LoadGuard(self.wait_quiet_s),
                )
                folded, label = _probe_at_best({name: ms(samples) for name, samples in times.items()}, list(probes))
                sets.append(folded)
                probe_labels.append(label)
                load = {"busy": load["busy"] or mark.busy,
                        "others_cores": max(load["others_cores"], mark.to_json()["others_cores"])}  # fmt: skip
                if load["busy"] or _ratio(sets[-1]) <= 1 + MARGIN:
                    break
        return sets, load, probe_labels

    def _contenders(self) -> list[tuple[Candidate, Path, Manifest]]:
        """The passed candidates worth timing: all but those the last quiet question that timed them
        found over ``SLOWER`` times its fastest (a candidate passed since then is timed)."""
        slow: set[str] = set()
        for verdict in self.verdicts:
            p50 = verdict.get("p50_ms", {})
            if PROBE not in p50 or verdict["busy"]:
                continue
            fastest = p50[verdict["fastest_passed"]]
            for name, p in p50.items():
                if name == PROBE:
                    continue
                if p > SLOWER * fastest:
                    slow.add(name)
                else:
                    slow.discard(name)  # timed near the fastest again since
        return [c for c in self.passed if c[0].name not in slow]


def int8_float_part(fmt: str) -> str:
    """The precision the layers ``fmt``'s int8 model leaves out run in (its writer's ``int8_float_part``:
    float32 in onnx QDQ graphs and OpenVINO int8 IRs; in an aoti package, bfloat16 where its products
    outrun float32's)."""
    return writer_of(fmt).int8_float_part()


def _fastest(p50: dict[str, float]) -> str:
    return min((name for name in p50 if name != PROBE), key=p50.__getitem__)


def _ratio(p50: dict[str, float]) -> float:
    """The probe's p50 over the fastest passed candidate's, in one set of rounds."""
    return p50[PROBE] / p50[_fastest(p50)]


def _probes(
    fmt: str, model: Any, feeds: dict[str, np.ndarray], engine: Any, batch: int
) -> dict[str, Callable[[], object]]:
    """Calls of ``model`` (format ``fmt``'s all-int8 model) on ``feeds``, run as that format's engine runs its
    artifact (``Engine.probe_call``): at its defaults (``PROBE``) and at each of the engine's ``tuned_options``
    here (``all-int8 [streams 2]``; a setting that cannot compile is left out, with a note)."""
    name = engine_for(fmt)
    if name is None:
        raise ValueError(f"no engine runs the {fmt} format")
    cls = engine_class(name)
    probes = {PROBE: cls.probe_call(model, feeds, engine)}
    for options in cls.tuned_options(batch, usable_cores()):
        try:
            probes[tuned_label(PROBE, options)] = cls.probe_call(model, feeds, engine, options)
        except Exception as exc:  # the probe at its defaults still answers
            log.info("optimize gate: %s all-int8 at %s left out: %s", fmt, options, exc)
    return probes


def _probe_at_best(p50: dict[str, float], probes: list[str]) -> tuple[dict[str, float], str]:
    """``p50`` with the all-int8 model's settings folded into ``PROBE`` (the fastest of them), and its label."""
    fastest = min(probes, key=p50.__getitem__)
    return {**{name: t for name, t in p50.items() if name not in probes}, PROBE: p50[fastest]}, fastest
