"""Judging one candidate with the user's accuracy spec, against the float32 PyTorch model.

Twice, and both must hold: across the artifact's shape range (the export check's report, stored in
its manifest: min, opt, max and odd sizes of every dimension, plus the batch-invariance probe), and
on the held-out samples, where the candidate's engine and the float model run the same inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from tk.accuracy import AccuracySpec, Criterion, Verdict, judge, measure_outputs, values_from_report
from tk.manifest import Manifest
from tk.runtime import load
from tk.runtime.batching import BatchRunner
from tk.runtime.eager import EagerEngine
from tk.workflows.optimize.candidates import Candidate
from tk.workflows.optimize.data import OptimizeData

IN_MEMORY = Path("<the model in memory>")  # BuiltModel's root: it reads no file


@dataclass
class Judgement:
    verdict: Verdict  # held-out values, failures of both parts
    shape_range: dict[str, Any] = field(default_factory=dict)  # the shape range's worst values

    @property
    def passed(self) -> bool:
        return self.verdict.passed


class BuiltModel(EagerEngine):
    """Eager float32 on the model ``tk optimize`` built from the user's command line, in memory (its
    weights, ``--checkpoint`` loaded): the reference is never rebuilt from a manifest, so no manifest in
    the cache can name code for it to import. ``manifest``: any candidate's, for the signature."""

    def __init__(self, module: nn.Module, manifest: Manifest, device: str) -> None:
        super().__init__(IN_MEMORY, dataclasses.replace(manifest, precision="fp32"), device=device)
        self._built = module

    def _load_model(self) -> None:
        self.module = self._built.eval().to(self.device)


class Reference:
    """The float32 model's outputs on the held-out samples, computed once (``BuiltModel``)."""

    def __init__(self, model: nn.Module, data: OptimizeData, batch_size: int, device: str) -> None:
        self.model = model
        self.data = data
        self.batch_size = batch_size
        self.device = device
        self.outputs: dict[str, np.ndarray] | None = None

    def get(self, manifest: Manifest) -> dict[str, np.ndarray]:
        if self.outputs is None:
            with BuiltModel(self.model, manifest, self.device) as eager:
                self.outputs = BatchRunner(eager, self.batch_size).run(self.data.held_out)
        return self.outputs


def judge_candidate(
    root: Path, manifest: Manifest, candidate: Candidate, accuracy: AccuracySpec, reference: Reference
) -> Judgement:
    """The spec's verdict on ``candidate`` (its format in the artifact at ``root``)."""
    report = manifest.check.get(candidate.format)
    range_failures: list[str] = []
    range_values: dict[str, Any] = {}
    if report is None:
        range_failures.append("shape range: the export check has no report for this format")
    else:
        range_values, problems = values_from_report(report)
        on_range = accuracy
        # top1 is judged on the held-out data alone where the range cannot: random inputs have no labels, and
        # the export check measures top-1 of (batch, classes) outputs only (not a token classifier's, say)
        if reference.data.labels is not None or range_values.get("top1") is None:
            on_range = AccuracySpec(tuple(c for c in accuracy.criteria if c.metric != "top1"))
        range_failures = judge(on_range, range_values, problems, where="shape range: ").failures
    expected = reference.get(manifest)
    with load(root, candidate.engine, device=reference.device, manifest=manifest, allow_failed=True) as engine:
        outputs = BatchRunner(engine, reference.batch_size).run(reference.data.held_out)
    values, problems = measure_outputs(expected, outputs, mask=reference.data.mask, labels=reference.data.labels)
    verdict = judge(accuracy, values, problems, where="held-out: ")
    verdict.failures = range_failures + verdict.failures
    return Judgement(verdict, {k: v for k, v in range_values.items() if v is not None})


def headline(verdict: Verdict, accuracy: AccuracySpec) -> str:
    """The spec's metrics on the held-out samples, as the table shows them."""
    parts = []
    for criterion in accuracy.criteria:
        value = verdict.values.get(criterion.metric)
        parts.append(f"{criterion.metric} {_number(criterion, value)}")
    return ", ".join(parts)


def _number(criterion: Criterion, value: float | None) -> str:
    if value is None:
        return "—"
    if criterion.metric == "sqnr":
        return "inf dB" if value == float("inf") else f"{value:.1f} dB"
    if criterion.metric == "top1":
        return f"{value:.1f}%"
    if criterion.metric == "cosine":
        return f"{value:.6f}"
    return f"{value:.2e}"
