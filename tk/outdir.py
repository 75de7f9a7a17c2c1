"""What ``--out`` may replace, and how a finished directory takes its place.

``tk export`` and ``tk optimize`` write a whole artifact into a staging directory beside ``--out``
and rename it into place; ``tk deploy triton`` writes a model into a repository. All three ask this
module first, and it answers one rule: tk deletes only what it can show it wrote.

- ``--out`` may be absent, an empty directory, or a tk artifact (its manifest parses and every file
  it lists verifies) that holds nothing else. A tk artifact that also holds other files (a user's
  ``README.md``) is replaced only with ``force``, which deletes them; a directory that is not a tk
  artifact never is. The refusal names the files.
- Where the two directories cannot be exchanged in one step, the old artifact is moved aside into a
  private directory (mode 0700, a random name) while the new one is renamed into place. A kill
  between the two renames leaves it there, and the next run puts it back, but only after checking
  that the directory is the user's own (owner, not writable by others) and that what it holds is an
  artifact signed by a key the user trusts. Anything else beside ``--out`` is left as it is, with a
  log note: another user who can write there (a shared 1777 directory) cannot plant an artifact
  that tk adopts, nor get tk to delete their directory or anyone else's.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import stat
from pathlib import Path

from tk.errors import TkError, UsageError, first_line
from tk.fileio import exchange_paths, exclusive_temp_dir
from tk.keys import others_can_write
from tk.manifest import MANIFEST, read_manifest, verify_artifact
from tk.signing import SIGNATURE, TrustPolicy, check_signature, names_this_manifest

log = logging.getLogger("tk.outdir")

NESTED = "candidates"  # tk optimize --keep all: other whole artifacts under the winner's directory
MOVED = "artifact"  # inside an .old directory: the previous artifact, moved aside
OLD = ".old"  # suffix of the directory the previous artifact is moved aside into
PARTIAL = ".partial"  # suffix of a staging directory (another run's, possibly still running: never touched)
SHOWN = 4  # unexpected files named in a refusal


def require_replaceable(out: Path, *, force: bool = False, keep: tuple[str, ...] = (), flag: str = "--out") -> None:
    """Refuse (``UsageError``, one line) to replace ``out`` unless it is absent, an empty directory, or a tk
    artifact holding nothing but what its manifest lists, its signature and ``candidates/`` artifacts.

    ``keep``: top-level names the caller moves into the new directory (the optimize cache), so they are
    not lost. ``force``: a tk artifact holding other files too may be replaced, deleting them. A directory
    that is not a tk artifact is never replaced.
    """
    if not os.path.lexists(out):
        return
    if out.is_symlink():
        raise UsageError(f"{flag} {out}: expected a directory (or nothing), found a symbolic link; name the directory")
    if not out.is_dir():
        raise UsageError(f"{flag} {out}: expected a directory (or nothing), found a file")
    if not os.path.lexists(out / MANIFEST):
        others = sorted(p.name for p in out.iterdir() if p.name not in keep)
        if others:
            raise UsageError(
                f"{flag} {out}: expected an empty directory or a tk artifact, found {_shown(others)} and no {MANIFEST}, "
                f"so it is not a tk artifact and tk will not replace (delete) it; choose another {flag}, or empty it first"
            )
        return
    try:
        foreign = foreign_files(out, keep)
    except TkError as exc:
        raise UsageError(
            f"{flag} {out}: expected an empty directory or a tk artifact whose files verify, found a {MANIFEST} that "
            f"is not one ({first_line(exc)}); tk will not replace (delete) it: choose another {flag}, or move it away"
        ) from exc
    if foreign and not force:
        raise UsageError(
            f"{flag} {out}: a tk artifact that also holds files its {MANIFEST} does not list ({_shown(foreign)}); "
            f"replacing it would delete them: move them or choose another {flag}, or pass --force to replace it and "
            "delete them"
        )


def foreign_files(root: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Paths under the artifact ``root`` that tk did not write there: neither its manifest, its signature,
    a file the manifest lists, a ``keep`` name, nor a whole artifact under ``candidates/``; an empty
    directory counts, a non-empty one is named by its files. Raises ``TkError`` unless ``root`` verifies."""
    manifest = verify_artifact(root)
    # the signature is tk's when it signs this very manifest; an empty or unrelated model.sig is the user's
    signature = (SIGNATURE,) if names_this_manifest(root, manifest) else ()
    listed = {MANIFEST, *signature, *(e.path for e in manifest.files)}
    found = [rel for rel, leaf in _entries(root, skip={*keep, NESTED}) if leaf and rel not in listed]
    nested = root / NESTED
    if os.path.lexists(nested):
        if nested.is_symlink() or not nested.is_dir():
            found.append(NESTED)
        else:
            found.extend(f"{NESTED}/{p.name}" for p in sorted(nested.iterdir()) if not _whole_artifact(p))
    return sorted(found)


