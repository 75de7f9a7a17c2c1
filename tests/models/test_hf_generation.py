"""hf:DIR --task text-generation: GPT-2, Llama and Qwen2 configs (random weights, tiny) exported as one
static-cache step, generating batched prompts of different lengths with transformers' own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.manifest import read_manifest
from tk.runtime import load
from tk.workflows.generation_check import parity_prompts

pytest.importorskip("transformers")

WORDS = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(125))]  # 128 tokens: ids 0-2 special


def _configs() -> dict:
    import transformers as tf

    shared = {"vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2}
    llama_like = {**shared, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    return {
        "gpt2": tf.GPT2Config(**shared, n_positions=64, n_embd=32, n_layer=2, n_head=4),
        "llama": tf.LlamaConfig(**llama_like),
        "qwen2": tf.Qwen2Config(**llama_like),
    }


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf-decoders")
    dirs = {}
    for name, config in _configs().items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        _tokenizer().save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="module")
def exported(decoders, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, directory in decoders.items():
        art = tmp_path_factory.mktemp("art") / name
        result = CliRunner().invoke(
            cli,
            ["export", f"hf:{directory}", "--task", "text-generation", "--out", str(art),
             "--format", "torch", "--format", "onnx", "--format", "openvino"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output + result.stderr
        out[name] = art
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_the_export_matches_transformers_generate_on_every_format(exported, name):
    manifest = read_manifest(exported[name])
    assert manifest.status == "passed"
    reference = manifest.generation["reference"]
    assert reference["against"] == "transformers generate" and reference["identical"] and reference["prompts"] == 8
    for fmt in ("torch", "onnx", "openvino"):
        report = manifest.generation["check"][fmt]
        assert report["identical"] and report["max_logit_error"] < 1e-5, (fmt, report)
    cache = manifest.generation["cache"]
    heads = 4 if name == "gpt2" else 2  # Llama and Qwen2 keep 2 key/value heads for 4 query heads
    assert (cache["slots"], cache["layers"], cache["heads"], cache["head_dim"]) == (64, 2, heads, 8)
    assert (manifest.generation["bos_token_id"], manifest.generation["eos_token_id"]) == (1, 2)


@pytest.mark.parametrize("engine", ["onnx", "openvino"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_batched_prompts_get_transformers_tokens(exported, name, engine):
    from tk.models.hf_generation import transformers_greedy

    with load(exported[name], "eager") as eager, load(exported[name], engine) as opened:
        prompts = parity_prompts(opened.manifest, count=5, seed=9)
        got = opened.generate(prompts, max_new_tokens=12)
        want = [transformers_greedy(eager.module, p, 12, 2) for p in prompts]
    assert got.tokens == want
    assert got.finish == ["stop" if w and w[-1] == 2 else "length" for w in want]


def test_tk_generate_takes_text_through_the_directorys_tokenizer(exported, tmp_path):
    out = tmp_path / "run.json"
    result = CliRunner().invoke(
        cli,
        ["generate", str(exported["llama"]), "--prompt", "w5 w6 w7", "--prompt", "w9", "--max-new-tokens", "4",
         "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    saved = json.loads(out.read_text())
    assert saved["prompts"] == [[8, 9, 10], [12]]  # w5 is id 8: three special tokens first
    lines = result.stdout.splitlines()
    decoded = _tokenizer().decode(saved["tokens"][0])
    assert lines[0] == f"0: {' '.join(map(str, saved['tokens'][0]))}  {decoded!r}"


def test_max_cache_len_sets_the_slots_and_is_recorded_for_the_rebuild(decoders, tmp_path):
    art = tmp_path / "short"
    args = ["export", f"hf:{decoders['gpt2']}", "--task", "text-generation", "--max-cache-len", "24", "--out", str(art)]
    result = CliRunner().invoke(cli, [*args, "--format", "onnx"])
    assert result.exit_code == 0, result.output + result.stderr
    manifest = read_manifest(art)
    assert manifest.generation["cache"]["slots"] == 24 and manifest.model["config"]["max_cache_len"] == 24
    assert manifest.signature.dims["seq"].max == 24 and manifest.status == "passed"
    too_long = CliRunner().invoke(cli, [*args[:-2], "--max-cache-len", "65", "--out", str(tmp_path / "x")])
    assert (
        too_long.exit_code == 2
        and "--max-cache-len: expected 4 to 64 (the config's positions), got 65" in too_long.stderr
    )
    other_task = CliRunner().invoke(
        cli,
        [
            "export",
            f"hf:{decoders['gpt2']}",
            "--task",
            "causal-lm",
            "--max-cache-len",
            "8",
            "--out",
            str(tmp_path / "y"),
        ],
    )
    assert other_task.exit_code == 2
    assert "--max-cache-len applies to --task text-generation, not to --task causal-lm" in other_task.stderr


def test_tk_bench_times_transformers_generate_beside_the_engines(exported):
    from tk.measure.load_guard import LoadGuard
    from tk.runtime import EngineChoice
    from tk.workflows.generation_bench import bench_generation

    quiet = LoadGuard(0, read_load=lambda: 0.0, read_cpu=None)
    report = bench_generation(
        exported["gpt2"], EngineChoice("onnx"), batch_sizes=[2], prompt_len=5, new_tokens=4, rounds=2, guard=quiet
    )
    assert [r.engine for r in report.rows] == ["onnx", "transformers"]  # eager opened for its model, not timed
    assert all(r.decode_step.median > 0 and r.ttft.median > 0 for r in report.rows)


def test_served_text_with_a_stop_string_streams_what_it_answers_whole(exported):
    """``tk serve`` on an hf: decoder takes text through its tokenizer; a stop string ends the text before it,
    and the streamed pieces add up to the whole reply's text."""
    import asyncio

    from tests.serve.conftest import drained
    from tk.runtime import EngineChoice
    from tk.serve.config import ServeConfig, resolve
    from tk.serve.generation_server import GenerationHandler, GenerationServer

    config = resolve(ServeConfig(str(exported["llama"]), engine=EngineChoice("onnx", options={"threads": 1})))
    handler = GenerationHandler(GenerationServer(config))
    tokenizer = _tokenizer()

    def body(value):
        async def stream():
            yield json.dumps(value).encode()

        return stream

    async def ask(path, value):
        reply = await handler.handle("POST", path, {}, body(value))
        if reply.stream is None:
            return json.loads(reply.body)
        return [json.loads(c.decode().removeprefix("data: ")) async for c in reply.stream if b"[DONE]" not in c]

    generate = f"/v2/models/{config.name}/generate"
    free = asyncio.run(ask(generate, {"text_input": "w5 w6 w7", "max_tokens": 8, "temperature": 0}))
    assert free["text_output"] == tokenizer.decode(free["output_ids"], skip_special_tokens=True)
    tokens = free["output_ids"]
    stop = tokenizer.decode(tokens[2:3])
    ends = next(k for k in range(1, 9) if stop in tokenizer.decode(tokens[:k]))
    expected = tokenizer.decode(tokens[:ends]).split(stop)[0]
    request = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, "stop": [stop]}

    async def stopped():
        whole = await ask("/v1/completions", request)
        streamed = await ask("/v1/completions", {**request, "stream": True})
        await drained(handler.server)  # the rows a stop string ended leave the batch before its next step
        return whole["choices"][0], streamed

    whole, streamed = asyncio.run(stopped())
    assert whole["text"] == expected and whole["finish_reason"] == "stop" and whole["token_ids"] == tokens[:ends]
    assert "".join(e["choices"][0]["text"] for e in streamed) == expected
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert handler.server.scheduler.active == 0 and not handler.server.batch.rows


