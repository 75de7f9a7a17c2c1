"""The onnx, aoti and trt engines: options, refusals, threads, and what they accept and return."""

from __future__ import annotations

import copy
import io
import shutil
import sys
import types
import zipfile

import numpy as np
import pytest
import torch

from tests.conftest import run_in_threads, runner_of_package
from tk.errors import BackendUnavailableError, IntegrityError, UsageError
from tk.export import ExportOptions
from tk.formats.aoti import FILE, packing_features
from tk.manifest import FileEntry, read_manifest
from tk.models import build_model
from tk.runtime import load
from tk.runtime.aoti import AOTInductorEngine
from tk.runtime.aoti_package import ALIGNMENT, AlignedCpuPackage, _model_library, realigned_constants
from tk.runtime.onnxrt import OnnxRuntimeEngine, usable_cores
from tk.runtime.tensorrt import TensorRTEngine
from tk.signing import TrustPolicy
from tk.spec import random_feeds
from tk.workflows.export import export


@pytest.fixture
def artifact(exported):
    """``artifact(name, formats)``: the tiny model's shared session artifact."""
    return lambda name, formats: exported(name, tuple(formats)).root


@pytest.fixture
def linear_onnx(artifact):
    return artifact("linear", ("onnx",))


# -- onnx --------------------------------------------------------------------------------------
def test_onnx_unavailable_reasons():
    assert OnnxRuntimeEngine.unavailable_reason("cpu") is None
    assert "unknown device 'tpu'" in OnnxRuntimeEngine.unavailable_reason("tpu")
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in OnnxRuntimeEngine.unavailable_reason("cuda")


def test_onnx_precision_reason_agrees_with_loading_a_bf16_graph(tmp_path):
    """The probe ``tk optimize`` skips onnx bf16 by says what loading a real bf16 graph finds."""
    reason = OnnxRuntimeEngine.precision_reason("bf16", "cpu")
    assert OnnxRuntimeEngine.precision_reason("fp32", "cpu") is None
    out = tmp_path / "mlp-bf16"
    export(build_model("mlp", size="tiny"), out, ExportOptions(formats=("onnx",), precision="bf16", check=False))
    if reason is None:
        with load(out, "onnx") as engine:
            assert engine.run(random_feeds(engine.inputs, {"batch": 2}, seed=0))
    else:
        assert "bfloat16 MatMul" in reason
        with pytest.raises(BackendUnavailableError, match="NOT_IMPLEMENTED"):
            load(out, "onnx").run(random_feeds(read_manifest(out).signature.inputs, {"batch": 2}, seed=0))


def test_onnx_numpy_in_numpy_out_and_torch_in_torch_out(linear_onnx):
    with load(linear_onnx, "onnx") as engine:
        feeds = random_feeds(engine.inputs, {"batch": 5}, seed=0)
        out = engine.run(feeds)
        assert list(out) == ["y"] and isinstance(out["y"], np.ndarray) and out["y"].shape == (5, 1)
        out_torch = engine.run({"x": torch.from_numpy(feeds["x"])})
        assert isinstance(out_torch["y"], torch.Tensor)
        np.testing.assert_array_equal(out_torch["y"].numpy(), out["y"])


def test_onnx_threads_and_optimization_options(linear_onnx):
    with load(linear_onnx, "onnx") as default, load(linear_onnx, "onnx", threads=1, optimization="basic") as one:
        assert default._session.get_session_options().intra_op_num_threads == usable_cores()
        options = one._session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert str(options.graph_optimization_level).endswith("ORT_ENABLE_BASIC")
        assert str(default._session.get_session_options().graph_optimization_level).endswith("ORT_ENABLE_ALL")
        feeds = random_feeds(default.inputs, {"batch": 3})
        np.testing.assert_allclose(one.run(feeds)["y"], default.run(feeds)["y"], rtol=1e-6, atol=1e-7)
    with pytest.raises(UsageError, match="optimization must be one of"):
        load(linear_onnx, "onnx", optimization="fastest").load()
    with pytest.raises(UsageError, match="threads must be a positive integer, got -1"):
        load(linear_onnx, "onnx", threads=-1).load()


def test_onnx_provider_option(linear_onnx):
    import onnxruntime as ort

    with load(linear_onnx, "onnx", provider="cpu") as engine:
        assert engine._session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(BackendUnavailableError, match="provider 'nope' is not available; this onnxruntime has"):
        load(linear_onnx, "onnx", provider="nope").load()
    expected = UsageError if "CUDAExecutionProvider" in ort.get_available_providers() else BackendUnavailableError
    with pytest.raises(expected):
        load(linear_onnx, "onnx", provider="cuda").load()  # a GPU provider on the cpu device


