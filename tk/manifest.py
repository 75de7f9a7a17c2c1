"""``manifest.json``: what an artifact directory holds, and the proof that it is whole.

Export writes the manifest last, so a directory without a complete manifest is not an artifact.
Every loader reads it first and checks each file's size and sha256 before loading anything.
Who made an artifact is proven by its public-key signature (``model.sig``, see ``tk.signing``),
which covers these very manifest bytes (``Manifest.source_sha256``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tk.errors import IntegrityError, UsageError
from tk.fileio import sha256_file
from tk.registries import DEVICES, PRECISIONS
from tk.safefiles import hash_inside, read_inside, sha256_bytes
from tk.spec import Signature

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LEGACY_HMAC_ENV = "TK_SIGNING_KEY"  # the shared-secret HMAC that public-key signatures replaced
STATUSES = ("passed", "failed", "unchecked")
OPTIMIZE_CACHE = ".candidates"  # tk optimize's cache inside an artifact: no signature covers it, no manifest lists it


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
    # tk optimize: the recommendation (format, precision, engine, options) and the candidates table
    optimize: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # format -> why it could not be written (the others were)
    # a decoder's generation facts: the entry points, the cache layout, special tokens, sampling defaults and
    # its generation check per format (``check``); empty for other models
    generation: dict[str, Any] = field(default_factory=dict)
    # sha256 of the manifest.json bytes this was parsed from ("" when built in memory): what a signature must name
    source_sha256: str = field(default="", compare=False, repr=False)

    @property
    def recommended_engine(self) -> str | None:
        """The engine ``tk optimize`` recommends for this artifact, or None."""
        engine = (self.optimize.get("recommended") or {}).get("engine")
        return engine if isinstance(engine, str) else None

    @property
    def recommended_engine_options(self) -> dict[str, Any]:
        """The engine settings ``tk optimize`` timed its recommendation at (OpenVINO's streams), or none."""
        options = (self.optimize.get("recommended") or {}).get("engine_options")
        return dict(options) if isinstance(options, dict) else {}

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
            **({"optimize": self.optimize} if self.optimize else {}),
            **({"failed": self.failed} if self.failed else {}),
            **({"generation": self.generation} if self.generation else {}),
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
            optimize=data.get("optimize", {}),
            failed=data.get("failed", {}),
            generation=data.get("generation", {}),
        )


def refuse_legacy_hmac_key() -> None:
    """``TK_SIGNING_KEY`` (a shared-secret HMAC of the manifest) was replaced by public-key signatures:
    a user who still sets it expects a protection that is no longer there, so say so instead of ignoring it."""
    if LEGACY_HMAC_ENV in os.environ:
        raise UsageError(
            f"{LEGACY_HMAC_ENV} is set, but tk no longer uses its HMAC: artifacts are signed with your public key "
            "(model.sig, see docs/security.md); unset it, and trust other people's keys with --public-key or TK_TRUSTED_KEYS"
        )


