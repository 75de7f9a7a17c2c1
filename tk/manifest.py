"""``manifest.json``: what an artifact directory holds, and the proof that it is whole.

Export writes the manifest last, so a directory without a complete manifest is not an artifact.
Every loader reads it first and checks each file's size and sha256 before loading anything;
with ``TK_SIGNING_KEY`` set, an HMAC of the manifest is written and verified as well.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.errors import IntegrityError, UsageError
from tk.fileio import sha256_file
from tk.spec import Signature

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIGNING_ENV = "TK_SIGNING_KEY"
STATUSES = ("passed", "failed", "unchecked")


@dataclass
class FileEntry:
    path: str  # relative to the artifact directory
    role: str  # weights | torch | onnx | onnx-data | aoti | trt | timing-cache
    size: int
    sha256: str

    @classmethod
    def of(cls, root: Path, path: str, role: str) -> FileEntry:
        full = root / path
        return cls(path, role, full.stat().st_size, sha256_file(full))


@dataclass
class Manifest:
    model: dict[str, Any]  # name, size, config, checkpoint sha256
    signature: Signature
    precision: str
    device: str
    formats: dict[str, dict[str, Any]] = field(default_factory=dict)  # format -> its file and settings
    files: list[FileEntry] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)  # format -> parity report (JSON)
    status: str = "unchecked"
    timings: dict[str, float] = field(default_factory=dict)  # step -> seconds
    created: str = ""
    format_version: int = FORMAT_VERSION

    def file(self, role: str) -> FileEntry:
        for entry in self.files:
            if entry.role == role:
                return entry
        have = ", ".join(sorted({e.role for e in self.files})) or "none"
        raise UsageError(f"artifact has no {role} file (it holds: {have}); export it with --format {role}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "status": self.status,
            "created": self.created,
            "model": self.model,
            "precision": self.precision,
            "device": self.device,
            "signature": self.signature.to_json(),
            "formats": self.formats,
            "files": [e.__dict__ for e in self.files],
            "versions": self.versions,
            "timings": self.timings,
            "check": self.check,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            model=data["model"],
            signature=Signature.from_json(data["signature"]),
            precision=data["precision"],
            device=data["device"],
            formats=data.get("formats", {}),
            files=[FileEntry(**e) for e in data["files"]],
            versions=data.get("versions", {}),
            check=data.get("check", {}),
            status=data.get("status", "unchecked"),
            timings=data.get("timings", {}),
            created=data.get("created", ""),
            format_version=data["format_version"],
        )


def _canonical(data: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in data.items() if k not in ("hmac", "checksum")}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written: JSON with its own sha256 (which catches accidental edits and
    corruption), plus an HMAC-SHA256 when ``TK_SIGNING_KEY`` is set (which catches deliberate ones)."""
    data = manifest.to_json()
    data["checksum"] = hashlib.sha256(_canonical(data)).hexdigest()
    key = os.environ.get(SIGNING_ENV)
    if key:
        data["hmac"] = hmac.new(key.encode(), _canonical(data), hashlib.sha256).hexdigest()
    return (json.dumps(data, indent=2) + "\n").encode()


def read_manifest(root: str | Path) -> Manifest:
    """Read and validate ``root/manifest.json`` (and its HMAC when a signing key is set)."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise UsageError(f"expected an artifact directory written by `tk export`, found no directory at {root}")
    if not path.is_file():
        raise IntegrityError(
            f"{root}: no {MANIFEST}; not a complete artifact (an export was interrupted or this is another directory)"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{path}: expected JSON, found damaged text ({exc})") from exc
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else type(data).__name__
        raise IntegrityError(f"{path}: expected manifest format version {FORMAT_VERSION}, found {found!r}")
    if data.get("checksum") != hashlib.sha256(_canonical(data)).hexdigest():
        raise IntegrityError(
            f"{path}: edited or damaged after export (its checksum does not match its content); re-export the artifact"
        )
    key = os.environ.get(SIGNING_ENV)
    if key:
        expected = hmac.new(key.encode(), _canonical(data), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(str(data.get("hmac", "")), expected):
            what = "no signature" if "hmac" not in data else "a signature that does not match"
            raise IntegrityError(f"{path}: {SIGNING_ENV} is set, and the manifest has {what}; refusing to load it")
    try:
        manifest = Manifest.from_json(data)
        for key in ("model", "formats", "versions", "check", "timings"):
            value = getattr(manifest, key)
            if not isinstance(value, dict):
                raise TypeError(f"{key} is a {type(value).__name__}, expected an object")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise IntegrityError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    if manifest.status not in STATUSES:
        raise IntegrityError(f"{path}: expected status in {STATUSES}, found {manifest.status!r}")
    return manifest


_VERIFIED: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> sha256 already computed


def verify_file(root: str | Path, entry: FileEntry) -> Path:
    """The file's path, once its size and sha256 match the manifest."""
    path = Path(root) / entry.path
    if Path(entry.path).is_absolute() or ".." in Path(entry.path).parts:
        raise IntegrityError(f"manifest names {entry.path!r}: expected a path inside the artifact")
    if not path.is_file():
        raise IntegrityError(f"{path}: missing; the manifest lists it as the {entry.role} file")
    stat = path.stat()
    size = stat.st_size
    if size != entry.size:
        raise IntegrityError(f"{path}: {size} bytes, the manifest expects {entry.size} (truncated or replaced)")
    # a command verifies the artifact, then each engine its file: hash a large file once per process
    key = (str(path.resolve()), size, stat.st_mtime_ns, stat.st_ino)
    digest = _VERIFIED.get(key) or sha256_file(path)
    _VERIFIED[key] = digest
    if digest != entry.sha256:
        raise IntegrityError(f"{path}: sha256 {digest[:12]}…, the manifest expects {entry.sha256[:12]}… (altered)")
    return path


def verify_artifact(root: str | Path) -> Manifest:
    """Read the manifest and verify every file it lists."""
    manifest = read_manifest(root)
    for entry in manifest.files:
        verify_file(root, entry)
    return manifest
