"""Reading input files: what is accepted, what is refused, and that nothing is ever unpickled."""

from __future__ import annotations

import numpy as np
import pytest

from tk.errors import InputError, UsageError
from tk.models import build_model
from tk.runtime.inputs import random_inputs, read_inputs
from tk.spec import Dim, TensorSpec, count_nonfinite

VOCAB = 1000  # transformer tiny
SEQ = 12


@pytest.fixture(scope="module")
def transformer():
    return build_model("transformer", size="tiny").signature


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", size="tiny").signature


def token_arrays(samples: int = 5, seq: int = SEQ) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, seq + 1, samples)
    mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    return {"input_ids": rng.integers(0, VOCAB, (samples, seq)) * mask, "attention_mask": mask}


def test_npz_with_every_input_is_read(tmp_path, transformer):
    arrays = token_arrays()
    np.savez(tmp_path / "in.npz", **arrays)
    got = read_inputs(tmp_path / "in.npz", transformer.inputs)
    assert list(got) == ["input_ids", "attention_mask"]
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name], value)
        assert got[name].dtype == np.int64


def test_narrower_integers_are_widened(tmp_path, transformer):
    arrays = {k: v.astype(np.int32) for k, v in token_arrays().items()}
    arrays["attention_mask"] = arrays["attention_mask"].astype(bool)
    np.savez(tmp_path / "in.npz", **arrays)
    got = read_inputs(tmp_path / "in.npz", transformer.inputs)
    assert {v.dtype for v in got.values()} == {np.dtype(np.int64)}
    np.testing.assert_array_equal(got["input_ids"], arrays["input_ids"])


def test_npy_is_memory_mapped(tmp_path, mlp):
    x = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    got = read_inputs(tmp_path / "x.npy", mlp.inputs)
    assert isinstance(got["x"], np.memmap)
    np.testing.assert_array_equal(got["x"], x)


def test_directory_of_npy_files_is_memory_mapped(tmp_path, transformer):
    arrays = token_arrays()
    for name, value in arrays.items():
        np.save(tmp_path / f"{name}.npy", value)
    got = read_inputs(tmp_path, transformer.inputs)
    assert all(isinstance(v, np.memmap) for v in got.values())
    np.testing.assert_array_equal(got["attention_mask"], arrays["attention_mask"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {"input_ids": a["input_ids"]}, r"missing \['attention_mask'\]"),
        (lambda a: a | {"token_type_ids": a["input_ids"]}, r"unexpected \['token_type_ids'\]"),
        (lambda a: a | {"input_ids": a["input_ids"].astype(np.float32)}, "expected dtype int64.*found float32"),
        (lambda a: a | {"input_ids": a["input_ids"].astype(np.uint64)}, "expected dtype int64.*found uint64"),
        (lambda a: a | {"input_ids": a["input_ids"][..., None]}, r"expected rank 2 \(batch, seq\)"),
        (lambda a: a | {"attention_mask": a["attention_mask"][:4]}, "sample counts differ.*5.*4"),
        (lambda a: a | {"attention_mask": a["attention_mask"][:, :6]}, "dimension 'seq' differ"),
    ],
    ids=["missing", "extra", "float-for-int", "uint64", "rank", "samples", "seq"],
)
def test_npz_that_does_not_fit_is_refused(tmp_path, transformer, change, message):
    np.savez(tmp_path / "in.npz", **change(token_arrays()))
    with pytest.raises(InputError, match=message):
        read_inputs(tmp_path / "in.npz", transformer.inputs)


def test_float64_for_float32_and_wrong_fixed_size_are_refused(tmp_path, mlp):
    np.save(tmp_path / "f64.npy", np.zeros((3, 8)))
    with pytest.raises(InputError, match=r"expected dtype float32.*found float64"):
        read_inputs(tmp_path / "f64.npy", mlp.inputs)
    np.save(tmp_path / "wide.npy", np.zeros((3, 9), np.float32))
    with pytest.raises(InputError, match=r"expected size 8 on axis 1 \(batch, 8\).*\(3, 9\)"):
        read_inputs(tmp_path / "wide.npy", mlp.inputs)


