"""Issue #10's findings, one test each: crafted artifacts, hostile inputs and limits that hold.

Each test builds the attack for real (a pickle payload that creates a file, a symlink to a file
outside the artifact, a FIFO, a zip bomb) with the manifest's hashes recomputed, as an attacker
without the signing key can, and asserts one clear error, exit code 2 and no code run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.conftest import rehash
from tk.cli import cli
from tk.errors import IntegrityError, TkError, UntrustedArtifactError
from tk.export import ExportOptions
from tk.manifest import read_manifest, verify_artifact
from tk.models import build_model
from tk.runtime import EngineChoice, load
from tk.spec import random_feeds
from tk.workflows.export import export

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_artifact(exported):
    """The session's tiny Transformer in torch and onnx formats; tests copy it before tampering."""
    return exported("transformer", ("torch", "onnx")).root


@pytest.fixture
def artifact(base_artifact, copy_of):
    return copy_of(base_artifact, "art")


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stderr


def infer_with_budget(budget: str, artifact: Path, inputs: Path) -> tuple[int, str]:
    """``tk --max-memory BUDGET infer ARTIFACT --inputs INPUTS``, the outputs beside the inputs."""
    return run_cli(
        "--max-memory", budget, "infer", str(artifact), "--inputs", str(inputs), "--out", str(inputs.with_name("o.npz"))
    )


def assert_one_line(code: int, stderr: str, fragment: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert fragment in lines[0], stderr


# -- critical: a crafted program.pt2 runs no code --------------------------------------------------
class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_archive(data: bytes, edit) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            target.writestr(info, edit(info.filename, source.read(info.filename)))
    return out.getvalue()


def _pickle_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("where", ["sample_inputs", "use_pickle_weight"])
def test_a_crafted_program_runs_no_code(artifact, tmp_path, where):
    marker = tmp_path / "pwned"
    payload = _pickle_bytes(Payload(marker))

    def edit(name: str, content: bytes) -> bytes:
        if where == "sample_inputs" and "sample_inputs/" in name:
            return payload
        if where == "use_pickle_weight" and name.endswith("model_weights_config.json"):
            config = json.loads(content)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            return json.dumps(config).encode()
        if where == "use_pickle_weight" and name.endswith("weights/weight_0"):
            return payload
        return content

    rehash(artifact, {"program.pt2": _rewrite_archive((artifact / "program.pt2").read_bytes(), edit)})
    for command in (
        ["infer", str(artifact), "--engine", "torch", "--random", "2", "--out", str(tmp_path / "o.npz")],
        ["check", str(artifact), "--engine", "torch"],
        ["bench", str(artifact), "--engine", "torch", "--iters", "1", "--batch-sizes", "1"],
    ):
        code, stderr = run_cli(*command)
        assert_one_line(code, stderr, "torch.export.load would unpickle")
    assert not marker.exists(), "the payload ran"


def test_a_program_rewritten_to_read_a_file_is_refused_before_it_runs(tmp_path):
    import copy

    from tk.errors import IntegrityError
    from tk.formats.torch_program import load_exported_program

    class Zeros(torch.nn.Module):
        def forward(self, x):
            return x * 0 + torch.zeros(4)

    program = torch.export.export(Zeros(), (torch.randn(2, 4),))
    bare = copy.copy(program)
    bare.example_inputs = None  # as tk saves programs: no pickled sample inputs
    saved = io.BytesIO()
    torch.export.save(bare, saved)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"0123456789abcdef")

    def edit(name: str, content: bytes) -> bytes:
        if not name.endswith("models/model.json"):
            return content
        model = json.loads(content)
        for node in model["graph_module"]["graph"]["nodes"]:
            if node["target"] == "torch.ops.aten.zeros.default":  # now: map a file outside the artifact
                node["target"] = "torch.ops.aten.from_file.default"
                node["inputs"] = [
                    {"name": "filename", "arg": {"as_string": str(secret)}, "kind": 1},
                    {"name": "shared", "arg": {"as_bool": False}, "kind": 1},
                    {"name": "size", "arg": {"as_int": 4}, "kind": 1},
                ] + [i for i in node["inputs"] if i["name"] != "size"]
        return json.dumps(model).encode()

    crafted = _rewrite_archive(saved.getvalue(), edit)
    with pytest.raises(IntegrityError, match=r"the program calls aten::from_file, which tk does not run"):
        load_exported_program(crafted)
    load_exported_program(saved.getvalue())  # the program as exported loads