def test_onnx_one_session_serves_many_threads(linear_onnx):
    with load(linear_onnx, "onnx") as engine:
        runs = [random_feeds(engine.inputs, {"batch": b}, seed=b) for b in (1, 7, 64)]
        expected = [engine.run(f)["y"] for f in runs]

        def worker():
            for _ in range(20):
                for feeds, want in zip(runs, expected, strict=True):
                    np.testing.assert_allclose(engine.run(feeds)["y"], want, rtol=1e-6, atol=1e-7)

        errors = run_in_threads(worker, 4)
        assert not errors, errors


def test_onnx_refuses_an_altered_model_file(linear_onnx, tmp_path):
    root = tmp_path / "a"
    shutil.copytree(linear_onnx, root)
    with open(root / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(IntegrityError, match=r"model\.onnx: .* bytes, the manifest expects"):
        OnnxRuntimeEngine(root, read_manifest(root)).load()


def test_onnx_refuses_missing_external_data(monkeypatch, tmp_path):
    import tk.export.onnx.writer as onnx_writer

    monkeypatch.setattr(onnx_writer, "SINGLE_FILE_LIMIT", 0)  # every model counts as large
    torch.manual_seed(0)
    root = export(build_model("linear", size="tiny"), tmp_path / "big", ExportOptions(formats=("onnx",))).out
    manifest = read_manifest(root)
    with OnnxRuntimeEngine(root, manifest) as engine:
        engine.run(random_feeds(engine.inputs, {"batch": 2}))

    (root / "model.onnx.data").unlink()
    with pytest.raises(
        IntegrityError, match=r"model\.onnx\.data: missing; the manifest lists it as the onnx-data file"
    ):
        OnnxRuntimeEngine(root, manifest).load()

    unlisted = copy.deepcopy(manifest)
    unlisted.files = [f for f in unlisted.files if f.role != "onnx-data"]
    with pytest.raises(IntegrityError, match=r"keeps its weights in model\.onnx\.data, and the manifest lists no"):
        OnnxRuntimeEngine(root, unlisted).load()


# -- aoti --------------------------------------------------------------------------------------
@pytest.fixture
def mlp_aoti(artifact):
    return artifact("mlp", ("aoti",))


@pytest.mark.slow
def test_aoti_runs_numpy_and_torch(mlp_aoti):
    with load(mlp_aoti, "aoti") as engine, load(mlp_aoti, "eager") as eager:
        feeds = random_feeds(engine.inputs, {"batch": 5}, seed=0)
        np.testing.assert_allclose(engine.run(feeds)["logits"], eager.run(feeds)["logits"], rtol=1e-4, atol=1e-5)
        out = engine.run({"x": torch.from_numpy(feeds["x"]).t().contiguous().t()})  # non-contiguous input
        assert isinstance(out["logits"], torch.Tensor) and out["logits"].shape == (5, 4)


def _offsets(runner) -> set[int]:
    return {t.data_ptr() % ALIGNMENT for t in runner.extract_constants_map(False).values() if t.numel()}


@pytest.mark.slow
def test_aoti_constants_off_cache_lines_are_moved_onto_them(mlp_aoti):
    """AOTInductor copies constants into one ``std::malloc`` block (16-byte aligned): put 16 bytes off a cache
    line here on purpose, they are moved onto 64-byte boundaries, the runner's own set freed, outputs unchanged."""
    runner = runner_of_package(mlp_aoti)
    x = [torch.from_numpy(random_feeds(read_manifest(mlp_aoti).signature.inputs, {"batch": 5}, seed=0)["x"])]
    want = runner.run(x)[0].clone()
    own_name = {original: name for name, original in runner.get_constant_names_to_original_fqns().items()}
    off = {}
    for name, t in runner.extract_constants_map(False).items():
        raw = torch.empty(t.nbytes + 2 * ALIGNMENT, dtype=torch.uint8)
        start = -raw.data_ptr() % ALIGNMENT + 16
        off[own_name.get(name, name)] = raw[start : start + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    runner.update_constant_buffer(off, False, True, True)
    assert _offsets(runner) == {16}
    moved = realigned_constants(runner)
    assert set(moved) == set(off) and _offsets(runner) == {0}
    assert torch.equal(runner.run(x)[0], want)
    assert realigned_constants(runner) == {}  # aligned already: left where they are


@pytest.mark.slow
def test_aoti_engine_runs_the_package_with_its_constants_aligned(mlp_aoti):
    with load(mlp_aoti, "aoti") as engine:
        assert isinstance(engine._model, AlignedCpuPackage)
        assert _offsets(engine._model._runner) == {0}
        feeds = random_feeds(engine.inputs, {"batch": 5}, seed=3)
        got = engine.run(feeds)["logits"]
    package = torch._inductor.aoti_load_package(str(mlp_aoti / FILE))  # torch's own loader, as it places them
    assert torch.equal(torch.from_numpy(got), package(torch.from_numpy(feeds["x"])))


def test_a_package_that_is_not_one_library_with_its_constants_opens_with_torchs_loader():
    def archive(*names: str) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            for name in names:
                z.writestr(name, b"\x7fELF")
        return buffer.getvalue()

    lib = "model/data/aotinductor/model/abc.wrapper.so"
    assert _model_library(archive(lib, "model/data/aotinductor/model/abc.wrapper.cpp")) == {"model.so": b"\x7fELF"}
    with_ops = archive(lib, "model/data/aotinductor/model/abc.wrapper.json", "model/data/aotinductor/model/x.json")
    assert _model_library(with_ops) == {"model.so": b"\x7fELF", "model.json": b"\x7fELF"}  # its proxy executor's ops
    assert _model_library(archive(lib, "model/data/aotinductor/model/def.wrapper.so")) is None  # two models
    assert _model_library(archive(lib, "model/data/weights/weight_0")) is None  # constants beside the library
    assert _model_library(archive("model/archive_format")) is None


@pytest.mark.slow
def test_aoti_refuses_a_package_for_another_device(mlp_aoti):
    manifest = read_manifest(mlp_aoti)
    manifest.formats["aoti"]["device"] = "cuda"
    with pytest.raises(BackendUnavailableError) as info:
        AOTInductorEngine(mlp_aoti, manifest, device="cpu").load()
    assert str(info.value).endswith(
        "was compiled for cuda, and cpu was requested; run it with --device cuda, or rebuild it with "
        "`tk export mlp --size tiny --format aoti --device cpu`"
    )


@pytest.mark.slow
def test_aoti_refuses_a_package_from_another_torch_or_cpu(mlp_aoti):
    manifest = read_manifest(mlp_aoti)
    other_torch = copy.deepcopy(manifest)
    other_torch.versions["torch"] = "2.99.0"
    with pytest.raises(BackendUnavailableError, match=r"compiled by torch 2\.99\.0, this is torch"):
        AOTInductorEngine(mlp_aoti, other_torch).load()
    other_cpu = copy.deepcopy(manifest)
    other_cpu.formats["aoti"]["cpu_isa"] = "sve9000"
    with pytest.raises(BackendUnavailableError, match="uses sve9000 instructions, which this CPU lacks"):
        AOTInductorEngine(mlp_aoti, other_cpu).load()
    here = packing_features()
    if here is not None:  # Linux: a frozen (bf16/fp16) package's weights, packed for a CPU with or without AMX
        packed_elsewhere = copy.deepcopy(manifest)
        packed_elsewhere.formats["aoti"]["packed_for"] = sorted(set(here) ^ {"amx_bf16"})
        with pytest.raises(BackendUnavailableError, match="weights were packed by oneDNN for a CPU with"):
            AOTInductorEngine(mlp_aoti, packed_elsewhere).load()


@pytest.mark.slow
def test_aoti_refuses_an_altered_package(mlp_aoti, tmp_path):
    root = tmp_path / "a"
    shutil.copytree(mlp_aoti, root)
    data = bytearray((root / "model.aoti.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "model.aoti.pt2").write_bytes(bytes(data))
    # the signature refuses it first; told to trust the artifact's code, the manifest's sha256 still does
    with pytest.raises(IntegrityError, match=r"do not match their signature \(changed: model\.aoti\.pt2\)"):
        AOTInductorEngine(root, read_manifest(root)).load()
    trusting = TrustPolicy(trust_artifact_code=True, warn=False)
    with pytest.raises(IntegrityError, match=r"model\.aoti\.pt2: sha256 .* \(altered\)"):
        AOTInductorEngine(root, read_manifest(root), trust=trusting).load()


# -- trt (what runs without TensorRT; GPU tests live in tests/export/test_tensorrt.py) -------------
def test_trt_unavailable_reason_comes_from_the_writer():
    from tk.formats.tensorrt import unavailable_reason

    assert TensorRTEngine.unavailable_reason("cuda") == unavailable_reason("cuda")


def test_trt_refuses_an_engine_from_another_tensorrt_version(monkeypatch, linear_onnx):
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.13.0.35"))
    manifest = read_manifest(linear_onnx)
    manifest.formats["trt"] = {"file": "model.plan", "tensorrt": "10.9.0.34", "hardware_compatibility": "ampere+"}
    manifest.files.append(FileEntry("model.plan", "trt", 1, "0" * 64))
    with pytest.raises(IntegrityError) as info:
        TensorRTEngine(linear_onnx, manifest, device="cuda").load()
    assert str(info.value).endswith(
        "the TensorRT engine was built with TensorRT 10.9.0.34, this machine has 10.13.0.35; an engine loads "
        "only in the version that built it: rebuild it with `tk export linear --size tiny --format trt --device cuda`"
    )
