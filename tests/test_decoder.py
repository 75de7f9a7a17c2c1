"""The built-in decoder end to end: training on its rule, the cached step against the plain forward, the
batched generation loop against a loop without cache, export per format with its generation check,
``tk generate`` and its one-line errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import IntegrityError, UsageError
from tk.generation_parity import compare_generation
from tk.manifest import MANIFEST, manifest_bytes, read_manifest
from tk.models import build_model
from tk.models.decoder import SIZES, greedy_without_cache, rule_accuracy, rule_sequences
from tk.models.train import train
from tk.runtime import load
from tk.runtime.generation import Generated, Sampling

PROMPTS = [[3, 5, 7], [10, 11, 12, 13, 14, 15], [60, 63], [1, 4, 7, 10, 13, 16, 19, 22, 25]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny decoder trained on its rule (it stops at its target loss, ~100 steps), and its checkpoint."""
    from tk.models.checkpoint import save_checkpoint

    spec = build_model("decoder", size="tiny")
    result = train(spec, seed=0)
    assert result.final_loss < 0.05, result.summary()
    path = tmp_path_factory.mktemp("decoder") / "decoder-tiny.safetensors"
    save_checkpoint(spec.module, path, {**spec.reference(), "train": result.summary()})
    return spec, path


@pytest.fixture(scope="module")
def artifact(trained, tmp_path_factory):
    _, checkpoint = trained
    out = tmp_path_factory.mktemp("art") / "decoder"
    result = CliRunner().invoke(
        cli,
        ["export", "decoder", "--size", "tiny", "--checkpoint", str(checkpoint), "--out", str(out),
         "--format", "torch", "--format", "onnx", "--format", "openvino"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    return out


def test_the_cached_step_computes_what_the_plain_forward_does(trained):
    spec, _ = trained
    module = spec.module.eval()
    ids = rule_sequences(SIZES["tiny"], torch.Generator().manual_seed(1), 3, 10)
    slots, (batch, seq) = 64, ids.shape
    keys = torch.zeros(batch, 2, 2, slots, 32)
    mask = torch.zeros(batch, slots, dtype=torch.int64)
    mask[:, :seq] = 1
    with torch.no_grad():
        logits, new_keys, _ = module(ids, torch.arange(seq).expand(batch, seq), torch.arange(seq), mask, keys, keys)
        plain = module(ids)[:, -1]
    assert new_keys.shape == (batch, 2, 2, seq, 32)
    assert float((logits - plain).abs().max()) < 1e-5


@pytest.mark.parametrize("start", [0, 5])
def test_attention_over_cache_then_step_equals_attention_over_the_cache_written(start):
    """``step_visibility``'s keys (the cache's slots, then the step's) give what attention over the cache with
    the step's keys written into their slots gives under the slot-wise mask (a row sees the slots it holds up
    to its own; a padded token sees itself): left-padded rows, a stale value in a step's slot, prefill and decode."""
    from tk.models.decoder import step_visibility

    gen = torch.Generator().manual_seed(3)
    batch, heads, slots, dim = 3, 2, 16, 8
    for width in (4, 1):
        cache_position = torch.arange(start + 4, start + 4 + width)
        mask = torch.zeros(batch, slots, dtype=torch.int64)
        mask[0, start : start + 4 + width] = 1
        mask[1, start + 2 : start + 4 + width] = 1  # two slots of padding
        mask[2, cache_position[-1]] = 1  # only its newest token is real
        past_k, past_v = torch.randn(batch, heads, slots, dim, generator=gen), torch.randn(batch, heads, slots, dim,
                                                                                             generator=gen)  # fmt: skip
        q, k, v = (torch.randn(batch, heads, width, dim, generator=gen) for _ in range(3))
        written_k = past_k.index_copy(2, cache_position, k)
        written_v = past_v.index_copy(2, cache_position, v)
        seen = torch.arange(slots)[None, :] <= cache_position[:, None]
        own = (torch.arange(slots)[None, :] == cache_position[:, None])[None, None]
        slotwise = (seen[None, None] & mask.bool()[:, None, None, :]) | own
        want = torch.nn.functional.scaled_dot_product_attention(q, written_k, written_v, attn_mask=slotwise)
        visible = step_visibility(cache_position, mask)
        assert visible.shape == (batch, 1, width, slots + width)
        got = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat([past_k, k], 2), torch.cat([past_v, v], 2), attn_mask=visible
        )
        assert float((got - want).abs().max()) < 1e-6, width


def test_the_trained_decoder_continues_its_rule(trained):
    spec, _ = trained
    cfg = SIZES["tiny"]
    held_out = rule_sequences(cfg, torch.Generator().manual_seed(123), 16, 8)
    prompts = [row[: 3 + i % 5].tolist() for i, row in enumerate(held_out)]
    outputs = [greedy_without_cache(spec.module.eval(), p, 12) for p in prompts]
    assert rule_accuracy(prompts, outputs, cfg.vocab_size) >= 0.95


@pytest.mark.parametrize("engine", ["eager", "torch", "onnx", "openvino"])
def test_batched_generation_matches_the_loop_without_cache(trained, artifact, engine):
    """Prompts of four lengths in one left-padded batch: each row as if generated alone without a cache."""
    spec, _ = trained
    want = [greedy_without_cache(spec.module.eval(), p, 20) for p in PROMPTS]
    with load(artifact, engine) as opened:
        got = opened.generate(PROMPTS, max_new_tokens=20)
    assert got.tokens == want
    assert got.finish == ["length"] * len(PROMPTS) and len(got.step_seconds) == 20


def test_the_export_records_entry_points_and_a_generation_check_per_format(artifact):
    manifest = read_manifest(artifact)
    assert manifest.status == "passed"
    assert manifest.generation["entry_points"]["decode"]["seq"] == [1, 1]
    assert manifest.generation["entry_points"]["prefill"]["seq"] == [1, 64]
    assert manifest.generation["cache"] == {"slots": 64, "layers": 2, "heads": 2, "head_dim": 32,
                                            "layout": "batch, layer, head, slot, head_dim"}  # fmt: skip
    for fmt in ("torch", "onnx", "openvino"):
        report = manifest.generation["check"][fmt]
        assert report["passed"] and report["identical"] and report["prompts"] == 8 and report["new_tokens"] == 16
        assert report["max_logit_error"] < 1e-4
        assert report["task_accuracy"] >= 0.95  # the rule's continuations, held out from training
    shown = CliRunner().invoke(cli, ["inspect", str(artifact)]).output
    assert "entry      decode: 1 new token, batch 1 to 8" in shown
    assert "generate   onnx: passed, 8 prompts x 16 greedy tokens identical" in shown


def test_stop_tokens_end_their_row_only(artifact):
    with load(artifact, "onnx") as opened:
        free = opened.generate(PROMPTS[:2], max_new_tokens=6)
        stop = free.tokens[0][2]  # the third token of the first prompt
        got = opened.generate(PROMPTS[:2], max_new_tokens=6, stop_ids=[stop])
    assert got.tokens[0] == free.tokens[0][:3] and got.finish[0] == "stop"
    assert got.tokens[1] == free.tokens[1] and got.finish[1] == "length"


def test_sampling_is_seeded_and_top_k_1_is_greedy(artifact):
    with load(artifact, "onnx") as opened:
        greedy = opened.generate(PROMPTS, max_new_tokens=8).tokens
        hot = Sampling(temperature=5.0, seed=3)
        first = opened.generate(PROMPTS, max_new_tokens=8, sampling=hot).tokens
        again = opened.generate(PROMPTS, max_new_tokens=8, sampling=hot).tokens
        other = opened.generate(PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=5.0, seed=4)).tokens
        top1 = opened.generate(PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=5.0, top_k=1)).tokens
        nucleus = opened.generate(PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0, top_p=1e-6)).tokens
    assert first == again and first != other and first != greedy
    assert top1 == greedy and nucleus == greedy


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"temperature": -1.0}, "--temperature: expected a number >= 0"),
        ({"top_k": -2}, "--top-k: expected 0"),
        ({"top_p": 0.0}, r"--top-p: expected a number in \(0, 1\]"),
    ],
)
def test_bad_sampling_is_one_line(values, message):
    with pytest.raises(UsageError, match=message):
        Sampling(**values)


