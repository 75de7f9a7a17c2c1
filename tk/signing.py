"""Public-key signatures of artifacts (OpenSSF model signing) and the user's decision whom to trust.

Every user has an elliptic-curve key (P-256), made on first use in ``$XDG_CONFIG_HOME/tk``
(else ``~/.config/tk``), and ``tk export`` signs each artifact with it: ``ARTIFACT/model.sig`` is
a Sigstore bundle over every file of the directory, so ``model_signing verify key ARTIFACT
--signature ARTIFACT/model.sig --public_key PUB`` accepts it as well.

Formats that hold native code (an AOTInductor ``.so``, a TensorRT plan) load only from an
artifact whose signature verifies against a key the user trusts: their own, ``--public-key
FILE``, the files of ``$TK_TRUSTED_KEYS`` and those in the config directory's ``trusted-keys/``;
or, one time, when the user says ``--trust-artifact-code``.

The chain from signature to loaded bytes: the signature holds the sha256 of ``manifest.json``;
that must be the sha256 of the very bytes the manifest in use was parsed from
(``Manifest.source_sha256``); the manifest holds the sha256 of each file, and engines load the
bytes they verified against it (``read_verified``). A file swapped after any of these checks
breaks the next link, never passes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tk.archives import compiled_code_in
from tk.errors import IntegrityError, UntrustedArtifactError, UsageError
from tk.fileio import atomic_open, atomic_write_bytes
from tk.manifest import MANIFEST, OPTIMIZE_CACHE, Manifest
from tk.safefiles import open_inside, private_copy, read_inside

log = logging.getLogger("tk.signing")

SIGNATURE = "model.sig"  # the artifact's signature file, beside manifest.json
TRUSTED_KEYS_ENV = "TK_TRUSTED_KEYS"  # os.pathsep-separated public key files (PEM)
PRIVATE_KEY = "signing-key.pem"  # in the config directory, mode 0600
PUBLIC_KEY = "signing-key.pub.pem"  # beside it: what the user hands to others
TRUSTED_DIR = "trusted-keys"  # in the config directory: *.pem public keys the user trusts
NATIVE_CODE_FORMATS = frozenset({"aoti", "trt"})  # file roles whose loading runs the artifact's code
# the only top-level names a signature leaves out, when signing and when verifying (git's files are signed)
UNSIGNED = (SIGNATURE, OPTIMIZE_CACHE)
_MAX_KEY_BYTES = 1 << 16  # a PEM key is a few hundred bytes
_MAX_SIGNATURE_BYTES = 16 << 20  # a bundle lists one digest per file: kilobytes, never megabytes


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


@dataclass(frozen=True)
class SignatureCheck:
    """What ``check_signature`` found: whether a trusted key signed the artifact and which.

    ``fingerprint``: the signing key's (verified when ``trusted``, else the key hint the bundle
    claims, or None). ``key``: the trusted public key file that verified it. ``reason``: why it is
    not trusted (empty when it is).
    """

    signed: bool
    trusted: bool
    fingerprint: str | None
    key: Path | None
    reason: str


# ----------------------------------------------------------------------------------- keys
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
def _read_key_file(path: Path, what: str, *, secret: bool = False, yours: bool = False) -> bytes:
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
    if _others_can_write(info):
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
    if _others_can_write(info) and not (sticky_ok and info.st_mode & stat.S_ISVTX):
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


def _others_can_write(info: os.stat_result) -> bool:
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

    key = _load_private_key(private)
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with atomic_open(public) as f:
        os.fchmod(f.fileno(), 0o644)  # not the umask's: a group-writable public key would be refused
        f.write(pem)


def _load_private_key(path: Path, data: bytes | None = None) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = _read_key_file(path, "private key", secret=True) if data is None else data
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
    _load_public_key(_read_key_file(path, "public key"), str(path))


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


def _trusted_keys(policy: TrustPolicy | None) -> dict[str, tuple[Path, bytes]]:
    """Fingerprint -> (key file, its bytes) for every trusted key; a named file that is missing, not a
    key, or that others can change is an error, never skipped."""
    keys: dict[str, tuple[Path, bytes]] = {}
    for path in trusted_key_files(policy):
        data = _read_key_file(path, "trusted public key", yours=path.parent in _config_dirs())
        keys.setdefault(fingerprint_of_file(path, data), (path, data))
    return keys


def _config_dirs() -> tuple[Path, Path]:
    return config_dir(), config_dir() / TRUSTED_DIR


def fingerprint_of_file(path: Path, data: bytes | None = None) -> str:
    try:
        return fingerprint_of(_read_key_file(path, "public key") if data is None else data)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from exc


# ----------------------------------------------------------------------------------- signing
def _hashing_config() -> Any:
    """What a signature covers, the same when signing and verifying: every file below the directory,
    git's (``.git/``, ``.gitattributes`` ...) included, but the top-level ``UNSIGNED`` names: the
    signature itself and tk optimize's cache (no manifest may list a file there: ``tk.manifest``)."""
    import model_signing

    return model_signing.hashing.Config().set_ignored_paths(paths=list(UNSIGNED), ignore_git_paths=False)


