"""hf:DIR models: tiny transformers models saved with save_pretrained, exported and checked offline."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from tk.cli import cli
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.manifest import read_manifest
from tk.models import build_model
from tk.runtime import load
from tk.workflows.export import export

VOCAB = 100


def _bert_dir(root: Path, *, tokenizer: bool) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    directory = root / "bert"
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    BertForSequenceClassification(config).save_pretrained(directory)
    if tokenizer:
        vocab = directory / "vocab.txt"
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
        vocab.write_text("\n".join(words) + "\n")
        BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(directory)
    return directory


def _distilbert_dir(root: Path) -> Path:
    from transformers import DistilBertConfig, DistilBertModel

    directory = root / "distilbert"
    config = DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=48
    )
    DistilBertModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"bert": _bert_dir(root, tokenizer=True), "distilbert": _distilbert_dir(root)}


def test_bert_signature_comes_from_forward_tokenizer_and_config(hf_dirs):
    spec = build_model(f"hf:{hf_dirs['bert']}", config={"task": "sequence-classification"})
    names = [s.name for s in spec.signature.inputs]
    assert names == ["input_ids", "attention_mask", "token_type_ids"]
    ids, mask, types = spec.signature.inputs
    assert (ids.kind, ids.low, ids.high) == ("ids", 0, VOCAB)
    assert mask.kind == "mask"
    assert (types.kind, types.high) == ("ids", 2)
    assert spec.signature.dims["seq"].max == 64
    assert [(o.name, o.shape) for o in spec.signature.outputs] == [("logits", ("batch", 3))]
    assert spec.reference()["config"] == {"task": "sequence-classification"}


def test_distilbert_takes_no_token_type_ids_and_outputs_hidden_states(hf_dirs):
    spec = build_model(f"hf:{hf_dirs['distilbert']}")
    assert [s.name for s in spec.signature.inputs] == ["input_ids", "attention_mask"]
    assert spec.signature.outputs[0].name == "last_hidden_state"
    assert spec.signature.outputs[0].shape == ("batch", "seq", 32)
    assert spec.signature.dims["seq"].max == 48


@pytest.mark.slow
def test_hf_export_passes_the_check_and_eager_rebuilds_from_the_directory(hf_dirs, tmp_path):
    from transformers import DistilBertModel

    spec = build_model(f"hf:{hf_dirs['distilbert']}")
    out = tmp_path / "art"
    result = export(spec, out, ExportOptions(formats=("onnx",), dims={}))
    assert result.passed
    report = result.manifest.check["onnx"]
    assert report["passed"] and max(o["max_abs"] for o in report["outputs"]) <= 1e-4
    manifest = read_manifest(out)
    assert manifest.model["name"] == f"hf:{hf_dirs['distilbert'].resolve()}"
    # transformers' own forward against the artifact, at a shape the check did not use
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (3, 17)).astype(np.int64)
    mask = np.ones((3, 17), np.int64)
    mask[1, 9:] = 0
    model = DistilBertModel.from_pretrained(hf_dirs["distilbert"], local_files_only=True).eval()
    import torch

    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))[0].numpy()
    with load(out, "onnx") as engine:
        got = engine.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    assert got.shape == (3, 17, 32)
    assert float(np.abs(got - want).max()) <= 1e-4
    with load(out, "eager") as eager:  # no --trust-model-code needed: only transformers' classes run
        again = eager.run({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
    assert float(np.abs(again - want).max()) <= 1e-5


@pytest.mark.slow
def test_cli_exports_an_hf_directory_with_its_task(hf_dirs, tmp_path):
    out = tmp_path / "cli-art"
    result = CliRunner().invoke(
        cli, ["export", f"hf:{hf_dirs['bert']}", "--task", "sequence-classification", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert f"artifact: {out} (passed)" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in manifest["signature"]["outputs"]] == ["logits"]
    assert manifest["model"]["config"] == {"task": "sequence-classification"}


def test_remote_code_configs_are_refused(hf_dirs, tmp_path):
    directory = tmp_path / "remote"
    directory.mkdir()
    config = json.loads((hf_dirs["distilbert"] / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="trust_remote_code"):
        build_model(f"hf:{directory}")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_missing_directory_unknown_task_and_pickled_weights_are_usage_errors(hf_dirs, tmp_path):
    with pytest.raises(UsageError, match="expected a local directory"):
        build_model(f"hf:{tmp_path / 'nothing'}")
    with pytest.raises(UsageError, match="--task: expected one of"):
        build_model(f"hf:{hf_dirs['distilbert']}", config={"task": "translation"})
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_dirs["distilbert"] / "config.json").read_text())
    marker = tmp_path / "pwned"
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))  # runs code if unpickled
    with pytest.raises(UsageError, match="safetensors"):
        build_model(f"hf:{pickled}")
    assert not marker.exists(), "the pickled weights were unpickled"


def test_task_option_is_refused_for_builtin_models():
    result = CliRunner().invoke(cli, ["export", "mlp", "--task", "masked-lm"])
    assert result.exit_code == 2
    assert "--task applies to hf:DIR models" in result.output


def test_the_command_lines_tasks_are_the_models_tasks():
    from tk.models.hf import TASKS
    from tk.registries import HF_TASKS

    assert tuple(TASKS) == HF_TASKS


def test_estimated_bytes_match_the_built_model(tmp_path):
    from itertools import chain

    from transformers import BertConfig, BertModel

    from tk.models.hf import estimated_bytes

    directory = tmp_path / "bert5"
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=64
    )
    model = BertModel(config)
    model.save_pretrained(directory)
    real = sum(t.numel() * t.element_size() for t in chain(model.parameters(), model.buffers()))
    assert estimated_bytes(directory, "feature-extraction") == real  # 5 layers: extrapolated from 1 and 2


def test_a_config_asking_for_2000_layers_is_refused_before_allocating(hf_dirs, tmp_path):
    directory = tmp_path / "deep"
    directory.mkdir()
    config = json.loads((hf_dirs["bert"] / "config.json").read_text())
    config.update(num_hidden_layers=2000, hidden_size=768, num_attention_heads=12, intermediate_size=3072)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes((hf_dirs["bert"] / "model.safetensors").read_bytes())
    result = CliRunner().invoke(cli, ["--max-memory", "1G", "export", f"hf:{directory}", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)  # a TkError, not a crash
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1, result.stderr
    # 2,000 BERT-base layers hold about 14.2e9 float32 parameters: 52.8 GiB
    assert f"hf:{directory.resolve()}" in lines[0] and "52.8 GiB, over tk's memory budget of 1.0 GiB" in lines[0]
    assert not (tmp_path / "o").exists()
