"""Issue #45, item 1 (critical): native code hidden in a ``torch``-format artifact's ``program.pt2``.

``torch.export.load`` extracts and dlopens any ``data/aotinductor/`` model a ``.pt2`` archive holds,
whatever the caller wants from it. The attack: a torch artifact (nothing native in its manifest)
whose ``program.pt2`` gained an AOTInductor model whose library has a constructor, the manifest
re-hashed as anyone can. Every entry point that loads the torch format must refuse it unless the
artifact is trusted, and even then never load the library; the constructor's marker file must never
appear. The control test shows the archive is a real attack.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from click.testing import CliRunner

from tests.conftest import rehash
from tests.test_security import PLANTED_C, assert_one_line, run_cli
from tk.archives import compiled_members
from tk.cli import cli
from tk.errors import IntegrityError, UntrustedArtifactError
from tk.formats.torch_program import load_exported_program
from tk.manifest import verify_artifact
from tk.runtime import EngineChoice, load
from tk.signing import holds_native_code

pytestmark = pytest.mark.slow  # the fixture's artifact holds an AOTInductor package (one compile per session)


@pytest.fixture
def planted(exported, tmp_path):
    """(a torch+onnx+aoti mlp artifact whose program.pt2 carries the aoti package's model with a planted
    library, the marker its constructor writes)."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc) to build the planted library")
    marker = tmp_path / "marker"
    (tmp_path / "planted.c").write_text(PLANTED_C)
    library = tmp_path / "planted.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(tmp_path / "planted.c")],
        check=True, timeout=120,
    )  # fmt: skip
    root = tmp_path / "planted-artifact"
    shutil.copytree(exported("mlp", ("torch", "onnx", "aoti")).root, root)
    package = zipfile.ZipFile(io.BytesIO((root / "model.aoti.pt2").read_bytes()))

    def plant(archive: zipfile.ZipFile, top: str) -> None:
        for info in package.infolist():
            if "/data/aotinductor/" in info.filename:  # the .so, its .cpp and metadata, under the program's folder
                name = f"{top}/{info.filename.split('/', 1)[1]}"
                archive.writestr(name, library.read_bytes() if name.endswith(".so") else package.read(info))

    out = program_with(root, plant)
    rehash(root, {"program.pt2": out.getvalue()})
    verify_artifact(root)  # every hash matches: only the signature (and the archive's contents) can tell
    return root, marker


def program_with(root, add) -> io.BytesIO:
    """``root/program.pt2``'s members, then what ``add(archive, top_folder)`` writes, as a new archive."""
    program = zipfile.ZipFile(io.BytesIO((root / "program.pt2").read_bytes()))
    top = program.infolist()[0].filename.split("/", 1)[0]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for info in program.infolist():
            archive.writestr(info, program.read(info))
        add(archive, top)
    return out


def test_the_planted_program_is_a_real_attack(planted):
    """The control: plain ``torch.export.load`` of the archive runs the constructor (in another process)."""
    root, marker = planted
    code = f"import torch\ntry:\n    torch.export.load({str(root / 'program.pt2')!r})\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300, check=False)
    assert marker.exists(), "torch.export.load did not load the planted library: the attack below proves nothing"


def test_every_entry_point_refuses_the_torch_engine_unless_trusted(planted, tmp_path):
    root, marker = planted
    shards = tmp_path / "shards"
    shards.mkdir()
    np.savez(shards / "a.npz", x=np.zeros((2, 16), dtype=np.float32))
    for args in (
        ["infer", str(root), "--engine", "torch", "--random", "2", "--out", str(tmp_path / "o.npz")],
        ["check", str(root), "--engine", "torch"],
        ["bench", str(root), "--engine", "torch", "--iters", "1", "--batch-sizes", "1", "--no-baselines"],
        ["debug", "locate", str(root), "--engine", "torch"],
        ["infer", str(root), "--engine", "torch", "--ray", "--inputs", str(shards), "--out", str(tmp_path / "ray")],
    ):
        code, stderr = run_cli(*args)
        assert_one_line(code, stderr, "refusing to load the torch engine")
        assert "(changed: manifest.json, program.pt2)" in stderr, stderr
        assert not marker.exists(), f"{args}: the planted library's code ran"
    with pytest.raises(UntrustedArtifactError):
        load(root, "torch")
    from tk.serve.config import ServeConfig, resolve

    with pytest.raises(UntrustedArtifactError, match="refusing to load the torch engine"):
        resolve(ServeConfig(artifact=str(root), engine=EngineChoice("torch")))  # before Ray or any replica starts
    assert not marker.exists()