def _entries(root: Path, skip: set[str]) -> list[tuple[str, bool]]:
    """Every path below ``root`` (links not followed, top-level ``skip`` names left out), each with
    whether it is a file, a link or an empty directory (what deleting it loses by itself)."""
    found = []
    for directory, dirs, files in os.walk(root):
        here = Path(directory).relative_to(root)
        if here == Path("."):
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        links = [d for d in dirs if os.path.islink(os.path.join(directory, d))]
        dirs[:] = [d for d in dirs if d not in links]
        for name in files + links:
            found.append(((here / name).as_posix(), True))
        for name in dirs:
            found.append(((here / name).as_posix(), _empty(Path(directory, name))))
    return found


def _empty(directory: Path) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is None


def _whole_artifact(path: Path) -> bool:
    """Whether ``path`` is a directory holding a tk artifact and nothing else."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        return not foreign_files(path)
    except TkError:
        return False


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def refuse_inside(path: Path, artifact: Path, given: str) -> None:
    """Refuse (one line, starting with the flags ``given``) an output ``path`` that is the directory
    ``artifact`` or inside it: writing there would change the artifact being read and break its signature."""
    root, where = artifact.resolve(), path.resolve()
    if where == root or root in where.parents:
        raise UsageError(f"{given}: expected a path outside the artifact {artifact}, which writing there would change")


def require_empty(out: Path, force: bool, flag: str = "--out") -> None:
    """Refuse (one line) a non-empty directory ``out`` unless ``force`` (then files of the same names as those
    written are replaced, and nothing else is touched): ``tk deploy triton``'s repository, which it writes
    into (a link to a directory is that directory) and never replaces."""
    if os.path.lexists(out) and not out.is_dir():
        raise UsageError(f"{flag} {out}: expected a directory, found a file")
    if force or not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if entries:
        raise UsageError(
            f"{flag} {out}: expected an empty or new directory, found {len(entries)} entries ({_shown(entries)}); "
            "pass --force to write into it (files of the same names are replaced, nothing else is touched)"
        )


def staging_dir(out: Path) -> Path:
    """A new directory beside ``out`` with a random name, for the new artifact (the usual mode: it becomes ``out``)."""
    return exclusive_temp_dir(out.parent, f".{out.name}.", PARTIAL)


def swap_into_place(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out`` with no moment at which ``out`` is missing; the caller has checked ``out``
    (``require_replaceable``).

    Where the OS can, the two directories are exchanged in one step and the old one (now at the staging
    name) removed. Elsewhere the old one is first moved aside into a private ``.old`` directory, put
    back here if the second rename fails, and by ``recover_interrupted`` if a kill lands between them.
    """
    if not os.path.lexists(out):
        os.replace(staging, out)
        return
    if exchange_paths(staging, out):
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = exclusive_temp_dir(out.parent, f".{out.name}.", OLD, mode=0o700)
    os.replace(out, old / MOVED)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(old / MOVED, out)
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


def recover_interrupted(out: Path, policy: TrustPolicy | None = None) -> None:
    """Undo what a run killed between ``swap_into_place``'s two renames left: put the artifact it moved
    aside back where ``out`` is missing, or remove it where ``out`` was written since.

    Only a ``.OUT.*.old`` directory that is the user's own (owner, not writable by group or others) and
    holds an artifact signed by a key ``policy`` trusts is touched; anything else is left as it is, with
    a log note. Staging (``.partial``) directories are another run's, possibly running, and stay.
    """
    if not out.parent.is_dir():
        return
    for old in sorted(out.parent.glob(f".{glob.escape(out.name)}.*{OLD}")):
        problem = _not_restorable(old, policy)
        if problem:
            log.warning("note: left %s as it is: not an artifact tk moved aside (%s)", old, problem)
            continue
        moved = old / MOVED
        if not os.path.lexists(moved):
            pass  # killed before the first rename: an empty directory of the user's
        elif not os.path.lexists(out):
            os.replace(moved, out)
            log.info("restored the previous artifact at %s from an interrupted run", out)
        else:
            shutil.rmtree(moved)  # killed after the second rename: the old artifact was to go
        os.rmdir(old)


def _not_restorable(old: Path, policy: TrustPolicy | None) -> str:
    """Why ``old`` is not what ``swap_into_place`` leaves when killed (a private directory of the user's,
    empty or holding an artifact of theirs signed by a key ``policy`` trusts), or ''."""
    try:
        problem = _not_private(old)
        if problem:
            return problem
        inside = [p.name for p in old.iterdir()]
        if not inside:
            return ""
        if inside != [MOVED]:
            return f"it holds {_shown(sorted(inside))}, not only {MOVED}/"
        return _not_private(old / MOVED) or _untrusted(old / MOVED, policy)
    except OSError as exc:
        return exc.strerror or str(exc)


def _not_private(path: Path) -> str:
    """Why ``path`` is not a directory of this user's that no one else can write to, or ''."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{path.name} belongs to user id {info.st_uid}, not to you"
    if others_can_write(info):  # group write is fine where the group is the user alone (umask 002's default)
        return f"{path.name} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return ""


def _untrusted(root: Path, policy: TrustPolicy | None) -> str:
    """Why the artifact at ``root`` is not signed by a key ``policy`` trusts, or ''."""
    try:
        found = check_signature(root, read_manifest(root), policy)
    except TkError as exc:
        return first_line(exc)
    return "" if found.trusted else f"its signature: {found.reason}"
