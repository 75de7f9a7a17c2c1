"""Artifact integrity: every file is verified against the manifest before it is loaded."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from click.testing import CliRunner

from tk.cli import cli
from tk.errors import IntegrityError, UsageError
from tk.export import ExportOptions
from tk.manifest import _canonical, read_manifest, verify_artifact
from tk.models import build_model
from tk.workflows.export import export


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "mlp"
    export(build_model("mlp", size="tiny"), out, ExportOptions(formats=("torch",)))
    return out


def copy_of(artifact, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    return target


def test_hashes_match_the_files(artifact):
    manifest = verify_artifact(artifact)
    assert manifest.status == "passed"
    assert {e.role for e in manifest.files} == {"weights", "torch"}
    assert manifest.signature.dims["batch"].max == 1024
    assert manifest.check["torch"]["passed"]


FORMAT_FILES = [
    ("torch", "program.pt2", []),
    ("onnx", "model.onnx", []),
    ("aoti", "model.aoti.pt2", [pytest.mark.slow]),
    ("weights", "weights.safetensors", []),
]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("fmt, filename", [pytest.param(f, n, marks=m, id=f) for f, n, m in FORMAT_FILES])
def test_damaged_files_are_refused_with_their_name(exported, tmp_path, fmt, filename, damage):
    """Every format that runs here: a truncated, altered or missing file is refused by every command."""
    import shutil

    source = exported("mlp", ("onnx",) if fmt == "weights" else (fmt,)).root
    root = tmp_path / "copy"
    shutil.copytree(source, root)
    target = root / filename
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[:-100])
    elif damage == "flip":
        target.write_bytes(data[:500] + bytes([data[500] ^ 0xFF]) + data[501:])
    else:
        target.unlink()
    with pytest.raises(IntegrityError, match=re.escape(filename)):
        verify_artifact(root)
    engine = "eager" if fmt == "weights" else fmt
    for args in (
        ["inspect", str(root)],
        ["check", str(root), "--engine", engine],
        ["infer", str(root), "--engine", engine, "--random", "2", "--out", str(tmp_path / "o.npz")],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, (args, result.output)
        assert filename in result.stderr and "Traceback" not in result.output
        assert not (tmp_path / "o.npz").exists()


def test_edited_manifest_breaks_the_signature(artifact, tmp_path):
    """The public-key signature replaced the HMAC: an attacker can redo the checksum, not the signature."""
    from tk.signing import check_signature

    out = copy_of(artifact, tmp_path)
    assert check_signature(out, read_manifest(out)).trusted
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    data["signature"]["inputs"][0]["shape"] = ["batch", 5]
    data["checksum"] = hashlib.sha256(_canonical(data)).hexdigest()
    path.write_text(json.dumps(data))
    found = check_signature(out, read_manifest(out))
    assert not found.trusted and "changed: manifest.json" in found.reason


def test_edited_manifest_shape_is_refused(artifact, tmp_path):
    root = copy_of(artifact, tmp_path)
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    data["signature"]["inputs"][0]["shape"] = ["batch", 5]
    path.write_text(json.dumps(data))
    with pytest.raises(IntegrityError, match="edited or damaged after export"):
        read_manifest(root)
    result = CliRunner().invoke(cli, ["inspect", str(root)])
    assert result.exit_code == 2 and "manifest.json" in result.stderr


def test_a_directory_without_manifest_is_not_an_artifact(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(IntegrityError, match="not a complete artifact"):
        read_manifest(tmp_path / "half")


def test_exporting_again_replaces_the_directory_whole(tmp_path):
    out = tmp_path / "a"
    export(build_model("linear", size="tiny"), out, ExportOptions(formats=("torch",)))
    (out / "stale.txt").write_text("old")  # a file tk did not write: replacing the artifact needs --force
    export(build_model("linear", size="tiny"), out, ExportOptions(formats=("torch",), force=True))
    assert not (out / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".a.")], "no staging directories left behind"


def test_an_optimize_recommendation_round_trips_and_is_checked(artifact, tmp_path):
    import dataclasses

    from tk.manifest import manifest_bytes
    from tk.runtime import load

    root = copy_of(artifact, tmp_path)
    manifest = verify_artifact(root)
    assert manifest.recommended_engine is None and "optimize" not in manifest.to_json()
    with pytest.raises(UsageError, match="no onnx file"):  # no recommendation: the default engine, onnx
        load(root)
    record = {"recommended": {"engine": "torch", "format": "torch"}, "candidates": []}
    (root / "manifest.json").write_bytes(manifest_bytes(dataclasses.replace(manifest, optimize=record)))
    assert read_manifest(root).recommended_engine == "torch"
    with load(root) as engine:
        assert engine.name == "torch"
    data = json.loads((root / "manifest.json").read_text())
    data["optimize"]["recommended"] = {"format": "torch"}
    (root / "manifest.json").write_bytes(manifest_bytes(dataclasses.replace(manifest, optimize=data["optimize"])))
    with pytest.raises(IntegrityError, match=r"optimize\.recommended: expected an object naming an engine"):
        read_manifest(root)
