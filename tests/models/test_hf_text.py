"""Texts as inputs of hf:DIR models: tokenized by the directory's tokenizer for tk optimize --data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from tests.models.test_hf import _bert_dir
from tk.cli import cli
from tk.errors import UsageError
from tk.models import ModelSpec, build_model
from tk.models.hf_text import read_text_samples

TEXTS = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9 w10", "w11 w12"]


def _named(spec: ModelSpec) -> tuple[str, list[str]]:
    return spec.name, [s.name for s in spec.signature.inputs]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bert_dir(tmp_path_factory.mktemp("hf-text"), tokenizer=True)


def test_texts_are_tokenized_by_the_directory_tokenizer_padded_to_the_longest(bert: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS[:2]) + "\n\n" + "\n".join(TEXTS[2:]) + "\n")  # the blank line is skipped
    spec = build_model(f"hf:{bert}")
    arrays, labels = read_text_samples(path, *_named(spec), min_seq=1, max_seq=64)
    assert labels is None
    assert list(arrays) == ["input_ids", "attention_mask", "token_type_ids"]
    want = AutoTokenizer.from_pretrained(bert)(TEXTS, padding="longest", return_tensors="np")
    assert arrays["input_ids"].shape == (4, 8)  # [CLS] + 6 words + [SEP]
    for name, array in arrays.items():
        assert array.dtype == np.int64
        np.testing.assert_array_equal(array, want[name])
    assert arrays["attention_mask"].sum(axis=1).tolist() == [5, 3, 8, 4]


def test_texts_are_truncated_at_the_maximum_and_padded_to_the_minimum(bert: Path, tmp_path: Path) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    spec = build_model(f"hf:{bert}")
    short, _ = read_text_samples(path, *_named(spec), min_seq=1, max_seq=5)
    assert short["input_ids"].shape == (4, 5) and short["input_ids"][2, -1] == 3  # [SEP] kept at the cut
    long, _ = read_text_samples(path, *_named(spec), min_seq=12, max_seq=64)
    assert long["input_ids"].shape == (4, 12)
    assert long["attention_mask"][:, 8:].sum() == 0 and long["input_ids"][:, 8:].sum() == 0  # [PAD] is id 0


def test_jsonl_labels_come_back_with_their_texts(bert: Path, tmp_path: Path) -> None:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(TEXTS)))
    arrays, labels = read_text_samples(path, *_named(build_model(f"hf:{bert}")), min_seq=1, max_seq=64)
    assert labels.tolist() == [0, 1, 2, 0] and arrays["input_ids"].shape[0] == 4


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"text": "w1", "label": 1}\n{"text": "w2"}\n', "on every line or on none, found it on 1 of 2"),
        ('{"text": "w1"}\nnot json\n', "texts.jsonl:2: expected a JSON object per line"),
        ('{"words": "w1"}\n', 'texts.jsonl:1: expected an object with a "text" string'),
        ('{"text": "w1", "label": -1}\n', "expected 'label' to be a class index"),
        ("\n\n", "expected texts, one per line; found none"),
    ],
)
def test_a_bad_jsonl_file_is_one_line_naming_it(bert: Path, tmp_path: Path, body: str, expected: str) -> None:
    path = tmp_path / "texts.jsonl"
    path.write_text(body)
    with pytest.raises(UsageError, match=r"texts\.jsonl") as info:
        read_text_samples(path, *_named(build_model(f"hf:{bert}")), min_seq=1, max_seq=64)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_texts_for_a_model_without_a_tokenizer_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("hello\n")
    with pytest.raises(UsageError, match="a text file needs an hf:DIR model with a tokenizer"):
        read_text_samples(path, *_named(build_model("transformer", size="tiny")), min_seq=1, max_seq=16)
    path.write_bytes(b"\xff\xfe bad\n")
    bert = _bert_dir(tmp_path, tokenizer=True)
    with pytest.raises(UsageError, match="expected UTF-8 text"):
        read_text_samples(path, *_named(build_model(f"hf:{bert}")), min_seq=1, max_seq=16)


@pytest.mark.slow
def test_optimize_judges_and_calibrates_on_texts_with_labels(bert: Path, tmp_path: Path) -> None:
    path = tmp_path / "texts.jsonl"
    lines = [
        {"text": " ".join(f"w{(i * 7 + j) % 90 + 1}" for j in range(3 + i % 9)), "label": i % 3} for i in range(16)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli,
        ["optimize", f"hf:{bert}", "--task", "sequence-classification", "--data", str(path),
         "--candidates", "onnx fp32", "--accuracy", "top1>=0", "--batch", "1:4:4", "--seq", "4:16:16",
         "--seconds", "0.05", "--no-peaks", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "on 8 texts.jsonl's held-out samples" in result.output and "judged on synthetic" not in result.output
    record = json.loads((out / "optimize.json").read_text())
    assert record["data"] == str(path) and record["held_out_samples"] == 8
    (winner,) = [r for r in record["candidates"] if r["winner"]]
    # top1 against the labels of the 8 held-out texts: an accuracy of an untrained model, a multiple of 12.5%
    assert 0 <= winner["accuracy"]["top1"] <= 100 and (winner["accuracy"]["top1"] / 12.5) % 1 == 0


def test_export_calibrates_on_texts_tokenized_like_optimize_data(bert: Path, tmp_path: Path) -> None:
    from tk.export import ExportOptions
    from tk.workflows.export import calibration_file

    path = tmp_path / "calibrate.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    spec = build_model(f"hf:{bert}")
    arrays = calibration_file(spec, ExportOptions(precision="int8", calibrate=str(path)))
    want, _ = read_text_samples(path, *_named(spec), min_seq=1, max_seq=64)
    assert list(arrays) == list(want)
    for name in want:
        np.testing.assert_array_equal(arrays[name], want[name])


def test_export_of_a_model_without_a_tokenizer_refuses_texts_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "calibrate.txt"
    path.write_text("hello\n")
    result = CliRunner().invoke(
        cli,
        ["export", "transformer", "--size", "tiny", "--format", "onnx", "--precision", "int8",
         "--calibrate", str(path), "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code != 0
    assert "a text file needs an hf:DIR model with a tokenizer" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_check_and_infer_read_texts_for_an_hf_artifact(bert: Path, tmp_path: Path) -> None:
    from transformers import BertModel

    art, texts = tmp_path / "art", tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["export", f"hf:{bert}", "--format", "onnx", "--batch", "1:4:8", "--out", str(art)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["check", str(art), "--engine", "onnx", "--inputs", str(texts)])
    assert result.exit_code == 0, result.output
    assert "parity passed for onnx" in result.output and "last_hidden_state" in result.output
    out = tmp_path / "out.npz"
    result = runner.invoke(cli, ["infer", str(art), "--engine", "onnx", "--inputs", str(texts), "--out", str(out)])
    assert result.exit_code == 0, result.output
    got = np.load(out)["last_hidden_state"]
    feeds, _ = read_text_samples(texts, *_named(build_model(f"hf:{bert}")), min_seq=1, max_seq=64)
    import torch

    model = BertModel.from_pretrained(bert, local_files_only=True).eval()
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    assert got.shape == want.shape == (4, 8, 32)
    assert float(np.abs(got - want).max()) <= 1e-4
    result = runner.invoke(cli, ["infer", str(art), "--inputs", str(tmp_path / "missing.txt"), "--out", str(out)])
    assert result.exit_code != 0 and "missing.txt: no such file" in result.output