def test_all_and_auto_skip_the_torch_engine_and_check_the_others(planted, tmp_path):
    root, marker = planted
    for args in (["check", str(root)], ["check", str(root), "--engine", "auto"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert "note: skipping torch, which runs the artifact's native code" in result.stderr, result.stderr
        assert not marker.exists()
    result = CliRunner().invoke(cli, ["bench", str(root), "--engine", "all", "--iters", "1", "--batch-sizes", "1",
                                      "--no-baselines", "--json", str(tmp_path / "b.json")])  # fmt: skip
    assert result.exit_code == 0, result.output
    timed = {row["engine"] for row in json.loads((tmp_path / "b.json").read_text())["results"]["rows"]}
    assert "torch" not in timed and "onnx" in timed, timed
    assert not marker.exists()


def test_inspect_names_the_torch_format_as_native_code(planted):
    root, marker = planted
    result = CliRunner().invoke(cli, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    native = [ln for ln in result.stdout.splitlines() if ln.startswith("native")]
    assert native and "torch" in native[0] and "refused unless trusted" in native[0], result.stdout
    assert holds_native_code(verify_artifact(root), root) == ["aoti", "torch"]
    assert not marker.exists()


def test_trusted_the_program_runs_without_its_compiled_members(planted, tmp_path):
    """Trusting the artifact lets the torch engine run the program, and still never loads the library:
    the program never needs it."""
    root, marker = planted
    result = CliRunner().invoke(cli, ["check", str(root), "--engine", "torch", "--trust-artifact-code"])
    assert result.exit_code == 0, result.output
    assert "parity passed for torch" in result.stdout, result.stdout
    assert not marker.exists()


def test_optimize_deploy_and_serve_never_load_it(planted, tmp_path):
    """``tk deploy triton`` copies the onnx file only; a served torch engine is refused before Ray starts."""
    root, marker = planted
    result = CliRunner().invoke(
        cli, ["deploy", "triton", str(root), "--format", "onnx", "--out", str(tmp_path / "repo")]
    )
    assert result.exit_code == 0, result.output
    assert not any(p.suffix in (".pt2", ".so") for p in (tmp_path / "repo").rglob("*"))
    assert not marker.exists()


def test_compiled_members_are_found_by_place_name_and_magic():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("p/data/aotinductor/model/x.json", b"{}")  # by place
        archive.writestr("p/extra/helper.so", b"not really")  # by name
        archive.writestr("p/data/weights/weight_9", b"\x7fELF\x02\x01")  # by magic number
        archive.writestr("p/data/weights/weight_0", b"\x00" * 16)
        archive.writestr("p/models/model.json", b"{}")
        archive.writestr("p/archive_format", b"pt2")
    with zipfile.ZipFile(io.BytesIO(out.getvalue())) as archive:
        found = compiled_members(archive)
    assert found == ["p/data/aotinductor/model/x.json", "p/extra/helper.so", "p/data/weights/weight_9"]
    with pytest.raises(IntegrityError, match="holds compiled code"):
        load_exported_program(out.getvalue())


@pytest.mark.parametrize("damage", ["encrypted", "corrupt"])
def test_a_member_that_cannot_be_read_is_one_line(exported, tmp_path, damage):
    """A member flagged encrypted, or a deflated one whose stream is garbage: tk inspect and tk check end
    in one line naming it (review: both were tracebacks)."""
    root = tmp_path / "art"
    shutil.copytree(exported("mlp", ("torch",)).root, root)
    program = zipfile.ZipFile(io.BytesIO((root / "program.pt2").read_bytes()))
    top = program.infolist()[0].filename.split("/", 1)[0]
    out = program_with(root, lambda archive, top: archive.writestr(
        zipfile.ZipInfo(f"{top}/extra/blob"), b"x" * 64, compress_type=zipfile.ZIP_DEFLATED))  # fmt: skip
    data = bytearray(out.getvalue())
    local = data.rfind(b"PK\x03\x04")  # the last member's local header
    central = data.rfind(b"PK\x01\x02")  # and its central directory entry
    if damage == "encrypted":
        for header, flag_at in ((central, 8), (local, 6)):
            data[header + flag_at] |= 0x01
    else:
        start = local + 30 + len(f"{top}/extra/blob")
        end = data.find(b"PK\x01\x02", start)  # the deflated bytes end where the central directory begins
        data[start:end] = b"\xff" * (end - start)
    rehash(root, {"program.pt2": bytes(data)})
    for args in (["inspect", str(root)], ["check", str(root), "--engine", "torch"]):
        code, stderr = run_cli(*args)
        assert_one_line(code, stderr, "extra/blob")
