"""Open each row's engine, run it once on one batch and judge it against eager fp32 by the
tolerance of its precision (max relative error, SQNR for int8)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cpu_table.direct import DirectEngine, peer_compile, peer_onnx
from benchmarks.cpu_table.exports import one_line
from benchmarks.cpu_table.rows import ROWS
from tk.parity import compare_output
from tk.runtime import load
from tk.runtime.base import Engine
from tk.tolerances import MIN_SQNR_DB, tolerance_for
from tk.workflows.ort_session import ORT_SPINNING


def open_row(key: str, artifacts: dict[str, Path], threads: int) -> Engine:
    """The engine of row ``key`` on its artifact (not loaded yet); onnxruntime sessions without spinning."""
    row = ROWS[key]
    if row.artifact not in artifacts:
        raise RuntimeError(f"its {row.artifact} export failed (see exports in the JSON)")
    root = artifacts[row.artifact]
    if row.engine == "peer-compile":
        return peer_compile(load(root, "eager"))
    if row.engine == "peer-onnx":
        return peer_onnx(load(root, "onnx"), threads)
    if row.engine == "onnx":
        return load(root, "onnx", threads=threads, spinning=False, **row.options)
    return load(root, row.engine, **row.options)


def named_numpy(engine: Engine, out: Any) -> dict[str, np.ndarray]:
    """Any engine's outputs (a dict, a list, a tensor) as float NumPy arrays by output name."""
    if not isinstance(out, dict):
        values = list(out) if isinstance(out, (list, tuple)) else [out]
        out = dict(zip([s.name for s in engine.outputs], values, strict=True))
    result = {}
    for name, value in out.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
            value = value.numpy()
        result[name] = np.asarray(value)
    return result


def engine_settings(engine: Engine) -> dict[str, Any]:
    """What an engine runs with, read back after loading (compile: freezing, precision; onnx: threads, spinning)."""
    settings = {
        k: v if isinstance(v, (bool, int, float, str, type(None), list)) else str(v)
        for k, v in engine.settings().items()
    }
    if engine.name == "compile":
        settings["dynamic"] = engine.options.dynamic  # type: ignore[attr-defined]
    if engine.name == "onnx":
        options = engine.session.get_session_options()  # type: ignore[attr-defined]
        settings["allow_spinning"] = options.get_session_config_entry(ORT_SPINNING)
    return settings


def finite(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else round(value, 2)


def parity_of(precision: str, reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, Any]:
    """``candidate`` against ``reference`` output by output, by the tolerance of ``precision``."""
    rtol, atol = tolerance_for(precision)
    min_sqnr = MIN_SQNR_DB.get(precision)
    outputs = {}
    for name, ref in reference.items():
        got = compare_output(name, ref, candidate[name], rtol, atol, min_sqnr)
        outputs[name] = {
            "max_rel": got.max_rel,
            "max_abs": got.max_abs,
            "sqnr_db": finite(got.sqnr_db),
            "passed": got.passed,
            "problem": got.problem,
        }
    return {
        "precision": precision,
        "rtol": rtol,
        "atol": atol,
        "min_sqnr_db": min_sqnr,
        "outputs": outputs,
        "max_rel": max(o["max_rel"] for o in outputs.values()),
        "sqnr_db": min((o["sqnr_db"] for o in outputs.values() if o["sqnr_db"] is not None), default=None),
        "passed": all(o["passed"] for o in outputs.values()),
    }


def open_and_check(
    rows: list[str],
    artifacts: dict[str, Path],
    feeds: dict[str, np.ndarray],
    threads: int,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[dict[str, Engine], dict[str, Any], dict[str, str]]:
    """Open each row's engine and measure its parity with the first row's (eager fp32) on ``feeds``.

    Returns the engines that ran, the parity per row, and why each other row could not run.
    """
    engines: dict[str, Engine] = {}
    parity: dict[str, Any] = {}
    failed: dict[str, str] = {}
    reference: dict[str, np.ndarray] | None = None
    for key in rows:
        say(f"open {key} and run it on its parity batch")
        try:
            engine = open_row(key, artifacts, threads)
            engine.load()
            start = time.perf_counter()
            out = named_numpy(engine, engine.run(feeds))
            first_call_s = time.perf_counter() - start
        except Exception as exc:  # a row that cannot run is reported, the others still run
            failed[key] = one_line(exc)
            say(f"{key} unavailable: {failed[key]}")
            continue
        engines[key] = engine
        reference = out if reference is None else reference
        parity[key] = parity_of(ROWS[key].precision, reference, out) | {"first_call_s": round(first_call_s, 2)}
        if not isinstance(engine, DirectEngine):
            parity[key]["settings"] = engine_settings(engine)
    return engines, parity, failed
