"""Public-key signatures of artifacts (OpenSSF model signing) and the user's decision whom to trust.

``tk export`` signs each artifact with the user's key (``tk.keys``): ``ARTIFACT/model.sig`` is a
Sigstore bundle over every file of the directory, so ``model_signing verify key ARTIFACT
--signature ARTIFACT/model.sig --public_key PUB`` accepts it as well.

Formats that hold native code (an AOTInductor ``.so``, a TensorRT plan) load only from an
artifact whose signature verifies against a key the user trusts: their own, ``--public-key
FILE``, the files of ``$TK_TRUSTED_KEYS`` and those in the config directory's ``trusted-keys/``;
or, one time, when the user says ``--trust-artifact-code`` (``TrustPolicy``).

The chain from signature to loaded bytes: the signature holds the sha256 of ``manifest.json``;
that must be the sha256 of the very bytes the manifest in use was parsed from
(``Manifest.source_sha256``); the manifest holds the sha256 of each file, and engines load the
bytes they verified against it (``read_verified``). A file swapped after any of these checks
breaks the next link, never passes.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tk.archives import compiled_code_in
from tk.errors import IntegrityError, TkError, UntrustedArtifactError, UsageError
from tk.fileio import atomic_write_bytes
from tk.keys import (
    PRIVATE_KEY,
    PUBLIC_KEY,
    TrustPolicy,
    ensure_own_key,
    fingerprint_of,
    load_private_key,
    read_key_file,
    trusted_key_files,
    trusted_keys,
)
from tk.manifest import MANIFEST, OPTIMIZE_CACHE, Manifest
from tk.safefiles import open_inside, private_copy, read_inside

__all__ = [  # TrustPolicy is the trust decision's input: callers import it from here
    "NATIVE_CODE_FORMATS",
    "SIGNATURE",
    "UNSIGNED",
    "SignatureCheck",
    "TrustPolicy",
    "check_signature",
    "explicit_policy",
    "holds_native_code",
    "how_to_trust",
    "loads_native_code",
    "require_trusted_code",
    "sign_artifact",
    "signature_summary",
    "untrusted_message",
    "untrusted_reason",
]

log = logging.getLogger("tk.signing")

SIGNATURE = "model.sig"  # the artifact's signature file, beside manifest.json
NATIVE_CODE_FORMATS = frozenset({"aoti", "trt"})  # file roles whose loading runs the artifact's code
# the only top-level names a signature leaves out, when signing and when verifying (git's files are signed)
UNSIGNED = (SIGNATURE, OPTIMIZE_CACHE)
_MAX_SIGNATURE_BYTES = 16 << 20  # a bundle lists one digest per file: kilobytes, never megabytes


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
    key_pem = read_key_file(key_path, "private key", secret=True)
    key = load_private_key(key_path, key_pem)
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
    keys = trusted_keys(policy)
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


def names_this_manifest(root: str | Path, manifest: Manifest) -> bool:
    """Whether ``root/model.sig`` is a signature bundle whose payload names the sha256 of the bytes ``manifest``
    was read from: a signature tk (or model_signing) wrote for this artifact, whoever's key made it. An empty
    file or any other content under that name is not (``tk.outdir``: then it is a user's file)."""
    try:
        bundle = json.loads(_read_signature(Path(root)))
        payload = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True))
        signed = _signed_manifest_digest(payload["predicate"]["resources"], payload["predicate"]["serialization"])
    except (OSError, TkError, ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        return False
    return bool(manifest.source_sha256) and signed == manifest.source_sha256


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