def _canonical(data: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in data.items() if k not in ("hmac", "checksum")}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as written: JSON with its own sha256, which catches accidental edits and
    corruption (deliberate ones are caught by the artifact's signature, ``tk.signing``)."""
    refuse_legacy_hmac_key()
    data = manifest.to_json()
    data["checksum"] = hashlib.sha256(_canonical(data)).hexdigest()
    return (json.dumps(data, indent=2) + "\n").encode()


def read_manifest(root: str | Path) -> Manifest:
    """Read and validate ``root/manifest.json``; the result remembers the sha256 of the bytes it was read from."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        found = "a file" if root.exists() else "no directory"
        raise UsageError(f"expected an artifact directory written by `tk export`, found {found} at {root}")
    if not os.path.lexists(path):
        raise IntegrityError(
            f"{root}: no {MANIFEST}; not a complete artifact (an export was interrupted or this is another directory)"
        )
    raw = read_inside(root, MANIFEST)
    try:
        data = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise IntegrityError(f"{path}: expected JSON, found damaged text ({exc})") from exc
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else type(data).__name__
        raise IntegrityError(f"{path}: expected manifest format version {FORMAT_VERSION}, found {found!r}")
    if data.get("checksum") != hashlib.sha256(_canonical(data)).hexdigest():
        raise IntegrityError(
            f"{path}: edited or damaged after export (its checksum does not match its content); re-export the artifact"
        )
    refuse_legacy_hmac_key()
    problem = schema_problem(data)
    if problem:
        raise IntegrityError(f"{path}: malformed manifest: {problem}")
    try:
        manifest = Manifest.from_json(data)
        manifest.source_sha256 = sha256_bytes(raw)
        return manifest
    except (KeyError, TypeError, ValueError, AttributeError, UsageError) as exc:
        raise IntegrityError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc


_HEX64 = re.compile(r"[0-9a-f]{64}")


def schema_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's structure (field: expected, found), or None; checked before any use."""
    try:
        for key in (
            "model",
            "signature",
            "formats",
            "versions",
            "check",
            "timings",
            "optimize",
            "failed",
            "generation",
        ):
            _need(isinstance(data.get(key, {}), dict), key, "an object", data.get(key))
        for fmt, why in data.get("failed", {}).items():
            _need(isinstance(why, str), f"failed.{fmt}", "a reason", why)
        _need(isinstance(data.get("files"), list), "files", "a list", data.get("files"))
        recommended = data.get("optimize", {}).get("recommended")
        _need(recommended is None or (isinstance(recommended, dict) and isinstance(recommended.get("engine"), str)),
              "optimize.recommended", "an object naming an engine", recommended)  # fmt: skip
        _need(data.get("status", "unchecked") in STATUSES, "status", f"one of {STATUSES}", data.get("status"))
        _need(data.get("precision") in PRECISIONS, "precision", f"one of {PRECISIONS}", data.get("precision"))
        _need(data.get("device") in DEVICES, "device", f"one of {DEVICES}", data.get("device"))
        _check_model(data["model"])
        _check_signature(data["signature"])
        _check_files(data["files"])
        for fmt, info in data.get("formats", {}).items():
            _need(isinstance(info, dict), f"formats.{fmt}", "an object", info)
        _check_reports(data.get("check", {}))
        if data.get("generation"):
            _check_generation(data["generation"])
        for step, seconds in data.get("timings", {}).items():
            _need(_number(seconds), f"timings.{step}", "seconds", seconds)
    except _SchemaError as exc:
        return str(exc)
    return None


def _need(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise _SchemaError(f"{field}: expected {expected}, found {type(value).__name__} {str(value)[:60]!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_model(model: dict[str, Any]) -> None:
    _need(isinstance(model.get("name"), str) and bool(model.get("name")), "model.name", "a name", model.get("name"))
    _need(model.get("size") is None or isinstance(model.get("size"), str), "model.size", "a string", model.get("size"))
    config = model.get("config")
    _need(config is None or isinstance(config, dict), "model.config", "an object", config)
    descriptions = model.get("input_descriptions", [])
    _need(isinstance(descriptions, list) and all(isinstance(d, str) for d in descriptions),
          "model.input_descriptions", "a list of strings", descriptions)  # fmt: skip
    for precision, pair in (model.get("tolerances") or {}).items():
        _need(isinstance(pair, list) and len(pair) == 2 and all(_number(v) and v >= 0 for v in pair),
              f"model.tolerances.{precision}", "[rtol, atol] of non-negative numbers", pair)  # fmt: skip


def _check_signature(signature: dict[str, Any]) -> None:
    dims = signature.get("dims")
    _need(isinstance(dims, dict), "signature.dims", "an object", dims)
    for name, dim in dims.items():
        _need(isinstance(dim, dict) and set(dim) == {"name", "min", "opt", "max"}
              and all(isinstance(dim[k], int) and not isinstance(dim[k], bool) for k in ("min", "opt", "max"))
              and dim["name"] == name, f"signature.dims.{name}", "{name, min, opt, max} integers", dim)  # fmt: skip
    for side in ("inputs", "outputs"):
        specs = signature.get(side)
        _need(isinstance(specs, list) and (side == "outputs" or bool(specs)), f"signature.{side}", "a list", specs)
        for i, spec in enumerate(specs):
            where = f"signature.{side}[{i}]"
            _need(isinstance(spec, dict) and isinstance(spec.get("name"), str), where, "an object with a name", spec)
            _need(isinstance(spec.get("shape"), list), f"{where}.shape", "a list", spec.get("shape"))
            for d in spec["shape"]:
                # an output's axis may be one the model computes from the inputs' (wav2vec2's frames from samples)
                named = isinstance(d, str) and (d in dims or (side == "outputs" and d.isidentifier()))
                ok = (isinstance(d, int) and not isinstance(d, bool) and d >= 1) or named
                _need(ok, f"{where}.shape", "sizes >= 1 or names of signature.dims", d)
            for bound in ("low", "high"):
                value = spec.get(bound)
                _need(value is None or (isinstance(value, int) and not isinstance(value, bool)),
                      f"{where}.{bound}", "an integer or null", value)  # fmt: skip


def _check_files(files: list[Any]) -> None:
    for i, entry in enumerate(files):
        where = f"files[{i}]"
        _need(isinstance(entry, dict) and set(entry) == {"path", "role", "size", "sha256"}, where,
              "{path, role, size, sha256}", entry)  # fmt: skip
        _need(isinstance(entry["path"], str) and isinstance(entry["role"], str), where, "string path and role", entry)
        _need(Path(entry["path"]).parts[:1] != (OPTIMIZE_CACHE,), f"{where}.path",
              f"a file outside {OPTIMIZE_CACHE}/ (the unsigned optimize cache)", entry["path"])  # fmt: skip
        _need(isinstance(entry["size"], int) and entry["size"] >= 0, f"{where}.size", "a byte count", entry["size"])
        _need(isinstance(entry["sha256"], str) and bool(_HEX64.fullmatch(entry["sha256"])), f"{where}.sha256",
              "64 hex digits", entry["sha256"])  # fmt: skip


def _check_reports(reports: dict[str, Any]) -> None:
    for fmt, report in reports.items():
        where = f"check.{fmt}"
        _need(isinstance(report, dict) and isinstance(report.get("passed"), bool)
              and isinstance(report.get("outputs"), list) and isinstance(report.get("shapes"), list)
              and _number(report.get("rtol")) and _number(report.get("atol")), where,
              "a parity report (passed, outputs, shapes, rtol, atol)", report)  # fmt: skip
        for out in report["outputs"]:
            _need(isinstance(out, dict) and isinstance(out.get("passed"), bool) and _number(out.get("max_abs"))
                  and _number(out.get("max_rel")), f"{where}.outputs", "per-output results", out)  # fmt: skip


def _check_generation(generation: dict[str, Any]) -> None:
    cache = generation.get("cache")
    _need(isinstance(cache, dict), "generation.cache", "an object", cache)
    for key in ("slots", "layers", "heads", "head_dim"):
        value = cache.get(key)
        _need(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1 << 20,
              f"generation.cache.{key}", "an integer from 1 to 2^20", value)  # fmt: skip
    vocab = generation.get("vocab_size")
    _need(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1, "generation.vocab_size",
          "a positive integer", vocab)  # fmt: skip
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = generation.get(key)
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab)
        _need(ok, f"generation.{key}", f"null or a token id below {vocab}", value)
    _need(isinstance(generation.get("check", {}), dict), "generation.check", "an object", generation.get("check"))


class _SchemaError(Exception):
    pass


def read_verified(root: str | Path, entry: FileEntry) -> bytes:
    """The bytes of ``entry``, read once from inside ``root`` (no links, no special files) and
    checked against its size and sha256; load from these bytes, never from the path again."""
    _require_listed_file(root, entry)
    data = read_inside(root, entry.path)
    _require_match(root, entry, len(data), sha256_bytes(data))
    return data


def verify_file(root: str | Path, entry: FileEntry) -> None:
    """Check ``entry``'s size and sha256, streaming the file (engines re-read and re-check what they load)."""
    _require_listed_file(root, entry)
    _require_match(root, entry, *hash_inside(root, entry.path))


def _require_listed_file(root: str | Path, entry: FileEntry) -> None:
    if not os.path.lexists(Path(root) / entry.path):
        raise IntegrityError(f"{Path(root) / entry.path}: missing; the manifest lists it as the {entry.role} file")


def _require_match(root: str | Path, entry: FileEntry, size: int, digest: str) -> None:
    path = Path(root) / entry.path
    if size != entry.size:
        raise IntegrityError(f"{path}: {size} bytes, the manifest expects {entry.size} (truncated or replaced)")
    if digest != entry.sha256:
        raise IntegrityError(f"{path}: sha256 {digest[:12]}…, the manifest expects {entry.sha256[:12]}… (altered)")


def verify_artifact(root: str | Path) -> Manifest:
    """Read the manifest and verify every file it lists."""
    manifest = read_manifest(root)
    for entry in manifest.files:
        verify_file(root, entry)
    return manifest
