"""Writing the candidates' artifacts (one checked export per group: one capture for every format of a
precision and setting), caching them, and writing the winner as an ordinary artifact.

The cache holds finished candidate artifacts under a directory named by a hash of what decides
them (model, its weights and code, dimension ranges, precision, options, formats, calibration data,
the samples the check runs, torch version and the CPU's packing features), so a re-run reuses every
artifact it already wrote and never one of an older model. The cache is an input like any other: an
artifact there is reused only once its signature verifies against a key the user trusts (their own,
which signed it) and its files match its manifest; anything else is written again (``cached``,
``clear_for_export``), and the winner is copied from bytes checked as they are copied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.errors import CannotWinError, IntegrityError, ParityError, PartialExportError, TkError, UsageError, first_line
from tk.export import ExportOptions, write_artifact
from tk.fileio import atomic_write_bytes
from tk.formats.aoti import packing_features
from tk.keys import others_can_write
from tk.manifest import MANIFEST, FileEntry, Manifest, manifest_bytes, read_manifest, verify_artifact
from tk.models import ModelSpec
from tk.outdir import NESTED, recover_interrupted, require_replaceable, staging_dir, swap_into_place
from tk.safefiles import open_inside, read_inside
from tk.signing import SIGNATURE, TrustPolicy, check_signature, sign_artifact
from tk.tolerances import MIN_SQNR_DB
from tk.workflows.check import run_export_check
from tk.workflows.optimize.candidates import Candidate, group_key

log = logging.getLogger("tk.optimize")
CACHE = ".candidates"
CANDIDATES = NESTED  # --keep all: the other passing artifacts, beside the winner
# 2: keyed by an hf:DIR or user model's weights and code (model_digest); 3: every model's; 4: by the samples
# the check runs (--data's held-out half); 5: groups named by the writers' own options
CACHE_VERSION = 5


@dataclasses.dataclass
class Written:
    """What one group's export gave each candidate: its artifact, or why there is none."""

    artifacts: dict[Candidate, tuple[Path, Manifest]] = dataclasses.field(default_factory=dict)
    errors: dict[Candidate, str] = dataclasses.field(default_factory=dict)
    skipped: dict[Candidate, str] = dataclasses.field(default_factory=dict)  # by the speed gate (optimize/gate.py)
    cache_hits: int = 0
    exports: int = 0


def arrays_digest(arrays: dict[str, np.ndarray] | None) -> str:
    if arrays is None:
        return "random"
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode() + str(arrays[name].dtype).encode() + str(arrays[name].shape).encode())
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()


def model_digest(module: torch.nn.Module) -> str:
    """sha256 of the module's weights and buffers (names, dtypes, shapes, bytes), its structure
    (``repr``) and the source file of its class: what a model named by a directory or a
    ``package.module:callable`` does not pin (new weights saved into the same ``hf:DIR``, an edited
    user model)."""
    digest = hashlib.sha256(repr(module).encode())
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy())  # the tensor's own bytes, not a copy
    try:
        digest.update(Path(inspect.getfile(type(module))).read_bytes())
    except (TypeError, OSError):  # a class without a source file (built in, or made at run time)
        pass
    return digest.hexdigest()


def group_dir(cache: Path, candidates: list[Candidate], base: ExportOptions, checkpoint_sha: str | None,
              spec: ModelSpec, model_sha: str | None) -> Path:  # fmt: skip
    """Where one group's artifact is cached: named by everything that decides it (``model_sha``:
    ``model_digest`` of the module as built, before any ``--checkpoint`` is loaded into it)."""
    precision, own = candidates[0].group
    parts = {
        "version": CACHE_VERSION,
        "model": spec.reference(),
        "checkpoint": checkpoint_sha,
        "weights_and_code": model_sha,
        "dims": {n: dataclasses.asdict(d) for n, d in base.dims.items()},
        "precision": precision,
        "options": None if own is None else [own[0], repr(own[1])],
        "formats": sorted(c.format for c in candidates),
        "calibration": arrays_digest(base.calibration_data) if precision == "int8" else None,
        "check_data": arrays_digest(base.check_data),
        "min_sqnr_db": sqnr_floor_for(precision, base),
        "device": base.device,
        "torch": torch.__version__,
        "cpu": packing_features(),
    }
    words = [] if own is None else [own[0], *candidates[0].name.split()[2:]]  # the format and its variant's words
    return cache / f"{precision}-{'-'.join(words) or 'default'}-{group_key(parts)}"


