"""A watcher that stops the HAProxy of a ``tk serve`` that ended without stopping it.

Ray Serve starts HAProxy from its HAProxyManager actor, in that actor's process group, without tying
HAProxy's life to the actor's. When ``tk serve``'s whole process group is signalled (``kill -TERM --
-PGID``, or ``timeout``, which signals the group), Ray's GCS and raylet in that group die at once,
the actors with them, and tk's own Ray core worker aborts before ``tk serve`` can shut Serve down:
HAProxy stayed running and kept the port, so the next ``tk serve`` on it failed with "found it taken"
(found on the 2-core test machine; Ctrl-C does not do it: Ray's processes block SIGINT and tk stops
Serve cleanly).

The watcher runs in a session of its own, so the group's signal does not reach it. It waits for the
``tk serve`` process to end, then stops every HAProxy whose command line names that server's private
state directory (a ``mkdtemp`` that only this server's HAProxy reads its configuration from), and
removes the directory. After a clean stop it finds nothing to do, and ``stop`` ends it anyway.

Run as ``python -m tk.serve.reaper OWNER_PID STATE_DIR``; ``watch`` starts it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 2.0  # from SIGTERM to SIGKILL


def watch(owner_pid: int, state_dir: Path) -> subprocess.Popen[bytes] | None:
    """Start the watcher of ``state_dir``'s HAProxy for ``owner_pid`` (None where there is no /proc)."""
    if not Path("/proc/self/cmdline").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "tk.serve.reaper", str(owner_pid), str(state_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # out of the owner's process group: a signal to the group does not end it
        close_fds=True,
    )


def haproxies_of(state_dir: Path) -> list[int]:
    """Pids of the HAProxy processes whose command line names a file in ``state_dir``."""
    marker = str(state_dir).rstrip("/") + "/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if not argv or Path(argv[0].decode(errors="replace")).name != "haproxy":
            continue
        if any(marker in arg.decode(errors="replace") for arg in argv[1:]):
            found.append(int(entry.name))
    return found


def reap(state_dir: Path) -> list[int]:
    """Stop ``state_dir``'s HAProxy processes (SIGTERM, then SIGKILL after ``GRACE_S``); returns their pids."""
    pids = haproxies_of(state_dir)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return pids


def wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Block until process ``pid`` has ended (a pidfd where the kernel has them, else polling)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the process is already gone
        while _alive(pid):
            time.sleep(poll_s)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (ended, not yet reaped by its parent) is no longer running
        return (Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split() or ["?"])[0] != "Z"
    except OSError:
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    owner, state_dir = int(argv[0]), Path(argv[1])
    wait_for_exit(owner)
    reap(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
