"""--engine auto: only engines whose parity passes compete, and the fastest of them wins."""

from __future__ import annotations

import shutil

from tk.export import ExportOptions
from tk.manifest import FileEntry, manifest_bytes, read_manifest
from tk.models import build_model
from tk.runtime import EngineChoice
from tk.workflows.auto import choose_engine
from tk.workflows.export import export


def test_auto_picks_the_fastest_passing_engine(exported):
    root = exported("mlp", ("onnx",)).root
    choice = choose_engine(root, read_manifest(root), EngineChoice(), batch_size=4, seconds=0.2)
    names = {c.engine for c in choice.candidates}
    assert {"eager", "onnx"} <= names
    passing = [c for c in choice.candidates if c.passed]
    assert choice.engine == min(passing, key=lambda c: c.p50_ms).engine
    assert "fastest of the engines that pass parity at batch 4" in choice.reason


def test_an_engine_that_fails_parity_is_never_chosen(exported, tmp_path):
    root = tmp_path / "wrong"
    shutil.copytree(exported("mlp", ("onnx",)).root, root)
    other = tmp_path / "other"
    export(build_model("mlp", size="tiny", seed=1), other, ExportOptions(formats=("onnx",), check=False))
    shutil.copy(other / "model.onnx", root / "model.onnx")  # another model's weights, hashes made to match
    manifest = read_manifest(root)
    manifest.files = [FileEntry.of(root, e.path, e.role) for e in manifest.files]
    (root / "manifest.json").write_bytes(manifest_bytes(manifest))
    choice = choose_engine(root, read_manifest(root), EngineChoice(), batch_size=4, seconds=0.1)
    onnx = next(c for c in choice.candidates if c.engine == "onnx")
    assert not onnx.passed and onnx.max_rel > 1e-3
    assert choice.engine != "onnx"
