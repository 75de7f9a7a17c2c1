"""hf:DIR beyond text: images, audio, encoder-decoder halves and decoders, from tiny random configs saved
with save_pretrained, exported to every CPU format and checked against transformers' own forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from tk.cli import cli
from tk.errors import InputError, UsageError
from tk.models import build_model
from tk.runtime import load
from tk.workflows.user_inputs import read_user_inputs

VOCAB = 100
SPECIAL = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}  # ids inside the tiny vocabularies
SEQ2SEQ = {"vocab_size": VOCAB, "d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, **SPECIAL}
SEQ2SEQ |= {"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4}


def _bart_config() -> Any:
    from transformers import BartConfig

    return BartConfig(**SEQ2SEQ, max_position_embeddings=64, decoder_start_token_id=2, forced_eos_token_id=2)


def _models() -> dict[str, Any]:
    import transformers as tf

    text = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    text |= {"intermediate_size": 64, "max_position_embeddings": 64}
    whisper = tf.WhisperConfig(
        **SEQ2SEQ,
        num_mel_bins=16,
        max_source_positions=50,  # 100 frames of features
        max_target_positions=64,
        decoder_start_token_id=0,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    wav2vec2 = tf.Wav2Vec2Config(
        **{**text, "vocab_size": 32},
        conv_dim=(16, 16, 16),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    vit = tf.ViTConfig(**{**text, "vocab_size": None}, image_size=32, patch_size=8, num_labels=5)
    convnext = tf.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=5, image_size=32)
    t5 = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)
    gpt2 = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=2
    )
    return {
        "vit": tf.ViTForImageClassification(vit),
        "convnext": tf.ConvNextForImageClassification(convnext),
        "wav2vec2": tf.Wav2Vec2Model(wav2vec2),
        "whisper": tf.WhisperForConditionalGeneration(whisper),
        "bart": tf.BartModel(_bart_config()),
        "bart-lm": tf.BartForConditionalGeneration(_bart_config()),
        "t5": tf.T5ForConditionalGeneration(t5),
        "gpt2": tf.GPT2LMHeadModel(gpt2),
        "deberta": tf.DebertaV2Model(tf.DebertaV2Config(**text)),  # no SDPA attention in transformers
        "mpnet": tf.MPNetModel(tf.MPNetConfig(**text)),  # nor here
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-tasks")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        models = _models()
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: root / name for name in models}


def _export(directory: Path, out: Path, *args: str, formats: tuple[str, ...] = ("torch", "onnx")) -> tuple[Any, dict]:
    """``tk export hf:DIR ARGS --format ... --out OUT``: the CLI's result and the manifest it wrote."""
    flags = [flag for fmt in formats for flag in ("--format", fmt)]
    result = CliRunner().invoke(cli, ["export", f"hf:{directory}", *args, *flags, "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "passed" and sorted(manifest["check"]) == sorted(formats)
    assert all(report["passed"] for report in manifest["check"].values())
    return result, manifest


def _io(manifest: dict) -> tuple[list, list, dict]:
    """Inputs and outputs as (name, dtype, shape), and dims as (min, opt, max)."""
    sig = manifest["signature"]
    io = [[(s["name"], s["dtype"], s["shape"]) for s in sig[k]] for k in ("inputs", "outputs")]
    return io[0], io[1], {n: (d["min"], d["opt"], d["max"]) for n, d in sig["dims"].items()}


def _close(got: np.ndarray, want: torch.Tensor) -> None:
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_image_classification_exports_to_every_cpu_format_and_checks_images(hf_dirs, tmp_path):
    from transformers import ViTForImageClassification

    out = tmp_path / "vit"
    _, manifest = _export(hf_dirs["vit"], out, "--task", "image-classification", formats=("torch", "onnx", "openvino"))
    inputs, outputs, dims = _io(manifest)
    assert inputs == [("pixel_values", "float32", ["batch", 3, "height", "width"])]  # channels, size: the config's
    assert outputs == [("logits", "float32", ["batch", 5])]
    assert dims["height"] == dims["width"] == (32, 32, 32)
    images = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    model = ViTForImageClassification.from_pretrained(hf_dirs["vit"], local_files_only=True).eval()
    with torch.no_grad():
        want = model(pixel_values=torch.from_numpy(images)).logits
    for fmt in ("onnx", "openvino"):
        with load(out, fmt) as engine:
            _close(engine.run({"pixel_values": images})["logits"], want)
    # a user's images as .npz float arrays named after the input: tk check reads them
    np.savez(tmp_path / "images.npz", pixel_values=images)
    checked = CliRunner().invoke(cli, ["check", str(out), "--engine", "onnx", "--inputs", str(tmp_path / "images.npz")])
    assert checked.exit_code == 0, checked.output
    np.savez(tmp_path / "double.npz", pixel_values=images.astype(np.float64))
    refused = CliRunner().invoke(cli, ["check", str(out), "--engine", "onnx", "--inputs", str(tmp_path / "double.npz")])
    assert refused.exit_code == 2
    assert "expected dtype float32" in refused.output and "found float64" in refused.output


def test_image_arrays_are_read_by_input_name_and_checked_against_the_image_size(hf_dirs, tmp_path):
    spec = build_model(f"hf:{hf_dirs['vit']}", task="image-classification")
    images = np.zeros((2, 3, 32, 32), np.float16)  # a narrower float widens safely
    np.savez(tmp_path / "ok.npz", pixel_values=images, labels=np.array([1, 4]))
    arrays = read_user_inputs(tmp_path / "ok.npz", spec.name, spec.signature.inputs, spec.signature.dims)
    assert list(arrays) == ["pixel_values"] and arrays["pixel_values"].shape == (2, 3, 32, 32)
    np.savez(tmp_path / "big.npz", pixel_values=np.zeros((2, 3, 48, 48), np.float32))
    with pytest.raises(InputError, match=r"'height'.*\[32, 32\].*48"):
        read_user_inputs(tmp_path / "big.npz", spec.name, spec.signature.inputs, spec.signature.dims)


@pytest.mark.slow
def test_image_features_follow_the_image_size_given(hf_dirs, tmp_path):
    from transformers import ConvNextModel

    out = tmp_path / "convnext"
    args = ("--task", "image-feature-extraction", "--dim", "height=64", "--dim", "width=64")
    _, manifest = _export(hf_dirs["convnext"], out, *args)
    _, outputs, dims = _io(manifest)
    assert dims["height"] == (64, 64, 64)
    # a CNN's feature map: its axes follow the image's size, so they are named, not fixed at the config's
    assert outputs == [("last_hidden_state", "float32", ["batch", 64, "feature_height", "feature_width"])]
    images = np.random.default_rng(2).standard_normal((2, 3, 64, 64)).astype(np.float32)
    model = ConvNextModel.from_pretrained(hf_dirs["convnext"], local_files_only=True).eval()
    with torch.no_grad():
        want = model(pixel_values=torch.from_numpy(images)).last_hidden_state
    assert tuple(want.shape) == (2, 64, 2, 2)
    with load(out, "onnx") as engine:
        _close(engine.run({"pixel_values": images})["last_hidden_state"], want)


@pytest.mark.slow
def test_wav2vec2_features_take_waveforms_of_any_length(hf_dirs, tmp_path):
    from transformers import Wav2Vec2Model

    spec = build_model(f"hf:{hf_dirs['wav2vec2']}")
    samples = spec.signature.dims["samples"]
    # two frames through the config's convolutions (kernels 10, 3, 3; strides 5, 2, 2) to 10 s at 16 kHz
    assert (samples.min, samples.opt, samples.max) == (60, 16000, 160000)
    out = tmp_path / "wav2vec2"
    _, manifest = _export(hf_dirs["wav2vec2"], out, "--dim", "samples=400:1600:3200")
    inputs, outputs, _ = _io(manifest)
    assert inputs == [("input_values", "float32", ["batch", "samples"])]
    assert outputs == [("last_hidden_state", "float32", ["batch", "frames", 32])]
    wave = np.random.default_rng(3).standard_normal((2, 1000)).astype(np.float32)
    model = Wav2Vec2Model.from_pretrained(hf_dirs["wav2vec2"], local_files_only=True).eval()
    with torch.no_grad():
        want = model(input_values=torch.from_numpy(wave)).last_hidden_state
    with load(out, "onnx") as engine:
        _close(engine.run({"input_values": wave})["last_hidden_state"], want)


@pytest.mark.slow
def test_whisper_features_are_its_encoders_on_its_fixed_frames(hf_dirs, tmp_path):
    from transformers import WhisperModel

    out = tmp_path / "whisper"
    _, manifest = _export(hf_dirs["whisper"], out)  # feature-extraction of an audio encoder-decoder: the encoder
    inputs, outputs, dims = _io(manifest)
    assert inputs == [("input_features", "float32", ["batch", 16, 100])]  # mel bins; 2 x max_source_positions
    assert outputs == [("last_hidden_state", "float32", ["batch", 50, 32])]
    assert list(dims) == ["batch"]
    features = np.random.default_rng(4).standard_normal((2, 16, 100)).astype(np.float32)
    encoder = WhisperModel.from_pretrained(hf_dirs["whisper"], local_files_only=True).eval().get_encoder()
    with torch.no_grad():
        want = encoder(input_features=torch.from_numpy(features)).last_hidden_state
    with load(out, "onnx") as engine:
        _close(engine.run({"input_features": features})["last_hidden_state"], want)
    same = build_model(f"hf:{hf_dirs['whisper']}", task="text2text-encoder").signature
    assert [(s.name, s.shape) for s in same.inputs] == [("input_features", ("batch", 16, 100))]


def test_whispers_decoder_step_takes_the_encoders_fixed_length_output(hf_dirs):
    sig = build_model(f"hf:{hf_dirs['whisper']}", task="text2text-decoder").signature
    assert [(s.name, s.dtype, s.shape) for s in sig.inputs] == [
        ("decoder_input_ids", "int64", ("batch", "decoder_seq")),
        ("encoder_hidden_states", "float32", ("batch", 50, 32)),  # no attention mask: Whisper's has none
    ]
    assert [(s.name, s.shape) for s in sig.outputs] == [("logits", ("batch", "decoder_seq", VOCAB))]
    assert sig.dims["decoder_seq"].max == 64  # max_target_positions
    assert sig.inputs[0].high == VOCAB


@pytest.mark.slow
def test_encoder_and_decoder_step_artifacts_compose_to_the_seq2seq_model(hf_dirs, tmp_path):
    from transformers import BartForConditionalGeneration

    directory = hf_dirs["bart-lm"]
    _, encoder_manifest = _export(directory, tmp_path / "enc", "--task", "text2text-encoder")
    _, decoder_manifest = _export(directory, tmp_path / "dec", "--task", "text2text-decoder")
    inputs, outputs, _ = _io(encoder_manifest)
    assert [i[0] for i in inputs] == ["input_ids", "attention_mask"]
    assert outputs == [("last_hidden_state", "float32", ["batch", "seq", 32])]
    inputs, outputs, dims = _io(decoder_manifest)
    assert inputs == [
        ("decoder_input_ids", "int64", ["batch", "decoder_seq"]),
        ("encoder_hidden_states", "float32", ["batch", "seq", 32]),
        ("attention_mask", "int64", ["batch", "seq"]),
    ]
    assert outputs == [("logits", "float32", ["batch", "decoder_seq", VOCAB])]
    assert dims["decoder_seq"] == (1, 16, 64)
    rng = np.random.default_rng(5)
    ids = rng.integers(3, VOCAB, (2, 10)).astype(np.int64)
    mask = np.ones((2, 10), np.int64)
    mask[1, 6:] = 0
    decoder_ids = rng.integers(3, VOCAB, (2, 5)).astype(np.int64)
    model = BartForConditionalGeneration.from_pretrained(directory, local_files_only=True).eval()
    with torch.no_grad():
        want = model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            decoder_input_ids=torch.from_numpy(decoder_ids),
        ).logits
    with load(tmp_path / "enc", "onnx") as encoder, load(tmp_path / "dec", "onnx") as decoder:
        encoded = encoder.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
        feeds = {"decoder_input_ids": decoder_ids, "encoder_hidden_states": encoded, "attention_mask": mask}
        _close(decoder.run(feeds)["logits"], want)


@pytest.mark.slow
def test_t5_features_name_the_encoder_task_and_its_encoder_exports(hf_dirs, tmp_path):
    result = CliRunner().invoke(cli, ["export", f"hf:{hf_dirs['t5']}", "--out", str(tmp_path / "no")])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "cannot run from input_ids alone" in lines[0] and "--task text2text-encoder" in lines[0]
    assert not (tmp_path / "no").exists()
    # torch.onnx fails on T5's program as captured (a view of incompatible strides); tk's ONNX writer converts
    # it decomposed (tests/export/test_fallbacks.py)
    _, manifest = _export(hf_dirs["t5"], tmp_path / "enc", "--task", "text2text-encoder")
    assert _io(manifest)[1] == [("last_hidden_state", "float32", ["batch", "seq", 32])]


@pytest.mark.slow
def test_causal_lm_exports_logits_without_the_kv_cache_to_openvino(hf_dirs, tmp_path):
    from transformers import GPT2LMHeadModel

    spec = build_model(f"hf:{hf_dirs['gpt2']}", task="causal-lm")
    assert spec.module.model.config.use_cache is False
    assert build_model(f"hf:{hf_dirs['gpt2']}").module.model.config.use_cache is False  # feature-extraction too
    out = tmp_path / "gpt2"
    _, manifest = _export(
        hf_dirs["gpt2"], out, "--task", "causal-lm", "--seq", "1:16:64", formats=("torch", "onnx", "openvino")
    )
    inputs, outputs, _ = _io(manifest)
    assert inputs == [("input_ids", "int64", ["batch", "seq"]), ("attention_mask", "int64", ["batch", "seq"])]
    assert outputs == [("logits", "float32", ["batch", "seq", VOCAB])]  # and no past_key_values
    ids = np.random.default_rng(6).integers(0, VOCAB, (2, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    model = GPT2LMHeadModel.from_pretrained(hf_dirs["gpt2"], local_files_only=True).eval()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    with load(out, "openvino") as engine:
        _close(engine.run({"input_ids": ids, "attention_mask": mask})["logits"], want)


def test_gpt2s_conv1d_loads_as_the_linear_it_is(hf_dirs):
    """transformers' Conv1D is a linear run as addmm with its weight transposed: the x86 int8 quantizer
    annotates aten.linear only, so GPT-2's products stayed float32 in an aoti int8 package."""
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    from tk.measure.roofline import linear_shapes

    spec = build_model(f"hf:{hf_dirs['gpt2']}", task="causal-lm")
    assert not any(isinstance(m, Conv1D) for m in spec.module.modules())
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, VOCAB, (2, 9)))
    mask = torch.ones_like(ids)
    model = GPT2LMHeadModel.from_pretrained(hf_dirs["gpt2"], local_files_only=True).eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        got = spec.module(ids, mask)
    # the same products; a transposed weight may take another BLAS kernel, so not bit for bit on every CPU
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    shapes = {(s.k, s.n): s.count for s in linear_shapes(spec.module, (ids, mask))}
    assert shapes == {(32, 96): 2, (32, 32): 2, (32, 128): 2, (128, 32): 2, (32, VOCAB): 1}  # 2 layers and the head
    graph = torch.export.export(spec.module, (ids, mask)).module().graph
    linears = [n for n in graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 9


@pytest.mark.slow
def test_bart_features_hold_the_sequence_range_torch_export_suggests(hf_dirs, tmp_path):
    out = tmp_path / "bart"
    result, manifest = _export(hf_dirs["bart"], out)
    assert "export capture seq: the model takes 3..64 of 1..64" in result.stderr
    assert "the artifact holds --seq 3:64:64" in result.stderr
    assert _io(manifest)[2]["seq"] == (3, 64, 64)  # the range the program holds, which the check ran
    assert min(s["seq"] for s in manifest["check"]["onnx"]["shapes"]) == 3


@pytest.mark.slow
def test_a_model_without_sdpa_loads_eager_attention_says_so_and_rebuilds_so(hf_dirs, tmp_path):
    out = tmp_path / "deberta"
    result, manifest = _export(hf_dirs["deberta"], out)
    assert "transformers has no SDPA attention for DebertaV2Model: loaded with its eager attention" in result.stderr
    assert manifest["model"]["config"] == {"task": "feature-extraction", "attn_implementation": "eager"}
    # DeBERTa-v2's default config has no token type table (type_vocab_size 0): no token_type_ids input
    assert [i[0] for i in _io(manifest)[0]] == ["input_ids", "attention_mask"]
    rebuilt = build_model(manifest["model"]["name"], config=manifest["model"]["config"])
    assert rebuilt.module.model.config._attn_implementation == "eager"
    ids = np.random.default_rng(7).integers(0, VOCAB, (2, 11)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with load(out, "eager") as eager, load(out, "onnx") as onnx:
        np.testing.assert_allclose(
            onnx.run(feeds)["last_hidden_state"], eager.run(feeds)["last_hidden_state"], atol=1e-5
        )


def test_mpnet_loads_eager_attention_and_sdpa_models_keep_sdpa(hf_dirs):
    mpnet = build_model(f"hf:{hf_dirs['mpnet']}")
    assert mpnet.config == {"task": "feature-extraction", "attn_implementation": "eager"}
    vit = build_model(f"hf:{hf_dirs['vit']}", task="image-classification")
    assert vit.config == {"task": "image-classification"}
    assert vit.module.model.config._attn_implementation == "sdpa"
    convnext = build_model(f"hf:{hf_dirs['convnext']}", task="image-classification")
    assert convnext.config == {"task": "image-classification"}  # no attention: nothing fell back


def test_a_manifest_cannot_choose_an_attention_implementation_from_the_hub(hf_dirs):
    config = {"task": "feature-extraction", "attn_implementation": "kernels-community/flash-attn"}
    with pytest.raises(UsageError, match="expected an attention implementation of eager or sdpa"):
        build_model(f"hf:{hf_dirs['deberta']}", config=config)


def test_tasks_a_model_has_no_class_or_part_for_are_one_line_errors(hf_dirs):
    with pytest.raises(UsageError, match="no AutoModelForImageClassification class for a 'gpt2' model"):
        build_model(f"hf:{hf_dirs['gpt2']}", task="image-classification")
    with pytest.raises(UsageError, match=r"encoder-decoder model's encoder .* has none: use --task feature-extraction"):
        build_model(f"hf:{hf_dirs['gpt2']}", task="text2text-encoder")
    with pytest.raises(UsageError, match=r"needs an image model \(pixel_values\); this one takes input_ids"):
        build_model(f"hf:{hf_dirs['deberta']}", task="image-feature-extraction")


def test_a_head_the_directory_has_no_weights_for_is_warned_of(hf_dirs, caplog):
    with caplog.at_level("WARNING", logger="tk.models"):
        spec = build_model(f"hf:{hf_dirs['deberta']}", task="sequence-classification")
    assert "no weights in the directory for classifier.bias, classifier.weight" in caplog.text
    assert "they are random (saved for another task?)" in caplog.text
    assert spec.signature.outputs[0].shape == ("batch", 2)


def test_a_config_transformers_maps_to_several_classes_loads(tmp_path):
    """DeiT's config maps to a tuple of classes (with and without the distillation head): the one loaded is
    the one its architectures name, and its attention is read from that class."""
    import transformers

    from tk.models.hf import load_hf_module

    torch.manual_seed(0)
    config = transformers.DeiTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, num_labels=5)  # fmt: skip
    transformers.DeiTForImageClassification(config).save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_hf_module(tmp_path, "image-classification")
    assert type(model).__name__ == "DeiTForImageClassification"
    assert model.config._attn_implementation == "sdpa"
