"""The trt format: TensorRT engines built from the ONNX file (GPU tests skip, saying what is missing)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import tk.export.tensorrt.writer as trt_writer
import tk.formats.tensorrt as trt_format
from tests.conftest import requires, run_in_threads
from tk.errors import BackendUnavailableError, InputError, IntegrityError
from tk.export import ExportOptions
from tk.export.tensorrt.writer import TrtOptions
from tk.models import build_model
from tk.runtime import load
from tk.spec import random_feeds
from tk.tolerances import tolerance_for
from tk.workflows.export import export

requires_trt = requires(cuda=True, tensorrt=True, min_compute_capability=(8, 0))  # tests/conftest.py's one gate


# -- what runs everywhere -----------------------------------------------------------------------
def test_unavailable_reason_names_every_missing_requirement(monkeypatch):
    monkeypatch.setattr(trt_format, "_import_error", lambda: "tensorrt is not installed (pip install 'tk[gpu]')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = trt_format.unavailable_reason("cuda")
    assert reason == "tensorrt is not installed (pip install 'tk[gpu]'); TensorRT needs a CUDA GPU; none found"


def test_unavailable_reason_names_old_gpus_and_the_cpu_device(monkeypatch):
    monkeypatch.setattr(trt_format, "_import_error", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    reason = trt_format.unavailable_reason("cpu")
    assert "compute capability 8.0 or newer" in reason and "Tesla T4 has 7.5" in reason
    assert reason.endswith("use --device cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert trt_format.unavailable_reason("cuda") is None


def test_profile_spans_each_dimension_range():
    spec = build_model("transformer", size="tiny")
    shapes = trt_writer.profile_shapes(spec.signature, spec.signature.dims)
    expected = {"min": [1, 1], "opt": [8, 16], "max": [64, 64]}
    assert shapes == {"input_ids": expected, "attention_mask": expected}


@pytest.mark.skipif(not trt_format.missing_requirements("cuda"), reason="this machine can build TensorRT engines")
def test_export_refuses_trt_here_with_the_reason(tmp_path):
    with pytest.raises(BackendUnavailableError, match="--format trt: ") as info:
        export(build_model("linear", size="tiny"), tmp_path / "a", ExportOptions(formats=("trt",)))
    assert str(info.value) == "--format trt: " + "; ".join(trt_format.missing_requirements("cpu"))


# -- what needs TensorRT and a GPU ----------------------------------------------------------------
@pytest.fixture(scope="module")
def trt_artifact(tmp_path_factory):
    torch.manual_seed(0)
    spec = build_model("transformer", size="tiny")
    root = tmp_path_factory.mktemp("trt") / "transformer"
    cache = root.parent / "timing.cache"
    from tk.runtime.onnxrt import OnnxRuntimeEngine

    # the export check runs every format on the export device: onnx joins only where onnxruntime has CUDA
    formats = ("onnx", "trt") if OnnxRuntimeEngine.unavailable_reason("cuda") is None else ("trt",)
    options = ExportOptions(formats=formats, device="cuda", settings={"trt": TrtOptions(timing_cache=cache)})
    result = export(spec, root, options)
    return spec.module.cpu().eval(), spec, result, cache


@pytest.mark.trt
@requires_trt
def test_export_passes_and_records_the_build(trt_artifact):
    import tensorrt as trt

    _, _, result, cache = trt_artifact
    m = result.manifest
    assert m.status == "passed", m.check
    assert all(o["max_abs"] < 1e-4 for o in m.check["trt"]["outputs"]), m.check["trt"]
    settings = m.formats["trt"]
    assert settings["file"] == "model.plan"
    # built from the exporter's standard-op graph: named only where the artifact ships it unchanged
    fused = m.formats.get("onnx", {}).get("fusions", {}).get("applied", False)
    assert settings["onnx"] == ("model.onnx" if "onnx" in m.formats and not fused else None)
    assert settings["tensorrt"] == trt.__version__ == m.versions["tensorrt"]
    assert settings["hardware_compatibility"] == "ampere+" and settings["strongly_typed"] and not settings["tf32"]
    assert settings["compute_capability"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert settings["profile"]["input_ids"] == {"min": [1, 1], "opt": [8, 16], "max": [64, 64]}
    assert cache.is_file() and cache.stat().st_size > 0  # saved for the next build


@pytest.mark.trt
@requires_trt
def test_dynamic_dims_match_eager_at_other_shapes(trt_artifact):
    module, spec, result, _ = trt_artifact
    feeds = random_feeds(spec.signature.inputs, {"batch": 3, "seq": 7}, seed=7)
    with torch.inference_mode():
        want = module(*[torch.from_numpy(feeds[s.name]) for s in spec.signature.inputs]).numpy()
    with load(result.out, "trt", device="cuda") as engine:
        got = engine.run(feeds)["logits"]
        on_gpu = engine.run({k: torch.from_numpy(v).cuda() for k, v in feeds.items()})["logits"]
    rtol, atol = tolerance_for("fp32")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert on_gpu.is_cuda
    np.testing.assert_allclose(on_gpu.cpu().numpy(), got, rtol=0, atol=1e-6)


@pytest.mark.trt
@requires_trt
def test_cuda_graph_and_threads_give_the_same_outputs(trt_artifact):
    _, spec, result, _ = trt_artifact
    runs = [random_feeds(spec.signature.inputs, {"batch": b, "seq": s}, seed=b) for b, s in [(1, 5), (4, 16), (3, 7)]]
    with (
        load(result.out, "trt", device="cuda") as plain,
        load(result.out, "trt", device="cuda", cuda_graph=True) as graphed,
    ):
        expected = [plain.run(f)["logits"] for f in runs]
        for _ in range(2):  # capture, then replay
            for feeds, want in zip(runs, expected, strict=True):
                np.testing.assert_allclose(graphed.run(feeds)["logits"], want, rtol=0, atol=1e-6)

        def worker():
            for feeds, want in zip(runs * 3, expected * 3, strict=True):
                np.testing.assert_allclose(plain.run(feeds)["logits"], want, rtol=0, atol=1e-6)

        errors = run_in_threads(worker, 4)
        assert not errors, errors
        assert len(plain._states) == 5  # the main thread's context and one per worker


@pytest.mark.trt
@requires_trt
def test_engine_from_another_tensorrt_version_is_refused(trt_artifact):
    from tk.runtime.tensorrt import TensorRTEngine

    result = trt_artifact[2]
    manifest = copy.deepcopy(result.manifest)
    manifest.formats["trt"]["tensorrt"] = "10.0.0.1"
    with pytest.raises(IntegrityError, match=r"built with TensorRT 10\.0\.0\.1.*--format trt --device cuda"):
        TensorRTEngine(result.out, manifest, device="cuda").load()


@pytest.mark.trt
@requires_trt
def test_static_engine_refuses_other_shapes(tmp_path):
    torch.manual_seed(0)
    result = export(
        build_model("mlp", size="tiny"),
        tmp_path / "static",
        ExportOptions(
            formats=("trt",),
            device="cuda",
            dynamic=False,
            settings={"trt": TrtOptions(timing_cache=tmp_path / "cache")},
        ),
    )
    assert result.manifest.status == "passed"
    assert result.manifest.formats["trt"]["onnx"] is None  # built from a temporary ONNX file
    assert sorted(f.role for f in result.manifest.files) == ["trt", "weights"]
    with load(result.out, "trt", device="cuda") as engine:
        engine.run(random_feeds(engine.inputs, {"batch": 8}))
        with pytest.raises(InputError, match=r"must be in \[8, 8\]"):
            engine.run(random_feeds(engine.inputs, {"batch": 3}))
