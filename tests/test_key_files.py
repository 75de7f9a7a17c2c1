"""Key files and directories others can change are refused, as ssh's StrictModes refuses them; a key
file that is not a regular file is one line, never a read that blocks.

Each test plays the user in a config directory of its own (``XDG_CONFIG_HOME`` under ``tmp_path``,
mode 0700 like the session's), so that loosening a mode never touches the session's keys.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.test_signing import key_pair
from tk.cli import cli
from tk.errors import UsageError
from tk.keys import PUBLIC_KEY, TRUSTED_DIR, TRUSTED_KEYS_ENV, config_dir, ensure_own_key
from tk.manifest import read_manifest
from tk.signing import check_signature, sign_artifact


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh config directory (its parent 0700, as pytest makes it) with the user's key pair in it."""
    home = tmp_path / "xdg"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv(TRUSTED_KEYS_ENV, raising=False)
    ensure_own_key()
    return home


@pytest.fixture
def signed_by_other(exported, copy_of, tmp_path: Path, user: Path) -> tuple[Path, Path, Path]:
    """(artifact signed by another key, that key's private file, its public file)."""
    art = copy_of(exported("mlp", ("torch",)).root, "art")
    private, public = key_pair(tmp_path)
    sign_artifact(art, private)
    return art, private, public


def one_line(result: Any) -> str:
    """The command's one ``error:`` line, its last (export's progress lines come before it)."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert result.exit_code == 2 and errors == lines[-1:] and "Traceback" not in result.output, result.output
    return lines[-1]


def refusal(call: Callable[[], object]) -> str:
    with pytest.raises(UsageError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


# -- directories others can write --------------------------------------------------------------------
def test_a_trusted_keys_directory_anyone_can_write_is_refused(signed_by_other):
    """Mode 1777 (a shared drop box): an attacker's key dropped in would decide what runs here."""
    art, _, public = signed_by_other
    trusted = config_dir() / TRUSTED_DIR
    trusted.mkdir()
    shutil.copy(public, trusted / "attacker.pem")
    assert check_signature(art, read_manifest(art)).trusted  # mode 0755: honoured
    trusted.chmod(0o1777)
    message = refusal(lambda: check_signature(art, read_manifest(art)))
    assert message.startswith(f"{trusted}: expected the trusted-keys directory only you can write, found mode 1777")
    assert message.endswith(f"chmod go-w {trusted}")


@pytest.mark.parametrize("which", ["config", "parent"])
def test_a_config_directory_or_its_parent_others_can_write_is_refused(signed_by_other, which):
    art, _, _ = signed_by_other
    directory = config_dir() if which == "config" else config_dir().parent
    directory.chmod(0o777)
    message = refusal(lambda: check_signature(art, read_manifest(art)))
    assert message.startswith(f"{directory}: expected ") and "found mode 0777" in message
    assert one_line(CliRunner().invoke(cli, ["export", "mlp", "--size", "tiny", "--format", "onnx",
                                             "--out", str(directory.parent / "out")])).endswith(f"chmod go-w {directory}")  # fmt: skip


def test_a_trusted_keys_directory_of_another_owner_is_refused(signed_by_other):
    art, _, public = signed_by_other
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    trusted = config_dir() / TRUSTED_DIR
    trusted.mkdir()
    shutil.copy(public, trusted / "colleague.pem")
    os.chown(trusted, 4242, -1)
    message = refusal(lambda: check_signature(art, read_manifest(art)))
    assert "expected the trusted-keys directory owned by you (uid 0) or root, found uid 4242" in message


# -- key files others can write ---------------------------------------------------------------------
@pytest.mark.parametrize("named", ["--public-key", TRUSTED_KEYS_ENV, TRUSTED_DIR, "own"])
def test_a_trusted_key_file_others_can_write_is_refused(signed_by_other, monkeypatch, named):
    art, _, public = signed_by_other
    if named == TRUSTED_KEYS_ENV:
        monkeypatch.setenv(TRUSTED_KEYS_ENV, str(public))
    elif named == TRUSTED_DIR:
        (config_dir() / TRUSTED_DIR).mkdir()
        public = Path(shutil.copy(public, config_dir() / TRUSTED_DIR / "colleague.pem"))
    elif named == "own":
        public = config_dir() / PUBLIC_KEY
    policy = _policy(public) if named == "--public-key" else None
    assert check_signature(art, read_manifest(art), policy).trusted is (named != "own")
    public.chmod(0o646)
    message = refusal(lambda: check_signature(art, read_manifest(art), policy))
    assert message.startswith(f"{public}: expected a ") and "found mode 0646 (writable by others)" in message
    assert message.endswith(f"chmod go-w {public}")
    if named == "--public-key":  # read when the option is parsed, whatever the command meets
        assert one_line(CliRunner().invoke(cli, ["inspect", str(art), "--public-key", str(public)])).endswith(
            f"chmod go-w {public}"
        )