@pytest.mark.parametrize("where", ["constant", "if branch"])
def test_an_onnx_graph_reading_a_file_through_a_node_attribute_is_refused(artifact, tmp_path, monkeypatch, where):
    import onnx
    from onnx import helper

    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "key.bin").write_bytes(bytes(range(256)) * 64)
    monkeypatch.chdir(tmp_path)  # a graph loaded from bytes resolves external data against the working directory
    model = onnx.load(artifact / "model.onnx")
    init = model.graph.initializer[0]
    value = onnx.TensorProto(name="c", dims=list(init.dims), data_type=init.data_type)
    value.data_location = onnx.TensorProto.EXTERNAL
    for key, text in (("location", "secrets/key.bin"), ("offset", "0"), ("length", str(4 * int(np.prod(init.dims))))):
        entry = value.external_data.add()
        entry.key, entry.value = key, text
    del model.graph.initializer[0]
    if where == "constant":
        model.graph.node.insert(0, helper.make_node("Constant", [], [init.name], value=value))
    else:
        model.graph.initializer.append(helper.make_tensor("cond", onnx.TensorProto.BOOL, [], [True]))
        out = helper.make_tensor_value_info("sub_out", init.data_type, list(init.dims))
        branch = helper.make_graph([helper.make_node("Constant", [], ["sub_out"], value=value)], "b", [], [out])
        model.graph.node.insert(
            0, helper.make_node("If", ["cond"], [init.name], then_branch=branch, else_branch=branch)
        )
    rehash(artifact, {"model.onnx": model.SerializeToString()})
    code, stderr = run_cli(
        "infer", str(artifact), "--engine", "onnx", "--random", "2", "--out", str(tmp_path / "o.npz")
    )
    assert_one_line(code, stderr, "the graph reads external data from ['secrets/key.bin'], which the manifest does not")
    assert not (tmp_path / "o.npz").exists()
    code, stderr = run_cli("deploy", "triton", str(artifact), "--out", str(tmp_path / "repo"))  # nor copied for Triton
    assert_one_line(code, stderr, "the graph reads external data from ['secrets/key.bin'], which the manifest does not")
    assert not (tmp_path / "repo").exists()


def test_programs_tk_writes_carry_no_pickled_entry(base_artifact):
    from tk.formats.torch_program import pickled_entries

    data = (base_artifact / "program.pt2").read_bytes()
    assert pickled_entries(data) == []
    sample = [n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if "sample_inputs/" in n]
    assert [zipfile.ZipFile(io.BytesIO(data)).getinfo(n).file_size for n in sample] == [0]


