"""``--out`` never destroys what tk did not make, and tk optimize's cache is an input (issue 45, items 2 and 3).

Every test here failed on the code before ``tk.outdir``: a web app's directory holding a ``manifest.json``
was replaced (its files deleted, exit 0), a user's README.md inside an artifact was deleted, a ``.OUT.x.old``
directory planted beside ``--out`` was adopted as the previous artifact or deleted, and a rewritten or
re-pointed candidate in the optimize cache was reused, shipped, and had its user code imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import rehash
from tk.cli import cli
from tk.errors import TkError
from tk.export import ExportOptions, recover_interrupted
from tk.manifest import manifest_bytes, read_manifest, verify_artifact
from tk.models import build_model
from tk.signing import check_signature, sign_artifact
from tk.workflows.export import export
from tk.workflows.optimize import OptimizeOptions, optimize
from tk.workflows.optimize.artifacts import refuse_foreign_out

ROOT = Path(__file__).resolve().parents[1]
LINEAR = ("linear", "--size", "tiny")
OLD = ".art.0123456789ab.old"  # what a kill between swap_into_place's two renames leaves beside --out "art"


def tree(root: Path) -> dict[str, str]:
    """Every entry below ``root`` (links not followed) -> sha256 of a file's bytes, 'dir', or a link's target."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = f"link:{os.readlink(path)}"
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def error_line(result: Any, code: int = 2) -> str:
    """The one ``error:`` line of a CLI run that ended in ``code``, with no traceback."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@contextlib.contextmanager
def logged(name: str) -> Iterator[list[str]]:
    """The messages logged to ``name`` (and below) inside the block, whatever the CLI did to tk's handlers."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def tk(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


def optimize_args(out: Path) -> list[str]:
    return ["optimize", *LINEAR, "--candidates", "onnx fp32", "--seconds", "0.02", "--no-peaks", "--out", str(out)]


def web_app(root: Path) -> Path:
    """A user's directory that holds a ``manifest.json`` that is not tk's (a web app's)."""
    root.mkdir()
    (root / "manifest.json").write_text('{"name": "my web app", "start_url": "/", "icons": []}\n')
    (root / "index.html").write_text("<html>mine</html>\n")
    (root / "static").mkdir()
    (root / "static" / "app.js").write_text("console.log('mine')\n")
    return root


# -- item 2: what --out may replace ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["export", "optimize"])
def test_a_directory_whose_manifest_is_not_tks_is_refused_and_kept(tmp_path: Path, command: str) -> None:
    app = web_app(tmp_path / "webapp")
    before = tree(app)
    args = ["export", *LINEAR, "--format", "torch", "--out", str(app)] if command == "export" else optimize_args(app)
    line = error_line(tk(*args))
    assert line.startswith(f"error: --out {app}: expected an empty directory or a tk artifact whose files verify, ")
    assert "tk will not replace (delete) it" in line
    assert tree(app) == before
    assert [p.name for p in tmp_path.iterdir()] == ["webapp"]  # no staging, no report, no cache left beside it


@pytest.fixture
def art(exported: Any, tmp_path: Path) -> Path:
    """A copy of the tiny linear model's torch artifact, signed by the user's own key, at ``tmp_path/art``."""
    root = tmp_path / "art"
    shutil.copytree(exported("linear", ("torch",)).root, root)
    return root


def test_an_artifact_holding_a_users_file_is_refused_and_force_replaces_it(art: Path, tmp_path: Path) -> None:
    (art / "README.md").write_text("my notes\n")
    (art / "notes").mkdir()
    before = tree(art)
    for args in (["export", *LINEAR, "--format", "torch", "--out", str(art)], optimize_args(art)):
        line = error_line(tk(*args))
        assert line == (
            f"error: --out {art}: a tk artifact that also holds files its manifest.json does not list (README.md, "
            "notes); replacing it would delete them: move them or choose another --out, or pass --force to replace "
            "it and delete them"
        )
        assert tree(art) == before
    result = tk("export", *LINEAR, "--format", "torch", "--out", str(art), "--force")
    assert result.exit_code == 0, result.output
    assert not (art / "README.md").exists() and not (art / "notes").exists()
    manifest = verify_artifact(art)
    assert check_signature(art, manifest).trusted
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


