"""Issue 50's decode goals on this CPU: tk's decoder artifacts against transformers' generate, ONNX Runtime
GenAI and optimum-intel, side by side in one run, on random-weight configs of ~100M parameters.

    .venv/bin/python -m benchmarks.decoder_goals [--models gpt2,llama] [--prompt-len 128] [--new-tokens 64]
        [--rounds 5] [--peers DIR] [--optimum-intel PYTHON] [--precision fp32|bf16] [--work DIR]
        [--out benchmarks/results]

For each model: a random-weight Hugging Face directory (GPT-2 small's config, 124M parameters; a
Llama-style config of 12 layers, hidden 768, 4 key/value heads, 32k vocabulary, ~110M parameters) with a
word-level tokenizer, exported by ``tk export hf:DIR --task text-generation`` to onnx and openvino
(its export check compares tk's loop with transformers' generate), then ``tk bench``'s generation
benchmark at batch 1: tk's engines, transformers' eager ``generate`` and, for Llama, ONNX Runtime GenAI's
own loop on the model its builder writes (fp32, CPU; GenAI's builder has no GPT-2) — every row timed in
the same interleaved rounds. The greedy tokens of each row are compared with transformers' on the bench's
prompt. ``--peers DIR``: where ``onnxruntime-genai`` is installed (``pip install --target DIR
--no-deps onnxruntime-genai``), when it is not in this environment.

optimum-intel's OpenVINO model, the issue's other peer, runs in a Python of its own (``--optimum-intel
PYTHON``: optimum-intel 2.2, the newest on PyPI when this was written, does not import with transformers 5):
``benchmarks/optimum_intel_worker.py`` exports the same directory there and answers each timed call over a
pipe, idle between its turns; it runs at every precision (f32, bf16), and its greedy tokens are compared
like the others'. Set one up with ``python3.11 -m venv /tmp/oivenv && /tmp/oivenv/bin/pip install
"optimum-intel[openvino]" "transformers<5"``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tk.measure.results import BenchRun

MODELS = ("gpt2", "llama")
SLOTS = 256  # the artifacts' cache: the prompt and the new tokens fit


def _configs(tiny: bool = False) -> dict[str, Any]:
    import transformers as tf

    if tiny:  # the script's logic in seconds (tests/test_bench_scripts.py): nothing to quote
        return {
            "gpt2": tf.GPT2Config(vocab_size=256, n_positions=512, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                  eos_token_id=2),
            # GenAI's GroupQueryAttention takes head sizes that are multiples of 16
            "llama": tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=1, eos_token_id=2),
        }  # fmt: skip
    llama = tf.LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return {"gpt2": tf.GPT2Config(), "llama": llama}


def make_directory(name: str, root: Path, tiny: bool = False) -> Path:
    """A random-weight model directory of ``name`` with a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    directory = root / name
    if (directory / "config.json").is_file():
        return directory
    config = _configs(tiny)[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config.vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return directory


def export_artifact(directory: Path, out: Path, precision: str = "fp32") -> Path:
    """``directory`` exported for onnx and openvino in float32, or for openvino alone in bf16 (its bf16 kernels:
    onnxruntime has none for the CPU)."""
    from tk.export import ExportOptions
    from tk.models import build_model
    from tk.workflows.export import export

    if (out / "manifest.json").is_file():
        return out
    spec = build_model(f"hf:{directory}", task="text-generation", cache_len=SLOTS)
    formats = ("onnx", "openvino") if precision == "fp32" else ("openvino",)
    export(spec, out, ExportOptions(formats=formats, precision=precision))
    return out


def transformers_rival(directory: Path, dtype: torch.dtype) -> Any:
    """transformers' eager ``generate`` of the model loaded in ``dtype``: the rival at the artifact's precision."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tk.measure.generation import GenerationRun

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()

    def make(prompts: list[list[int]], new_tokens: int) -> GenerationRun:
        ids = torch.tensor(prompts, dtype=torch.int64)

        def generate(count: int) -> float:
            config = GenerationConfig(do_sample=False, max_new_tokens=count, min_new_tokens=count, eos_token_id=None,
                                      pad_token_id=0)  # fmt: skip
            started = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            return time.perf_counter() - started

        def call() -> tuple[float, list[float]]:
            first = generate(1)
            whole = generate(new_tokens)
            return first, [max(whole - first, 0.0) / (new_tokens - 1)]

        return GenerationRun(call)

    return make


def build_genai(directory: Path, out: Path, peers: str | None) -> Path:
    """ONNX Runtime GenAI's model of ``directory`` (its builder, fp32 for the CPU)."""
    if (out / "genai_config.json").is_file():
        return out
    env = None if peers is None else {"PYTHONPATH": peers, "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(directory), "-o", str(out),
               "-p", "fp32", "-e", "cpu"]  # fmt: skip
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def genai_rival(path: Path) -> tuple[Any, Any]:
    """A ``tk.workflows.generation_bench`` rival running ONNX Runtime GenAI's loop, and its greedy tokens."""
    import onnxruntime_genai as og

    from tk.measure.generation import GenerationRun

    model = og.Model(str(path))

    def run(prompt: list[int], new_tokens: int, steps: list[float] | None = None) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(
            do_sample=False, max_length=len(prompt) + new_tokens, min_length=len(prompt) + new_tokens
        )
        generator = og.Generator(model, params)
        tokens = []
        started = time.perf_counter()
        generator.append_tokens(prompt)  # the prefill, and the first token's logits
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
        if steps is not None:
            steps.append(time.perf_counter() - started)
        while not generator.is_done():
            started = time.perf_counter()
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if steps is not None:
                steps.append(time.perf_counter() - started)
        return tokens

    def make(prompts: list[list[int]], new_tokens: int) -> GenerationRun:
        if len(prompts) != 1:
            raise ValueError("the GenAI rival runs batch 1")

        def call() -> tuple[float, list[float]]:
            steps: list[float] = []
            run(prompts[0], new_tokens, steps)
            return steps[0], steps[1:]

        return GenerationRun(call)

    return make, run


class OptimumIntelRival:
    """optimum-intel's ``OVModelForCausalLM`` of ``directory`` in ``python`` (``benchmarks/optimum_intel_worker.py``)
    at ``precision`` (fp32, bf16): ``make`` is a ``bench_generation`` rival, ``greedy`` its tokens for one prompt."""

    def __init__(self, python: str, directory: Path, precision: str) -> None:
        worker = Path(__file__).with_name("optimum_intel_worker.py")
        hint = {"fp32": "f32", "bf16": "bf16"}[precision]
        self.process = subprocess.Popen(
            [python, str(worker), str(directory), hint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"},
        )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdin is not None
        for line in self.process.stdout:  # the export's own prints come first
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"{worker} ended before it was ready (exit {self.process.wait()})")

    def ask(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        assert self.process.stdout is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        return self.ask(prompt, new_tokens)["tokens"]

    def make(self, prompts: list[list[int]], new_tokens: int) -> Any:
        from tk.measure.generation import GenerationRun

        if len(prompts) != 1:
            raise ValueError("the optimum-intel rival runs batch 1")

        def call() -> tuple[float, list[float]]:
            reply = self.ask(prompts[0], new_tokens)
            return reply["ttft"], reply["steps"]

        return GenerationRun(call)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def tokens_agree(
    artifact: Path, prompt: list[int], new_tokens: int, peers: dict[str, Any], engines: tuple[str, ...]
) -> dict[str, Any]:
    """Greedy tokens of each engine, and of each peer (name: tokens of a prompt), against transformers' on one
    prompt: the share equal, position by position."""
    from tk.models.hf_generation import transformers_greedy
    from tk.runtime import load

    out: dict[str, Any] = {}
    with load(artifact, "eager") as eager:
        want = transformers_greedy(eager.module, prompt, new_tokens, None)
        for engine in engines:
            with load(artifact, engine) as opened:
                got = opened.generate([prompt], max_new_tokens=new_tokens, stop_ids=()).tokens[0]
            out[engine] = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    for name, greedy in peers.items():
        got = greedy(prompt, new_tokens)
        out[name] = sum(a == b for a, b in zip(got, want, strict=False)) / len(want)
    return out


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model's table: tk's engines at ``args.precision`` and every peer there is, in the same rounds."""
    from rich.console import Console

    from tk.measure.load_guard import LoadGuard
    from tk.runtime import EngineChoice
    from tk.workflows.generation_bench import bench_generation, render_generation

    directory = make_directory(name, args.work, args.tiny)
    bf16 = args.precision == "bf16"
    artifact = export_artifact(directory, args.work / f"{name}-art{'-bf16' if bf16 else ''}", args.precision)
    engines = ("openvino",) if bf16 else ("onnx", "openvino")
    others: dict[str, Any] = {}
    greedy: dict[str, Any] = {}
    if bf16:  # at fp32 the bench times transformers' eager generate itself
        others["transformers bf16"] = transformers_rival(directory, torch.bfloat16)
    if name == "llama" and not bf16 and importlib.util.find_spec("onnxruntime_genai") is not None:
        others["onnxruntime-genai"], greedy["onnxruntime-genai"] = genai_rival(
            build_genai(directory, args.work / "llama-genai", args.peers)
        )
    elif name == "llama" and not bf16:
        print("note: onnxruntime-genai is not installed here (--peers DIR): its row is left out")
    optimum = OptimumIntelRival(args.optimum_intel, directory, args.precision) if args.optimum_intel else None
    if optimum is not None:
        others["optimum-intel openvino"], greedy["optimum-intel openvino"] = optimum.make, optimum.greedy
    try:
        report = bench_generation(
            artifact, EngineChoice(",".join(engines)), batch_sizes=[1], prompt_len=args.prompt_len,
            new_tokens=args.new_tokens, rounds=args.rounds, rivals=not bf16, others=others, guard=LoadGuard(30.0),
        )  # fmt: skip
        Console(width=160).print(render_generation(report))
        prompt = torch.randint(3, 200, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
        agreement = tokens_agree(artifact, prompt, args.new_tokens, greedy, engines)
    finally:
        if optimum is not None:
            optimum.close()
    print(f"{name}: greedy tokens equal to transformers' float32 over {args.new_tokens}: {agreement}")
    return {**report.to_json(), "token_agreement": agreement}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peers", default=None, help="where onnxruntime-genai is installed, if not here")
    parser.add_argument("--optimum-intel", default=None, metavar="PYTHON",
                        help="a Python with optimum-intel[openvino] (and transformers 4): its row")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("runs/decoder-goals"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="tiny configs: the script's logic in seconds")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: tk's openvino bf16 artifact against transformers' generate in bf16")  # fmt: skip
    args = parser.parse_args(argv)
    if args.peers:
        sys.path.insert(0, args.peers)
    run = BenchRun("decoder-goals", settings=vars(args))
    results = {name: bench_model(name, args) for name in args.models.split(",")}
    print(f"results: {run.write(results, args.out)}")


if __name__ == "__main__":
    main()