# -- critical: nothing outside the artifact is read ---------------------------------------------------
def test_a_symlinked_file_is_refused_and_nothing_about_its_target_leaks(artifact, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(os.urandom(4096))
    (artifact / "weights.safetensors").unlink()
    (artifact / "weights.safetensors").symlink_to(outside)
    rehash(artifact)  # the hash now matches the outside file, as an attacker would make it
    for command in (["inspect", str(artifact)], ["check", str(artifact), "--engine", "onnx"]):
        code, stderr = run_cli(*command)
        assert_one_line(code, stderr, "weights.safetensors: a symbolic link")
        secret_hash = hashlib.sha256(outside.read_bytes()).hexdigest()
        assert secret_hash[:12] not in stderr and "4096" not in stderr


def test_a_symlinked_model_and_directory_are_refused(artifact, tmp_path, base_artifact):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(base_artifact / "model.onnx", elsewhere / "model.onnx")
    (artifact / "model.onnx").unlink()
    (artifact / "model.onnx").symlink_to(elsewhere / "model.onnx")
    rehash(artifact)
    with pytest.raises(IntegrityError, match=r"model\.onnx: a symbolic link"):
        load(artifact, "onnx").load()


def test_hard_links_and_fifos_inside_an_artifact_are_refused(artifact, tmp_path):
    os.link(artifact / "model.onnx", tmp_path / "second-name.onnx")
    with pytest.raises(IntegrityError, match="a hard link"):
        verify_artifact(artifact)
    (tmp_path / "second-name.onnx").unlink()
    (artifact / "model.onnx").unlink()
    os.mkfifo(artifact / "model.onnx")
    with pytest.raises(IntegrityError, match="not a regular file"):
        verify_artifact(artifact)  # returns at once: a FIFO is never opened for a blocking read


# -- high: a verified file cannot change before it is loaded -----------------------------------------
def test_a_file_rewritten_after_verification_is_caught_at_load(artifact):
    manifest = verify_artifact(artifact)
    path = artifact / "program.pt2"
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime restored
    with pytest.raises(IntegrityError, match=r"program\.pt2: sha256 .* \(altered\)"):
        load(artifact, "torch", manifest=manifest).load()


# -- high: numbers a user gives are validated --------------------------------------------------------
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--rtol", "nan"], "--rtol: expected a finite tolerance"),
        (["--atol", "nan"], "--atol: expected a finite tolerance"),
        (["--rtol", "-1"], "--rtol: expected a finite tolerance"),
    ],
)
def test_nan_or_negative_tolerances_are_refused(artifact, args, fragment):
    code, stderr = run_cli("check", str(artifact), "--engine", "onnx", *args)
    assert_one_line(code, stderr, fragment)


@pytest.mark.parametrize("engine", ["torch", "onnx"])
@pytest.mark.parametrize(
    "bad, fragment", [(1000, "token id 1000 is outside"), (-1, "token id -1 is outside"), (10**9, "outside")]
)
def test_token_ids_outside_the_vocabulary_are_refused(artifact, engine, bad, fragment):
    with load(artifact, engine) as e:
        feeds = random_feeds(e.inputs, {"batch": 2, "seq": 5})
        feeds["input_ids"][1, 2] = bad
        with pytest.raises(TkError, match=fragment):
            e.run(feeds)


def test_an_all_padding_mask_row_is_refused(artifact, tmp_path):
    with load(artifact, "onnx") as e:
        feeds = random_feeds(e.inputs, {"batch": 3, "seq": 5})
        feeds["attention_mask"][2] = 0
        with pytest.raises(TkError, match="row 2 of the attention mask is all 0"):
            e.run(feeds)
    np.savez(tmp_path / "in.npz", **feeds)
    code, stderr = run_cli(
        "infer", str(artifact), "--inputs", str(tmp_path / "in.npz"), "--out", str(tmp_path / "o.npz")
    )
    assert_one_line(code, stderr, "row 2 of the attention mask is all 0")


# -- medium: hangs ---------------------------------------------------------------------------------
def test_bench_with_a_nan_budget_is_refused(artifact):
    code, stderr = run_cli("bench", str(artifact), "--engine", "onnx", "--seconds", "nan")
    assert_one_line(code, stderr, "--seconds: expected a finite time budget")