@pytest.mark.slow
@pytest.mark.fits(seconds=120)  # torch.compile of the tiny model's step in the warm-up
def test_tk_bench_times_transformers_compiled_static_cache_too(exported):
    from tk.measure.load_guard import LoadGuard
    from tk.runtime import EngineChoice
    from tk.workflows.generation_bench import bench_generation

    quiet = LoadGuard(0, read_load=lambda: 0.0, read_cpu=None)
    report = bench_generation(
        exported["llama"], EngineChoice("onnx"), batch_sizes=[1], prompt_len=5, new_tokens=4, rounds=1, guard=quiet,
        compiled_rival=True,
    )  # fmt: skip
    assert [r.engine for r in report.rows] == ["onnx", "transformers", "transformers compiled"]
    assert all(r.decode_step.median > 0 and r.ttft.median > 0 for r in report.rows)


def test_grouped_attention_equals_transformers_sdpa_with_padding(decoders):
    """The llama config shares 2 key/value heads among 4: tk's grouped attention gives transformers' SDPA
    logits on left-padded prompts, prefill and decode, within float32 rounding."""
    import torch
    from transformers import AutoModelForCausalLM

    from tk.models.hf_generation import transformers_attention, use_grouped_attention

    model = AutoModelForCausalLM.from_pretrained(decoders["llama"], attn_implementation="sdpa").eval()
    ids = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5], mask[1, :1] = 0, 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        use_grouped_attention(model, model.config)
        assert model.config._attn_implementation == "tk_sdpa_grouped"
        got = model(ids, attention_mask=mask).logits
        with transformers_attention(model):  # the reference and the rivals run transformers' own
            assert model.config._attn_implementation == "sdpa"
        assert model.config._attn_implementation == "tk_sdpa_grouped"
    real = mask.bool()
    assert (got - want)[real].abs().max().item() < 1e-5


