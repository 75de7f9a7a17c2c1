"""Triton's ``perf_analyzer`` against ``tk serve``: find a binary that runs here, run it, read its CSV.

``perf_analyzer`` ships inside the ``tritonclient`` wheel (``bin/perf_analyzer``). Wheels after
2.45.0 need glibc 2.38; 2.45.0's runs on Debian 12 with ``libb64-0d`` installed and
``libcudart.so.12`` (from ``nvidia-cuda-runtime-cu12``) on ``LD_LIBRARY_PATH``, even for HTTP on
the CPU. ``scripts/setup.sh`` puts both wheels in ``.venv/opt/perf_analyzer`` (apart from the venv's
own newer ``tritonclient``). Where to look: ``TK_PERF_ANALYZER`` (the binary), ``perf_analyzer``
on ``PATH``, then ``<venv>/opt/perf_analyzer/bin``.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tk.errors import UsageError

ENV = "TK_PERF_ANALYZER"
INSTALL_HINT = (
    "pip install --no-deps --target .venv/opt/perf_analyzer 'tritonclient[all]==2.45.0' nvidia-cuda-runtime-cu12 "
    "and apt-get install libb64-0d (scripts/setup.sh does the first)"
)


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    env: dict[str, str]  # the environment it runs in (LD_LIBRARY_PATH with libcudart)


def _candidates() -> list[Path]:
    found = []
    if os.environ.get(ENV):
        found.append(Path(os.environ[ENV]))
    on_path = shutil.which("perf_analyzer")
    if on_path:
        found.append(Path(on_path))
    found.append(Path(sys.prefix) / "opt" / "perf_analyzer" / "bin" / "perf_analyzer")
    return found


def _cudart_dirs(binary: Path) -> list[str]:
    """``nvidia/cuda_runtime/lib`` folders next to the binary's install and on ``sys.path``."""
    roots = [binary.parent.parent, *(Path(p) for p in sys.path if p)]
    return [
        str(r / "nvidia" / "cuda_runtime" / "lib") for r in roots if (r / "nvidia" / "cuda_runtime" / "lib").is_dir()
    ]


def find_perf_analyzer() -> PerfAnalyzer:
    """A ``perf_analyzer`` that starts here (``--version`` answers), or ``UsageError`` saying why not."""
    reasons = []
    for binary in _candidates():
        if not binary.is_file():
            continue
        env = dict(os.environ)
        libs = _cudart_dirs(binary)
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])])
        try:
            probe = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True, timeout=30)
        except OSError as exc:
            reasons.append(f"{binary}: {exc.strerror}")
            continue
        if probe.returncode == 0:
            return PerfAnalyzer(binary, env)
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        reasons.append(f"{binary}: {lines[-1] if lines else f'exit {probe.returncode}'}")
    found = "; ".join(reasons) if reasons else "none found"
    raise UsageError(f"perf_analyzer: expected a binary that runs here, found {found}; install: {INSTALL_HINT}")


# the CSV's latency phases (microseconds, averages over the window): together the client's average latency
# ("Network+Server Send/Recv" is what is left of it once the others are taken out)
PHASE_COLUMNS = (
    "Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input", "Server Compute Infer",
    "Server Compute Output", "Client Recv",
)  # fmt: skip


@dataclass(frozen=True)
class PerfRow:
    concurrency: int
    inferences_per_s: float
    p50_ms: float
    p99_ms: float
    client_send_recv_ms: float
    server_queue_ms: float
    server_compute_ms: float  # the server's input, infer and output phases (its statistics, averaged)
    server_infer_ms: float  # the engine call alone
    avg_ms: float  # the client's average latency: the sum of the CSV's phases, which perf_analyzer splits it into

    @property
    def overhead_ms(self) -> float:
        """What serving added to the engine call, averaged over the same requests: everything the
        client waited for but the server's ``compute_infer`` (the engine call itself)."""
        return self.avg_ms - self.server_infer_ms


