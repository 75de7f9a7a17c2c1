"""``--engine auto``: the fastest engine on this machine whose parity passes at the artifact's precision.

Every engine this machine can run is checked against eager on the same valid random inputs,
then the ones that pass are timed side by side (interleaved) at the batch size asked for.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.manifest import Manifest
from tk.parity import check_engines
from tk.runtime import EngineChoice, available_engines, open_engines, trusted_engines, unavailable_reason
from tk.tolerances import artifact_tolerance
from tk.workflows.bench import measure


@dataclass
class EngineCandidate:
    engine: str
    passed: bool
    max_rel: float
    p50_ms: float | None = None
    note: str = ""


@dataclass
class AutoChoice:
    engine: str
    batch_size: int
    candidates: list[EngineCandidate] = field(default_factory=list)
    recommended: str | None = None  # why: tk optimize chose this engine for the artifact (its manifest says so)
    options: dict[str, Any] = field(default_factory=dict)  # the engine settings tk optimize chose with it (streams)

    @property
    def reason(self) -> str:
        if self.recommended:
            return self.recommended
        chosen = next(c for c in self.candidates if c.engine == self.engine)
        others = [
            f"{c.engine} {c.p50_ms:.3g} ms" if c.passed and c.p50_ms is not None else f"{c.engine} {c.note}"
            for c in self.candidates
            if c.engine != self.engine
        ]
        return (
            f"fastest of the engines that pass parity at batch {self.batch_size}: {self.engine} "
            f"{chosen.p50_ms:.3g} ms (max rel error {chosen.max_rel:.1e})"
            + (f"; {', '.join(others)}" if others else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "options": self.options,
            "batch_size": self.batch_size,
            "reason": self.reason,
            "candidates": [c.__dict__ for c in self.candidates],
        }


def check_candidates(
    reference: Any, engines: dict[str, Any], manifest: Manifest, shape: dict[str, int]
) -> list[EngineCandidate]:
    """Each engine's parity against ``reference`` at ``shape``, under the artifact's precision tolerances."""
    from tk.measure.hardware import cpu_precision_reason

    rtol, atol, min_sqnr = artifact_tolerance(manifest.precision, manifest.model)
    candidates = []
    for name, engine in engines.items():
        if name == "eager":
            candidates.append(EngineCandidate(name, True, 0.0))
            continue
        no_hardware = cpu_precision_reason(manifest.precision) if getattr(engine, "device", "cpu") == "cpu" else None
        if no_hardware:  # never auto-pick emulated reduced precision (every engine but eager runs at it)
            candidates.append(EngineCandidate(name, False, 0.0, note=no_hardware))
            continue
        report = check_engines(
            reference,
            engine,
            [shape],
            precision=manifest.precision,
            rtol=rtol,
            atol=atol,
            min_sqnr_db=min_sqnr,
            batch_invariance=False,
        )
        worst = max((o.max_rel for o in report.outputs), default=0.0)
        candidates.append(EngineCandidate(name, report.passed, worst, note="" if report.passed else "fails parity"))
    return candidates


def pick(candidates: list[EngineCandidate], rows: list[Any], batch_size: int) -> AutoChoice:
    """The fastest passing candidate at ``batch_size`` among benchmark ``rows``."""
    p50 = {row.engine: row.p50_ms for row in rows if row.batch_size == batch_size}
    timed = [EngineCandidate(c.engine, c.passed, c.max_rel, p50.get(c.engine), c.note) for c in candidates]
    best = min((c for c in timed if c.passed and c.p50_ms is not None), key=lambda c: c.p50_ms)
    return AutoChoice(best.engine, batch_size, timed)


def default_shape(manifest: Manifest, batch_size: int, sizes: dict[str, int] | None = None) -> dict[str, int]:
    shape = {name: dim.opt for name, dim in manifest.signature.dims.items()}
    shape.update(sizes or {})
    if "batch" in shape:
        shape["batch"] = batch_size
    return shape


def choose_engine(
    root: str | Path,
    manifest: Manifest,
    choice: EngineChoice,
    *,
    batch_size: int,
    sizes: dict[str, int] | None = None,
    seconds: float = 0.5,
) -> AutoChoice:
    """Check, then time, every engine this machine can run for ``manifest``; return the fastest that passes.

    An artifact written by ``tk optimize`` names its engine: that one is returned, untimed, with the engine
    settings it was timed at (``AutoChoice.options``: what the caller opens it with, under the user's own).

    ``choice`` gives the device, the options (each engine takes the ones it declares) and the
    failure policy; its name is not read. ``sizes`` sets the other dimensions (default: their
    opt); ``seconds`` is the timing budget per engine. Engines running native code that
    ``choice.trust`` does not allow are left out with a note.
    """
    recommended = manifest.recommended_engine
    if (
        recommended is not None
        and unavailable_reason(recommended, choice.device) is None
        and trusted_engines(
            root, manifest, [recommended], choice.trust
        )  # an untrusted native one: a note, then the others
    ):
        how = manifest.optimize.get("recommended", {})
        options = manifest.recommended_engine_options
        settings = f" with {', '.join(f'{k} {v}' for k, v in options.items())}" if options else ""
        why = (
            f"engine tk optimize recommends for this artifact ({how.get('candidate', recommended)}{settings}, "
            f"chosen on {how.get('cpu', 'its machine')})"
        )
        candidates = [EngineCandidate(recommended, True, 0.0)]
        return AutoChoice(recommended, batch_size, candidates, recommended=why, options=options)
    shape = default_shape(manifest, batch_size, sizes)
    with ExitStack() as stack:
        names = trusted_engines(root, manifest, available_engines(manifest, choice.device), choice.trust)
        engines = open_engines(stack, root, choice, names, manifest=manifest)
        candidates = check_candidates(engines["eager"], engines, manifest, shape)
        passing = {c.engine: engines[c.engine] for c in candidates if c.passed}
        bench = measure(passing, [batch_size], seconds=seconds, sizes={k: v for k, v in shape.items() if k != "batch"})
    return pick(candidates, bench.rows, batch_size)