def _generated(tokens, logits):
    return Generated([[1]] * len(tokens), tokens, ["length"] * len(tokens), [np.asarray(s, np.float32) for s in logits])


def test_a_difference_at_a_near_tie_is_reported_not_failed_in_reduced_precision():
    # row 0 differs at step 1, where the reference's margin is 0.01; row 1 agrees with a logit error of 0.02
    reference = _generated([[0, 1], [0, 0]], [[[5.0, 1.0], [5.0, 1.0]], [[2.0, 2.01], [5.0, 1.0]]])
    candidate = _generated([[0, 0], [0, 0]], [[[5.0, 1.0], [5.0, 1.0]], [[2.02, 2.0], [5.02, 1.0]]])
    reduced = compare_generation(reference, candidate, engine="x", rtol=0, atol=1e-3, reduced=True)
    assert reduced.passed and not reduced.identical and reduced.agreement == 0.75
    d = reduced.divergence
    assert (d.prompt, d.step, d.reference_token, d.candidate_token, d.near_tie) == (0, 1, 1, 0, True)
    assert d.margin == pytest.approx(0.01, abs=1e-6) and d.logit_error == pytest.approx(0.02, abs=1e-6)
    assert "prompt 0 step 1 (0 for 1, margin 1.00e-02" in reduced.summary()
    fp32 = compare_generation(reference, candidate, engine="x", rtol=0, atol=1e-3, reduced=False)
    assert not fp32.passed  # in float32 any different token fails


