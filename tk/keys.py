"""Key files: the user's own key pair, the public keys they trust, and the modes a key file must have.

Every user has an elliptic-curve key (P-256), made on first use in ``$XDG_CONFIG_HOME/tk`` (else
``~/.config/tk``): ``tk export`` signs each artifact with it (``tk.signing``). The keys trusted
are the user's own, ``--public-key FILE`` (``TrustPolicy``), the files of ``$TK_TRUSTED_KEYS`` and
those in the config directory's ``trusted-keys/``. Key files others can change are refused, as
ssh's StrictModes refuses them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tk.errors import UsageError
from tk.fileio import atomic_open

TRUSTED_KEYS_ENV = "TK_TRUSTED_KEYS"  # os.pathsep-separated public key files (PEM)
PRIVATE_KEY = "signing-key.pem"  # in the config directory, mode 0600
PUBLIC_KEY = "signing-key.pub.pem"  # beside it: what the user hands to others
TRUSTED_DIR = "trusted-keys"  # in the config directory: *.pem public keys the user trusts
_MAX_KEY_BYTES = 1 << 16  # a PEM key is a few hundred bytes


@dataclass(frozen=True)
class TrustPolicy:
    """The user's decision for one command: keys trusted besides the standing ones, and the one-off override.

    ``public_keys``: PEM public key files whose signatures are trusted (``--public-key``), in
    addition to the user's own key and the trusted-keys settings. ``trust_artifact_code``: load
    native code from this artifact even unsigned or signed by an unknown key (``--trust-artifact-code``),
    with a warning on stderr unless ``warn`` is off (the export-time check, which runs code this
    process compiled a moment earlier, before the artifact is signed).
    """

    public_keys: tuple[Path, ...] = ()
    trust_artifact_code: bool = False
    warn: bool = True


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/tk``, else ``~/.config/tk``: where the user's key and trusted keys live."""
    base = os.environ.get("XDG_CONFIG_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".config") / "tk"


def own_key_paths() -> tuple[Path, Path]:
    """The user's private and public key files (which may not exist yet)."""
    directory = config_dir()
    return directory / PRIVATE_KEY, directory / PUBLIC_KEY


# Key files others can change are refused, as ssh's StrictModes refuses them: whoever can write a
# trusted key, or add one to the trusted-keys directory, decides which artifacts run native code here.
def read_key_file(path: Path, what: str, *, secret: bool = False, yours: bool = False) -> bytes:
    """The bytes of the key file ``path``, or one ``UsageError`` line: unless it is a regular file (a
    FIFO or device is refused before it is opened, so nothing blocks) that no one but its owner can
    change, in a directory where no one else can replace it. ``secret`` (a private key): nor read,
    and owned by you (or root); ``yours`` (a file of your config directory): owned by you (or root)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: expected a {what} file, found {_kind(info)}; refusing to read it")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read this {what}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)  # the file opened, which may have been swapped since the stat
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path}: expected a {what} file, found {_kind(info)}; refusing to read it")
        _require_safe_key_file(path, info, what, secret=secret, yours=yours)
        _require_safe_directory(Path(os.path.realpath(path)).parent, f"the directory of a {what}", sticky_ok=True)
        data = f.read(_MAX_KEY_BYTES + 1)
    if len(data) > _MAX_KEY_BYTES:
        raise UsageError(f"{path}: expected a {what} (a PEM file of a few hundred bytes), found over {_MAX_KEY_BYTES}")
    return data


def _require_safe_key_file(path: Path, info: os.stat_result, what: str, *, secret: bool, yours: bool) -> None:
    mode = stat.S_IMODE(info.st_mode)
    if secret or yours:
        _require_yours(path, info, what)
    if secret and mode & 0o077:
        raise UsageError(
            f"{path}: expected a private key only you can read, found mode {mode:04o}; "
            f"refusing to sign with it: chmod 600 {path}"
        )
    if others_can_write(info):
        raise UsageError(
            f"{path}: expected a {what} file only you can change, found mode {mode:04o} (writable by others); "
            f"refusing to trust it: chmod go-w {path}"
        )


def _require_safe_directory(directory: Path, what: str, *, sticky_ok: bool = False, yours: bool = False) -> None:
    """Refuse (one ``UsageError`` line) ``directory`` if others can write it (``sticky_ok``: unless its
    sticky bit keeps them from replacing your files: not for a directory whose every file is trusted)
    or, with ``yours``, if it belongs to someone else than you or root. A missing directory passes."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"{directory}: cannot read {what}: {exc.strerror or exc}") from exc
    if yours:
        _require_yours(directory, info, what)
    if others_can_write(info) and not (sticky_ok and info.st_mode & stat.S_ISVTX):
        mode = stat.S_IMODE(info.st_mode)
        raise UsageError(
            f"{directory}: expected {what} only you can write, found mode {mode:04o}: whoever can write there "
            f"chooses the keys you trust; refusing to use it: chmod go-w {directory}"
        )


def _require_safe_config_dir() -> None:
    """The config directory, its parent and its trusted-keys directory: yours, and only you can write them."""
    directory = config_dir()
    _require_safe_directory(directory.parent, "the directory of your tk config", yours=True)
    _require_safe_directory(directory, "your tk config directory", yours=True)
    _require_safe_directory(directory / TRUSTED_DIR, "the trusted-keys directory", yours=True)


def _require_yours(path: Path, info: os.stat_result, what: str) -> None:
    if hasattr(os, "geteuid") and info.st_uid not in (os.geteuid(), 0):
        raise UsageError(
            f"{path}: expected {what} owned by you (uid {os.geteuid()}) or root, found uid {info.st_uid}; "
            "refusing to use it"
        )


def others_can_write(info: os.stat_result) -> bool:
    """Whether anyone but the owner can write: other users, or a group with members besides you (a
    user private group, the default on Debian and Ubuntu with umask 002, is you alone: ssh allows it too)."""
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and not _group_is_only_you(info.st_gid)


def _group_is_only_you(gid: int) -> bool:
    try:
        import grp
        import pwd

        you = pwd.getpwuid(os.geteuid())
        members = grp.getgrgid(gid).gr_mem
    except (ImportError, KeyError, AttributeError):
        return False
    if gid != you.pw_gid or any(name != you.pw_name for name in members):
        return False
    return not any(user.pw_gid == gid and user.pw_uid != you.pw_uid for user in pwd.getpwall())


def _kind(info: os.stat_result) -> str:
    if stat.S_ISDIR(info.st_mode):
        return "a directory"
    if stat.S_ISFIFO(info.st_mode):
        return "a FIFO"
    if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
        return "a device"
    return "a socket or other special file"


def fingerprint_of(public_pem: bytes) -> str:
    """A public key's fingerprint: sha256 of its PEM SubjectPublicKeyInfo, hex (model_signing's key hint)."""
    from cryptography.hazmat.primitives import serialization

    key = _load_public_key(public_pem, "public key")
    canonical = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(canonical).hexdigest()


_key_lock = threading.Lock()


def ensure_own_key() -> tuple[Path, Path]:
    """The user's key pair, made on first use (EC P-256, private key mode 0600, written atomically).

    Two processes making it at once end with one key: each writes a private temporary file and
    links it into place; the second link fails and that process uses the first one's key.
    """
    private, public = own_key_paths()
    with _key_lock:
        if not private.exists():
            _create_private_key(private)
        if not public.exists():
            _write_public_key(private, public)
    _require_safe_config_dir()
    return private, public


def _create_private_key(private: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        private.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {private.parent} for your signing key ({exc.strerror or exc})") from exc
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    tmp = private.parent / f".{private.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process made the key first: keep theirs
            os.link(tmp, private)
    except OSError as exc:
        raise UsageError(f"cannot write your signing key {private} ({exc.strerror or exc})") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _write_public_key(private: Path, public: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = load_private_key(private)
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with atomic_open(public) as f:
        os.fchmod(f.fileno(), 0o644)  # not the umask's: a group-writable public key would be refused
        f.write(pem)


def load_private_key(path: Path, data: bytes | None = None) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = read_key_file(path, "private key", secret=True) if data is None else data
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{path}: expected an unencrypted PEM private key, found something else ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise UsageError(f"{path}: expected an elliptic-curve private key (P-256), found {type(key).__name__}")
    return key


def check_public_key_file(path: Path) -> None:
    """Refuse (``UsageError``, one line) a ``--public-key`` file that cannot be read, that others can
    change, or that is not an EC public key."""
    _load_public_key(read_key_file(path, "public key"), str(path))


def _load_public_key(data: bytes, what: str) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{what}: expected a PEM public key, found something else ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise UsageError(f"{what}: expected an elliptic-curve public key, found {type(key).__name__}")
    return key


def trusted_key_files(policy: TrustPolicy | None = None) -> list[Path]:
    """Every public key file trusted under ``policy``: the user's own (once it exists), ``policy.public_keys``,
    the files of ``$TK_TRUSTED_KEYS`` and ``trusted-keys/*.pem`` in the config directory."""
    policy = policy or TrustPolicy()
    files: list[Path] = []
    _require_safe_config_dir()
    own = own_key_paths()[1]
    if own.is_file():
        files.append(own)
    files.extend(Path(p) for p in policy.public_keys)
    for item in os.environ.get(TRUSTED_KEYS_ENV, "").split(os.pathsep):
        if item.strip():
            files.append(Path(item.strip()))
    trusted_dir = config_dir() / TRUSTED_DIR
    if trusted_dir.is_dir():
        files.extend(sorted(trusted_dir.glob("*.pem")))
    return files


def trusted_keys(policy: TrustPolicy | None) -> dict[str, tuple[Path, bytes]]:
    """Fingerprint -> (key file, its bytes) for every trusted key; a named file that is missing, not a
    key, or that others can change is an error, never skipped."""
    keys: dict[str, tuple[Path, bytes]] = {}
    for path in trusted_key_files(policy):
        data = read_key_file(path, "trusted public key", yours=path.parent in _config_dirs())
        keys.setdefault(fingerprint_of_file(path, data), (path, data))
    return keys


def _config_dirs() -> tuple[Path, Path]:
    return config_dir(), config_dir() / TRUSTED_DIR


def fingerprint_of_file(path: Path, data: bytes | None = None) -> str:
    try:
        return fingerprint_of(read_key_file(path, "public key") if data is None else data)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from exc
