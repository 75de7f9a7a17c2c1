"""Parity that means generation: greedy tokens and per-step logits of an engine against PyTorch eager.

Both engines generate greedily from the same prompts (of different lengths, batched). Tokens must be
identical; each row's logits are compared step by step up to its first differing token (after it the
two are fed different tokens). Where a token differs, the report names the prompt, the step and the
reference's margin there (its best logit minus its second best): in reduced precision a difference at
a near-tie (a margin within twice the logit error the engine shows where it agrees) is reported, not failed.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tk.runtime.base import Engine
from tk.runtime.generation import CacheLayout, Generated

log = logging.getLogger("tk.check")

PROMPTS = 8
NEW_TOKENS = 16
NEAR_TIE = 2.0  # a margin within this many times the logit error before it is a near-tie


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


def parity_new_tokens(manifest: Any) -> int:
    """Tokens the check generates per prompt: ``NEW_TOKENS``, at most half the cache (a short ``--max-cache-len``)."""
    return min(NEW_TOKENS, CacheLayout.from_generation(manifest.generation).slots // 2)


def parity_prompts(manifest: Any, *, count: int = PROMPTS, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 2 tokens and more the artifact can take with room for ``parity_new_tokens``: for the
    built-in decoder its rule's sequences (so its continuations are checkable), else random token ids."""
    generation = manifest.generation
    layout = CacheLayout.from_generation(generation)
    vocab = int(generation["vocab_size"])
    longest = max(2, min(manifest.signature.dims["seq"].max, layout.slots - parity_new_tokens(manifest)))
    lengths = [2 + (i * (longest - 2)) // max(1, count - 1) for i in range(count)]
    gen = torch.Generator().manual_seed(seed + 7_000_003)
    if manifest.model.get("name") == "decoder":
        from tk.models.decoder import DecoderConfig, rule_sequences

        cfg = DecoderConfig(**manifest.model["config"])
        rows = rule_sequences(cfg, gen, count, max(lengths))
        return [rows[i, :n].tolist() for i, n in enumerate(lengths)]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def compare_generation(
    reference: Generated, candidate: Generated, *, engine: str, rtol: float, atol: float, reduced: bool
) -> GenerationReport:
    """The report of ``candidate`` against ``reference`` (both greedy, with logits kept).

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


def check_generation(
    reference: Engine,
    candidate: Engine,
    prompts: list[list[int]],
    *,
    rtol: float,
    atol: float,
    new_tokens: int = NEW_TOKENS,
) -> GenerationReport:
    """Greedy generation of ``candidate`` against ``reference`` on ``prompts`` (one batch)."""
    want = reference.generate(prompts, max_new_tokens=new_tokens, stop_ids=(), keep_logits=True)
    got = candidate.generate(prompts, max_new_tokens=new_tokens, stop_ids=(), keep_logits=True)
    reduced = candidate.manifest.precision not in ("fp32", "tf32")
    report = compare_generation(want, got, engine=candidate.name, rtol=rtol, atol=atol, reduced=reduced)
    if candidate.manifest.model.get("name") == "decoder":
        from tk.models.decoder import rule_accuracy

        report.task_accuracy = rule_accuracy(prompts, got.tokens, int(candidate.manifest.generation["vocab_size"]))
    return report


def check_decoder(
    reference: Engine, candidate: Engine, *, rtol: float, atol: float, log_line: bool = False
) -> GenerationReport:
    """A decoder artifact's generation check (``check_generation`` on ``parity_prompts``): what ``tk export``
    records per format and ``tk check`` runs per engine; ``log_line``: say its verdict on the check's log."""
    manifest = candidate.manifest
    new_tokens = parity_new_tokens(manifest)
    report = check_generation(
        reference, candidate, parity_prompts(manifest), rtol=rtol, atol=atol, new_tokens=new_tokens
    )
    if log_line:
        log.info("generate %-6s %s %s", candidate.name, "ok" if report.passed else "FAILED", report.summary())
    return report


def check_against_transformers(reference: Engine) -> dict[str, Any] | None:
    """An ``hf:DIR`` decoder's eager step, driven by tk's loop (prompts batched, left-padded), against
    transformers' own greedy ``generate`` of each prompt alone: proof that the step graph computes the
    user's model. None for other models (the built-in decoder's loop is tested against its plain forward)."""
    from tk.models.hf import is_hf_name
    from tk.models.hf_generation import transformers_greedy

    manifest = reference.manifest
    if not is_hf_name(str(manifest.model.get("name", ""))) or not hasattr(reference, "module"):
        return None
    prompts, new_tokens = parity_prompts(manifest), parity_new_tokens(manifest)
    eos = manifest.generation.get("eos_token_id")
    ours = reference.generate(prompts, max_new_tokens=new_tokens).tokens
    theirs = [transformers_greedy(reference.module, p, new_tokens, eos) for p in prompts]
    first = first_difference(ours, theirs)
    report = {"against": "transformers generate", "prompts": len(prompts), "new_tokens": new_tokens,
              "identical": first is None, "first_difference": first, "passed": first is None}  # fmt: skip
    verdict = "ok" if first is None else "FAILED"
    detail = "identical tokens" if first is None else f"first difference {first}"
    log.info("generate eager  %s against transformers' generate, %d prompts: %s", verdict, len(prompts), detail)
    return report


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