def test_a_difference_that_is_no_near_tie_fails():
    reference = _generated([[0, 0]], [[[5.0, 1.0]], [[5.0, 1.0]]])
    candidate = _generated([[0, 1]], [[[5.0, 1.0]], [[1.0, 5.0]]])
    report = compare_generation(reference, candidate, engine="x", rtol=0, atol=1e-3, reduced=True)
    assert not report.passed and not report.divergence.near_tie and report.divergence.margin == 4.0


def test_identical_tokens_with_logits_beyond_tolerance_fail_in_fp32():
    reference = _generated([[0]], [[[5.0, 1.0]]])
    candidate = _generated([[0]], [[[5.5, 1.0]]])
    report = compare_generation(reference, candidate, engine="x", rtol=0, atol=1e-3, reduced=False)
    assert report.identical and not report.passed and report.max_logit_error == pytest.approx(0.5)


def test_tk_generate_prints_tokens_streams_and_writes_json(artifact, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:2]))
    out = tmp_path / "run.json"
    result = CliRunner().invoke(
        cli, ["generate", str(artifact), "--prompt-ids", str(prompts), "--max-new-tokens", "5", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout.splitlines() == ["0: 9 11 13 15 17", "1: 16 17 18 19 20"]
    assert "10 tokens for 2 prompts on onnx: time to first token" in result.stderr
    saved = json.loads(out.read_text())
    assert saved["tokens"] == [[9, 11, 13, 15, 17], [16, 17, 18, 19, 20]] and saved["finish"] == ["length"] * 2
    text = tmp_path / "one.txt"
    text.write_text("3, 5, 7\n")
    streamed = CliRunner().invoke(
        cli,
        [
            "generate",
            str(artifact),
            "--prompt-ids",
            str(text),
            "--max-new-tokens",
            "4",
            "--stream",
            "--engine",
            "torch",
        ],
    )
    assert streamed.exit_code == 0, streamed.output + streamed.stderr
    assert streamed.stdout.splitlines() == ["9 11 13 15", "0: length"]


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("[[1, 2], []]", [], "prompt 1: expected at least one token, found an empty prompt"),
        ("[[1, 64]]", [], r"prompt 0: expected token ids in \[0, 64\), found 64"),
        ("[[1, 2]]", ["--max-new-tokens", "63"], "exceeds the artifact's cache of 64 slots; expected at most 62"),
        ('{"a": 1}', [], "expected a list of lists of token ids"),
        ("[[1, 2]", [], "expected JSON"),
        ("[[1, 2]]", ["--prompt", "hi"], "expected --prompt-ids FILE or --prompt TEXT .* found both"),
        ("[[1, 2]]", ["--temperature", "-1"], "--temperature: expected a number >= 0"),
    ],
)
def test_tk_generate_errors_are_one_line(artifact, tmp_path, content, args, message):
    prompts = tmp_path / "p.json"
    prompts.write_text(content)
    result = CliRunner().invoke(cli, ["generate", str(artifact), "--prompt-ids", str(prompts), *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert re.search(message, lines[0]), lines[0]


def test_tk_generate_refuses_text_without_a_tokenizer_and_a_model_that_is_no_decoder(artifact, tmp_path):
    result = CliRunner().invoke(cli, ["generate", str(artifact), "--prompt", "hello"])
    assert (
        result.exit_code == 2
        and "--prompt: expected an hf:DIR model with a tokenizer, found 'decoder'" in result.stderr
    )
    mlp = tmp_path / "mlp"
    assert (
        CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--format", "torch", "--out", str(mlp)]).exit_code
        == 0
    )
    ids = tmp_path / "p.txt"
    ids.write_text("1 2\n")
    result = CliRunner().invoke(cli, ["generate", str(mlp), "--prompt-ids", str(ids), "--engine", "torch"])
    assert (
        result.exit_code == 2
        and "expected a decoder artifact (a manifest with generation entry points)" in result.stderr
    )


def test_a_crafted_cache_layout_is_one_line(artifact, tmp_path):
    manifest = read_manifest(artifact)
    manifest.generation["cache"]["slots"] = -1
    copy = tmp_path / "crafted"
    copy.mkdir()
    (copy / MANIFEST).write_bytes(manifest_bytes(manifest))
    with pytest.raises(IntegrityError, match=r"generation.cache.slots: expected an integer from 1 to 2\^20"):
        read_manifest(copy)


def test_max_cache_len_shrinks_the_cache_within_the_models_positions():
    spec = build_model("decoder", size="tiny", cache_len=40)
    assert spec.generation["cache"]["slots"] == 40 and spec.config["max_cache_len"] == 40
    assert spec.signature.inputs[4].shape == ("batch", 2, 2, 40, 32)
    with pytest.raises(UsageError, match=r"--max-cache-len: expected 4 to 64 \(the model's positions\), got 65"):
        build_model("decoder", size="tiny", cache_len=65)
    with pytest.raises(UsageError, match="--max-cache-len applies to decoders"):
        build_model("mlp", size="tiny", cache_len=8)


def test_tk_check_runs_greedy_generation_per_engine(artifact, tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(cli, ["check", str(artifact), "--engine", "onnx,openvino", "--json", str(out)])
    assert result.exit_code == 0, result.output + result.stderr
    assert "generation onnx: passed, 8 prompts x 16 tokens identical, max logit error" in result.stdout
    assert "generation openvino: passed" in result.stdout
    assert result.stdout.strip().endswith("parity passed for onnx, openvino")
    saved = json.loads(out.read_text())
    assert saved["generation"]["onnx"]["identical"] and saved["generation"]["onnx"]["task_accuracy"] >= 0.95


def test_tk_bench_times_generation_per_engine_and_batch(artifact, tmp_path):
    from tk.measure.load_guard import LoadGuard
    from tk.runtime import EngineChoice
    from tk.workflows.generation_bench import bench_generation, render_generation

    quiet = LoadGuard(0, read_load=lambda: 0.0, read_cpu=None)  # the verdict never depends on the machine
    report = bench_generation(
        artifact, EngineChoice("onnx,torch,openvino"), batch_sizes=[1, 3], prompt_len=6, new_tokens=5, rounds=2,
        guard=quiet,
    )  # fmt: skip
    assert [(r.engine, r.batch) for r in report.rows] == [(e, b) for b in (1, 3) for e in ("onnx", "torch", "openvino")]
    for row in report.rows:
        assert row.ttft.n == 2 and row.decode_step.n == 2 and row.decode_step.median > 0
        # keys and values in float32: every one of the 64 slots, or those OpenVINO holds at the middle decode step
        slots = 6 + 5 // 2 if row.engine == "openvino" else 64
        assert row.cache_bytes == 2 * row.batch * 2 * 2 * slots * 32 * 4
        assert row.bytes_per_step == row.cache_bytes + read_manifest(artifact).file("weights").size
        assert row.load is not None and not row.load.busy
    assert report.bandwidth_bytes_per_s > 0
    assert "TTFT ms" in str(render_generation(report).columns[2].header)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        cli, ["bench", str(artifact), "--engine", "onnx", "--batch-sizes", "2", "--iters", "1", "--new-tokens", "3",
              "--prompt-len", "4", "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    saved = json.loads(out.read_text())
    assert saved["command"] == "tk bench generation" and saved["results"]["rows"][0]["batch"] == 2
    too_big = CliRunner().invoke(cli, ["bench", str(artifact), "--engine", "onnx", "--batch-sizes", "9"])
    assert too_big.exit_code == 2 and "--batch-sizes: expected at most 8" in too_big.stderr


@pytest.mark.parametrize(
    ("precision", "fmt"),
    [("bf16", "torch"), ("int8", "onnx"), pytest.param("int8", "openvino", marks=pytest.mark.fits(seconds=30))],
)
def test_reduced_precision_keeps_the_rule_and_a_float32_cache(trained, tmp_path, precision, fmt):
    """(NNCF's calibrated int8 runs OpenVINO's static-cache step: its calibration feeds are the step's.)"""
    _, checkpoint = trained
    out = tmp_path / precision
    result = CliRunner().invoke(
        cli, ["export", "decoder", "--size", "tiny", "--checkpoint", str(checkpoint), "--out", str(out),
              "--precision", precision, "--format", fmt],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    manifest = read_manifest(out)
    report = manifest.generation["check"][fmt]
    assert manifest.status == "passed" and report["passed"]
    assert report["task_accuracy"] >= 0.95 and report["agreement"] >= 0.9
    assert [s.dtype for s in manifest.signature.inputs[4:]] == ["float32", "float32"]  # the cache stays float32
    assert "cache" not in manifest.formats[fmt]


@pytest.mark.parametrize(("mode", "bits", "loose"), [("weights", 8, []), ("weights-int4", 4, ["--atol", "1.5"])])
def test_weight_only_quantization_keeps_the_rule(trained, tmp_path, mode, bits, loose):
    """--int8-mode weights/weights-int4: onnx's products become MatMulNBits of 8 or 4 bits (the head's Gemm too),
    openvino's weights are compressed by NNCF; greedy generation keeps to the trained rule."""
    import onnx

    _, checkpoint = trained
    out = tmp_path / mode
    result = CliRunner().invoke(
        cli, ["export", "decoder", "--size", "tiny", "--checkpoint", str(checkpoint), "--out", str(out),
              "--precision", "int8", "--int8-mode", mode, "--format", "onnx", "--format", "openvino",
              "--min-sqnr", "10", *loose],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    manifest = read_manifest(out)
    assert manifest.formats["openvino"]["cache"] == "state"  # compressed weights keep OpenVINO's own cache
    graph = onnx.load(str(out / "model.onnx")).graph
    products = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(products) == 2 * 4 + 1  # two blocks of qkv, proj and two feed-forward products; and the head
    assert {a.i for n in products for a in n.attribute if a.name == "bits"} == {bits}
    assert not [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1].startswith("head")]
    record = manifest.formats["onnx"]["quantization"]
    assert record["bits"] == bits and record["gemms_rewritten"] == 1
    assert manifest.formats["openvino"]["quantization"]["mode"] == mode
    for fmt in ("onnx", "openvino"):
        report = manifest.generation["check"][fmt]
        assert report["task_accuracy"] >= 0.95, (fmt, report)
    # the export's --atol and --min-sqnr are recorded: tk check holds the artifact to what its export did
    assert manifest.model["min_sqnr_db"] == 10 and manifest.model.get("tolerances", {}).get("int8", [0, 0.1])[1] == (
        1.5 if loose else 0.1
    )
    check = CliRunner().invoke(cli, ["check", str(out), "--engine", "onnx,openvino"])
    assert check.exit_code == 0, check.output


@pytest.mark.fits(seconds=40)  # 27 s on the 2-core AVX2 EPYC
def test_tk_optimize_judges_a_decoder_by_greedy_agreement_and_writes_the_fastest(trained, tmp_path):
    _, checkpoint = trained
    out = tmp_path / "best"
    result = CliRunner().invoke(
        cli, ["optimize", "decoder", "--size", "tiny", "--checkpoint", str(checkpoint), "--out", str(out),
              "--formats", "onnx", "--precisions", "fp32,int8"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    record = json.loads((out / "optimize.json").read_text())
    rows = {row["candidate"]: row for row in record["rows"]}
    assert set(rows) == {"onnx fp32", "onnx int8 weights", "onnx int8 weights-int4"}
    assert rows["onnx fp32"]["agreement"] == 1.0 and rows["onnx fp32"]["max_logit_error"] < 1e-4
    for row in rows.values():
        assert row["passed"] and row["task_accuracy"] >= 0.95 and row["decode_ms"] > 0
        assert 0 < row["bandwidth_share"] and row["bytes_per_step"] > 0
    assert rows["onnx int8 weights"]["bytes_per_step"] < rows["onnx fp32"]["bytes_per_step"]
    winner = read_manifest(out)
    assert winner.status == "passed" and list(winner.formats) == [rows[record["winner"]]["format"]]
    assert winner.optimize["accuracy"] == "agreement>=0.99"
    check = CliRunner().invoke(cli, ["check", str(out), "--engine", "onnx"])
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize(
    ("accuracy", "message"),
    [
        (["--accuracy", "agreement>=1.5"], "expected agreement>=X with X in (0, 1]"),
        (["--accuracy", "sqnr>=35"], "judged by greedy-token agreement"),
        (["--batch", "4", "--seconds", "1"], "--batch, --seconds: not taken by a decoder's optimize"),
    ],
)
def test_tk_optimize_takes_only_what_a_decoder_is_judged_by(tmp_path, accuracy, message):
    result = CliRunner().invoke(cli, ["optimize", "decoder", "--size", "tiny", *accuracy, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_tk_bench_refuses_flags_the_generation_benchmark_does_not_take(artifact, tmp_path):
    result = CliRunner().invoke(
        cli, ["bench", str(artifact), "--engine", "onnx", "--junit", str(tmp_path / "j.xml"), "--seconds", "1"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--seconds, --junit: not taken by a decoder's generation benchmark" in result.stderr
    mlp = tmp_path / "mlp"
    assert (
        CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--format", "onnx", "--out", str(mlp)]).exit_code
        == 0
    )
    other = CliRunner().invoke(cli, ["bench", str(mlp), "--engine", "onnx", "--new-tokens", "8"])
    assert (
        other.exit_code == 2
        and "--prompt-len, --new-tokens and --compiled-rival apply to a decoder artifact" in other.stderr
    )


def test_debug_locate_on_the_decode_step_finds_nothing_in_a_float32_graph(artifact):
    """Every module's output in the fused ONNX graph of the float32 decoder is within tolerance: a product whose
    bias onnxruntime's fusions add outside it (BiasGelu, the skip-layer-norm's Sum) is compared with that bias,
    and a module whose own output was fused away (a block's residual add) is listed as unmatched, not failed."""
    from tk.workflows.debug.locate import locate

    result = locate(artifact, "onnx")
    assert result.engine_passed and result.first is None, [(r.module, r.sqnr_db) for r in result.rows if not r.passed]
    compared = {r.module for r in result.rows}
    assert {"blocks.0.attn.proj", "blocks.0.ffn.up", "blocks.1.ffn.down", "head"} <= compared
    assert max(r.max_abs for r in result.rows) < 1e-4


def test_debug_locate_reads_a_decode_steps_feeds_from_a_file(artifact, tmp_path):
    """A decode step's feeds as generation made them (cache_position is shared by the rows: no batch axis)."""
    from tk.runtime.generation import CacheLayout, generate
    from tk.workflows.debug.locate import locate

    captured = {}
    with load(artifact, engine="onnx") as engine:

        def step(feeds):
            if feeds["input_ids"].shape[1] == 1 and not captured:
                captured.update({name: value.numpy().copy() for name, value in feeds.items()})
            return engine.run(feeds)

        generate(step, CacheLayout.from_generation(engine.manifest.generation), PROMPTS[:2], max_new_tokens=3)
    np.savez(tmp_path / "decode.npz", **captured)
    assert captured["input_ids"].shape == (2, 1) and captured["cache_position"].shape == (1,)
    result = locate(artifact, "onnx", inputs=tmp_path / "decode.npz")
    assert result.engine_passed and result.first is None
    assert {r.shape[1] for r in result.rows if r.module.endswith("ffn.up")} == {1}  # one new token per row
