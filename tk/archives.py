"""Compiled code hidden in an artifact's zip archives, found before anything is extracted or loaded.

A ``.pt2`` archive is a zip whatever its manifest role says: ``torch.export.load`` extracts every
``data/aotinductor/`` member of one and dlopens its library (a constructor in it runs at once),
even when the caller only wants the exported program. So every zip file an engine would load is
read here first, from its central directory and the first bytes of each member, and a member that
is compiled code by its place, its name or its magic number is reported. Nothing is extracted.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from tk.errors import IntegrityError, TkError, first_line
from tk.manifest import Manifest
from tk.safefiles import open_inside

AOTI_DIR = "data/aotinductor/"  # where torch.export's archives keep AOTInductor models (torch's AOTINDUCTOR_DIR)
CODE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd", ".o", ".a")
# ELF, Mach-O (both byte orders, 32/64-bit, universal) and PE/COFF
CODE_MAGIC = (b"\x7fELF", b"\xfe\xed\xfa\xce", b"\xfe\xed\xfa\xcf", b"\xce\xfa\xed\xfe", b"\xcf\xfa\xed\xfe",
              b"\xca\xfe\xba\xbe", b"MZ")  # fmt: skip
ZIP_MAGIC = b"PK\x03\x04"


def _in_aoti_dir(name: str) -> bool:
    """Whether ``name`` lies under ``data/aotinductor/`` below the archive's top folder (torch strips that
    folder, whatever it is called) or at the top."""
    return name.startswith(AOTI_DIR) or (("/" in name) and name.split("/", 1)[1].startswith(AOTI_DIR))


def compiled_members(archive: zipfile.ZipFile) -> list[str]:
    """The members of ``archive`` that are compiled code: under ``data/aotinductor/``, named like a
    library or object file, or starting with an executable's magic number."""
    found = []
    for info in archive.infolist():
        name = info.filename
        if _in_aoti_dir(name) or name.lower().endswith(CODE_SUFFIXES):
            found.append(name)
            continue
        if info.is_dir() or info.file_size == 0:
            continue
        try:
            with archive.open(info) as member:
                head = member.read(4)
        except Exception as exc:  # an encrypted flag (RuntimeError), a corrupt stream (zlib.error), a bad CRC ...
            raise IntegrityError(
                f"{name}: a zip member that cannot be read ({type(exc).__name__}: {first_line(exc)})"
            ) from exc
        if head.startswith(CODE_MAGIC):
            found.append(name)
    return found


def compiled_members_of_bytes(data: bytes, source: str) -> list[str]:
    """``compiled_members`` of the zip archive ``data`` (empty when ``data`` is not a zip archive)."""
    if not data.startswith(ZIP_MAGIC):
        return []
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return compiled_members(archive)
    except IntegrityError as exc:
        raise IntegrityError(f"{source}: {exc}") from exc
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, ValueError) as exc:
        raise IntegrityError(f"{source}: a damaged zip archive ({first_line(exc)})") from exc


def compiled_code_in(root: str | Path, manifest: Manifest, role: str) -> list[str]:
    """``path:member`` for each compiled member of the zip files ``manifest`` lists under ``role``, read
    from inside ``root`` (what ``tk inspect``, ``--engine all`` and the loaders ask before trusting a format
    that should hold no code). A file that is missing or unreadable is left to the loader's own checks."""
    found = []
    for entry in manifest.files:
        if entry.role != role:
            continue
        try:
            found += [f"{entry.path}:{name}" for name in _compiled_members_at(root, entry.path)]
        except _Unreadable as exc:  # one line, never "no code": the trust gate asks before anything loads
            raise IntegrityError(str(exc)) from exc
        except (TkError, OSError, zipfile.BadZipFile, EOFError, NotImplementedError, ValueError):
            continue  # the engine reads the verified bytes and refuses a missing or damaged file itself
    return found


def _compiled_members_at(root: str | Path, relative: str) -> list[str]:
    """``compiled_members`` of the file ``root/relative`` when it is a zip archive (else none); a member that
    cannot be read is an ``IntegrityError`` naming it, raised past the caller's open errors."""
    with open_inside(root, relative) as (fd, _), open(fd, "rb", closefd=False) as f:
        if f.read(4) != ZIP_MAGIC:
            return []
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            try:
                return compiled_members(archive)
            except IntegrityError as exc:
                raise _Unreadable(f"{Path(root) / relative}: {exc}") from exc


class _Unreadable(Exception):
    """A member of an artifact's archive that cannot be read: not left to the loader (the trust gate asks first)."""