def test_a_fifo_in_an_input_directory_is_refused_without_blocking(artifact, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    os.mkfifo(inputs / "input_ids.npy")
    np.save(inputs / "attention_mask.npy", np.ones((2, 4), dtype=np.int64))
    done = subprocess.run(
        [sys.executable, "-m", "tk", "infer", str(artifact), "--inputs", str(inputs), "--out", str(tmp_path / "o.npz")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_line(done.returncode, done.stderr, "not a regular file")


# -- medium: tracebacks become one line ---------------------------------------------------------------
def _npz_with_header(path: Path, shape: tuple[int, ...]) -> None:
    """An .npz whose one array declares ``shape`` but holds a few bytes (a crafted header, a zip bomb)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("input_ids.npy", header.getvalue() + b"\\0" * 64)
        z.writestr("attention_mask.npy", header.getvalue() + b"\\0" * 64)


def test_a_huge_declared_npz_ends_in_one_line_before_allocating(artifact, tmp_path):
    _npz_with_header(tmp_path / "bomb.npz", (100_000, 1_000_000))
    code, stderr = infer_with_budget("1G", artifact, tmp_path / "bomb.npz")
    assert_one_line(code, stderr, "over tk's memory budget of 1.0 GiB")


def test_a_zip_bomb_npz_is_refused_by_the_budget(artifact, tmp_path):
    ids = np.zeros((4096, 64), dtype=np.int64)  # 2 MiB that compress to a few KiB
    np.savez_compressed(tmp_path / "bomb.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    assert (tmp_path / "bomb.npz").stat().st_size < 100_000
    code, stderr = infer_with_budget("1M", artifact, tmp_path / "bomb.npz")
    assert_one_line(code, stderr, "over tk's memory budget")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["infer", "ART", "--random", str(10**11), "--out", "OUT/o.npz"], "over tk's memory budget"),
        (["bench", "ART", "--engine", "onnx", "--seq", "0", "--iters", "1"], "expected a size of at least 1"),
        (["inspect", "ART/" + "x" * 5000], "File name too long"),
        (["check", "ART", "--engine", "onnx", "--samples", "0"], "--samples: expected 1 or more"),
    ],
)
def test_bad_numbers_and_paths_end_in_one_line(artifact, tmp_path, args, fragment):
    args = [a.replace("ART", str(artifact)).replace("OUT", str(tmp_path)) for a in args]
    code, stderr = run_cli(*args)
    assert_one_line(code, stderr, fragment)


def test_sequences_of_length_zero_are_refused(artifact, tmp_path):
    np.savez(tmp_path / "empty.npz", input_ids=np.zeros((2, 0), np.int64), attention_mask=np.zeros((2, 0), np.int64))
    code, stderr = run_cli(
        "infer", str(artifact), "--inputs", str(tmp_path / "empty.npz"), "--out", str(tmp_path / "o.npz")
    )
    assert_one_line(code, stderr, "expected every size to be at least 1")


def test_export_with_a_huge_range_is_refused_before_allocating(tmp_path):
    code, stderr = run_cli(
        "--max-memory", "2G", "export", "transformer", "--size", "tiny", "--format", "onnx",
        "--batch", f"1:8:{10**9}", "--out", str(tmp_path / "x"),
    )  # fmt: skip
    assert_one_line(code, stderr, "over tk's memory budget")


def test_onnxruntime_run_errors_end_in_one_line(artifact):
    import onnx

    model = onnx.load(artifact / "model.onnx")
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 16  # the graph now says seq is fixed at 16
    rehash(artifact, {"model.onnx": model.SerializeToString()})
    with load(artifact, "onnx") as e:
        with pytest.raises(TkError, match="engine 'onnx' failed while running"):
            e.run(random_feeds(e.inputs, {"batch": 2, "seq": 4}))


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda m: m["files"][0].__setitem__("path", 7), "files[0]: expected string path and role"),
        (lambda m: m["model"]["config"].__setitem__("hiddn", 3), "unknown config key(s) hiddn"),
        (lambda m: m["model"].__setitem__("name", None), "model.name: expected a name"),
        (lambda m: m["check"].__setitem__("onnx", {}), "check.onnx: expected a parity report"),
        (lambda m: m["signature"]["dims"]["seq"].__setitem__("max", 10**12), "over tk's memory budget"),
        (lambda m: m["model"]["config"].__setitem__("hidden", 10**7), "over tk's memory budget"),
        # sized from builds at 1 and 2 layers: building a million on the meta device took over 5 minutes
        (lambda m: m["model"]["config"].__setitem__("layers", 10**6), "over tk's memory budget"),
    ],
)
def test_malformed_manifests_with_valid_checksums_end_in_one_line(artifact, edit, fragment):
    data = json.loads((artifact / "manifest.json").read_text())
    edit(data)
    data.pop("checksum")
    from tk.manifest import _canonical

    data["checksum"] = hashlib.sha256(_canonical(data)).hexdigest()
    (artifact / "manifest.json").write_text(json.dumps(data))
    code, stderr = run_cli("--max-memory", "4G", "check", str(artifact), "--engine", "onnx")
    assert_one_line(code, stderr, fragment)


def test_user_model_spec_errors_and_system_exit_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "usermods.py").write_text(
        "import sys, torch\n"
        "from tk.models import UserModel\n"
        "def bad_axis():\n"
        "    return UserModel(torch.nn.Linear(3, 2), {'x': torch.ones(2, 3)}, dynamic_dims={'x': {5: 'batch'}})\n"
        "def as_list():\n"
        "    return UserModel(torch.nn.Linear(3, 2), [torch.ones(2, 3)])\n"
        "def leaves():\n"
        "    sys.exit(0)\n"
    )
    for name, fragment in (
        ("bad_axis", "axis 5 is not an axis of the example"),
        ("as_list", "expected a dict of input name -> torch.Tensor, got list"),
        ("leaves", "calling it failed: SystemExit"),
    ):
        code, stderr = run_cli("export", f"usermods:{name}", "--format", "torch", "--out", str(tmp_path / name))
        assert_one_line(code, stderr, fragment)
        assert not (tmp_path / name).exists()


# -- low -----------------------------------------------------------------------------------------------
def test_a_kill_between_the_two_renames_is_recovered_on_the_next_run(tmp_path):
    from tk.export import recover_interrupted

    out = tmp_path / "art"
    export(build_model("linear", size="tiny"), out, ExportOptions(formats=("torch",)))
    before = read_manifest(out).files
    old = tmp_path / ".art.abc123.old"  # what a kill after the first of two renames leaves
    old.mkdir()
    os.replace(out, old / "artifact")
    recover_interrupted(out)
    assert read_manifest(out).files == before and not old.exists()


def test_a_stray_module_in_the_working_directory_shadows_nothing(tmp_path):
    marker = tmp_path / "shadowed"
    (tmp_path / "onnxruntime.py").write_text(f"open({str(marker)!r}, 'w')\nraise SystemExit('stray module imported')\n")
    (tmp_path / "mymodel.py").write_text(
        "import torch\nimport onnxruntime\n\ndef build():\n    return torch.nn.Linear(3, 2)\n"
    )
    tk_command = Path(sys.executable).parent / "tk"  # the installed command (python -m puts the cwd first itself)
    done = subprocess.run(
        [str(tk_command), "export", "mymodel:build", "--input", "x:float32:2x3", "--format", "onnx",
         "--out", str(tmp_path / "art")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not marker.exists()


def test_training_that_diverges_saves_nothing(tmp_path):
    for lr in ("nan", "1e30"):
        code, stderr = run_cli(
            "train", "linear", "--size", "tiny", "--steps", "20", "--lr", lr, "--out", str(tmp_path / "c.safetensors")
        )
        assert code == 2 and ("finite --lr" in stderr or "training diverged" in stderr), stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_a_reference_that_produces_nan_never_passes(tmp_path):
    spec = build_model("linear", size="tiny")
    with torch.no_grad():
        next(spec.module.parameters()).fill_(float("nan"))
    from tk.errors import ParityError

    with pytest.raises(ParityError, match="the PyTorch reference itself produces"):
        export(spec, tmp_path / "nan", ExportOptions(formats=("onnx",)))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--opset", "99"], "--opset: expected at most"),
        (["--batch", "1:1:8"], "specializes a size of 1 to a constant"),
    ],
)
def test_export_numbers_are_checked(tmp_path, args, fragment):
    code, stderr = run_cli("export", "mlp", "--size", "tiny", "--format", "onnx", "--out", str(tmp_path / "x"), *args)
    assert_one_line(code, stderr, fragment)


@pytest.mark.parametrize("value", ["", "secret"])
def test_the_retired_hmac_key_is_an_error_not_a_false_protection(tmp_path, monkeypatch, value):
    monkeypatch.setenv("TK_SIGNING_KEY", value)
    code, stderr = run_cli("export", "mlp", "--size", "tiny", "--format", "torch", "--out", str(tmp_path / "x"))
    assert_one_line(code, stderr, "TK_SIGNING_KEY is set, but tk no longer uses its HMAC")
    assert not (tmp_path / "x").exists()


# -- issue #20, critical: an AOTInductor package runs native code only when its signer is trusted ------------
PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the package's code ran\\n", f); fclose(f); }
}
"""


@pytest.fixture
def crafted_aoti(exported, tmp_path):
    """A copy of a tiny aoti+onnx+torch artifact whose package's .so is replaced by a library with a
    constructor that writes ``marker``; the manifest re-hashed (sizes, sha256, checksum) as anyone can."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (cc) to build the planted library")
    marker = tmp_path / "marker"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    library = tmp_path / "planted.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(source)], check=True, timeout=120
    )
    root = tmp_path / "crafted"
    shutil.copytree(exported("mlp", ("torch", "onnx", "aoti")).root, root)
    package = root / "model.aoti.pt2"
    original = zipfile.ZipFile(io.BytesIO(package.read_bytes()))
    replaced = io.BytesIO()
    with zipfile.ZipFile(replaced, "w") as out:
        libraries = [i for i in original.infolist() if i.filename.endswith(".so")]
        assert libraries, "the package holds a shared library"
        for info in original.infolist():
            out.writestr(info, library.read_bytes() if info in libraries else original.read(info))
    rehash(root, {"model.aoti.pt2": replaced.getvalue()})
    verify_artifact(root)  # every hash matches: only the signature can tell
    return root, marker


def run_tk(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m tk`` in a fresh process (a library loaded there cannot touch the test process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tk", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_crafted_aoti_package_runs_no_code(crafted_aoti, tmp_path):
    root, marker = crafted_aoti
    for args in (
        ["infer", str(root), "--engine", "aoti", "--random", "2", "--out", str(tmp_path / "o.npz")],
        ["check", str(root), "--engine", "aoti"],
        ["bench", str(root), "--engine", "aoti", "--iters", "1", "--batch-sizes", "1", "--no-baselines"],
        ["debug", "locate", str(root), "--engine", "aoti"],
    ):
        code, stderr = run_cli(*args)
        assert_one_line(code, stderr, "refusing to load the aoti engine")
        for how in ("--public-key FILE", f"tk sign {root}", "--trust-artifact-code"):
            assert how in stderr, stderr
        assert "(changed: manifest.json, model.aoti.pt2)" in stderr, stderr
        assert not marker.exists(), f"{args[0]}: the planted library's code ran"
    with pytest.raises(UntrustedArtifactError):
        load(root, "aoti")
    from tk.serve.config import ServeConfig, resolve

    with pytest.raises(UntrustedArtifactError, match="refusing to load the aoti engine"):
        resolve(ServeConfig(artifact=str(root), engine=EngineChoice("aoti")))  # before Ray or any replica starts
    assert not marker.exists()
    (root / "model.sig").unlink()  # no signature at all: refused the same way
    code, stderr = run_cli("check", str(root), "--engine", "aoti")
    assert_one_line(code, stderr, "because it has no model.sig")
    assert not marker.exists()


@pytest.mark.slow
def test_the_crafted_package_is_a_real_attack(crafted_aoti, tmp_path):
    """The control: told to trust the artifact's code, tk loads it and the constructor runs
    (in a separate process), so the refusals above are what keeps it from running."""
    root, marker = crafted_aoti
    done = run_tk(
        "infer", str(root), "--engine", "aoti", "--random", "2", "--out", str(tmp_path / "o.npz"),
        "--trust-artifact-code", cwd=tmp_path,
    )  # fmt: skip
    assert marker.exists(), done.stderr
    assert "warning: --trust-artifact-code: loading the aoti engine's native code" in done.stderr


@pytest.mark.slow
def test_engine_all_skips_an_untrusted_aoti_and_checks_the_others(crafted_aoti):
    root, marker = crafted_aoti
    result = CliRunner().invoke(cli, ["check", str(root)])
    assert result.exit_code == 0, result.output
    assert "note: skipping aoti, which runs the artifact's native code" in result.stderr
    passed = [ln for ln in result.stdout.splitlines() if ln.startswith("parity passed for ")]
    checked = set(passed[0].removeprefix("parity passed for ").split(", ")) if len(passed) == 1 else set()
    assert {"onnx", "torch"} <= checked and "aoti" not in checked, result.stdout
    assert not marker.exists()


def test_json_nested_past_pythons_recursion_limit_is_one_line(artifact, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "deep.json").write_text(deep)
    code, stderr = run_cli("check", str(artifact), "--engine", "onnx", "--baseline", str(tmp_path / "deep.json"))
    assert_one_line(code, stderr, "not a readable JSON file")
    (artifact / "manifest.json").write_text(deep)
    code, stderr = run_cli("inspect", str(artifact))
    assert_one_line(code, stderr, "expected JSON, found damaged text")


def test_a_golden_file_that_is_not_an_npz_is_one_line(artifact, tmp_path):
    (tmp_path / "garbage.npz").write_bytes(os.urandom(4096))
    code, stderr = run_cli("check", str(artifact), "--engine", "onnx", "--golden", str(tmp_path / "garbage.npz"))
    assert_one_line(code, stderr, "expected an .npz archive of arrays, found something else")


def test_locate_on_inputs_that_make_the_model_nan_says_so(exported, tmp_path):
    root = exported("mlp", ("onnx",)).root
    spec = read_manifest(root).signature.inputs[0]
    x = random_feeds([spec], {"batch": 2}, seed=0)[spec.name]
    x[0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", **{spec.name: x})
    code, stderr = run_cli("debug", "locate", str(root), "--engine", "onnx", "--inputs", str(tmp_path / "nan.npz"))
    assert_one_line(code, stderr, "the PyTorch model itself produces")


def test_external_data_in_a_functions_attribute_default_is_seen():
    import onnx
    from onnx import TensorProto, helper

    from tk.runtime.onnxrt import _external_locations

    value = onnx.TensorProto(name="v", dims=[4], data_type=TensorProto.FLOAT)
    value.data_location = TensorProto.EXTERNAL
    for key, text in (("location", "secret.bin"), ("offset", "0"), ("length", "16")):
        entry = value.external_data.add()
        entry.key, entry.value = key, text
    const = helper.make_node("Constant", [], ["y"])  # takes the function's attribute `value` by reference
    const.attribute.append(onnx.AttributeProto(name="value", ref_attr_name="value", type=onnx.AttributeProto.TENSOR))
    function = helper.make_function("custom", "F", [], ["y"], [const], [helper.make_opsetid("", 20)], attributes=[])
    function.attribute_proto.append(helper.make_attribute("value", value))  # the default a bare call gets
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("F", [], ["out"], domain="custom")], "g", [], [out])
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("custom", 1)]
    model = helper.make_model(graph, functions=[function], opset_imports=opsets)
    assert _external_locations(model.SerializeToString()) == {"secret.bin"}


def test_a_program_that_prints_through_a_higher_order_operator_is_refused(tmp_path):
    from tk.errors import IntegrityError
    from tk.formats.torch_program import load_exported_program, save_exported_program

    class Prints(torch.nn.Module):
        def forward(self, x):
            torch._higher_order_ops.print("{0.__class__.__repr__.__globals__[torch].os.environ[HOME]}", x)
            return x + 1

    save_exported_program(torch.export.export(Prints(), (torch.randn(2),)), tmp_path / "p.pt2")
    with pytest.raises(IntegrityError, match="the program calls the higher-order operator print"):
        load_exported_program((tmp_path / "p.pt2").read_bytes())
