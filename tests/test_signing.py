"""``tk.signing``: the user's key, ``model.sig`` over every file, whom ``tk`` trusts, ``tk sign`` and ``tk inspect``.

The session's key lives in a temporary ``XDG_CONFIG_HOME`` (tests/conftest.py); a test that
plays another user points ``XDG_CONFIG_HOME`` somewhere else.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.conftest import rehash
from tk.cli import cli
from tk.errors import IntegrityError, UntrustedArtifactError, UsageError
from tk.keys import (
    PRIVATE_KEY,
    PUBLIC_KEY,
    TRUSTED_DIR,
    TRUSTED_KEYS_ENV,
    config_dir,
    ensure_own_key,
    fingerprint_of_file,
    trusted_key_files,
)
from tk.manifest import manifest_bytes, read_manifest
from tk.runtime import load
from tk.runtime.eager import module_from_manifest
from tk.signing import SIGNATURE, TrustPolicy, check_signature, sign_artifact

ROOT = Path(__file__).resolve().parents[1]
MODEL_SIGNING = Path(sys.executable).with_name("model_signing")


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def key_pair(directory: Path, name: str = "other") -> tuple[Path, Path]:
    """A P-256 key pair written as PEM files, as another person would make with openssl (private: mode 0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


@pytest.fixture(scope="module")
def torch_artifact(exported):
    """The session's tiny mlp in the torch format (no native code), exported (and signed) once: read, never changed."""
    return exported("mlp", ("torch",)).root


@pytest.fixture
def copy(torch_artifact, copy_of):
    return copy_of(torch_artifact, "copy")


@pytest.fixture
def aoti_copy(exported, copy_of):
    return copy_of(exported("mlp", ("torch", "onnx", "aoti")).root, "aoti")


@pytest.fixture
def other_user(tmp_path, monkeypatch):
    """Run as a user with their own (different) config directory."""
    home = tmp_path / "other-user-config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    return home


# -- the user's own key ----------------------------------------------------------------------------
def test_own_key_is_made_once_private_beside_its_public_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    private, public = ensure_own_key()
    assert private == tmp_path / "xdg" / "tk" / PRIVATE_KEY and public == private.with_name(PUBLIC_KEY)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700
    first = private.read_bytes()
    assert b"BEGIN PRIVATE KEY" in first and b"BEGIN PUBLIC KEY" in public.read_bytes()
    assert ensure_own_key() == (private, public) and private.read_bytes() == first  # never replaced
    assert [p.name for p in private.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_without_xdg_the_key_lives_in_home_config(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config_dir() == tmp_path / ".config" / "tk"


def test_concurrent_first_use_makes_one_key(tmp_path, monkeypatch):
    from tests.conftest import run_in_threads

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    seen: list[bytes] = []
    errors = run_in_threads(lambda: seen.append(ensure_own_key()[0].read_bytes()), threads=4)
    assert errors == [] and len(set(seen)) == 1


# -- signing ---------------------------------------------------------------------------------------
def test_export_signs_and_the_model_signing_cli_verifies_it(torch_artifact, tmp_path):
    assert (torch_artifact / SIGNATURE).is_file()
    public = ensure_own_key()[1]
    done = subprocess.run(
        [str(MODEL_SIGNING), "verify", "key", str(torch_artifact), "--signature", str(torch_artifact / SIGNATURE),
         "--public_key", str(public)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stdout + done.stderr
    bundle = json.loads((torch_artifact / SIGNATURE).read_text())
    payload = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    names = sorted(r["name"] for r in payload["predicate"]["resources"])
    assert names == sorted(p.name for p in torch_artifact.iterdir() if p.name != SIGNATURE)


def test_tk_sign_with_another_key_verifies_with_model_signing(copy, tmp_path):
    private, public = key_pair(tmp_path)
    result = invoke("sign", str(copy), "--private-key", str(private))
    assert result.exit_code == 0, result.output
    assert fingerprint_of_file(public) in result.stdout
    done = subprocess.run(
        [str(MODEL_SIGNING), "verify", "key", str(copy), "--signature", str(copy / SIGNATURE), "--public_key", str(public)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not check_signature(copy, read_manifest(copy)).trusted  # the session's own key did not sign it
    found = check_signature(copy, read_manifest(copy), TrustPolicy(public_keys=(public,)))
    assert found.trusted and found.fingerprint == fingerprint_of_file(public) and found.key == public


def test_tk_sign_show_public_key_prints_the_own_key():
    result = invoke("sign", "--show-public-key")
    public = ensure_own_key()[1]
    assert result.exit_code == 0 and str(public) in result.stdout and fingerprint_of_file(public) in result.stdout


def test_tk_sign_refuses_a_tampered_artifact(copy):
    (copy / "program.pt2").write_bytes((copy / "program.pt2").read_bytes() + b"x")
    result = invoke("sign", str(copy))
    assert result.exit_code == 2 and "program.pt2" in result.stderr and "Traceback" not in result.output


# -- verifying -------------------------------------------------------------------------------------
def test_own_export_is_trusted_and_names_its_signer(torch_artifact):
    found = check_signature(torch_artifact, read_manifest(torch_artifact))
    assert found.trusted and found.fingerprint == fingerprint_of_file(ensure_own_key()[1]), found


@pytest.mark.parametrize(
    "change, reason",
    [
        ("append", "(changed: manifest.json, weights.safetensors)"),  # a file's bytes, manifest re-hashed
        ("extra", "(added: extra.so)"),  # a file added beside the others
        ("remove", "(removed: program.pt2; changed: manifest.json)"),  # the signature still names it
        ("manifest", "(changed: manifest.json)"),  # the manifest edited, its checksum redone
        ("unsigned", f"no {SIGNATURE}"),
        ("garbage", "not a model_signing bundle"),
    ],
)
def test_any_change_after_signing_is_not_trusted(copy, change, reason):
    if change == "append":
        (copy / "weights.safetensors").write_bytes((copy / "weights.safetensors").read_bytes() + b"\0")
        rehash(copy)
    elif change == "extra":
        (copy / "extra.so").write_bytes(b"\x7fELF")
    elif change == "remove":
        manifest = read_manifest(copy)
        manifest.files = [e for e in manifest.files if e.role != "torch"]
        (copy / "program.pt2").unlink()
        (copy / "manifest.json").write_bytes(manifest_bytes(manifest))
    elif change == "manifest":
        manifest = read_manifest(copy)
        manifest.created = "edited"
        (copy / "manifest.json").write_bytes(manifest_bytes(manifest))  # its checksum redone too
    elif change == "unsigned":
        (copy / SIGNATURE).unlink()
    else:
        (copy / SIGNATURE).write_text("{not json")
    found = check_signature(copy, read_manifest(copy))
    assert not found.trusted and reason in found.reason, found


@pytest.mark.parametrize("source", ["", "0" * 64])
def test_only_the_signed_manifest_bytes_are_trusted(torch_artifact, source):
    """A manifest built in memory, or read from other bytes than those signed (swapped between the
    signature check of the directory and the read), is not trusted."""
    manifest = read_manifest(torch_artifact)
    manifest.source_sha256 = source
    found = check_signature(torch_artifact, manifest)
    assert not found.trusted and "manifest.json is not the one that was signed" in found.reason


def test_trusted_keys_setting_and_directory(copy, tmp_path, monkeypatch):
    private, public = key_pair(tmp_path)
    sign_artifact(copy, private)
    manifest = read_manifest(copy)
    assert not check_signature(copy, manifest).trusted
    monkeypatch.setenv(TRUSTED_KEYS_ENV, os.pathsep.join([str(tmp_path / "absent.pem"), str(public)]))
    with pytest.raises(UsageError, match="cannot read this trusted public key"):
        check_signature(copy, manifest)  # a named key file that cannot be read is an error, never skipped
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    assert check_signature(copy, manifest).trusted
    monkeypatch.delenv(TRUSTED_KEYS_ENV)
    other_home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(other_home))
    (other_home / "tk" / TRUSTED_DIR).mkdir(parents=True)
    assert not check_signature(copy, manifest).trusted
    shutil.copy(public, other_home / "tk" / TRUSTED_DIR / "colleague.pem")
    assert trusted_key_files() == [other_home / "tk" / TRUSTED_DIR / "colleague.pem"]
    assert check_signature(copy, manifest).trusted


def test_a_non_key_public_key_file_is_one_line(copy, tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(UsageError, match="expected a PEM public key"):
        check_signature(copy, read_manifest(copy), TrustPolicy(public_keys=(bad,)))


# -- native code loads only from trusted artifacts --------------------------------------------------
@pytest.mark.slow
def test_own_aoti_export_loads_with_no_flag(aoti_copy):
    with load(aoti_copy, "aoti") as engine:
        out = engine.run({"x": np.ones((2, 8), "float32")})
    assert out["logits"].shape == (2, 4)


@pytest.mark.slow
def test_another_users_aoti_needs_their_public_key(aoti_copy, tmp_path):
    private, public = key_pair(tmp_path)
    assert invoke("sign", str(aoti_copy), "--private-key", str(private)).exit_code == 0
    with pytest.raises(UntrustedArtifactError, match="signed by a key you do not trust"):
        load(aoti_copy, "aoti")
    refused = invoke("infer", str(aoti_copy), "--engine", "aoti", "--random", "2", "--out", str(tmp_path / "o.npz"))
    assert refused.exit_code == 2 and "--public-key" in refused.stderr and "tk sign" in refused.stderr
    trusted = invoke(
        "infer", str(aoti_copy), "--engine", "aoti", "--random", "2", "--out", str(tmp_path / "o.npz"),
        "--public-key", str(public),
    )  # fmt: skip
    assert trusted.exit_code == 0, trusted.output
    assert (tmp_path / "o.npz").is_file()


@pytest.mark.slow
def test_aoti_changed_after_signing_is_refused_before_loading(aoti_copy, tmp_path):
    (aoti_copy / "weights.safetensors").write_bytes((aoti_copy / "weights.safetensors").read_bytes() + b"\0")
    rehash(aoti_copy)
    with pytest.raises(UntrustedArtifactError, match="do not match their signature"):
        load(aoti_copy, "aoti")


@pytest.mark.slow
def test_inspect_shows_an_untrusted_signer_and_native_code(aoti_copy, other_user):
    signer = check_signature(aoti_copy, read_manifest(aoti_copy)).fingerprint  # the key hint, as another user sees it
    shown = invoke("inspect", str(aoti_copy))
    assert shown.exit_code == 0, shown.output
    assert (
        f"by key {signer}: NOT trusted here" in shown.stdout
        and "native     aoti" in shown.stdout
        and "refused unless" in shown.stdout
    )


def test_inspect_shows_the_fingerprint_of_a_trusted_signer(torch_artifact):
    shown = invoke("inspect", str(torch_artifact))
    assert shown.exit_code == 0, shown.output
    own = fingerprint_of_file(ensure_own_key()[1])
    assert f"by key {own}" in shown.stdout and "verified, trusted" in shown.stdout
    assert "native     none" in shown.stdout


# -- user model code: the signature replaces the HMAC ----------------------------------------------
def test_user_model_rebuilds_without_flag_when_signed_by_a_trusted_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    out = tmp_path / "scorer"
    assert invoke("export", "examples.user_model:scorer", "--format", "torch", "--out", str(out)).exit_code == 0
    module_from_manifest(out, read_manifest(out))  # the user's own export: no --trust-model-code
    own_public = ensure_own_key()[1]
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "someone-else"))
    with pytest.raises(IntegrityError, match="user code"):
        module_from_manifest(out, read_manifest(out))
    module_from_manifest(out, read_manifest(out), trust=TrustPolicy(public_keys=(own_public,)))


def test_the_retired_hmac_key_is_refused_in_one_line(torch_artifact, monkeypatch):
    monkeypatch.setenv("TK_SIGNING_KEY", "secret")
    result = invoke("inspect", str(torch_artifact))
    assert result.exit_code == 2 and "TK_SIGNING_KEY is set, but tk no longer uses its HMAC" in result.stderr


def test_an_ignored_cache_directory_may_change_without_breaking_the_signature(copy):
    """tk optimize keeps its candidates' cache inside the winner's directory; the manifest never lists it."""
    (copy / ".candidates").mkdir()
    (copy / ".candidates" / "a.json").write_text("{}")
    sign_artifact(copy, ignore=(".candidates",))
    (copy / ".candidates" / "b.json").write_text("{}")
    assert check_signature(copy, read_manifest(copy)).trusted
    done = subprocess.run(
        [str(MODEL_SIGNING), "verify", "key", str(copy), "--signature", str(copy / SIGNATURE),
         "--public_key", str(ensure_own_key()[1])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (copy / "extra.bin").write_bytes(b"x")  # anything else still breaks it
    assert not check_signature(copy, read_manifest(copy)).trusted


def test_a_public_key_that_cannot_be_used_is_an_error_even_without_native_code(tmp_path):
    art = tmp_path / "mlp"
    assert (
        CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--format", "onnx", "--out", str(art)]).exit_code
        == 0
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    good = tmp_path / "good.pem"
    key = ec.generate_private_key(ec.SECP384R1()).public_key()
    good.write_bytes(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for path, says in (
        (tmp_path / "missing.pem", "cannot read this public key"),
        (garbage, "expected a PEM public key"),
    ):
        result = CliRunner().invoke(cli, ["inspect", str(art), "--public-key", str(path)])
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert CliRunner().invoke(cli, ["inspect", str(art), "--public-key", str(good)]).exit_code == 0


def test_a_key_on_a_curve_model_signing_does_not_take_is_one_line(tmp_path):
    art = tmp_path / "mlp"
    assert (
        CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--format", "onnx", "--out", str(art)]).exit_code
        == 0
    )
    key = tmp_path / "k1.pem"
    private = ec.generate_private_key(ec.SECP256K1())
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key.chmod(0o600)
    result = CliRunner().invoke(cli, ["sign", str(art), "--private-key", str(key)])
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Unsupported key for curve 'secp256k1'" in lines[0], (
        result.stderr
    )


# -- what a signature covers: the same files when signing and verifying ----------------------------
GIT_PATHS = (".git/config", ".github/workflows/ci.yml", ".gitattributes", ".gitignore")


@pytest.mark.parametrize("added", GIT_PATHS)
def test_a_git_file_added_after_signing_breaks_the_signature(copy, added):
    """model_signing's verifier leaves git's files out by default; tk signs them, so it must check them."""
    assert check_signature(copy, read_manifest(copy)).trusted
    (copy / added).parent.mkdir(parents=True, exist_ok=True)
    (copy / added).write_text("planted after signing")
    found = check_signature(copy, read_manifest(copy))
    assert not found.trusted and f"(added: {added})" in found.reason, found


def test_a_directory_holding_git_files_signs_and_verifies(copy):
    (copy / ".gitattributes").write_text("*.pt2 filter=lfs\n")
    (copy / ".git").mkdir()
    (copy / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert invoke("sign", str(copy)).exit_code == 0
    assert check_signature(copy, read_manifest(copy)).trusted
    payload = json.loads(base64.b64decode(json.loads((copy / SIGNATURE).read_text())["dsseEnvelope"]["payload"]))
    assert {".gitattributes", ".git/HEAD"} <= {r["name"] for r in payload["predicate"]["resources"]}
    done = subprocess.run(
        [str(MODEL_SIGNING), "verify", "key", str(copy), "--signature", str(copy / SIGNATURE),
         "--public_key", str(ensure_own_key()[1]), "--no-ignore-git-paths"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr  # as docs/security.md shows it
    (copy / ".gitattributes").write_text("changed\n")
    assert "(changed: .gitattributes)" in check_signature(copy, read_manifest(copy)).reason


def test_a_signature_that_leaves_git_files_out_is_not_trusted(copy, tmp_path):
    """model_signing's CLI signs with git's files left out by default: files added there would verify."""
    import model_signing

    hashing = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE])  # ignore_git_paths defaults on
    config = model_signing.signing.Config().use_elliptic_key_signer(private_key=ensure_own_key()[0])
    config.set_hashing_config(hashing).sign(copy, tmp_path / SIGNATURE)
    shutil.copy(tmp_path / SIGNATURE, copy / SIGNATURE)
    found = check_signature(copy, read_manifest(copy))
    assert not found.trusted and "its signature leaves out .git, .gitattributes, .github, .gitignore" in found.reason


def test_only_the_top_level_optimize_cache_is_left_out(copy):
    sign_artifact(copy)  # as tk export and tk sign do: the cache is left out without being named
    (copy / ".candidates" / "abc").mkdir(parents=True)
    (copy / ".candidates" / "abc" / "model.onnx").write_bytes(b"cached")
    assert check_signature(copy, read_manifest(copy)).trusted
    (copy / "sub" / ".candidates").mkdir(parents=True)
    (copy / "sub" / ".candidates" / "x.so").write_bytes(b"\x7fELF")
    found = check_signature(copy, read_manifest(copy))
    assert not found.trusted and "(added: sub/.candidates/x.so)" in found.reason
    with pytest.raises(ValueError, match="only"):
        sign_artifact(copy, ignore=("sub",))  # a name left out only when signing would never verify


@pytest.mark.parametrize("listed", [".candidates/abc/model.onnx", "./.candidates/w.safetensors"])
def test_a_manifest_never_lists_a_file_of_the_unsigned_cache(copy, listed):
    manifest = read_manifest(copy)
    entry = manifest.files[0]
    (copy / listed).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(copy / entry.path, copy / listed)
    entry.path = listed
    (copy / "manifest.json").write_bytes(manifest_bytes(manifest))
    with pytest.raises(IntegrityError, match=r"files\[0\]\.path: expected a file outside \.candidates/"):
        read_manifest(copy)
