"""``tk generate``: text generation with a decoder artifact, on any engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tk.cli.common import SEED, RegistryChoice, engine_choice, path_option, refuse_writes_into
from tk.errors import UsageError
from tk.registries import ENGINES

if TYPE_CHECKING:
    from tk.runtime.choice import EngineChoice


@click.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@path_option("--prompt-ids", "prompt_ids", help="Prompts as token ids: .json (list of lists) or text, one per line.")
@click.option("--prompt", "texts", multiple=True, help="A prompt as text, through the model's tokenizer (repeatable).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy; above 0 samples.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k likeliest tokens (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Sample from the nucleus of mass p.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of sampling.")
@click.option("--stop-id", "stop_ids", type=int, multiple=True, help="Stop a prompt at this token (default: EOS).")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated.")
@path_option("--json", "json_path", help="Also write prompts, tokens and timings as JSON.")
@engine_choice(choices=RegistryChoice(ENGINES, ()), help="Engine that runs the artifact's steps.")
def generate_cmd(
    artifact: Path,
    prompt_ids: Path | None,
    texts: tuple[str, ...],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    stop_ids: tuple[int, ...],
    stream: bool,
    json_path: Path | None,
    choice: EngineChoice,
) -> None:
    """Generate from a decoder artifact's prompts: prefill, then decode one token at a time.

    Prompts of different lengths run together (left-padded). Prints each prompt's new tokens (and their
    text with the model's tokenizer), then the time to first token and the decode rate.
    """
    from tk.fileio import atomic_write_json
    from tk.manifest import verify_artifact
    from tk.runtime import open_engine
    from tk.runtime.generation import Sampling
    from tk.runtime.prompts import read_prompt_ids, tokenizer_of

    refuse_writes_into(artifact, json=json_path)
    if (prompt_ids is None) == (not texts):
        raise UsageError(
            "expected --prompt-ids FILE or --prompt TEXT (one of them), found " + ("both" if texts else "neither")
        )
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    manifest = verify_artifact(artifact)
    tokenizer = tokenizer_of(manifest, "--prompt") if texts else None
    prompts = read_prompt_ids(prompt_ids) if prompt_ids is not None else [tokenizer.encode(t) for t in texts]
    printer = _Streamer(len(prompts)) if stream else None
    with open_engine(artifact, choice, manifest=manifest) as engine:
        result = engine.generate(
            prompts,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_ids=list(stop_ids) or None,
            on_tokens=printer,
        )
    if printer is not None:
        printer.close()
    for row, tokens in enumerate(result.tokens):
        text = f"  {tokenizer.decode(tokens)!r}" if tokenizer is not None else ""
        click.echo(f"{row}: {' '.join(map(str, tokens))}{text}" if not stream else f"{row}: {result.finish[row]}{text}")
    click.echo(
        f"{sum(map(len, result.tokens))} tokens for {len(prompts)} prompts on {engine.name}: time to first token "
        f"{result.time_to_first_token * 1e3:.1f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s",
        err=True,
    )
    if json_path is not None:
        atomic_write_json(json_path, _json(engine.name, sampling, result))


class _Streamer:
    """Tokens as they come: one prompt's on one line, several prompts' one line per step (``row:token``)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __call__(self, step: int, tokens: list[int | None]) -> None:
        if self.rows == 1:
            sys.stdout.write(("" if step == 0 else " ") + str(tokens[0]))
        else:
            sys.stdout.write(" ".join(f"{row}:{t}" for row, t in enumerate(tokens) if t is not None) + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        if self.rows == 1:
            sys.stdout.write("\n")


def _json(engine: str, sampling: Any, result: Any) -> dict[str, Any]:
    import dataclasses

    return {
        "engine": engine,
        "sampling": dataclasses.asdict(sampling),
        "prompts": result.prompts,
        "tokens": result.tokens,
        "finish": result.finish,
        "time_to_first_token_s": result.time_to_first_token,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "step_seconds": result.step_seconds,
    }


COMMANDS = (generate_cmd,)
