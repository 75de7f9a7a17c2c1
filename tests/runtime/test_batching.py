"""BatchRunner and infer_file: batches give what each sample gives alone, whatever the batching."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tk.errors import InputError, UsageError
from tk.manifest import Manifest
from tk.runtime import load
from tk.runtime.base import Engine
from tk.runtime.batching import BatchRunner, infer_file
from tk.spec import Dim, Signature, TensorSpec

SAMPLES = 37
BATCH = 8
ATOL = 1e-5


@pytest.fixture(scope="module")
def artifacts(exported):
    """transformer tiny (dynamic and static, same weights) and mlp tiny, torch format: the session's exports."""
    return {
        "transformer": exported("transformer", ("torch",)).root,
        "static": exported("transformer", ("torch",), dynamic=False).root,
        "mlp": exported("mlp", ("torch",)).root,
    }


class Recording:
    """An engine wrapper that records the shape of every batch it is given."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inputs, self.outputs, self.dims = engine.inputs, engine.outputs, engine.dims
        self.shapes: list[dict[str, tuple[int, ...]]] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        self.shapes.append({name: value.shape for name, value in feeds.items()})
        return self.engine.run(feeds)


def token_inputs(samples: int, seq: int, *, seed: int = 0, longest: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded token ids and masks of random lengths; the first batch holds short sequences only."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, (longest or seq) + 1, samples)
    lengths[:BATCH] = rng.integers(1, 5, min(BATCH, samples))
    mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(0, 1000, (samples, seq)) * mask, "attention_mask": mask}


def one_by_one(engine: Engine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each sample run alone, at the file's full (padded) length."""
    samples = len(next(iter(inputs.values())))
    runs = [engine.run({k: v[i : i + 1] for k, v in inputs.items()}) for i in range(samples)]
    return {name: np.concatenate([r[name] for r in runs]) for name in runs[0]}


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("engine_name", ["eager", "torch"])
def test_transformer_batches_are_cut_to_the_longest_sequence(artifacts, engine_name):
    inputs = token_inputs(SAMPLES, 24)
    with load(artifacts["transformer"], "eager") as eager, load(artifacts["transformer"], engine_name) as engine:
        recording = Recording(engine)
        got = BatchRunner(recording, BATCH).run(inputs)
        assert_close(got, one_by_one(eager, inputs))
    lengths = inputs["attention_mask"].sum(axis=1)
    expected = [(min(BATCH, SAMPLES - s), int(lengths[s : s + BATCH].max())) for s in range(0, SAMPLES, BATCH)]
    assert [shapes["input_ids"] for shapes in recording.shapes] == expected
    assert expected[0][1] <= 4  # the first batch really was cut


def test_mlp_batches_match_samples_alone_and_report_progress(artifacts):
    x = np.random.default_rng(0).standard_normal((SAMPLES, 8)).astype(np.float32)
    done: list[int] = []
    with load(artifacts["mlp"], "eager") as eager:
        runner = BatchRunner(eager, BATCH)
        got = runner.run({"x": x}, progress=done.append)
        assert_close(got, one_by_one(eager, {"x": x}))
    assert done == [8, 16, 24, 32, 37]
    assert runner.batches == 5


def test_static_batch_is_padded_and_the_padding_stripped(artifacts):
    inputs = token_inputs(SAMPLES, 16)
    with load(artifacts["static"], "torch") as static, load(artifacts["transformer"], "eager") as eager:
        recording = Recording(static)
        runner = BatchRunner(recording)
        assert runner.batch_size == BATCH
        got = runner.run(inputs)
        assert_close(got, one_by_one(eager, inputs))
    assert got["logits"].shape == (SAMPLES, 2)
    assert [s["input_ids"] for s in recording.shapes] == [(BATCH, 16)] * 5  # static seq: never cut
    with pytest.raises(UsageError, match="fixed batch of 8"):
        BatchRunner(static, 4)


def test_batch_size_default_and_range(artifacts):
    with load(artifacts["mlp"], "eager") as eager:
        assert BatchRunner(eager).batch_size == eager.dims["batch"].opt
        with pytest.raises(UsageError, match=r"batch range \[1, 1024\]"):
            BatchRunner(eager, 2000)


def test_long_files_run_when_real_sequences_fit(artifacts):
    with load(artifacts["transformer"], "eager") as eager:
        seq_max = eager.dims["seq"].max
        inputs = token_inputs(SAMPLES, seq_max + 16, longest=20)  # padded past the max, real tokens fit
        got = BatchRunner(eager, BATCH).run(inputs)
        assert_close(got, one_by_one(eager, {k: v[:, :seq_max] for k, v in inputs.items()}))
        inputs["attention_mask"][5, : seq_max + 3] = 1
        with pytest.raises(InputError, match=rf"1 sample\(s\) are longer than .* max of {seq_max} \(sample 5 has"):
            BatchRunner(eager, BATCH).run(inputs)


