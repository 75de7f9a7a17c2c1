"""Greedy generation compared: tokens, per-step logits, the first difference and whether it is a near-tie.

``tk.workflows.generation_check`` runs two engines' generation (``tk.runtime.generation.Generated``: prompts,
tokens, per-step logits) and judges them here. Each row's logits are compared step by step up to its first
differing token (after it the two are fed different tokens); where a token differs, the report names the
prompt, the step and the reference's margin there (its best logit minus its second best), and a difference
within ``NEAR_TIE`` times the logit error the engine shows where it agrees is a near-tie.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

NEAR_TIE = 2.0  # a margin within this many times the logit error where the engine agrees is a near-tie


@dataclass
class Divergence:
    prompt: int  # which prompt
    step: int  # 0: the first new token
    reference_token: int
    candidate_token: int
    margin: float  # the reference's best logit minus its second best at that step
    logit_error: float  # the engine's largest logit error where it chose the reference's tokens
    near_tie: bool


@dataclass
class GenerationReport:
    engine: str
    prompts: int
    new_tokens: int  # per prompt
    identical: bool
    agreement: float  # share of the reference's tokens the engine reproduced before each row's divergence
    max_logit_error: float  # over every row's steps up to its divergence (all steps where none)
    atol: float
    rtol: float
    divergence: Divergence | None  # the earliest one
    passed: bool
    task_accuracy: float | None = None  # the built-in decoder: the share of tokens that follow the rule

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        tokens = f"{self.prompts} prompts x {self.new_tokens} tokens"
        if self.identical:
            return f"{tokens} identical, max logit error {self.max_logit_error:.2e}"
        d = self.divergence
        assert d is not None
        kind = "a near-tie" if d.near_tie else "not a near-tie"
        return (
            f"{tokens}, {self.agreement:.1%} agree; first difference: prompt {d.prompt} step {d.step} "
            f"({d.candidate_token} for {d.reference_token}, margin {d.margin:.2e}, logit error {d.logit_error:.2e}: {kind})"
        )


def compare_generation(
    reference: Any, candidate: Any, *, engine: str, rtol: float, atol: float, reduced: bool
) -> GenerationReport:
    """The report of ``candidate`` against ``reference`` (``Generated`` of both, greedy, with logits kept).

    The engine's logit error is measured where both were fed the same tokens and chose the same one (each
    row's steps before its first difference); a difference is a near-tie when the reference's margin there
    is within ``NEAR_TIE`` times that error."""
    worst, agreed, total = 0.0, 0, 0
    differing: list[tuple[int, int, int, int, float]] = []  # row, step, reference token, candidate token, margin
    for row, (want, got) in enumerate(zip(reference.tokens, candidate.tokens, strict=True)):
        total += len(want)
        for step, expected in enumerate(want):
            ref_logits = reference.logits[step][row]
            got_token = got[step] if step < len(got) else -1
            if got_token != expected:
                top2 = np.sort(ref_logits)[-2:]
                differing.append((row, step, expected, got_token, float(top2[1] - top2[0])))
                break
            worst = max(worst, float(np.abs(ref_logits - candidate.logits[step][row]).max()))
            agreed += 1
    first = None
    if differing:
        row, step, expected, got_token, margin = min(differing, key=lambda d: (d[1], d[0]))
        first = Divergence(row, step, expected, got_token, margin, worst, margin <= NEAR_TIE * worst)
    scale = max(float(np.abs(np.stack(reference.logits)).max()), 1.0) if reference.logits else 1.0
    logits_ok = worst <= atol + rtol * scale
    identical = first is None
    near_ties = all(m <= NEAR_TIE * worst for *_, m in differing)
    passed = (identical or near_ties) if reduced else (identical and logits_ok)
    return GenerationReport(
        engine=engine,
        prompts=len(reference.prompts),
        new_tokens=max((len(t) for t in reference.tokens), default=0),
        identical=identical,
        agreement=agreed / total if total else 1.0,
        max_logit_error=worst,
        atol=atol,
        rtol=rtol,
        divergence=first,
        passed=passed,
    )


def first_difference(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any] | None:
    """The earliest step (then prompt) where two generations' tokens differ (a row that stopped earlier shows
    None there), or None where they are identical."""
    found = []
    for row, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        step = next((i for i in range(max(len(got), len(want))) if got[i : i + 1] != want[i : i + 1]), None)
        if step is not None:
            found.append({"prompt": row, "step": step, "tk": _at(got, step), "transformers": _at(want, step)})
    return min(found, key=lambda d: (d["step"], d["prompt"])) if found else None


def _at(tokens: list[int], step: int) -> int | None:
    return tokens[step] if step < len(tokens) else None