@pytest.mark.parametrize("content", [b"", b"my own signature notes\n"])
def test_a_model_sig_that_does_not_sign_this_manifest_is_the_users_file(art: Path, content: bytes) -> None:
    """Found by the property test below (hypothesis, beside two busy loops): an empty model.sig written into an
    artifact was replaced as if it were tk's signature. A model.sig is tk's only when it signs this manifest."""
    (art / "model.sig").write_bytes(content)
    before = tree(art)
    line = error_line(tk("export", *LINEAR, "--format", "torch", "--out", str(art)))
    assert line.startswith(
        f"error: --out {art}: a tk artifact that also holds files its manifest.json does not list (model.sig)"
    )
    assert tree(art) == before


def test_force_never_replaces_a_directory_that_is_not_a_tk_artifact(tmp_path: Path) -> None:
    app = web_app(tmp_path / "webapp")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("important")
    before = {"webapp": tree(app), "mine": tree(mine)}
    for out, fragment in ((app, "whose files verify"), (mine, "not a tk artifact")):
        line = error_line(tk("export", *LINEAR, "--format", "torch", "--out", str(out), "--force"))
        assert fragment in line
    assert {"webapp": tree(app), "mine": tree(mine)} == before


def test_an_empty_directory_may_be_used(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    result = tk("export", *LINEAR, "--format", "torch", "--out", str(out), "--no-check")
    assert result.exit_code == 0, result.output
    assert verify_artifact(out).formats.keys() == {"torch"}


def _another_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "someone-else.pem"
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)
    return path


def _plant(how: str, old: Path, tmp_path: Path) -> str:
    """Make ``old/artifact`` (a copy of the user's own signed artifact) into what ``how`` says; the note's reason."""
    moved = old / "artifact"
    old.chmod(0o700)
    if how == "writable by others":
        old.chmod(0o777)  # a 1777 directory's neighbour made it so
        return "is writable by others (mode 0777)"
    if how == "broken signature":
        rehash(moved, {"weights.safetensors": b"planted weights"})  # every hash matches: only the signature can tell
        return "its files do not match their signature"
    if how == "signed by a key you do not trust":
        sign_artifact(moved, _another_key(tmp_path))
        return "signed by a key you do not trust"
    if os.getuid() != 0:
        pytest.skip("making a directory another user's needs root (chown)")
    for directory, dirs, files in os.walk(old):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(directory, name), 12345, 12345)
    return "belongs to user id 12345, not to you"


@pytest.mark.parametrize(
    "how", ["writable by others", "broken signature", "signed by a key you do not trust", "another user's"]
)
def test_a_planted_old_directory_is_neither_adopted_nor_deleted(exported: Any, tmp_path: Path, how: str) -> None:
    old = tmp_path / OLD
    old.mkdir()
    shutil.copytree(exported("linear", ("torch",)).root, old / "artifact")
    reason = _plant(how, old, tmp_path)
    planted = tree(old)
    out = tmp_path / "art"
    for _ in range(2):  # --out missing (what adopting would fill), then --out present (what cleaning would delete)
        result = tk("export", *LINEAR, "--format", "torch", "--out", str(out), "--no-check")
        assert result.exit_code == 0, result.output
        assert f"note: left {old} as it is: not an artifact tk moved aside" in result.stderr
        assert reason in result.stderr, result.stderr
        assert tree(old) == planted
    with logged("tk.outdir") as notes:
        refuse_foreign_out(out)  # what tk optimize does first
    assert tree(old) == planted and reason in " ".join(notes)
    assert check_signature(out, verify_artifact(out)).trusted  # the export's own, not the planted one


KILLED_EXPORT = """
import os, signal, sys
from pathlib import Path

import tk.outdir
from tk.export import ExportOptions
from tk.models import build_model
from tk.workflows.export import export

real_replace = os.replace


def no_exchange(a, b):  # the OS cannot swap the two directories: two renames, killed after the first
    def replace_then_die(src, dst):
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_die
    return False


tk.outdir.exchange_paths = no_exchange
export(build_model("linear", size="tiny"), Path(sys.argv[1]), ExportOptions(formats=("torch",), check=False))
"""