def cached(root: Path, formats: list[str]) -> tuple[Manifest | None, str]:
    """The checked artifact at ``root`` holding every one of ``formats`` once it proves to be the user's own
    tk artifact (its signature verifies against a key they trust, its files match its manifest), else None
    and why not ('' where there is nothing there, or an artifact of theirs that lacks a check of ``formats``)."""
    if not os.path.lexists(root):
        return None, ""
    try:
        manifest = verify_artifact(root)
        found = check_signature(root, manifest, TrustPolicy())
    except TkError as exc:
        return None, first_line(exc)
    if not found.trusted:
        return None, f"its signature: {found.reason}"
    if (
        found.fingerprint != own_fingerprint()
    ):  # the cache is this user's own: a key trusted for others' artifacts is not
        return None, "its signature is not your own key's"
    if manifest.status == "unchecked" or any(f not in manifest.check and f not in manifest.failed for f in formats):
        return None, ""
    return manifest, ""


def own_fingerprint() -> str | None:
    """The fingerprint of the user's own public key (None before it exists)."""
    from tk.keys import fingerprint_of_file, own_key_paths

    public = own_key_paths()[1]
    return fingerprint_of_file(public) if public.is_file() else None


def clear_for_export(root: Path, reason: str) -> Path:
    """Where a group whose cached artifact at ``root`` cannot be reused (``reason``) is written again: ``root``,
    once what is there is moved aside (when tk made it: the user's own directory holding a tk manifest), else a
    new directory beside it, leaving what is there untouched and unused."""
    if not reason:
        return root
    token = secrets.token_hex(6)
    if _made_by_tk(root):
        aside = root.with_name(f".{root.name}.{token}.discarded")
        os.replace(root, aside)
        log.warning("note: optimize cache: %s cannot be reused (%s); moved it to %s, writing it again", root,
                    reason, aside.name)  # fmt: skip
        return root
    fresh = root.with_name(f"{root.name}-{token}")
    log.warning("note: optimize cache: %s is not an artifact of yours (%s); left it as it is, writing this group to "
                "%s instead", root, reason, fresh.name)  # fmt: skip
    return fresh


def _made_by_tk(root: Path) -> bool:
    """Whether ``root`` is a directory of this user's, writable by no one else, holding a tk manifest."""
    try:
        info = os.lstat(root)
        read_manifest(root)
    except (OSError, TkError):
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not others_can_write(info)


