"""Issue 50's parity goal: greedy tokens identical to PyTorch's over 64 new tokens for 16 prompts of different
lengths, on every CPU format, for GPT-2-, Llama- and Qwen2-style configs (random weights) and the trained
built-in decoder.

    .venv/bin/python -m benchmarks.decoder_parity [--checkpoint decoder-small.safetensors] [--formats
        torch,onnx,openvino,aoti] [--prompts 16] [--new-tokens 64] [--work DIR] [--out benchmarks/results]

Each Hugging Face config (2 layers, hidden 64, a 256-token vocabulary, 128 positions) is saved with random
weights and exported by ``tk export hf:DIR --task text-generation`` with a cache of 128 slots; each format's
engine generates from the 16 prompts (2 to 60 tokens, random ids) in batches of 8, left-padded, and its
tokens are compared with transformers' own greedy ``generate`` of each prompt alone. The built-in decoder
(``--checkpoint``: trained by ``tk train decoder --size small``; else trained here) is compared with its
eager loop without a cache (``greedy_without_cache``) on prompts of its rule.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from tk.measure.results import BenchRun

FORMATS = ("torch", "onnx", "openvino", "aoti")
SLOTS = 128


def hf_directory(name: str, root: Path) -> Path:
    import transformers as tf
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    shared = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2}
    llama = {**shared, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": SLOTS}  # fmt: skip
    config = {
        "gpt2": lambda: tf.GPT2Config(**shared, n_positions=SLOTS, n_embd=64, n_layer=2, n_head=4),
        "llama": lambda: tf.LlamaConfig(**llama),
        "qwen2": lambda: tf.Qwen2Config(**llama),
    }[name]()
    directory = root / name
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(directory)
    return directory


def export(model: list[str], out: Path, formats: list[str]) -> Path:
    from click.testing import CliRunner

    from tk.cli import cli

    args = ["export", *model, "--out", str(out), "--max-cache-len", str(SLOTS)]
    for fmt in formats:
        args += ["--format", fmt]
    result = CliRunner().invoke(cli, args)
    if result.exit_code != 0:
        raise SystemExit(f"export {model} failed:\n{result.output}{result.stderr}")
    return out


def prompts_for(manifest: Any, count: int, new_tokens: int) -> list[list[int]]:
    from tk.workflows.generation_check import parity_prompts

    longest = SLOTS - new_tokens
    lengths = [2 + i * (longest - 2) // (count - 1) for i in range(count)]
    if manifest.model.get("name") == "decoder":
        rows = parity_prompts(manifest, count=count, seed=3)
        return [r[:n] for r, n in zip(rows, lengths, strict=True)]  # the rule's sequences, cut to each length
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def reference_tokens(artifact: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """PyTorch's greedy tokens of each prompt alone: transformers' generate, or the built-in decoder's loop."""
    from tk.runtime import load

    with load(artifact, engine="eager") as eager:
        module = eager.module
        if eager.manifest.model.get("name") == "decoder":
            from tk.models.decoder import greedy_without_cache

            return [greedy_without_cache(module, p, new_tokens) for p in prompts]
        from tk.models.hf_generation import transformers_greedy

        return [transformers_greedy(module, p, new_tokens, None) for p in prompts]


def compare(artifact: Path, formats: list[str], prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from tk.runtime import load

    want = reference_tokens(artifact, prompts, new_tokens)
    row: dict[str, Any] = {}
    for fmt in formats:
        with load(artifact, engine=fmt) as engine:
            got = engine.generate(prompts, max_new_tokens=new_tokens, stop_ids=()).tokens
        # transformers stops a row at the config's end-of-sequence token (its generation config keeps it): compare
        # up to there
        got = [g[: len(w)] for g, w in zip(got, want, strict=True)]
        same = sum(g == w for g, w in zip(got, want, strict=True))
        agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
        row[fmt] = {"identical_prompts": same, "prompts": len(prompts), "tokens_agreeing": agree,
                    "tokens": sum(map(len, want))}  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="the trained small built-in decoder")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tk-decoder-parity"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    run = BenchRun("decoder-parity", settings=vars(args))
    checkpoint = args.checkpoint or train_small(args.work)
    models = {name: [f"hf:{hf_directory(name, args.work / 'hf')}", "--task", "text-generation"]
              for name in ("gpt2", "llama", "qwen2")}  # fmt: skip
    models["decoder (trained)"] = ["decoder", "--size", "small", "--checkpoint", str(checkpoint)]
    from tk.manifest import read_manifest

    results: dict[str, Any] = {}
    for name, model in models.items():
        artifact = export(model, args.work / "art" / name.split()[0], formats)
        prompts = prompts_for(read_manifest(artifact), args.prompts, args.new_tokens)
        results[name] = compare(artifact, formats, prompts, args.new_tokens)
        cells = ", ".join(f"{f} {r['identical_prompts']}/{r['prompts']}" for f, r in results[name].items())
        print(f"{name}: prompts with all {args.new_tokens} tokens identical: {cells}", flush=True)
    print(f"results: {run.write(results, args.out)}")


def train_small(work: Path) -> Path:
    from click.testing import CliRunner

    from tk.cli import cli

    path = work / "decoder-small.safetensors"
    if not path.exists():
        result = CliRunner().invoke(cli, ["train", "decoder", "--size", "small", "--out", str(path)])
        if result.exit_code != 0:
            raise SystemExit(result.output)
    return path


if __name__ == "__main__":
    main()