def sign_artifact(root: str | Path, private_key: str | Path | None = None, *, ignore: tuple[str, ...] = ()) -> str:
    """Write ``root/model.sig`` over every file of ``root`` but the top-level ``UNSIGNED`` names
    (``model.sig``, the optimize cache) and return the signing key's fingerprint. ``private_key``: a
    PEM EC key file (default: the user's own). ``ignore``: names the caller leaves out, which must be
    among ``UNSIGNED`` (anything else would be left out here and hashed when verifying)."""
    import model_signing

    if not set(ignore) <= set(UNSIGNED):
        raise ValueError(f"sign_artifact: ignore={ignore!r}; only {UNSIGNED} are left out of a signature")
    root = Path(root)
    if not root.is_dir():
        found = "a file" if root.exists() else "no directory"
        raise UsageError(f"expected an artifact directory, found {found} at {root}")
    key_path = Path(private_key) if private_key is not None else ensure_own_key()[0]
    key_pem = _read_key_file(key_path, "private key", secret=True)
    key = _load_private_key(key_path, key_pem)
    from cryptography.hazmat.primitives import serialization

    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        # signed outside the directory, so no temporary file is hashed, with the key bytes checked above
        with private_copy({PRIVATE_KEY: key_pem}) as scratch:
            config = model_signing.signing.Config().use_elliptic_key_signer(private_key=scratch / PRIVATE_KEY)
            config = config.set_hashing_config(_hashing_config())
            config.sign(root, scratch / SIGNATURE)
            bundle = (scratch / SIGNATURE).read_bytes()
    except ValueError as exc:  # a symbolic link or an unsupported key, from model_signing
        raise UsageError(f"{root}: cannot sign it ({exc})") from exc
    atomic_write_bytes(root / SIGNATURE, bundle)
    return fingerprint_of(public_pem)


# ----------------------------------------------------------------------------------- verifying
# (root, manifest sha256, keys, the directory's file metadata) -> signer
_verified: dict[tuple[str, str, frozenset[str], tuple[Any, ...]], tuple[str, Path]] = {}
_verified_lock = threading.Lock()


