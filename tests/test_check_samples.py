"""The user's samples across the shape range: fitted to each shape, run by the export check and the int8
judges, and written by ``tk train --samples``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner

from tk.cli import cli
from tk.export import ExportOptions
from tk.export.context import ExportContext
from tk.export.int8.calibration import JUDGE_SEEDS, calibration_feeds, judge_feeds, split_calibration_samples
from tk.models import build_model
from tk.spec import Dim, TensorSpec, fitted_samples, shapes_to_check
from tk.workflows.export import export


def token_samples(count: int = 10, seq: int = 12, *, vocab: int = 1000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, seq + 1, count)
    mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(1, vocab, (count, seq)) * mask, "attention_mask": mask}


def test_samples_are_cut_or_padded_along_a_masked_dimension_and_taken_in_turn() -> None:
    inputs = build_model("transformer", size="tiny").signature.inputs
    samples = token_samples()
    longer = fitted_samples(samples, inputs, {"batch": 4, "seq": 20}, seed=2)
    assert longer is not None and longer["input_ids"].shape == (4, 20)
    taken = [8, 9, 0, 1]  # seed 2 starts at sample 2 * 4, wrapping around the 10 samples
    np.testing.assert_array_equal(longer["input_ids"][:, :12], samples["input_ids"][taken])
    assert not longer["input_ids"][:, 12:].any() and not longer["attention_mask"][:, 12:].any()  # padding, unattended
    shorter = fitted_samples(samples, inputs, {"batch": 3, "seq": 5}, seed=0)
    assert shorter is not None
    np.testing.assert_array_equal(shorter["attention_mask"], samples["attention_mask"][:3, :5])
    assert shorter["input_ids"].dtype == np.int64 and shorter["input_ids"].flags.c_contiguous


def test_samples_that_cannot_fit_a_shape_give_none() -> None:
    image = [TensorSpec("pixels", "float32", ("batch", 3, "height", 8))]  # no mask spans height: never resized
    pixels = {"pixels": np.ones((2, 3, 8, 8), np.float32)}
    assert fitted_samples(pixels, image, {"batch": 2, "height": 16}) is None
    same = fitted_samples(pixels, image, {"batch": 5, "height": 8})
    assert same is not None and same["pixels"].shape == (5, 3, 8, 8)
    inputs = build_model("transformer", size="tiny").signature.inputs
    assert fitted_samples({"input_ids": token_samples()["input_ids"]}, inputs, {"batch": 2, "seq": 12}) is None


def test_padding_a_sample_leaves_the_models_output_unchanged() -> None:
    spec = build_model("transformer", size="tiny")
    spec.module.eval()
    samples = token_samples(count=6)
    padded = fitted_samples(samples, spec.signature.inputs, {"batch": 6, "seq": 40})
    assert padded is not None
    with torch.no_grad():
        as_is = spec.module(*(torch.from_numpy(samples[n]) for n in ("input_ids", "attention_mask")))
        longer = spec.module(*(torch.from_numpy(padded[n]) for n in ("input_ids", "attention_mask")))
    assert float((as_is - longer).abs().max()) < 1e-5


def test_the_export_check_runs_the_samples_at_every_shape(tmp_path: Path) -> None:
    spec = build_model("transformer", size="tiny")
    samples = token_samples(count=40)
    result = export(spec, tmp_path / "art", ExportOptions(check_data=samples))
    report = result.manifest.check["onnx"]
    assert report["passed"] and report["inputs"] == "samples"
    assert report["shapes"] == shapes_to_check(result.manifest.signature.dims)
    plain = export(build_model("transformer", size="tiny"), tmp_path / "plain", ExportOptions())
    assert plain.manifest.check["onnx"]["inputs"] == "random"


def _context(spec, check_data, calibration_data=None) -> ExportContext:
    dims = {"batch": Dim("batch", 1, 8, 16), "seq": Dim("seq", 1, 12, 24)}
    options = ExportOptions(check_data=check_data, calibration_data=calibration_data)
    return ExportContext(spec, spec.module, dims, options, Path("."), spec.example_inputs())


def test_the_int8_judges_run_as_many_distinct_sample_batches_as_the_samples_fill() -> None:
    spec = build_model("transformer", size="tiny")
    samples = token_samples(count=20)
    ctx = _context(spec, samples)
    shapes = shapes_to_check(ctx.dims)
    feeds = judge_feeds(ctx)
    batches = [s["batch"] for s in shapes]
    distinct = [min(JUDGE_SEEDS, -(-20 // b)) for b in batches]  # 20 samples: 8 batches of 1, 3 of 8, 2 of 16...
    assert len(feeds) == sum(distinct)
    rows = [tuple(row) for row in samples["input_ids"]]
    for batch in feeds:  # each judged row is a sample, cut or padded with zeros
        for row in batch["input_ids"]:
            seq = min(len(row), 12)
            assert tuple(row[:seq]) in {r[:seq] for r in rows} and not row[12:].any()
    random = judge_feeds(_context(spec, None))
    assert len(random) == JUDGE_SEEDS * len(shapes)
    # where the calibration samples are the user's too, the search judges every other one of them (the
    # check's stay unseen) and the ranges are fitted to the rest
    calibration = token_samples(count=40, vocab=7)
    ctx = _context(spec, samples, calibration)
    judged = judge_feeds(ctx)
    assert len(judged) == sum(distinct) and all(int(b["input_ids"].max()) < 7 for b in judged)
    aside = {tuple(r) for r in calibration["input_ids"][1::2]}
    assert all(tuple(row[:12]) in aside for b in judged for row in b["input_ids"] if len(row) >= 12)
    fitted = calibration_feeds(ctx)
    rows = np.concatenate([b["input_ids"] for b in fitted])
    np.testing.assert_array_equal(rows, calibration["input_ids"][0::2])  # 20 samples: batches of 8, 8, 4
    # a static batch of 32 that half of 40 samples cannot fill: all calibrate, and the search judges them
    static = ExportContext(spec, spec.module, {**ctx.dims, "batch": Dim("batch", 32, 32, 32)}, ctx.options, Path("."),
                           spec.example_inputs())  # fmt: skip
    assert split_calibration_samples(static)[1] is None
    assert [b["input_ids"].shape[0] for b in calibration_feeds(static)] == [32]
    # without the user's check samples the search judges random inputs, as the check does: all calibrate
    alone = _context(spec, None, calibration)
    assert split_calibration_samples(alone)[1] is None and len(judge_feeds(alone)) == JUDGE_SEEDS * len(shapes)


def test_train_writes_held_out_samples_that_optimize_reads_with_labels(tmp_path: Path) -> None:
    from tk.workflows.optimize.data import optimize_data

    out = tmp_path / "tiny.safetensors"
    args = ["train", "transformer", "--size", "tiny", "--steps", "2", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--samples", str(tmp_path / "val.npz"), "--samples-count", "10"])
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "val.npz") as arrays:
        assert sorted(arrays) == ["attention_mask", "input_ids", "labels"]
        assert arrays["input_ids"].shape == (10, 16) and set(arrays["labels"].tolist()) <= {0, 1}
    spec = build_model("transformer", size="tiny")
    data = optimize_data(spec, spec.signature.dims, {"batch": 4, "seq": 16}, tmp_path / "val.npz")
    assert data.held_out["input_ids"].shape == (5, 16) and data.labels is not None and len(data.labels) == 5
    bad = CliRunner().invoke(cli, [*args, "--samples", str(tmp_path / "x.npz"), "--samples-count", "1"])
    assert bad.exit_code == 2 and "expected 2 or more samples, got 1" in bad.output
    assert not (tmp_path / "x.npz").exists()


def test_optimize_checks_on_the_held_out_half_of_data(tmp_path: Path) -> None:
    from tk.accuracy import parse_accuracy
    from tk.workflows.optimize.artifacts import group_dir
    from tk.workflows.optimize.candidates import Candidate
    from tk.workflows.optimize.data import optimize_data
    from tk.workflows.optimize.run import OptimizeOptions, _export_options

    spec = build_model("transformer", size="tiny")
    np.savez(tmp_path / "data.npz", **token_samples(count=8, seq=16))
    dims, sizes = spec.signature.dims, {"batch": 4, "seq": 16}
    accuracy = parse_accuracy(None)
    given = _export_options(
        OptimizeOptions(), accuracy, dims, optimize_data(spec, dims, sizes, tmp_path / "data.npz"), None
    )
    assert given.check_data is not None and given.check_data["input_ids"].shape == (4, 16)
    synthetic = _export_options(OptimizeOptions(), accuracy, dims, optimize_data(spec, dims, sizes, None), None)
    assert synthetic.check_data is None
    fp32 = [Candidate("onnx", "fp32", "onnx")]
    dirs = {group_dir(tmp_path, fp32, o, None, spec, None) for o in (given, synthetic)}
    assert len(dirs) == 2  # the cache never gives an artifact checked on other inputs


def test_export_checks_on_a_samples_file_with_labels(tmp_path: Path) -> None:
    from tk.manifest import read_manifest

    samples = {**token_samples(count=12, seq=16), "labels": np.arange(12) % 2}
    np.savez(tmp_path / "val.npz", **samples)
    args = ["export", "transformer", "--size", "tiny", "--format", "onnx", "--seq", "1:16:32"]
    result = CliRunner().invoke(cli, [*args, "--check-inputs", str(tmp_path / "val.npz"), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    report = read_manifest(tmp_path / "a").check["onnx"]
    assert report["passed"] and report["inputs"] == "samples"
    check = ["check", str(tmp_path / "a"), "--engine", "onnx"]
    on_random = CliRunner().invoke(cli, check)  # says that the export judged on samples, not these
    assert on_random.exit_code == 0 and "note: the export check of onnx ran your samples" in on_random.output
    on_samples = CliRunner().invoke(cli, [*check, "--inputs", str(tmp_path / "val.npz")])  # its labels left out
    assert on_samples.exit_code == 0 and "note:" not in on_samples.output
    assert "of 12 samples" in on_samples.output
    np.savez(tmp_path / "long.npz", **token_samples(count=4, seq=40))  # longer than the --seq maximum
    bad = CliRunner().invoke(cli, [*args, "--check-inputs", str(tmp_path / "long.npz"), "--out", str(tmp_path / "b")])
    assert bad.exit_code != 0 and "seq" in bad.output and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_a_left_padded_sample_is_cut_to_its_tokens_not_its_padding() -> None:
    inputs = build_model("transformer", size="tiny").signature.inputs
    mask = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]], np.int64)
    ids = np.arange(1, 19).reshape(3, 6) * mask
    cut = fitted_samples({"input_ids": ids, "attention_mask": mask}, inputs, {"batch": 3, "seq": 2})
    assert cut is not None
    # left-padded: from its first token; right-padded: from 0; one token at the end: the last 2 positions
    np.testing.assert_array_equal(cut["attention_mask"], [[1, 1], [1, 1], [0, 1]])
    np.testing.assert_array_equal(cut["input_ids"], [[4, 5], [7, 8], [0, 18]])


def test_samples_that_fit_only_some_shapes_are_named_and_warned_of(tmp_path: Path, caplog) -> None:
    from tk.cli.common import build

    # a token model whose second input is not a mask: its seq dimension can be cut or padded by nothing
    spec = build("examples.user_model:scorer", None, ("tokens:int64:4x16:0-500", "tokens_keep:int64:4x16:0-2"))
    rng = np.random.default_rng(0)
    samples = {"tokens": rng.integers(0, 500, (40, 16)), "tokens_keep": np.ones((40, 16), np.int64)}
    with caplog.at_level("WARNING", logger="tk.export"):
        result = export(spec, tmp_path / "a", ExportOptions(check_data=samples))
    report = result.manifest.check["onnx"]
    fitting = [s for s in report["shapes"] if s["seq"] == 16]
    assert report["inputs"].startswith("samples; random at ") and report["inputs"].count("random at") == 5 - len(
        fitting
    )
    assert "your samples fit only some shapes" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tk.export"):
        other = export(spec, tmp_path / "b", ExportOptions(check_data={"tokens": samples["tokens"]}))
    assert other.manifest.check["onnx"]["inputs"] == "random" and "fit no shape of the range" in caplog.text


def test_train_samples_refusals_and_a_task_without_labels(tmp_path: Path) -> None:
    compare = ["train", "transformer", "--size", "tiny", "--steps", "1", "--compare", "--samples", "x.npz"]
    refused = CliRunner().invoke(cli, compare)
    assert refused.exit_code == 2 and "--samples: --compare trains two copies" in refused.output
    out = ["--out", str(tmp_path / "lin.safetensors"), "--samples", str(tmp_path / "lin")]  # any name: an npz archive
    result = CliRunner().invoke(
        cli, ["train", "linear", "--size", "tiny", "--steps", "2", *out, "--samples-count", "6"]
    )
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "lin") as arrays:  # a regression task: inputs only, no labels
        assert list(arrays) == [s.name for s in build_model("linear", size="tiny").signature.inputs]
        assert next(iter(arrays.values())).shape[0] == 6


def test_infer_and_check_leave_a_labels_array_out(tmp_path: Path) -> None:
    samples = {**token_samples(count=6, seq=16), "labels": np.arange(6) % 2}
    np.savez(tmp_path / "val.npz", **samples)
    export(build_model("transformer", size="tiny"), tmp_path / "a", ExportOptions())
    args = ["infer", str(tmp_path / "a"), "--engine", "onnx", "--inputs", str(tmp_path / "val.npz")]
    result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out.npz")])
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "out.npz") as outputs:
        assert outputs["logits"].shape == (6, 2)
