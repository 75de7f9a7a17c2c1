"""The batch-invariance probe: a sample's output must not depend on the other samples in its batch.

The first ``INVARIANCE_SAMPLES`` samples of a batch run alone through the engine and are compared
with their rows of the engine's batched outputs (``tk.comparison.compare_output``). ``tk.parity``
runs it on the candidate; ``tk.reference`` runs it on eager itself, to learn eager's own variance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tk.comparison import OutputParity, compare_output, padding_positions

INVARIANCE_SAMPLES = 2  # samples of a batch re-run alone to check batch invariance


def largest_run(feeds: Sequence[Mapping[str, np.ndarray]]) -> int | None:
    """The index of the first run with the largest batch: where the batch-invariance probe looks."""
    return max(range(len(feeds)), key=lambda i: batch_size(feeds[i])) if feeds else None


def worst_of(results: Iterable[OutputParity]) -> OutputParity:
    worst = OutputParity("batch invariance", None)
    for result in results:
        worst.merge(result)
    worst.name = "batch invariance"
    return worst


def batch_size(feeds: Mapping[str, np.ndarray]) -> int:
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


def batch_dim_is_dynamic(engine: Any) -> bool:
    """Whether a batch of one can run: the batch dimension goes down to 1 and leads the first input and every
    input that has it (inputs without it, such as a decoder's ``cache_position``, serve every sample)."""
    dim = engine.dims.get("batch")
    shared_or_leading = all(_leads_with_batch(s) or "batch" not in s.shape for s in engine.inputs)
    return dim is not None and dim.min <= 1 and _leads_with_batch(engine.inputs[0]) and shared_or_leading


def _leads_with_batch(spec: Any) -> bool:
    return bool(spec.shape) and spec.shape[0] == "batch"


def probe_invariance(
    engine: Any,
    feeds: Mapping[str, np.ndarray],
    batched: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float,
    floors: Mapping[str, float] | None = None,
) -> dict[str, OutputParity]:
    """A sample's output must not depend on the other samples in its batch: per batched output, the worst
    of the first ``INVARIANCE_SAMPLES`` samples run alone against their rows of ``batched``."""
    worst: dict[str, OutputParity] = {}
    for i in range(min(INVARIANCE_SAMPLES, batch_size(feeds))):
        per_sample = {spec.name for spec in engine.inputs if _leads_with_batch(spec)}
        sample = {name: value[i : i + 1] if name in per_sample else value for name, value in feeds.items()}
        alone = engine.run(sample)
        valid = padding_positions(engine.inputs, engine.outputs, sample, alone)
        for name, value in alone.items():
            out_spec = next((s for s in engine.outputs if s.name == name), None)
            if out_spec is None or not out_spec.shape or out_spec.shape[0] != "batch":
                continue
            floor = (floors or {}).get(name)
            result = compare_output(
                name, batched[name][i : i + 1], value, rtol, atol, valid=valid.get(name), floor=floor
            )
            if not result.passed:
                result.problem = (
                    f"sample {i} of output {name!r} alone vs in a batch of {batch_size(feeds)}: {result.problem}"
                )
            if name in worst:
                worst[name].merge(result)
            else:
                worst[name] = result
    return worst