def write_group(spec: ModelSpec, root: Path, candidates: list[Candidate], base: ExportOptions) -> Written:
    """The artifact of one group, from the cache or a checked export; a group whose export fails for
    another reason than parity is retried one format at a time, so one format's failure is its own."""
    formats = [c.format for c in candidates]
    written = Written()
    manifest, reason = cached(root, formats)
    if manifest is not None:
        log.info("optimize cache hit: %s (%s)", root.name, ", ".join(c.name for c in candidates))
        written.cache_hits = 1
        return _from_artifact(written, candidates, root, manifest)
    root = clear_for_export(root, reason)
    export_options = group_export_options(candidates, base)
    try:
        written.exports = 1
        write_artifact(spec, root, export_options, check=run_export_check)
    except ParityError:
        pass  # written and marked failed by the precision's own tolerance: the user's spec judges it next
    except CannotWinError as exc:  # only int8 groups ask the gate, and each holds one format
        written.skipped = {c: first_line(exc) for c in candidates}
        return written
    except PartialExportError:  # written with the formats that converted; the manifest names the others
        pass
    except (TkError, RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:  # a writer's failure
        if len(candidates) > 1:
            log.info(
                "optimize: the %s export failed (%s); trying its formats one at a time", root.name, first_line(exc)
            )
            return _one_at_a_time(spec, root, candidates, base)
        written.errors[candidates[0]] = f"export failed: {type(exc).__name__}: {first_line(exc)}"
        return written
    return _from_artifact(written, candidates, root, verify_artifact(root))


def _from_artifact(written: Written, candidates: list[Candidate], root: Path, manifest: Manifest) -> Written:
    """``written`` with each candidate's artifact, or the failure its format's conversion recorded."""
    for candidate in candidates:
        if candidate.format in manifest.failed:
            written.errors[candidate] = f"export failed: {manifest.failed[candidate.format]}"
        else:
            written.artifacts[candidate] = (root, manifest)
    return written


def group_export_options(candidates: list[Candidate], base: ExportOptions) -> ExportOptions:
    """``base`` for one group: its formats and precision, and each candidate's writer options (its variant)."""
    precision = candidates[0].precision
    formats = tuple(c.format for c in candidates)
    settings = {c.format: c.options for c in candidates if c.options is not None}
    return dataclasses.replace(
        base, formats=formats, precision=precision, settings=settings, min_sqnr_db=sqnr_floor_for(precision, base),
        calibration_data=base.calibration_data if precision == "int8" else None,  # --data calibrates int8 only
    )  # fmt: skip


def sqnr_floor_for(precision: str, base: ExportOptions) -> float | None:
    """The user's SQNR floor for a group at ``precision`` (None where SQNR does not judge it: float32)."""
    return base.min_sqnr_db if precision in MIN_SQNR_DB else None


def _one_at_a_time(spec: ModelSpec, root: Path, candidates: list[Candidate], base: ExportOptions) -> Written:
    written = Written()
    for candidate in candidates:
        one = write_group(spec, root.with_name(f"{root.name}-{candidate.format}"), [candidate], base)
        written.artifacts.update(one.artifacts)
        written.errors.update(one.errors)
        written.skipped.update(one.skipped)
        written.cache_hits += one.cache_hits
        written.exports += one.exports
    return written


def refuse_foreign_out(out: Path, cache: Path | None = None, *, force: bool = False) -> None:
    """``out`` may be absent, empty, hold only the optimize cache, or be a tk artifact holding nothing else
    (``force``: other files too, which writing the winner deletes); ``tk.outdir.require_replaceable``.
    A ``cache`` (``--cache-dir``) inside ``out`` must be ``out/.candidates``: the rest of ``out`` is replaced
    as a whole. An artifact an interrupted run left aside is put back first."""
    for flag, path in (("--out", out), ("--cache-dir", cache)):
        if path is not None and (blocker := _file_above(path)) is not None:
            raise UsageError(f"{flag} {path}: expected a directory path, found a file at {blocker}")
    if cache is not None:
        where, inside = cache.resolve(), out.resolve()
        if (where == inside or inside in where.parents) and where != inside / CACHE:
            raise UsageError(
                f"--cache-dir {cache}: inside --out it must be {out / CACHE} (the rest of {out} is replaced when "
                "the winner is written); choose that or a directory outside it"
            )
    recover_interrupted(out)
    require_replaceable(out, force=force, keep=_moved_along(out, cache))


def _moved_along(out: Path, cache: Path | None) -> tuple[str, ...]:
    """What of ``out`` the winner's directory takes over: the cache, where it lives in ``out``."""
    return (CACHE,) if cache is None or cache.resolve() == (out / CACHE).resolve() else ()


def _file_above(path: Path) -> Path | None:
    """The nearest of ``path``'s parents that exists as something other than a directory, or None."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _kept_files(manifest: Manifest, fmt: str) -> list[FileEntry]:
    """The weights (eager's reference) and the files of format ``fmt`` (its role, or roles ``fmt-*``)."""
    return [e for e in manifest.files if e.role == "weights" or e.role == fmt or e.role.startswith(f"{fmt}-")]


def write_winner(out: Path, root: Path, manifest: Manifest, candidate: Candidate, judged: dict[str, Any],
                 record: dict[str, Any], extras: dict[str, bytes], others: list[Path], cache: Path,
                 *, force: bool = False) -> None:  # fmt: skip
    """``out`` as an artifact holding the winner's format, its manifest recording ``record``; ``extras``
    (name -> bytes: the table's JSON, the plot) listed in it; ``others`` (--keep all) under candidates/.
    Every file is copied from the bytes it was judged by (hashed while copied, checked against ``manifest``)."""
    require_replaceable(out, force=force, keep=_moved_along(out, cache))  # again: files may have come meanwhile
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out)
    try:
        kept = _kept_files(manifest, candidate.format)
        for entry in kept:
            copy_verified(root, entry.path, staging, entry.size, entry.sha256)
        files = list(kept)
        for name, data in extras.items():
            atomic_write_bytes(staging / name, data)
            files.append(FileEntry.of(staging, name, f"optimize-{Path(name).suffix.lstrip('.')}"))
        report = {
            **manifest.check[candidate.format],
            "passed": True,
            "judged_by": record["accuracy"],
            "accuracy": judged,
        }
        final = dataclasses.replace(
            manifest, files=files, formats={candidate.format: manifest.formats.get(candidate.format, {})},
            check={candidate.format: report}, status="passed", optimize=record,
        )  # fmt: skip
        atomic_write_bytes(staging / MANIFEST, manifest_bytes(final))
        for other in others:
            copy_artifact(other, staging / CANDIDATES / other.name)
        if cache.resolve() == (out / CACHE).resolve() and cache.is_dir():
            os.replace(cache, staging / CACHE)  # the cache lives in the artifact: it moves with it
        sign_artifact(staging, ignore=(CACHE,))  # after the last write; the cache is no part of the artifact
        swap_into_place(staging, out)
    except BaseException:
        recover_interrupted(out)  # an interruption between the fallback's two renames: the old artifact goes back
        if (staging / CACHE).is_dir() and not cache.exists() and cache.parent.is_dir():
            os.replace(staging / CACHE, cache)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def copy_verified(root: Path, relative: str, target: Path, size: int, sha256: str) -> None:
    """Copy ``root/relative`` to ``target/relative`` (read inside ``root``, no links), hashing the bytes as they
    are copied; ``IntegrityError`` unless they are ``size`` bytes of sha256 ``sha256``."""
    dest = target / relative
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, copied = hashlib.sha256(), 0
    with open_inside(root, relative) as (fd, _), open(dest, "xb") as f:
        while block := os.read(fd, 1 << 20):
            digest.update(block)
            f.write(block)
            copied += len(block)
    if copied != size or digest.hexdigest() != sha256:
        raise IntegrityError(
            f"{root / relative}: changed since it was checked ({copied} bytes, sha256 {digest.hexdigest()[:12]}…; "
            f"expected {size} bytes, sha256 {sha256[:12]}…); nothing was written to --out"
        )


def copy_artifact(root: Path, target: Path) -> None:
    """A verified copy of the artifact at ``root`` (``--keep all``): its manifest, each file it lists and its signature."""
    manifest = read_manifest(root)
    raw = read_inside(root, MANIFEST)
    copy_verified(root, MANIFEST, target, len(raw), manifest.source_sha256)
    for entry in manifest.files:
        copy_verified(root, entry.path, target, entry.size, entry.sha256)
    if os.path.lexists(root / SIGNATURE):
        signature = read_inside(root, SIGNATURE)
        atomic_write_bytes(target / SIGNATURE, signature)
