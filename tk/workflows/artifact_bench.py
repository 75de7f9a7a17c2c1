"""``tk bench`` as a library call: open an artifact's engines, optionally keep the ones whose parity
passes (``auto``), time them interleaved, and say which one ``auto`` would pick at each batch size."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tk.errors import UsageError
from tk.manifest import verify_artifact
from tk.measure.floor import LinearSplit
from tk.measure.load_guard import DEFAULT_WAIT_QUIET_S, LoadGuard
from tk.measure.roofline import Roofline, engine_precision, mask_input
from tk.runtime import EngineChoice, open_engines
from tk.workflows.auto import AutoChoice, EngineCandidate, check_candidates, default_shape, pick
from tk.workflows.bench import BenchReport, measure
from tk.workflows.engine_list import engines_to_check

BASELINES = ("eager", "compile")  # always timed beside the engines asked for


def parse_batch_sizes(text: str) -> list[int]:
    """``1,8,32`` as a list of positive integers."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise UsageError(f"--batch-sizes: expected comma-separated integers such as 1,8,32, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--batch-sizes: expected positive integers, got {text!r}")
    return sizes


def bench_artifact(
    root: str | Path,
    choice: EngineChoice,
    *,
    batch_sizes: list[int],
    seconds: float | None = None,
    iters: int | None = None,
    sizes: dict[str, int] | None = None,
    warmup: int = 3,
    io: str = "host",
    baselines: bool = True,
    progress: Callable[[str], None] | None = None,
    roofline: bool = False,
    wait_quiet: float = DEFAULT_WAIT_QUIET_S,
) -> tuple[BenchReport, list[AutoChoice]]:
    """Time the engines named by ``choice.name`` (comma-separated, ``all`` or ``auto``) beside eager
    and compile (unless ``baselines`` is off).

    With ``auto`` only engines whose parity passes at the opt shape compete, and the choice at
    each batch size comes back with the report. Each engine takes the options of ``choice`` it
    declares; the onnxruntime threads' spinning is turned off when several engines are
    interleaved (spinning threads keep the cores from the engine timed next). ``roofline`` measures this machine's
    matrix-product rate at the model's linear shapes, between the engines' calls, and each
    engine's share of it (``tk.measure.roofline``). Each batch size's rounds wait up to
    ``wait_quiet`` seconds for a quiet machine and are marked busy otherwise (``tk.measure.load_guard``).
    With ``all`` or ``auto``, engines running native code that ``choice.trust`` does not allow are left out with a note.
    """
    if seconds is not None and iters is not None:
        raise UsageError("expected at most one of --seconds and --iters")
    if roofline and choice.device != "cpu":
        raise UsageError("--roofline measures the CPU's matrix-product peak: use it with --device cpu")
    manifest = verify_artifact(root)
    auto = choice.name == "auto"
    baseline_names = BASELINES if baselines else ()
    names = engines_to_check(
        choice.name, manifest, choice.device, baselines=baseline_names, keep_eager=True, root=root, trust=choice.trust
    )
    choice = choice.with_defaults({"spinning": len(names) == 1}, names)
    untimed = ["eager"] if "eager" not in names and (roofline or auto) else []  # the FLOPs and parity need it
    with ExitStack() as stack:
        opened = open_engines(stack, root, choice, [*names, *untimed], manifest=manifest)
        eager = opened.get("eager")
        opened = {name: opened[name] for name in names}
        candidates = _parity_at_opt(eager, opened, manifest, sizes) if auto else None
        if candidates is not None:
            opened = {c.engine: opened[c.engine] for c in candidates if c.passed}
        peaks = _roofline(opened, eager, manifest, sizes) if roofline else None
        report = measure(
            opened, batch_sizes, seconds=seconds, iters=iters, sizes=sizes, warmup=warmup, io=io, progress=progress,
            guard=LoadGuard(wait_quiet), between=peaks.between if peaks else None,
        )  # fmt: skip
        report.settings["engines"] = {name: engine.settings() for name, engine in opened.items()}
        if peaks:
            report.settings["roofline"] = _fill_roofline(peaks, report, manifest)
    choices: list[AutoChoice] = []
    if candidates is not None:
        choices = [pick(candidates, report.rows, batch) for batch in sorted({row.batch_size for row in report.rows})]
        report.settings["auto"] = [auto_choice.to_json() for auto_choice in choices]
    return report, choices


def _parity_at_opt(
    eager: Any, opened: dict[str, Any], manifest: Any, sizes: dict[str, int] | None
) -> list[EngineCandidate]:
    """``--engine auto``'s candidates: each engine's parity with eager at the opt batch (``check_candidates``)."""
    batch_dim = manifest.signature.dims.get("batch")
    shape = default_shape(manifest, batch_dim.opt if batch_dim else 1, sizes)
    return check_candidates(eager, opened, manifest, shape)


def _fill_roofline(peaks: Roofline, report: BenchReport, manifest: Any) -> dict[str, Any]:
    """Each row's shares of its engine's precision (an int8 artifact's engines: of their own mix of precisions)."""
    return peaks.fill(
        report, lambda e: engine_precision(e, manifest.precision), lambda e: LinearSplit.of_engine(manifest, e)
    )


def _roofline(opened: dict[str, Any], eager: Any, manifest: Any, sizes: dict[str, int] | None) -> Roofline:
    import torch

    from tk.spec import random_feeds

    shape = default_shape(manifest, 1, sizes)
    feeds = random_feeds(manifest.signature.inputs, shape)
    args = tuple(torch.from_numpy(feeds[s.name]) for s in manifest.signature.inputs)
    precisions = {engine_precision(name, manifest.precision) for name in opened}
    splits = [LinearSplit.of_engine(manifest, name) for name in opened]
    floors = precisions.union(*(s.float_floors for s in splits if s is not None))
    return Roofline(eager.module, args, floors, mask_input(manifest.signature.inputs))
