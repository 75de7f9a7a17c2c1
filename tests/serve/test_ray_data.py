"""``tk infer --ray``: 2 Ray Data actors over 10 shards write the same output bytes as ``tk infer``."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("ray.data", reason="needs Ray Data (pip install 'tk[serve]')")

from tk.cli import cli
from tk.spec import random_feeds

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_instance():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def write_shards(signature, root):
    """10 shards of 3-12 samples with sequences of 8-24 tokens: 8 .npz, a directory of .npy, a .parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    same_as_npz = {}
    for i in range(10):
        feeds = random_feeds(signature.inputs, {"batch": 3 + i, "seq": 8 + (i % 3) * 8}, seed=i)
        if i == 8:
            (root / "shard08").mkdir()
            for name, array in feeds.items():
                np.save(root / "shard08" / f"{name}.npy", array)
        elif i == 9:
            table = pa.table({name: list(array) for name, array in feeds.items()})
            pq.write_table(table, root / "shard09.parquet")
            same_as_npz["shard09"] = feeds
        else:
            np.savez(root / f"shard{i:02d}.npz", **feeds)
    return same_as_npz


def test_ray_outputs_are_byte_identical_to_tk_infer(ray_instance, exported, tmp_path):
    art = exported("transformer", ("onnx",))
    shards = tmp_path / "shards"
    parquet_twins = write_shards(art.manifest.signature, shards)
    result = invoke(
        "infer", art.root, "--ray", "--actors", 2, "--inputs", shards, "--out", tmp_path / "ray", "--threads", 1
    )
    assert result.exit_code == 0, result.output
    assert "in 10 shards on 2 actor(s)" in result.stdout
    for twin, feeds in parquet_twins.items():  # tk infer reads no Parquet: the same arrays as .npz
        np.savez(tmp_path / f"{twin}.npz", **feeds)
    total = 0
    for i in range(10):
        name = f"shard{i:02d}"
        source = tmp_path / f"{name}.npz" if name in parquet_twins else next(shards.glob(f"{name}*"))
        single = tmp_path / "single" / f"{name}.npz"
        single.parent.mkdir(exist_ok=True)
        result = invoke("infer", art.root, "--inputs", source, "--out", single, "--threads", 1)
        assert result.exit_code == 0, result.output
        with np.load(single) as want, np.load(tmp_path / "ray" / f"{name}.npz") as got:
            assert sorted(got.files) == sorted(want.files) == ["logits"]
            assert got["logits"].shape == want["logits"].shape == (3 + i, 2)
            assert got["logits"].dtype == want["logits"].dtype
            assert got["logits"].tobytes() == want["logits"].tobytes()
            total += len(got["logits"])
    assert total == sum(3 + i for i in range(10))