def test_a_run_killed_between_the_two_renames_is_put_back(art: Path, tmp_path: Path) -> None:
    before = read_manifest(art).files
    done = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(art)], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not art.exists()
    (old,) = [p for p in tmp_path.iterdir() if p.name.endswith(".old")]
    assert re.fullmatch(r"\.art\.[0-9a-f]{12}\.old", old.name)  # unguessable: another user cannot name it first
    assert os.stat(old).st_mode & 0o777 == 0o700  # private: no one else can put anything in it
    recover_interrupted(art)
    assert read_manifest(art).files == before and not old.exists()
    assert check_signature(art, verify_artifact(art)).trusted


# -- item 3: the optimize cache is an input -------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache of one tk optimize of the tiny linear model (onnx fp32 only): copy it before changing it."""
    base = tmp_path_factory.mktemp("optimize-cache")
    result = optimize(build_model("linear", size="tiny"), base / "out", _options(base / "cache"))
    assert result.exports == 1
    return base / "cache"


def _options(cache: Path) -> OptimizeOptions:
    return OptimizeOptions(candidates=("onnx fp32",), seconds=0.02, peaks=False, cache_dir=cache)


def _cached_group(first_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "cache"
    shutil.copytree(first_run, cache)
    (group,) = [p for p in cache.iterdir() if p.is_dir()]
    return cache, group


def _rewrite_onnx(group: Path) -> bytes:
    """Rewrite the cached candidate's graph (the same outputs, a planted property) and its manifest's hashes, as
    anyone who can write there can; only its signature tells. The new bytes."""
    import onnx

    model = onnx.load(group / "model.onnx")
    onnx.helper.set_model_props(model, {"planted": "rewritten after the fact"})
    planted = model.SerializeToString()
    rehash(group, {"model.onnx": planted})
    return planted


def test_a_rewritten_cached_candidate_is_rebuilt_and_never_wins(first_run: Path, tmp_path: Path) -> None:
    cache, group = _cached_group(first_run, tmp_path)
    planted = _rewrite_onnx(group)
    with logged("tk.optimize") as notes:
        result = optimize(build_model("linear", size="tiny"), tmp_path / "out", _options(cache))
    assert (result.exports, result.cache_hits) == (1, 0)
    shipped = (tmp_path / "out" / "model.onnx").read_bytes()
    assert b"rewritten after the fact" not in shipped
    assert check_signature(tmp_path / "out", verify_artifact(tmp_path / "out")).trusted
    (aside,) = [p for p in cache.iterdir() if p.name.endswith(".discarded")]  # tk's own: moved out of the way
    assert aside.name.startswith(f".{group.name}.") and (aside / "model.onnx").read_bytes() == planted
    assert "cannot be reused (its signature: its files do not match their signature" in " ".join(notes)


def test_a_cached_candidate_that_is_not_the_users_is_left_alone_and_not_used(first_run: Path, tmp_path: Path) -> None:
    cache, group = _cached_group(first_run, tmp_path)
    _rewrite_onnx(group)
    group.chmod(0o777)  # writable by others: not a directory tk made for this user
    before = tree(group)
    result = optimize(build_model("linear", size="tiny"), tmp_path / "out", _options(cache))
    assert (result.exports, result.cache_hits) == (1, 0)
    assert tree(group) == before  # untouched, and the winner came from a new directory beside it
    assert Path(result.winner.artifact).parent == cache and Path(result.winner.artifact) != group
    assert b"rewritten after the fact" not in (tmp_path / "out" / "model.onnx").read_bytes()


@pytest.mark.parametrize("signed", [False, True], ids=["signature-broken", "re-signed-with-your-key"])
def test_a_cached_manifest_naming_user_code_is_never_imported(
    first_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: bool
) -> None:
    """Re-signed with the user's own key, the entry is reused, and still its code is not imported: the
    reference the candidates are judged and timed against is the model optimize built, in memory."""
    marker = tmp_path / "marker"
    module = f"tk_planted_cache_{'signed' if signed else 'broken'}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\ndef build():\n    raise SystemExit('built')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    cache, group = _cached_group(first_run, tmp_path)
    manifest = read_manifest(group)
    manifest.model.update(name=f"{module}:build", size=None)  # as a user model's manifest says
    (group / "manifest.json").write_bytes(manifest_bytes(manifest))
    if signed:
        sign_artifact(group)
    try:
        result = optimize(build_model("linear", size="tiny"), tmp_path / "out", _options(cache))
    finally:
        assert not marker.exists(), "a cached manifest's user code was imported"
    assert module not in sys.modules
    assert (result.cache_hits, result.exports) == ((1, 0) if signed else (0, 1))
    assert result.winner is not None and result.winner.status == "passed"


def test_the_winner_is_copied_from_bytes_checked_as_they_are_copied(first_run: Path, tmp_path: Path) -> None:
    from tk.errors import IntegrityError
    from tk.workflows.optimize.artifacts import write_winner
    from tk.workflows.optimize.candidates import Candidate

    cache, group = _cached_group(first_run, tmp_path)
    manifest = verify_artifact(group)
    (group / "model.onnx").write_bytes((group / "model.onnx").read_bytes() + b"\0")  # changed after it was judged
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=r"model\.onnx: changed since it was checked .*nothing was written"):
        write_winner(out, group, manifest, Candidate("onnx", "fp32", "onnx"), {}, {"accuracy": "sqnr>=35"}, {}, [],
                     cache)  # fmt: skip
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["cache"]


