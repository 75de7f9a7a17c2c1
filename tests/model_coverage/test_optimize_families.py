"""``tk optimize`` on one tiny model of each task family (issue 49's goal), judged on the task's own inputs:
a ``.npz`` of pixel_values, input_values, a decoder step's inputs, or token ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests.model_coverage.catalog import VOCAB
from tk.cli import cli
from tk.manifest import read_manifest

SAMPLES = 8  # half judges (fp32 calibrates nothing)
RNG_SEED = 49


def _ids(rng: np.random.Generator, seq: int) -> np.ndarray:
    return rng.integers(3, VOCAB, (SAMPLES, seq)).astype(np.int64)


def _mask(seq: int) -> np.ndarray:
    mask = np.ones((SAMPLES, seq), np.int64)
    mask[1::2, seq // 2 :] = 0  # every other sample padded to half its length
    return mask


def _family_data(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Each family's samples, named as its model's inputs."""
    floats = rng.standard_normal
    return {
        "vision": {"pixel_values": floats((SAMPLES, 3, 32, 32)).astype(np.float32)},
        "audio": {"input_values": floats((SAMPLES, 1600)).astype(np.float32)},
        "seq2seq": {
            "decoder_input_ids": _ids(rng, 8),
            "encoder_hidden_states": floats((SAMPLES, 8, 32)).astype(np.float32),
            "attention_mask": _mask(8),
        },
        "causal-lm": {"input_ids": _ids(rng, 8), "attention_mask": _mask(8)},
        "text": {
            "input_ids": _ids(rng, 8),
            "attention_mask": _mask(8),
            "token_type_ids": np.zeros((SAMPLES, 8), np.int64),
            "labels": rng.integers(0, 3, SAMPLES),  # a labels array: top1 is an accuracy
        },
    }


# family -> (hf directory, --task, the flags of its ranges beyond --batch)
FAMILIES = {
    "vision": ("vit", "image-classification", ()),
    "audio": ("wav2vec2", "feature-extraction", ("--dim", "samples=400:1600:3200")),
    "seq2seq": ("bart", "text2text-decoder", ("--seq", "1:8:16", "--dim", "decoder_seq=1:8:16")),
    "causal-lm": ("llama", "causal-lm", ("--seq", "1:8:16")),
    "text": ("bert", "sequence-classification", ("--seq", "1:8:16")),
}


@pytest.mark.slow
@pytest.mark.fits(seconds=25)  # 12-18 s a family on the 2-core AMX Xeon
@pytest.mark.parametrize("family", list(FAMILIES))
def test_optimize_finds_a_checked_fp32_artifact_on_the_familys_own_inputs(
    family: str, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    directory, task, ranges = FAMILIES[family]
    data = tmp_path / f"{family}.npz"
    np.savez(data, **_family_data(np.random.default_rng(RNG_SEED))[family])
    out = tmp_path / "best"
    args = ["optimize", f"hf:{hf_dirs[directory]}", "--task", task, "--formats", "onnx,torch", "--precisions", "fp32"]
    args += ["--seconds", "0.2", "--batch", "1:2:4", *ranges, "--data", str(data), "--no-peaks", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    record = json.loads((out / "optimize.json").read_text())
    assert record["data"] == str(data) and record["held_out_samples"] >= SAMPLES // 2
    rows = {row["candidate"]: row for row in record["candidates"]}
    assert {"onnx fp32", "torch fp32"} <= set(rows), sorted(rows)
    for name in ("onnx fp32", "torch fp32"):
        assert rows[name]["status"] == "passed", rows[name]
        sqnr = rows[name]["accuracy"]["sqnr"]  # on the held-out samples of --data
        assert sqnr == "inf" or sqnr >= 35, rows[name]
    manifest = read_manifest(out)
    assert manifest.status == "passed" and manifest.optimize["recommended"]["precision"] == "fp32"
    assert manifest.optimize["recommended"]["engine"] in ("onnx", "torch")