def run_perf_analyzer(
    tool: PerfAnalyzer,
    url: str,
    model: str,
    samples: Sequence[Mapping[str, np.ndarray]],
    concurrency: Sequence[int],
    *,
    batch: int = 1,
    out_dir: Path,
    measurement_ms: int = 2000,
    requests_per_window: int | None = None,
    stability_percent: float = 10.0,
    max_trials: int = 10,
    timeout_s: float = 600.0,
) -> tuple[list[PerfRow], str]:
    """Run ``perf_analyzer`` over HTTP at each concurrency; its rows (from its CSV) and its output.

    Each window lasts ``measurement_ms``, or, with ``requests_per_window``, that many requests;
    perf_analyzer repeats windows (``max_trials`` at most) until three agree within
    ``stability_percent`` (its default 10 % fails on a busy machine: the correctness checks pass 100).

    ``samples``: the requests' data, one sample each without the batch dimension (valid token ids
    and masks: perf_analyzer's random or zero data would be refused), sent in turn (``--input-data``,
    with ``--shape`` from the first). Raises ``UsageError`` with the tool's last line when it fails (a
    failed request ends it with an error)."""
    csv_path = out_dir / "perf_analyzer.csv"
    data_path = out_dir / "perf_analyzer_data.json"
    entries = [
        {name: {"content": a.reshape(-1).tolist(), "shape": list(a.shape)} for name, a in s.items()} for s in samples
    ]
    data_path.write_text(json.dumps({"data": entries}))
    window = (
        ["--measurement-mode", "count_windows", "--measurement-request-count", str(requests_per_window)]
        if requests_per_window
        else ["--measurement-interval", str(measurement_ms)]
    )
    command = [
        str(tool.binary), "-m", model, "-u", url.removeprefix("http://"), "-i", "http", "-b", str(batch),
        "--concurrency-range", f"{min(concurrency)}:{max(concurrency)}:{_step(concurrency)}", *window,
        "--stability-percentage", f"{stability_percent:g}", "--max-trials", str(max_trials), "--percentile", "99",
        "-f", str(csv_path), "--input-data", str(data_path),
        *(arg for name, a in samples[0].items() for arg in ("--shape", f"{name}:{','.join(map(str, a.shape))}")),
    ]  # fmt: skip
    done = subprocess.run(command, env=tool.env, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        lines = output.strip().splitlines()
        raise UsageError(f"perf_analyzer: expected exit 0, got {done.returncode}: {lines[-1] if lines else ''}")
    return read_csv(csv_path), output


def _step(levels: Sequence[int]) -> int:
    ordered = sorted(set(levels))
    steps = {b - a for a, b in itertools.pairwise(ordered)}
    if len(steps) > 1:
        raise UsageError(f"perf_analyzer: concurrency levels must be evenly spaced, got {list(levels)}")
    return steps.pop() if steps else 1


def read_csv(path: Path) -> list[PerfRow]:
    """perf_analyzer's ``-f`` CSV (latencies in microseconds) as rows, by concurrency: perf_analyzer
    writes them by throughput, so concurrency 4 came first in a CI run where it served less than 1."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            us = {name: float(row[name]) for name in PHASE_COLUMNS}
            rows.append(
                PerfRow(
                    concurrency=int(row["Concurrency"]),
                    inferences_per_s=float(row["Inferences/Second"]),
                    p50_ms=float(row["p50 latency"]) / 1e3,
                    p99_ms=float(row["p99 latency"]) / 1e3,
                    client_send_recv_ms=(us["Client Send"] + us["Client Recv"]) / 1e3,
                    server_queue_ms=us["Server Queue"] / 1e3,
                    server_compute_ms=(
                        us["Server Compute Input"] + us["Server Compute Infer"] + us["Server Compute Output"]
                    )
                    / 1e3,
                    server_infer_ms=us["Server Compute Infer"] / 1e3,
                    avg_ms=sum(us.values()) / 1e3,
                )
            )
    return sorted(rows, key=lambda r: r.concurrency)
