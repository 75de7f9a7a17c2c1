"""An onnxruntime CPU session built by hand, outside tk's engine: the peers the benchmarks compare
tk with (a plain session on tk's ONNX file, Optimum's ONNX) and the sessions they profile.

All graph optimizations, ``threads`` intra-op threads, and no spinning: after each run idle
worker threads otherwise spin on the cores and slow the next call of an interleaved round (tk's
own sessions in the benchmarks are opened with ``spinning=False`` for the same reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ORT_SPINNING = "session.intra_op.allow_spinning"


def plain_session(path: str | Path, threads: int, *, profile_prefix: str | Path | None = None) -> Any:
    """An ``onnxruntime.InferenceSession`` on ``path`` (CPU provider); ``profile_prefix``: profile its runs there."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.add_session_config_entry(ORT_SPINNING, "0")
    options.log_severity_level = 3  # errors only
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