def test_a_group_writable_key_is_refused_when_the_group_is_not_yours_alone(signed_by_other):
    art, _, public = signed_by_other
    if os.geteuid() != 0:
        pytest.skip("giving a file to another group needs root")
    public.chmod(0o664)
    os.chown(public, -1, 4242)  # a group that is not the user's private group
    with pytest.raises(UsageError, match=r"found mode 0664 \(writable by others\)"):
        check_signature(art, read_manifest(art), _policy(public))


def test_a_key_file_in_a_directory_others_can_write_is_refused_unless_sticky(signed_by_other, tmp_path):
    art, _, public = signed_by_other
    shared = tmp_path / "shared"
    shared.mkdir()
    key = Path(shutil.copy(public, shared / "colleague.pem"))
    shared.chmod(0o777)  # anyone could replace the file with their own key
    assert f"{shared}: expected the directory of a trusted public key only you can write" in refusal(
        lambda: check_signature(art, read_manifest(art), _policy(key))
    )
    shared.chmod(0o1777)  # like /tmp: others cannot replace a file they do not own
    assert check_signature(art, read_manifest(art), _policy(key)).trusted


def test_a_link_to_a_key_in_a_directory_others_can_write_is_refused(signed_by_other, tmp_path):
    """The directory checked is the one the key file lies in, not the one holding a link to it."""
    art, _, public = signed_by_other
    shared = tmp_path / "shared"
    shared.mkdir()
    target = Path(shutil.copy(public, shared / "colleague.pem"))
    shared.chmod(0o777)
    (config_dir() / TRUSTED_DIR).mkdir()
    (config_dir() / TRUSTED_DIR / "colleague.pem").symlink_to(target)
    assert refusal(lambda: check_signature(art, read_manifest(art))).startswith(f"{shared}: expected the directory")


def _policy(*keys: Path) -> Any:
    from tk.signing import TrustPolicy

    return TrustPolicy(public_keys=keys)


# -- private keys others can read -------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_private_key_others_can_read_is_refused_with_the_chmod(signed_by_other, mode):
    art, private, _ = signed_by_other
    private.chmod(mode)
    line = one_line(CliRunner().invoke(cli, ["sign", str(art), "--private-key", str(private)]))
    assert line == (
        f"error: {private}: expected a private key only you can read, found mode {mode:04o}; "
        f"refusing to sign with it: chmod 600 {private}"
    )
    private.chmod(0o600)
    assert CliRunner().invoke(cli, ["sign", str(art), "--private-key", str(private)]).exit_code == 0


def test_the_own_private_key_made_readable_is_refused(signed_by_other):
    art, _, _ = signed_by_other
    private = ensure_own_key()[0]
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    private.chmod(0o644)
    assert one_line(CliRunner().invoke(cli, ["sign", str(art)])).endswith(f"chmod 600 {private}")


def test_the_own_key_pair_gets_its_modes_whatever_the_umask(tmp_path, monkeypatch):
    """With umask 002 (Debian's and Ubuntu's for users with a private group) the public key would be 0664."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o002)
    try:
        private, public = ensure_own_key()
    finally:
        os.umask(old)
    assert (stat.S_IMODE(private.stat().st_mode), stat.S_IMODE(public.stat().st_mode)) == (0o600, 0o644)
    assert stat.S_IMODE(private.parent.stat().st_mode) == 0o700


# -- key files that are not regular files ------------------------------------------------------------
def returns(call: Callable[[], Any], seconds: float = 120.0) -> Any:
    """``call()``'s result; fails, instead of hanging the suite, if it blocks (on a FIFO) for ``seconds``."""
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("named", ["--public-key", TRUSTED_KEYS_ENV, TRUSTED_DIR, "--private-key"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_key_that_is_not_a_regular_file_is_one_line_and_never_blocks(
    signed_by_other, tmp_path, monkeypatch, named, kind
):
    art, _, _ = signed_by_other
    if named == TRUSTED_DIR:
        (config_dir() / TRUSTED_DIR).mkdir()
    key = (config_dir() / TRUSTED_DIR if named == TRUSTED_DIR else tmp_path) / "evil.pem"
    if kind == "fifo":
        os.mkfifo(key)
    elif kind == "directory":
        key.mkdir()
    elif named == TRUSTED_DIR:
        pytest.skip("a device cannot be made inside the trusted-keys directory without mknod")
    else:
        key = Path("/dev/zero")
    found = {"fifo": "a FIFO", "directory": "a directory", "device": "a device"}[kind]
    if named in ("--public-key", "--private-key"):
        args = ["inspect", str(art), "--public-key", str(key)]
        if named == "--private-key":
            args = ["sign", str(art), "--private-key", str(key)]
        line = one_line(returns(lambda: CliRunner().invoke(cli, args)))
        click_says = kind == "directory" and "is a directory" in line  # click's dir_okay=False, before tk reads it
        assert click_says or (f"{key}: expected a " in line and f"file, found {found}; refusing to read it" in line)
        return
    if named == TRUSTED_KEYS_ENV:
        monkeypatch.setenv(TRUSTED_KEYS_ENV, str(key))
    message = returns(lambda: refusal(lambda: check_signature(art, read_manifest(art))))
    assert message.startswith(f"{key}: expected a trusted public key") and f"found {found}; refusing" in message