# -- the property: every file tk did not write is byte-identical ----------------------------------------------
NAMES = ["manifest.json", "model.sig", "README.md", "weights.safetensors", "program.pt2", "model.onnx", ".candidates",
         "candidates", "artifact", "notes"]  # fmt: skip
BESIDE = [OLD.replace(".art.", ".out."), ".out.1.old", ".out.fedcba987654.partial", "other", ".out.old", "out.json"]


@st.composite
def user_trees(draw: Any) -> tuple[str, list[tuple[str, bytes]]]:
    """What --out starts as (nothing, an empty directory, a tk artifact) and the user's files, by relative path
    from --out's parent: under ``out/`` and beside it."""
    start = draw(st.sampled_from(["nothing", "empty", "artifact"]))
    files = []
    for _ in range(draw(st.integers(0, 5))):
        top = draw(st.sampled_from(["out", *BESIDE]))
        rest = draw(st.lists(st.sampled_from(NAMES), min_size=0 if top != "out" else 1, max_size=3))
        files.append(("/".join([top, *rest]), draw(st.binary(min_size=0, max_size=32))))
    return start, files


def _lay_out(root: Path, start: str, files: list[tuple[str, bytes]], artifact: Path) -> dict[str, str]:
    """Build the tree under ``root``; the user's files (path -> sha256), each that could be written."""
    out = root / "out"
    if start == "empty":
        out.mkdir()
    elif start == "artifact":
        shutil.copytree(artifact, out)
    mine: dict[str, str] = {}
    for rel, data in files:
        path = root / rel
        if any(p.exists() and not p.is_dir() for p in path.parents) or path.is_dir():
            continue  # a file where a directory is wanted, or the reverse: this one cannot be laid out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        mine[rel] = hashlib.sha256(data).hexdigest()
    return mine


def _run(command: str, out: Path, exported: Any, cache: Path, force: bool) -> set[str]:
    """Run ``command`` to ``out`` (a refusal is an outcome like any other); what it says it wrote, from out's parent."""
    try:
        if command == "export":
            export(build_model("linear", size="tiny"), out, ExportOptions(formats=("torch",), check=False))
        elif command == "optimize":
            optimize(build_model("linear", size="tiny"), out, _options(cache))
        else:
            from tk.serve.triton import deploy_triton

            written = deploy_triton(exported("linear", ("onnx",)).root, out, force=force)
            return {f"out/{p.as_posix()}" for p in written.files}
    except TkError:
        pass
    return set()


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", ["export", pytest.param("optimize", marks=pytest.mark.fits(seconds=75)), "deploy"]
)  # optimize: 54 s on the 2-core AVX2 EPYC
@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=user_trees(), force=st.booleans())
@example(layout=("artifact", [("out/README.md", b"mine")]), force=False)
@example(layout=("nothing", [(f"{OLD.replace('.art.', '.out.')}/artifact/manifest.json", b"{}")]), force=False)
def test_every_file_tk_did_not_write_is_byte_identical(
    exported: Any, first_run: Path, command: str, layout: tuple[str, list[tuple[str, bytes]]], force: bool
) -> None:
    start, files = layout
    with tempfile.TemporaryDirectory() as where:
        root = Path(where)
        mine = _lay_out(root, start, files, exported("linear", ("torch",)).root)
        written = _run(command, root / "out", exported, first_run, force and command == "deploy")
        kept = {rel: digest for rel, digest in mine.items() if rel not in written}
        assert {rel: digest for rel, digest in tree(root).items() if rel in kept} == kept
