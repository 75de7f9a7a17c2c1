"""Property tests: shapes inside the ranges keep parity, shapes outside are refused,
and garbage in place of an artifact file is refused without crashing the process."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tk.errors import InputError, TkError
from tk.export import ExportOptions
from tk.manifest import FileEntry, manifest_bytes, read_manifest
from tk.models import build_model
from tk.runtime import available_engines, load
from tk.spec import random_feeds
from tk.workflows.export import export

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def transformer_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("prop") / "transformer"
    formats = tuple(f for f in ("torch", "onnx") if f in ("torch", "onnx"))
    export(build_model("transformer", size="tiny"), out, ExportOptions(formats=formats, check=False))
    return out


@pytest.fixture(scope="module")
def engines(transformer_artifact):
    names = [n for n in available_engines(read_manifest(transformer_artifact)) if n in ("eager", "torch", "onnx")]
    opened = {n: load(transformer_artifact, n).load() for n in names}
    yield opened
    for engine in opened.values():
        engine.close()


@SETTINGS
@given(batch=st.integers(1, 64), seq=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_shapes_inside_the_ranges_keep_parity(engines, batch, seq, seed):
    feeds = random_feeds(engines["eager"].inputs, {"batch": batch, "seq": seq}, seed=seed)
    reference = engines["eager"].run(feeds)["logits"]
    for name, engine in engines.items():
        got = engine.run(feeds)["logits"]
        assert got.shape == (batch, 2)
        np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5, err_msg=name)


@SETTINGS
@given(
    batch=st.one_of(st.integers(65, 200), st.integers(1, 64)),
    seq=st.one_of(st.integers(65, 300), st.integers(1, 64)),
)
def test_shapes_outside_the_ranges_are_refused(engines, batch, seq):
    outside = batch > 64 or seq > 64
    feeds = random_feeds(engines["eager"].inputs, {"batch": batch, "seq": seq})
    for engine in engines.values():
        if outside:
            with pytest.raises(InputError, match=r"must be in \[1, 64\] for this artifact, got"):
                engine.check_feeds(feeds)
        else:
            assert engine.check_feeds(feeds) == {"batch": batch, "seq": seq}


@SETTINGS
@given(rank=st.integers(0, 4), dtype=st.sampled_from(["float32", "int32", "float64", "bool"]))
def test_wrong_rank_or_dtype_is_refused(engines, rank, dtype):
    feeds = random_feeds(engines["eager"].inputs, {"batch": 2, "seq": 3})
    feeds["input_ids"] = np.zeros((2,) * rank, dtype=dtype)
    with pytest.raises(InputError, match="expected"):
        engines["eager"].check_feeds(feeds)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=4096))
def test_random_bytes_in_place_of_a_file_never_crash(transformer_artifact, tmp_path_factory, data):
    """Even with the manifest's hashes made to match, a loader refuses garbage with a TkError."""
    manifest = read_manifest(transformer_artifact)
    for entry in manifest.files:
        engine = {"weights": "eager", "torch": "torch", "onnx": "onnx"}.get(entry.role)
        if engine not in available_engines(manifest):
            continue
        root = tmp_path_factory.mktemp("garbage")
        target = root / "art"
        shutil.copytree(transformer_artifact, target)
        (target / entry.path).write_bytes(data)
        damaged = read_manifest(target)
        with pytest.raises(TkError, match=r"sha256|bytes"):
            load(target, engine).load()
        damaged.files = [FileEntry.of(target, e.path, e.role) for e in damaged.files]
        (target / "manifest.json").write_bytes(manifest_bytes(damaged))
        with pytest.raises(TkError):
            load(target, engine).load()