def test_pickled_object_array_is_refused_without_unpickling(tmp_path, transformer):
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling would create the marker file

    objects = np.empty(5, dtype=object)
    objects[:] = [Trap() for _ in range(5)]
    np.savez(tmp_path / "in.npz", input_ids=objects, attention_mask=token_arrays()["attention_mask"])
    np.save(tmp_path / "objects.npy", objects, allow_pickle=True)
    with pytest.raises(UsageError, match="'input_ids' holds Python objects"):
        read_inputs(tmp_path / "in.npz", transformer.inputs)
    with pytest.raises(UsageError, match="holds Python objects"):
        read_inputs(tmp_path / "objects.npy", [transformer.inputs[0]])
    assert not marker.exists()


def test_npy_for_a_two_input_model_is_refused(tmp_path, transformer):
    np.save(tmp_path / "ids.npy", token_arrays()["input_ids"])
    with pytest.raises(InputError, match=r"one array, this model takes 2 inputs \(input_ids, attention_mask\)"):
        read_inputs(tmp_path / "ids.npy", transformer.inputs)


def test_truncated_and_foreign_files_are_refused(tmp_path, mlp):
    np.save(tmp_path / "x.npy", np.zeros((100, 8), np.float32))
    data = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="truncated"):
        read_inputs(tmp_path / "cut.npy", mlp.inputs)
    np.savez(tmp_path / "x.npz", x=np.zeros((100, 8), np.float32))
    data = (tmp_path / "x.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="truncated"):
        read_inputs(tmp_path / "cut.npz", mlp.inputs)
    (tmp_path / "x.csv").write_text("1,2,3\n")
    with pytest.raises(UsageError, match=r"expected a NumPy \.npz or \.npy file, found a file starting with"):
        read_inputs(tmp_path / "x.csv", mlp.inputs)
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(UsageError, match="found an empty file"):
        read_inputs(tmp_path / "empty.npy", mlp.inputs)
    with pytest.raises(UsageError, match="no such file"):
        read_inputs(tmp_path / "absent.npz", mlp.inputs)


def test_random_inputs_are_valid(transformer):
    arrays = random_inputs(transformer.inputs, transformer.dims, 20, seed=3, sizes={"seq": 10})
    assert arrays["input_ids"].shape == arrays["attention_mask"].shape == (20, 10)
    assert arrays["input_ids"].min() >= 0 and arrays["input_ids"].max() < VOCAB
    assert set(np.unique(arrays["attention_mask"])) <= {0, 1}
    assert arrays["attention_mask"].sum(axis=1).min() >= 1
    again = random_inputs(transformer.inputs, transformer.dims, 20, seed=3, sizes={"seq": 10})
    np.testing.assert_array_equal(arrays["input_ids"], again["input_ids"])
    default = random_inputs(transformer.inputs, transformer.dims, 2)
    assert default["input_ids"].shape == (2, transformer.dims["seq"].opt)


def test_random_inputs_need_every_size():
    specs = [TensorSpec("x", "float32", ("batch", "width"))]
    with pytest.raises(UsageError, match=r"no size for dimension.*width"):
        random_inputs(specs, {"batch": Dim("batch", 1, 4, 8)}, 3)
    assert random_inputs(specs, {}, 3, sizes={"width": 5})["x"].shape == (3, 5)


def test_count_nonfinite_counts_floats_only():
    x = np.zeros((4, 3), np.float32)
    x[0, 0], x[1, 2], x[3, 1] = np.nan, np.inf, -np.inf
    assert count_nonfinite({"x": x, "ids": np.zeros((4, 3), np.int64)}) == {"x": 3}
    assert count_nonfinite({"empty": np.zeros((0, 3), np.float32)}) == {"empty": 0}