def test_a_bad_shard_is_one_line(ray_instance, exported, tmp_path):
    art = exported("transformer", ("onnx",))
    shards = tmp_path / "shards"
    shards.mkdir()
    feeds = random_feeds(art.manifest.signature.inputs, {"batch": 2, "seq": 8})
    feeds["input_ids"][1, 3] = 5000
    np.savez(shards / "bad.npz", **feeds)
    result = CliRunner().invoke(
        cli, ["infer", str(art.root), "--ray", "--inputs", str(shards), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "token id 5000 is outside" in errors[0], result.stderr
    assert not (tmp_path / "o" / "bad.npz").exists()


def test_ray_needs_a_directory_and_a_named_engine(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    result = CliRunner().invoke(
        cli, ["infer", str(art.root), "--ray", "--inputs", str(tmp_path), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "found no .npz, .npy or .parquet shard" in result.stderr
    result = CliRunner().invoke(
        cli,
        ["infer", str(art.root), "--ray", "--engine", "auto", "--inputs", str(tmp_path), "--out", str(tmp_path / "o")],
    )
    assert result.exit_code == 2 and "name an engine" in result.stderr


def test_parquet_columns_become_arrays_and_ragged_or_null_rows_are_refused(exported, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tk.errors import InputError
    from tk.serve.data import read_parquet

    art = exported("transformer", ("onnx",))
    specs = art.manifest.signature.inputs
    feeds = random_feeds(specs, {"batch": 5, "seq": 12}, seed=3)
    for name, table in {
        "lists": pa.table({n: list(a) for n, a in feeds.items()}),
        "fixed": pa.table({n: pa.FixedSizeListArray.from_arrays(a.reshape(-1), 12) for n, a in feeds.items()}),
    }.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
        arrays = read_parquet(tmp_path / f"{name}.parquet", specs)
        for n, a in feeds.items():
            assert arrays[n].dtype == a.dtype and arrays[n].shape == (5, 12)
            np.testing.assert_array_equal(arrays[n], a)
    ragged = {n: [list(row[: 12 - i]) for i, row in enumerate(a)] for n, a in feeds.items()}
    pq.write_table(pa.table(ragged), tmp_path / "ragged.parquet")
    with pytest.raises(InputError, match="expected rows of one length, found lengths 8 to 12"):
        read_parquet(tmp_path / "ragged.parquet", specs)
    nulls = {n: [list(row) if i else None for i, row in enumerate(a)] for n, a in feeds.items()}
    pq.write_table(pa.table(nulls), tmp_path / "nulls.parquet")
    with pytest.raises(InputError, match="1 missing"):
        read_parquet(tmp_path / "nulls.parquet", specs)


def _bomb(path):
    """A Parquet file of a few KB whose 2,000 rows of 4,096 equal token ids decode to 64 MiB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = np.ones(4096, np.int64)
    ids = pa.FixedSizeListArray.from_arrays(pa.array(np.tile(row, 2000)), 4096)
    pq.write_table(pa.table({"input_ids": ids, "attention_mask": ids}), path)
    return path


def test_parquet_decoded_size_comes_from_the_footer(exported, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tk.errors import ResourceError
    from tk.serve.data import parquet_decoded_bytes, read_parquet

    art = exported("transformer", ("onnx",))
    specs = art.manifest.signature.inputs
    feeds = random_feeds(specs, {"batch": 5, "seq": 12}, seed=3)
    pq.write_table(pa.table({n: list(a) for n, a in feeds.items()}), tmp_path / "ok.parquet")
    decoded = sum(a.nbytes for a in read_parquet(tmp_path / "ok.parquet", specs).values())
    assert decoded <= parquet_decoded_bytes(tmp_path / "ok.parquet") <= 4 * decoded
    bomb = _bomb(tmp_path / "bomb.parquet")
    assert bomb.stat().st_size < 100_000
    assert parquet_decoded_bytes(bomb) >= 2 * 2 * 2000 * 4096 * 8  # two 64 MiB columns, Arrow + NumPy
    monkeypatch.setenv("TK_MAX_MEMORY", "64M")
    with pytest.raises(
        ResourceError, match=r"bomb\.parquet \(the values its Parquet footer declares\) would need 250\.\d MiB"
    ):
        read_parquet(bomb, specs)  # what each Ray actor runs before reading a row group
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    from tk.errors import UsageError

    with pytest.raises(UsageError, match="cannot read it as Parquet"):
        parquet_decoded_bytes(tmp_path / "broken.parquet")


def test_infer_ray_refuses_a_parquet_bomb_before_ray_starts(exported, tmp_path):
    import ray

    art = exported("transformer", ("onnx",))
    shards = tmp_path / "shards"
    shards.mkdir()
    _bomb(shards / "bomb.parquet")
    was_running = ray.is_initialized()
    result = CliRunner().invoke(
        cli,
        ["--max-memory", "64M", "infer", str(art.root), "--ray", "--inputs", str(shards), "--out", str(tmp_path / "o")],
    )
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1 and "bomb.parquet" in lines[0] and "over tk's memory budget of 64.0 MiB" in lines[0]
    assert ray.is_initialized() == was_running  # refused before Ray was started