def test_openvino_keeps_the_cache_and_fuses_it_into_attention(exported):
    """OpenVINO's IR of a decoder keeps its cache (a variable per layer and kind, no scatter), and the CPU plugin
    runs each layer's attention over the cache it holds (``ScaledDotProductAttentionWithKVCache``); the llama
    config's shared key/value heads add no broadcast to what GPT-2's IR runs."""
    import collections

    import numpy as np
    import openvino as ov

    from tk.runtime import load

    broadcasts = {}
    for name in ("gpt2", "llama"):
        ops = collections.Counter(
            op.get_type_name() for op in ov.Core().read_model(str(exported[name] / "model.xml")).get_ordered_ops()
        )
        assert ops["ReadValue"] == ops["Assign"] == 4  # 2 layers x keys, values
        assert ops["ScatterElementsUpdate"] == ops["ScatterUpdate"] == 0
        engine = load(exported[name], "openvino")
        assert engine.keeps_cache and read_manifest(exported[name]).formats["openvino"]["cache"] == "state"
        compiled = ov.Core().compile_model(
            str(exported[name] / "model.xml"), "CPU", {"PERF_COUNT": True, "INFERENCE_PRECISION_HINT": "f32"}
        )
        request = compiled.create_infer_request()
        for ids, first in (([3, 4, 5], 0), ([6], 3)):  # a prefill, then a decode step on its cache
            width = len(ids)
            request.infer(
                {
                    "input_ids": np.array([ids]),
                    "position_ids": np.arange(first, first + width)[None],
                    "attention_mask": np.ones((1, first + width), np.int64),
                    "beam_idx": np.zeros(1, np.int32),
                }
            )
        ran = collections.Counter(p.node_type for p in request.profiling_info)
        assert ran["ScaledDotProductAttentionWithKVCache"] == 2, ran
        broadcasts[name] = ran["Broadcast"]
    assert broadcasts["llama"] == broadcasts["gpt2"]


def test_grouped_attention_hands_what_it_does_not_do_to_transformers():
    import torch
    from torch import nn

    from tk.models.hf_generation import grouped_sdpa_attention

    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="does not support `softcap`"):
        grouped_sdpa_attention(module, query, key, key, None, softcap=30.0)
    out, _ = grouped_sdpa_attention(module, query, key, key, None)  # causal, no mask: spelled out per stacked row
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1), key.repeat_interleave(2, 1),
                                                            is_causal=True)  # fmt: skip
    assert out.shape == (1, 3, 4, 8) and float((out - want.transpose(1, 2)).abs().max()) < 1e-6
