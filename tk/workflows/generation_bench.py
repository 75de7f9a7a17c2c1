"""``tk bench`` for decoders: time to first token and decode speed per engine and batch, side by side.

Each round generates ``new_tokens`` tokens (no stop token) from prompts of ``prompt_len`` tokens on every
engine in a new random order (``tk.measure.timing.interleave``), so machine noise hits all alike. The loop
times each step: the prefill's is the time to first token, the others are decode steps. For an
``hf:DIR`` artifact, transformers' own ``generate`` on the same model runs beside the engines (eager
attention as loaded, its dynamic cache; with ``compiled_rival`` also its static cache under ``torch.compile``),
timed by a streamer that notes when each token is chosen: the first is its time to first token.

Decode at batch 1 is bound by memory bandwidth: each step reads every weight and the cache. The table
shows the bytes a step reads over its time, and that as a share of this machine's copy bandwidth,
measured in the same run (``copy_bandwidth``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from tk.errors import UsageError
from tk.manifest import verify_artifact
from tk.measure.generation import (
    GenerationBench,
    GenerationRow,
    GenerationRun,
    copy_bandwidth,
    transformers_rival,
)
from tk.measure.hardware import machine_description
from tk.measure.load_guard import LoadGuard, quiet_or_marked
from tk.measure.timing import interleave
from tk.runtime import EngineChoice, open_engines
from tk.runtime.generation import CacheLayout, Generated
from tk.workflows.engine_list import engines_to_check

TRANSFORMERS = "transformers"  # the rival row of an hf:DIR artifact
TRANSFORMERS_COMPILED = "transformers compiled"  # its static cache with torch.compile (--compiled-rival)


def bench_generation(
    root: str | Path,
    choice: EngineChoice,
    *,
    batch_sizes: list[int],
    prompt_len: int | None = None,
    new_tokens: int = 32,
    rounds: int = 5,
    warmup: int = 1,
    rivals: bool = True,
    compiled_rival: bool = False,
    progress: Callable[[str], None] | None = None,
    guard: LoadGuard | None = None,
    others: dict[str, Callable[[list[list[int]], int], GenerationRun]] | None = None,
) -> GenerationBench:
    """Time ``new_tokens`` greedy tokens from prompts of ``prompt_len`` tokens (default: the opt of the
    artifact's ``seq``) on each engine of ``choice`` at each of ``batch_sizes``, ``rounds`` interleaved rounds
    after ``warmup`` untimed ones; ``rivals``: transformers' ``generate`` beside them for an hf:DIR model;
    ``others``: more rivals by name, each made from the prompts and the number of new tokens (a peer's runtime,
    ``benchmarks/decoder_goals.py``), timed in the same rounds."""
    manifest = verify_artifact(root)
    if not manifest.generation:
        raise UsageError(f"{root}: expected a decoder artifact for the generation benchmark, found none")
    layout = CacheLayout.from_generation(manifest.generation)
    prompt_len = manifest.signature.dims["seq"].opt if prompt_len is None else prompt_len
    _check_sizes(manifest, layout, batch_sizes, prompt_len, new_tokens, rounds)
    names = engines_to_check(choice.name, manifest, choice.device, keep_eager=True, root=root, trust=choice.trust)
    report = GenerationBench(machine=machine_description(choice.device))
    report.settings = {"prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds, "engines": names}
    with ExitStack() as stack:
        untimed = ["eager"] if rivals and "eager" not in names else []  # holds the model transformers runs
        opened = open_engines(stack, root, choice, [*names, *untimed], manifest=manifest)
        weights = _weight_bytes(root, manifest)
        model = getattr(getattr(opened.get("eager"), "module", None), "model", None)  # an hf:DIR eager step's
        pad = manifest.generation.get("pad_token_id") or 0
        rival = transformers_rival(model, pad) if rivals else None
        compiled = transformers_rival(model, pad, compiled=True) if rivals and compiled_rival else None
        opened = {name: opened[name] for name in names}
        for batch in batch_sizes:
            prompts = _prompts(batch, prompt_len, int(manifest.generation["vocab_size"]))
            runs = {name: _engine_run(engine, prompts, new_tokens) for name, engine in opened.items()}
            if rival is not None:
                runs[TRANSFORMERS] = rival(prompts, new_tokens)
            if compiled is not None:
                runs[TRANSFORMERS_COMPILED] = compiled(prompts, new_tokens)
            runs.update({name: make(prompts, new_tokens) for name, make in (others or {}).items()})
            for run in runs.values():
                for _ in range(warmup):
                    run.call()
                run.samples.clear()
            _, mark = quiet_or_marked(lambda r=runs: interleave({n: r[n].timed for n in r}, iters=rounds), guard)
            for name, run in runs.items():
                cache = _cache_bytes(opened.get(name), layout, batch, prompt_len + new_tokens // 2)
                report.rows.append(run.row(name, batch, prompt_len, new_tokens, weights, cache, mark))
            if progress is not None:
                progress(f"bench  batch {batch}: {', '.join(runs)} timed over {rounds} rounds")
    report.bandwidth_bytes_per_s = copy_bandwidth()
    return report


def _check_sizes(
    manifest: Any, layout: CacheLayout, batch_sizes: list[int], prompt_len: int, new_tokens: int, rounds: int
) -> None:
    largest = manifest.signature.dims["batch"].max
    if max(batch_sizes) > largest:
        raise UsageError(
            f"--batch-sizes: expected at most {largest} (the artifact's batch range), got {max(batch_sizes)}"
        )
    if prompt_len < 1 or new_tokens < 2 or prompt_len + new_tokens > layout.slots:
        raise UsageError(
            f"--prompt-len {prompt_len} and --new-tokens {new_tokens}: expected a prompt of 1 or more and 2 or more "
            f"new tokens within the artifact's {layout.slots} cache slots"
        )
    if rounds < 1:
        raise UsageError(f"--iters: expected 1 or more rounds, got {rounds}")


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 1_000_003 + length)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "int8": 1}  # bytes a weight takes at each precision


def _weight_bytes(root: str | Path, manifest: Any) -> int:
    """The weights a step reads: the float32 safetensors file every artifact holds, scaled to the artifact's
    precision (int8 counted as all int8: a layer kept in float reads more)."""
    return manifest.file("weights").size * WEIGHT_BYTES.get(manifest.precision, 4) // 4


def _cache_bytes(engine: Any, layout: CacheLayout, batch: int, filled: int) -> int:
    """The cache's bytes a decode step reads: every slot of the static cache, or, where the engine keeps the cache
    (OpenVINO's stateful IR, at its own precision), the ``filled`` slots of the middle decode step."""
    if engine is None or not engine.keeps_cache:
        return layout.nbytes(batch)
    return layout.nbytes(batch, engine.kept_cache_itemsize) * filled // layout.slots


def _engine_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> GenerationRun:
    def call() -> tuple[float, list[float]]:
        out: Generated = engine.generate(prompts, max_new_tokens=new_tokens, stop_ids=())
        return out.step_seconds[0], out.step_seconds[1:]

    return GenerationRun(call)


def render_generation(report: GenerationBench) -> Any:
    """The report as a rich table: per engine and batch, time to first token, decode speed and bandwidth."""
    from rich.table import Table

    s = report.settings
    table = Table(
        title=f"generation, {report.machine.get('cpu')}: prompt {s['prompt_len']}, {s['new_tokens']} new tokens"
    )
    for header in ("engine", "batch", "TTFT ms", "decode ms/step", "q1-q3", "tokens/s", "speed-up", "cache MB", "GB/s",
                   "of bandwidth", "load"):  # fmt: skip
        table.add_column(header, justify="left" if header in ("engine", "load") else "right")
    for row in report.rows:
        first = _against(report.rows, row.batch)
        step = row.decode_step
        moved = row.bytes_per_step / step.median if step.median > 0 else 0.0
        share = f"{moved / report.bandwidth_bytes_per_s:.0%}" if report.bandwidth_bytes_per_s else "-"
        busy = "busy" if row.load is not None and row.load.busy else ""
        table.add_row(
            row.engine,
            str(row.batch),
            f"{row.ttft.median * 1e3:.2f}",
            f"{step.median * 1e3:.3f}",
            f"{step.q1 * 1e3:.3f}-{step.q3 * 1e3:.3f}",
            f"{row.tokens_per_s:.1f}",
            f"{row.tokens_per_s / first.tokens_per_s:.2f}x" if first.tokens_per_s else "-",
            f"{row.cache_bytes / 1e6:.2f}",
            f"{moved / 1e9:.2f}",
            share,
            busy,
        )
    table.caption = (
        f"speed-up: decode tokens/s against {TRANSFORMERS}'s generate where it ran, else eager; copy bandwidth "
        f"{(report.bandwidth_bytes_per_s or 0) / 1e9:.1f} GB/s measured in this run"
    )
    return table


def _against(rows: list[GenerationRow], batch: int) -> GenerationRow:
    """The row a batch's speed-ups are measured against: transformers' generate, else eager, else the first."""
    same = [r for r in rows if r.batch == batch]
    return next((r for name in (TRANSFORMERS, "eager") for r in same if r.engine == name), same[0])
