"""Where an artifact's time goes: onnxruntime's profiler (kernel time by op type) and torch's
profiler on a kernel-profiled copy of an AOTInductor package (top operators).

A package's kernels and its calls into ATen are invisible to the profiler unless compiled with
``cpp.enable_kernel_profile``: the profiled copy is compiled again with that setting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.export import ExportOptions
from tk.manifest import Manifest
from tk.models import ModelSpec
from tk.runtime.aoti_package import open_package
from tk.workflows.export import export
from tk.workflows.ort_session import plain_session

log = logging.getLogger("tk")
TOP = 10  # operators listed per package


def _args(manifest: Manifest, feeds: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(feeds[s.name]) for s in manifest.signature.inputs)


def profile_package(model: Any, manifest: Manifest, feeds: dict[str, np.ndarray], runs: int = 3) -> list[dict]:
    """The top operators of ``runs`` profiled calls of a kernel-profiled package, per call and as a share."""
    from torch.profiler import ProfilerActivity, profile

    args = _args(manifest, feeds)
    with torch.inference_mode():
        for _ in range(2):
            model(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(runs):
                model(*args)
    averages = [e for e in prof.key_averages() if e.key != "inductor_wrapper_call"]  # the whole call
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]
    total = sum(e.self_cpu_time_total for e in averages)
    top = [
        {
            "op": e.key[:60],
            "self_ms_per_call": round(e.self_cpu_time_total / runs / 1e3, 2),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count // runs,
        }
        for e in events
    ]
    for t in top:
        log.info("  %-60s %9.2f ms  %5.1f%%  x%d", t["op"], t["self_ms_per_call"], 100 * t["share"], t["calls"])
    return top


def profile_aoti_artifact(root: Path, manifest: Manifest, feeds: dict[str, np.ndarray], work: Path) -> list[dict]:
    """The top operators of an artifact's AOTInductor package: its program (the artifact must hold
    the torch format) compiled again with its Inductor settings and graph passes plus ``cpp.enable_kernel_profile``."""
    from tk.export.aoti.writer import aoti_package_from_exported_program
    from tk.formats.torch_program import FILE as PROGRAM
    from tk.formats.torch_program import load_exported_program

    program = load_exported_program((root / PROGRAM).read_bytes())
    program.example_inputs = (_args(manifest, feeds), {})  # tk saves programs without them; AOTInductor needs some
    aoti = manifest.formats["aoti"]
    configs = {**aoti.get("inductor_configs", {}), "cpp.enable_kernel_profile": True}
    path = work / f"{root.name}-profiled.aoti.pt2"
    aoti_package_from_exported_program(
        program, path, inductor_configs=configs, precision=manifest.precision, device=aoti.get("device", "cpu")
    )
    return profile_package(open_package(path.read_bytes(), aoti.get("device", "cpu")), manifest, feeds)


def profile_aoti_export(
    spec: ModelSpec, options: ExportOptions, feeds: dict[str, np.ndarray], work: Path
) -> list[dict]:
    """The top operators of an AOTInductor export of ``spec`` made again with ``cpp.enable_kernel_profile``
    (the same calibration and exclusions for int8: both are deterministic)."""
    import torch._inductor.config as inductor_config

    root = work / "int8-profiled"
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        manifest = export(spec, root, dataclasses.replace(options, formats=("aoti",))).manifest
    return profile_package(open_package((root / "model.aoti.pt2").read_bytes(), manifest.device), manifest, feeds)


def profile_onnx(path: Path, feeds: dict[str, np.ndarray], work: Path, runs: int = 3) -> list[dict]:
    """onnxruntime's profiler on an ONNX graph: kernel time per op type, per call, and its share."""
    prefix = work / f"{path.parent.name}-ort-profile"
    session = plain_session(path, torch.get_num_threads(), profile_prefix=prefix)
    session.run(None, feeds)  # warm-up, in the profile too: left out below by counting from the end
    for _ in range(runs):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    return op_type_shares(events, runs)


def op_type_shares(events: list[dict], runs: int) -> list[dict]:
    """Kernel time per op type over the last ``runs`` runs of an onnxruntime profile (one warm-up before)."""
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(kernels) // (runs + 1)
    by_op: dict[str, list[float]] = {}
    for e in kernels[-runs * per_run :]:
        by_op.setdefault(e["args"]["op_name"], []).append(e["dur"])
    total = sum(sum(v) for v in by_op.values())
    top = [
        {
            "op": op,
            "ms_per_call": round(sum(d) / runs / 1e3, 2),
            "share": round(sum(d) / total, 3),
            "nodes": len(d) // runs,
        }
        for op, d in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))
    ]
    for t in top[:14]:
        log.info("  %-24s %9.2f ms  %5.1f%%  x%d", t["op"], t["ms_per_call"], 100 * t["share"], t["nodes"])
    return top
