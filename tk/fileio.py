"""Files written whole or not at all, and their hashes."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from tk.errors import UsageError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file beside ``path`` that replaces it, flushed to disk, on a clean exit; removed on error.

    Other readers see the old file or the whole new one, never a part. A failed write (a full
    disk, no permission) is one ``UsageError`` naming the path.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = exclusive_temp_file(path.parent, f".{path.name}.", ".tmp")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename."""
    with atomic_open(path) as f:
        f.write(data)


def exclusive_temp_file(directory: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file with a random name in ``directory``, opened for writing, with the usual mode.

    Unlike ``tempfile.mkstemp`` (mode 0600), the file is created 0666 and the kernel applies the
    process umask, so the finished file gets the mode any other new file would, without reading
    (or changing) the umask.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        name = os.path.join(directory, f"{prefix}{secrets.token_hex(6)}{suffix}")
        try:
            return os.open(name, flags, 0o666), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory}")


def exclusive_temp_dir(directory: Path, prefix: str, suffix: str, *, mode: int = 0o777) -> Path:
    """A new directory with a random name in ``directory``, with ``mode`` less the umask (default: the usual mode)."""
    for _ in range(100):
        path = Path(directory) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            path.mkdir(mode=mode)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {directory}")


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the OS
    or file system cannot, so the caller falls back to two renames."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
