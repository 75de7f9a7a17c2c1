"""Reading files that a user points ``tk`` at, without leaving the directory they named.

Every file of an artifact (and of an input directory) is opened relative to the directory's real
path, one component at a time with ``O_NOFOLLOW``: a symbolic link anywhere inside, a hard link
(a file with more than one name, which may live elsewhere), a FIFO or a device is refused before
a byte is read, and the error says nothing about what the link points to. A file's bytes are read
once, hashed, and loaded from those bytes, so nothing can change between verification and use.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tk.errors import IntegrityError, UsageError
from tk.limits import require_within_budget

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def check_relative(relative: str, what: str) -> tuple[str, ...]:
    """The parts of a path that must stay inside its directory: no absolute path, no ``..``."""
    parts = Path(relative).parts
    if not isinstance(relative, str) or not relative or Path(relative).is_absolute() or ".." in parts:
        raise IntegrityError(f"{what} names {relative!r}: expected a relative path inside the directory")
    return parts


@contextlib.contextmanager
def open_inside(root: str | Path, relative: str, what: str = "artifact") -> Iterator[tuple[int, os.stat_result]]:
    """An open read-only descriptor of ``root/relative`` and its ``fstat``, once it is proven to be a
    regular file with one name, reached without following any link below ``root``."""
    parts = check_relative(relative, what)
    shown = Path(root) / relative
    try:
        real_root = os.path.realpath(root)
        fd = os.open(real_root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise UsageError(f"{root}: cannot open the directory ({exc.strerror or exc})") from exc
    opened = [fd]
    try:
        for part in parts[:-1]:
            try:
                fd = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _refusal(exc, Path(root) / part, what) from exc
            opened.append(fd)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=fd)
        except OSError as exc:
            raise _refusal(exc, shown, what) from exc
        opened.append(fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IntegrityError(f"{shown}: not a regular file (a FIFO, device or directory); refusing to read it")
        if info.st_nlink > 1:
            raise IntegrityError(
                f"{shown}: a hard link (the file has {info.st_nlink} names, which may lie outside the {what}); "
                "refusing to read it: copy the file instead of linking it"
            )
        yield fd, info
    finally:
        for each in reversed(opened):
            os.close(each)


def _refusal(exc: OSError, path: Path, what: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.EMLINK) or (exc.errno == errno.ENOTDIR and os.path.islink(path)):
        return IntegrityError(
            f"{path}: a symbolic link; every file of an {what} must be a regular file inside it, refusing to follow it"
        )
    if exc.errno == errno.ENOENT:
        return IntegrityError(f"{path}: missing")
    return IntegrityError(f"{path}: cannot open it ({exc.strerror or exc})")


def _blocks(fd: int, size: int) -> Iterator[bytes]:
    remaining = size
    while remaining > 0:
        block = os.read(fd, min(remaining, 1 << 24))
        if not block:
            return
        yield block
        remaining -= len(block)


def read_inside(root: str | Path, relative: str, what: str = "artifact") -> bytes:
    """The whole of ``root/relative``, read once through ``open_inside`` (sized against the memory budget)."""
    with open_inside(root, relative, what) as (fd, info):
        require_within_budget(info.st_size, f"{Path(root) / relative}")
        return b"".join(_blocks(fd, info.st_size))


def hash_inside(root: str | Path, relative: str, what: str = "artifact") -> tuple[int, str]:
    """Size and sha256 of ``root/relative``, streamed through ``open_inside`` (nothing held in memory)."""
    digest = hashlib.sha256()
    size = 0
    with open_inside(root, relative, what) as (fd, info):
        for block in _blocks(fd, info.st_size):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def require_regular_file(path: str | Path, what: str) -> None:
    """``path`` itself (not a link) is a regular file: a FIFO named ``x.npy`` never blocks a read."""
    try:
        info = os.lstat(path)
    except FileNotFoundError as exc:
        raise UsageError(f"{path}: no such file; expected {what}") from exc
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    if stat.S_ISLNK(info.st_mode):
        real = os.stat(path, follow_symlinks=True) if os.path.exists(path) else None
        if real is None or not stat.S_ISREG(real.st_mode):
            raise UsageError(f"{path}: a link to something that is not a regular file; expected {what}")
        return
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path}: not a regular file (a FIFO, device or directory); expected {what}")


@contextlib.contextmanager
def private_copy(files: dict[str, bytes]) -> Iterator[Path]:
    """A private directory (mode 0700) holding ``files`` (relative name -> verified bytes), removed after.

    For loaders that take only a path (AOTInductor packages, ONNX with external data): they read
    the bytes that were verified, not a file that could have changed since.
    """
    directory = Path(tempfile.mkdtemp(prefix="tk-verified-"))
    try:
        for relative, data in files.items():
            target = directory / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as f:
                f.write(data)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