class Echo(Engine):
    """A fake engine with a per-token output: ``hidden = ids * mask`` (batch, seq), ``count`` = tokens."""

    name = "echo"

    def _load(self) -> None:
        pass

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = (feeds["input_ids"] * feeds["attention_mask"]).float()
        return {"hidden": hidden, "count": feeds["attention_mask"].sum(dim=1, keepdim=True)}


def echo_engine(batch: Dim, seq: Dim) -> Echo:
    signature = Signature(
        inputs=[
            TensorSpec("input_ids", "int64", ("batch", "seq"), kind="ids", low=0, high=1000),
            TensorSpec("attention_mask", "int64", ("batch", "seq"), kind="mask", low=0, high=2),
        ],
        outputs=[TensorSpec("hidden", "float32", ("batch", "seq")), TensorSpec("count", "int64", ("batch", 1))],
        dims={"batch": batch, "seq": seq},
    )
    return Echo("/nonexistent", Manifest(model={}, signature=signature, precision="fp32", device="cpu"))


def test_per_token_outputs_are_padded_back_to_the_file_length():
    inputs = token_inputs(SAMPLES, 24)
    inputs = {k: v.astype(np.int32) for k, v in inputs.items()}  # widened batch by batch
    engine = echo_engine(Dim("batch", 2, 4, 6), Dim("seq", 1, 16, 32))
    got = BatchRunner(engine, 5).run(inputs)
    assert got["hidden"].shape == (SAMPLES, 24)
    np.testing.assert_array_equal(got["hidden"], inputs["input_ids"] * inputs["attention_mask"])
    np.testing.assert_array_equal(got["count"][:, 0], inputs["attention_mask"].sum(axis=1))


def test_a_batch_below_the_minimum_is_padded():
    inputs = token_inputs(3, 24)
    recording = Recording(echo_engine(Dim("batch", 4, 4, 8), Dim("seq", 1, 16, 32)))
    got = BatchRunner(recording).run(inputs)
    assert recording.shapes[0]["input_ids"][0] == 4
    np.testing.assert_array_equal(got["count"][:, 0], inputs["attention_mask"].sum(axis=1))


def test_infer_file_writes_one_array_per_output(artifacts, tmp_path):
    inputs = token_inputs(SAMPLES, 24)
    inputs["attention_mask"] = inputs["attention_mask"].astype(np.int32)
    np.savez(tmp_path / "in.npz", **inputs)
    calls: list[tuple[int, int]] = []
    with load(artifacts["transformer"], "torch") as engine:
        result = infer_file(
            engine,
            tmp_path / "out" / "logits.npz",
            inputs=tmp_path / "in.npz",
            batch_size=16,
            progress=lambda d, t: calls.append((d, t)),
        )
    assert (result.samples, result.batches, result.nonfinite_outputs) == (SAMPLES, 3, {"logits": 0})
    assert calls == [(16, SAMPLES), (32, SAMPLES), (SAMPLES, SAMPLES)]
    with np.load(result.out) as written:
        assert written.files == ["logits"]
        assert written["logits"].shape == (SAMPLES, 2) and written["logits"].dtype == np.float32
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["logits.npz"]  # no temporary file left


def test_infer_file_random_samples_and_nonfinite_counts(artifacts, tmp_path):
    with load(artifacts["mlp"], "eager") as engine:
        result = infer_file(engine, tmp_path / "random.npz", random=10, seed=1)
        assert (result.samples, result.batches, result.nonfinite_inputs) == (10, 2, {"x": 0})
        with np.load(result.out) as written:
            assert written["logits"].shape == (10, 4)
        x = np.ones((4, 8), np.float32)
        x[1, 3] = np.nan
        np.save(tmp_path / "x.npy", x)
        result = infer_file(engine, tmp_path / "nan.npz", inputs=tmp_path / "x.npy")
        assert result.nonfinite_inputs == {"x": 1}
        assert result.nonfinite_outputs == {"logits": 4}  # a NaN feature spoils that sample's every logit
        with pytest.raises(UsageError, match="exactly one of"):
            infer_file(engine, tmp_path / "o.npz", inputs=tmp_path / "x.npy", random=3)
        with pytest.raises(UsageError, match="exactly one of"):
            infer_file(engine, tmp_path / "o.npz")
        with pytest.raises(UsageError, match=r"ending in \.npz"):
            infer_file(engine, tmp_path / "o.npy", random=3)