def check_signature(root: str | Path, manifest: Manifest, policy: TrustPolicy | None = None) -> SignatureCheck:
    """Whether ``root/model.sig`` verifies against a trusted key, covers every file of ``root`` as
    it is now, and names the sha256 of the bytes ``manifest`` was read from.

    A positive answer is remembered for this process (by directory, manifest sha256, trusted keys
    and every file's size, mtime and inode, so a file added or rewritten since is hashed again):
    what the manifest lists is bound to it by sha256 in any case, so it stays true for every file
    an engine loads through ``read_verified``.
    """
    root = Path(root)
    keys = _trusted_keys(policy)
    cache_key = (os.path.realpath(root), manifest.source_sha256, frozenset(keys), _directory_state(root))
    with _verified_lock:
        known = _verified.get(cache_key)
    if known is not None:
        return SignatureCheck(True, True, known[0], known[1], "")
    if not os.path.lexists(root / SIGNATURE):
        return SignatureCheck(False, False, None, None, f"it has no {SIGNATURE}")
    try:
        raw = _read_signature(root)
        bundle = json.loads(raw)
        hint = bundle["verificationMaterial"]["publicKey"]["hint"]
        payload = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True))
        resources = payload["predicate"]["resources"]
        serialization = payload["predicate"]["serialization"]
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError) as exc:
        return SignatureCheck(True, False, None, None, f"its {SIGNATURE} is not a model_signing bundle ({exc})")
    hint = hint if isinstance(hint, str) else None
    if hint not in keys:
        return SignatureCheck(True, False, hint, None, "it is signed by a key you do not trust")
    key, key_pem = keys[hint]
    left_out = _left_out(serialization)
    if left_out:
        return SignatureCheck(True, False, hint, key, f"its signature leaves out {left_out}, which tk checks "
                              "(sign with `tk sign`, or model_signing's --no-ignore-git-paths)")  # fmt: skip
    problem = _verify_bundle(root, raw, key_pem)
    if problem:
        return SignatureCheck(True, False, hint, key, problem)
    signed = _signed_manifest_digest(resources, serialization)
    if signed is None:
        return SignatureCheck(True, False, hint, key, f"its signature does not cover {MANIFEST} by sha256")
    if not manifest.source_sha256 or signed != manifest.source_sha256:
        return SignatureCheck(True, False, hint, key, f"its {MANIFEST} is not the one that was signed")
    with _verified_lock:
        _verified[cache_key] = (hint, key)
    return SignatureCheck(True, True, hint, key, "")


def _directory_state(root: Path) -> tuple[Any, ...]:
    """Every entry below ``root`` with its size, mtime and inode (cheap: no file is read)."""
    state = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files + dirs):
            info = os.lstat(os.path.join(directory, name))
            state.append(
                (os.path.relpath(os.path.join(directory, name), root), info.st_size, info.st_mtime_ns, info.st_ino)
            )
    return tuple(state)


def _read_signature(root: Path) -> bytes:
    with open_inside(root, SIGNATURE) as (_, info):
        if info.st_size > _MAX_SIGNATURE_BYTES:
            raise ValueError(f"{info.st_size} bytes, expected at most {_MAX_SIGNATURE_BYTES}")
    return read_inside(root, SIGNATURE)


def _verify_bundle(root: Path, raw: bytes, key_pem: bytes) -> str:
    """Verify the bundle ``raw`` with the public key ``key_pem`` and every file of ``root`` against it: '' or why not.

    model_signing reads the signature and the key from paths: it gets a private copy of the bytes
    read and checked here, so the payload checked below is the one it verified.
    """
    import model_signing

    try:
        with private_copy({SIGNATURE: raw, PUBLIC_KEY: key_pem}) as copy:
            config = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=copy / PUBLIC_KEY)
            config = config.set_hashing_config(_hashing_config())  # its default leaves git's files out
            config.verify(root, copy / SIGNATURE)
    except Exception as exc:  # model_signing raises ValueError, cryptography InvalidSignature, OSError ...
        return _mismatch_reason(exc)
    return ""


def _mismatch_reason(exc: BaseException) -> str:
    """model_signing's verification error as a short reason naming the files that differ."""
    text = str(exc)
    if type(exc).__name__ == "InvalidSignature":
        return "its signature does not verify with the key it names"
    changed = re.findall(r"Hash mismatch for \\*'([^'\\]+)", text)  # quotes come escaped inside its list
    extra = re.search(r"Extra files found in model \\*'[^']*': ([^\]\"'\\]+)", text)
    missing = re.search(r"Missing files in model \\*'[^']*': ([^\]\"'\\]+)", text)
    parts = [f"removed: {missing.group(1).strip()}"] if missing else []
    parts += [f"added: {extra.group(1).strip()}"] if extra else []
    parts += [f"changed: {', '.join(changed)}"] if changed else []
    if parts:
        return f"its files do not match their signature ({'; '.join(parts)})"
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"its signature does not verify ({first[:200]})"


