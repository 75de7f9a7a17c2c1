"""``tk deploy triton``: every generated config.pbtxt parses into Triton's ModelConfig and matches the manifest."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient (pip install 'tk[serve]')")
from tritonclient.grpc import model_config_pb2 as pb

from tk.errors import UsageError
from tk.manifest import read_manifest
from tk.serve.triton import TRITON_TYPES, deploy_triton, read_config, triton_config
from tk.spec import numpy_dtype


def check_against_manifest(config, manifest, *, batching: bool) -> None:
    sig = manifest.signature
    batch = sig.dims["batch"]
    assert config.max_batch_size == (batch.max if batching else 0)
    assert [i.name for i in config.input] == [s.name for s in sig.inputs]
    assert [o.name for o in config.output] == [s.name for s in sig.outputs]
    for entry, spec in [*zip(config.input, sig.inputs, strict=True), *zip(config.output, sig.outputs, strict=True)]:
        assert pb.DataType.Name(entry.data_type) == TRITON_TYPES[spec.dtype]
        shape = spec.shape[1:] if batching else spec.shape
        expected = [d if isinstance(d, int) else (sig.dims[d].min if sig.dims[d].static else -1) for d in shape]
        assert list(entry.dims) == expected, (entry.name, list(entry.dims), expected)
    if batching:
        assert list(config.dynamic_batching.preferred_batch_size) == [batch.opt]
    else:
        assert not config.HasField("dynamic_batching")
    assert len(config.instance_group) == 1 and config.instance_group[0].count == 1
    (warmup,) = config.model_warmup
    assert sorted(warmup.inputs) == sorted(s.name for s in sig.inputs)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_onnx_repository_parses_and_matches_manifest(exported, tmp_path, dynamic):
    art = exported("transformer", ("onnx",), dynamic=dynamic)
    result = deploy_triton(art.root, tmp_path / "repo")
    model_dir = tmp_path / "repo" / "transformer"
    config = read_config(model_dir / "config.pbtxt")
    assert config == result.config
    assert config.platform == "onnxruntime_onnx" and config.default_model_filename == "model.onnx"
    check_against_manifest(config, art.manifest, batching=dynamic)
    assert (model_dir / "1" / "model.onnx").read_bytes() == (art.root / "model.onnx").read_bytes()
    # the warmup files hold one valid sample in the input's dtype and dims
    warmup = config.model_warmup[0]
    for spec in art.manifest.signature.inputs:
        entry = warmup.inputs[spec.name]
        sizes = art.manifest.signature.opt_sizes()
        expected = list(spec.concrete_shape(sizes))[1:] if dynamic else list(spec.concrete_shape(sizes))
        assert list(entry.dims) == expected  # one sample at the opt sizes (the whole static batch)
        data = np.fromfile(model_dir / "warmup" / entry.input_data_file, dtype=numpy_dtype(spec.dtype))
        assert data.size == int(np.prod(expected))
        if spec.kind == "ids":
            assert data.min() >= spec.low and data.max() < spec.high
        if spec.kind == "mask":
            assert data.max() == 1


def test_external_data_is_copied(monkeypatch, tmp_path):
    import torch

    from tk.export import ExportOptions
    from tk.export.onnx import writer as onnx_writer
    from tk.models import build_model
    from tk.workflows.export import export

    monkeypatch.setattr(onnx_writer, "SINGLE_FILE_LIMIT", 0)  # every model counts as large
    torch.manual_seed(0)
    export(build_model("linear", size="tiny"), tmp_path / "art", ExportOptions(formats=("onnx",)))
    manifest = read_manifest(tmp_path / "art")
    data_name = manifest.formats["onnx"]["external_data"]
    assert data_name
    deploy_triton(tmp_path / "art", tmp_path / "repo", name="lin")
    version = tmp_path / "repo" / "lin" / "1"
    assert (version / data_name).read_bytes() == (tmp_path / "art" / data_name).read_bytes()
    import onnxruntime as ort

    session = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    spec = manifest.signature.inputs[0]
    feed = np.ones((2, *spec.shape[1:]), np.float32)
    assert session.run(None, {spec.name: feed})[0].shape[0] == 2


def _with_trt_profile(manifest, batch=(1, 8, 32), seq=(16, 16, 16)):
    """The manifest as a TensorRT export of the same signature would write it (profile per input)."""
    m = copy.deepcopy(manifest)
    profile = {
        s.name: {which: [batch[i], seq[i]] for i, which in enumerate(("min", "opt", "max"))} for s in m.signature.inputs
    }
    m.formats["trt"] = {"file": "model.plan", "profile": profile}
    return m


def test_trt_dims_follow_the_engine_profile(exported):
    manifest = exported("transformer", ("onnx",)).manifest
    config = triton_config(_with_trt_profile(manifest), "trt", name="t")
    assert config.platform == "tensorrt_plan" and config.default_model_filename == "model.plan"
    assert config.max_batch_size == 32  # the profile's max, not the manifest's dims
    assert [list(i.dims) for i in config.input] == [[16], [16]]  # seq fixed by the profile
    assert [list(o.dims) for o in config.output] == [[2]]
    assert list(config.model_warmup[0].inputs["input_ids"].dims) == [16]
    assert pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_GPU"
    dynamic_seq = triton_config(_with_trt_profile(manifest, seq=(1, 16, 64)), "trt", name="t")
    assert [list(i.dims) for i in dynamic_seq.input] == [[-1], [-1]]
    with pytest.raises(UsageError, match="batch min of 2"):
        triton_config(_with_trt_profile(manifest, batch=(2, 8, 32)), "trt", name="t")


def test_missing_format_is_refused(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    with pytest.raises(UsageError, match="no trt file"):
        deploy_triton(art.root, tmp_path / "repo", fmt="trt")
    assert not Path(tmp_path / "repo").exists()


def test_non_empty_out_is_refused_unless_force(exported, tmp_path):
    art = exported("transformer", ("onnx",))
    repo = tmp_path / "repo"
    (repo / "transformer").mkdir(parents=True)
    (repo / "transformer" / "config.pbtxt").write_text("name: 'theirs'\n")
    with pytest.raises(
        UsageError,
        match=r"^--out .*repo: expected an empty or new directory, found 1 entries \(transformer\); pass --force",
    ):
        deploy_triton(art.root, repo)
    assert (repo / "transformer" / "config.pbtxt").read_text() == "name: 'theirs'\n"  # untouched
    from click.testing import CliRunner

    from tk.cli import cli

    run = CliRunner().invoke(cli, ["deploy", "triton", str(art.root), "--out", str(repo)])
    assert run.exit_code == 2 and "pass --force" in run.stderr
    run = CliRunner().invoke(cli, ["deploy", "triton", str(art.root), "--out", str(repo), "--force"])
    assert run.exit_code == 0, run.output
    assert read_config(repo / "transformer" / "config.pbtxt").name == "transformer"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="expected a directory, found a file"):
        deploy_triton(art.root, tmp_path / "file", force=True)


def test_default_name_is_safe_and_errors_name_only_flags_given(exported, tmp_path):
    from types import SimpleNamespace

    from tk.serve.protocol import default_model_name

    def named(name):
        return default_model_name(SimpleNamespace(model={"name": name}))

    assert named("hf:/abs/path/to/MiniLM-L6 v2") == "MiniLM-L6-v2"
    assert named("hf:/abs/dir/") == "dir"
    assert named("tests.planted:build") == "tests.planted-build"
    assert named("../..") == "model" and named("") == "model"
    art = exported("transformer", ("onnx",))
    with pytest.raises(UsageError, match=r"^--name '\.\./evil': expected"):
        deploy_triton(art.root, tmp_path / "r1", name="../evil")


@pytest.mark.slow
def test_hf_artifact_deploys_and_serves_under_its_directory_name(tmp_path):
    pytest.importorskip("transformers")
    from transformers import DistilBertConfig, DistilBertModel

    from tk.export import ExportOptions
    from tk.models import build_model
    from tk.serve.config import ServeConfig, resolve
    from tk.workflows.export import export

    directory = tmp_path / "my model.v1"
    config = DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=16)
    DistilBertModel(config).save_pretrained(directory)
    art = tmp_path / "art"
    export(build_model(f"hf:{directory}"), art, ExportOptions(formats=("onnx",), dims={}))
    result = deploy_triton(art, tmp_path / "repo")
    assert result.root == tmp_path / "repo" / "my-model.v1" and result.config.name == "my-model.v1"
    assert resolve(ServeConfig(artifact=str(art))).name == "my-model.v1"


def _with_untrusted_plan(root: Path, plan: bytes) -> None:
    """``root`` (an onnx artifact) holding a TensorRT plan too, as anyone can add one: the manifest lists the plan
    by sha256, with its profile, and its checksum is redone; only the signature tells that no one you trust made it."""
    from tk.manifest import FileEntry, manifest_bytes

    (root / "model.plan").write_bytes(plan)
    manifest = _with_trt_profile(read_manifest(root))
    manifest.files.append(FileEntry.of(root, "model.plan", "trt"))
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))


def test_an_untrusted_plan_is_deployed_only_when_trusted(exported, tmp_path):
    """A TensorRT plan is native code Triton loads: ``tk deploy triton`` applies the trust decision every engine does."""
    import shutil

    from click.testing import CliRunner

    from tk.cli import cli
    from tk.errors import UntrustedArtifactError
    from tk.signing import sign_artifact

    root = tmp_path / "art"
    shutil.copytree(exported("transformer", ("onnx",)).root, root)
    plan = b"a plan someone else built"
    _with_untrusted_plan(root, plan)
    repo = tmp_path / "repo"
    with pytest.raises(UntrustedArtifactError, match=r"refusing to deploy its trt file, native code that Triton would "
                       r"load, because its files do not match their signature \(added: model\.plan; changed"):  # fmt: skip
        deploy_triton(root, repo)
    assert not repo.exists()
    run = CliRunner().invoke(cli, ["deploy", "triton", str(root), "--out", str(repo)])
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.exit_code == 2 and len(errors) == 1 and "--trust-artifact-code for this one run" in errors[0], run.output
    assert not repo.exists()
    deploy_triton(root, tmp_path / "onnx-only", fmt="onnx")  # the ONNX graph holds no native code: no decision
    run = CliRunner().invoke(cli, ["deploy", "triton", str(root), "--out", str(repo), "--trust-artifact-code"])
    assert run.exit_code == 0, run.output
    assert "warning: --trust-artifact-code: deploying the trt file of" in run.stderr
    assert (repo / "transformer" / "1" / "model.plan").read_bytes() == plan
    sign_artifact(root)  # the user vouches for it with their own key: deployed with no flag
    deploy_triton(root, tmp_path / "signed")
    assert (tmp_path / "signed" / "transformer" / "1" / "model.plan").read_bytes() == plan


def test_an_out_inside_the_artifact_is_refused(exported, tmp_path):
    import shutil

    from tk.manifest import verify_artifact
    from tk.signing import check_signature

    root = tmp_path / "art"
    shutil.copytree(exported("transformer", ("onnx",)).root, root)
    before = sorted(p.name for p in root.iterdir())
    for out, name, given in (
        (root / "repo", None, f"--out {root / 'repo'}"),
        (root, None, f"--out {root}"),
        (tmp_path, "art", f"--out {tmp_path} --name art"),  # REPO/NAME is the artifact itself
    ):
        with pytest.raises(UsageError) as info:
            deploy_triton(root, out, name=name, force=True)
        expected = f"{given}: expected a path outside the artifact {root}, which writing there would change"
        assert str(info.value) == expected
    assert sorted(p.name for p in root.iterdir()) == before
    assert check_signature(root, verify_artifact(root)).trusted
