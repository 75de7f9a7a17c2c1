"""Parity that means generation: greedy tokens and per-step logits of an engine against PyTorch eager.

Both engines generate greedily from the same prompts (of different lengths, batched), which
``tk.generation_parity`` compares: tokens must be identical, and in float32 each step's logits within
tolerance; in reduced precision a difference at a near-tie is reported, not failed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tk.generation_parity import GenerationReport, compare_generation, first_difference
from tk.runtime.base import Engine
from tk.runtime.generation import CacheLayout

log = logging.getLogger("tk.check")

PROMPTS = 8
NEW_TOKENS = 16


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


def record_generation(
    manifest: Any, reference: Engine, candidate: Engine, fmt: str, *, rtol: float, atol: float
) -> None:
    """The export check of format ``fmt``'s generation, into ``manifest.generation["check"]``."""
    report = check_decoder(reference, candidate, rtol=rtol, atol=atol, log_line=True)
    manifest.generation.setdefault("check", {})[fmt] = report.to_json()


def record_reference(manifest: Any, reference: Engine) -> None:
    """An ``hf:DIR`` decoder's comparison with transformers' ``generate``, as ``manifest.generation["reference"]``."""
    against = check_against_transformers(reference)
    if against is not None:
        manifest.generation["reference"] = against


def generation_passed(manifest: Any) -> bool:
    """Whether every generation check recorded in the manifest passed (True for other models)."""
    generation = manifest.generation or {}
    reports = [*generation.get("check", {}).values(), *([generation["reference"]] if "reference" in generation else [])]
    return all(r["passed"] for r in reports)