def _left_out(serialization: Any) -> str:
    """The paths a bundle's signer left out besides ``UNSIGNED`` (model_signing's CLI leaves out git's
    files by default), or ''; verifying leaves out what the bundle says, so files added there would pass."""
    paths = serialization.get("ignore_paths", []) if isinstance(serialization, dict) else []
    if not isinstance(paths, list):
        return repr(paths)[:80]
    extra = sorted({str(p) for p in paths} - set(UNSIGNED))
    return ", ".join(extra)[:200]


def _signed_manifest_digest(resources: Any, serialization: Any) -> str | None:
    if not isinstance(serialization, dict) or serialization.get("method") != "files":
        return None
    for item in resources if isinstance(resources, list) else []:
        if isinstance(item, dict) and item.get("name") == MANIFEST and item.get("algorithm") == "sha256":
            digest = item.get("digest")
            return digest if isinstance(digest, str) else None
    return None


def explicit_policy(policy: TrustPolicy | None) -> TrustPolicy:
    """``policy`` with every trusted key file named: for a process elsewhere (a Ray replica) whose
    environment and config directory may differ from the caller's."""
    policy = policy or TrustPolicy()
    return TrustPolicy(tuple(trusted_key_files(policy)), policy.trust_artifact_code, policy.warn)


def holds_native_code(manifest: Manifest, root: str | Path | None = None) -> list[str]:
    """The formats of ``manifest`` whose loading runs code from the artifact: aoti and trt always, and,
    read from ``root``, any other whose zip archive holds compiled code (a ``.pt2`` that ``torch.export.load``
    would dlopen from, whatever format the manifest calls it)."""
    roles = {e.role for e in manifest.files}
    native = roles & NATIVE_CODE_FORMATS
    if root is not None:
        native |= {role for role in roles - native if compiled_code_in(root, manifest, role)}
    return sorted(native)


def loads_native_code(root: str | Path, manifest: Manifest, role: str) -> bool:
    """Whether loading ``role``'s files from ``root`` runs code from the artifact (see ``holds_native_code``)."""
    return role in NATIVE_CODE_FORMATS or bool(compiled_code_in(root, manifest, role))


_overridden: set[tuple[str, str]] = set()


def require_trusted_code(root: str | Path, manifest: Manifest, policy: TrustPolicy | None, what: str) -> None:
    """Refuse to load ``what`` (native code from ``root``) unless a trusted key signed the artifact
    or ``policy.trust_artifact_code`` (then one warning on stderr). Call it before any of the code loads."""
    policy = policy or TrustPolicy()
    found = check_signature(root, manifest, policy)
    if found.trusted:
        return
    if policy.trust_artifact_code:
        once = (os.path.realpath(root), manifest.source_sha256)
        if policy.warn and once not in _overridden:
            _overridden.add(once)
            log.warning(
                "warning: --trust-artifact-code: loading the %s engine's native code from %s although %s",
                what,
                root,
                untrusted_reason(found),
            )
        return
    raise UntrustedArtifactError(untrusted_message(root, what, found))


def untrusted_message(root: str | Path, what: str, found: SignatureCheck) -> str:
    """The one-line refusal: which engine, why the artifact is not trusted, and how to trust it."""
    return (
        f"{root}: refusing to load the {what} engine, which runs the artifact's native code, because "
        f"{untrusted_reason(found)}; {how_to_trust(root)}"
    )


def untrusted_reason(found: SignatureCheck) -> str:
    signer = f" (key {found.fingerprint[:16]}…)" if found.fingerprint and not found.key else ""
    return found.reason + signer


def how_to_trust(root: str | Path) -> str:
    return (
        f"to trust it: --public-key FILE (its signer's public key), `tk sign {root}` if you made it, "
        "or --trust-artifact-code for this one run"
    )


def signature_summary(root: str | Path, manifest: Manifest, policy: TrustPolicy | None = None) -> SignatureCheck:
    """``check_signature`` for display (``tk inspect``): a bad trusted-key setting becomes the reason, not an error."""
    try:
        return check_signature(root, manifest, policy)
    except (UsageError, IntegrityError) as exc:
        return SignatureCheck(os.path.lexists(Path(root) / SIGNATURE), False, None, None, str(exc))
