"""What one export run shares between its format writers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.models import ModelSpec
from tk.spec import Dim


@dataclass
class ExportOptions:
    """How to export. ``None`` means the default, resolved in ``tk.export.export``."""

    formats: tuple[str, ...] = ("onnx",)  # torch | onnx | aoti | trt | all
    precision: str = "fp32"  # fp32 | fp16 | bf16 | int8
    dynamic: bool = True  # False: every dimension fixed at its opt size
    dims: dict[str, Dim] = field(default_factory=dict)  # overrides of the model's dimension ranges
    opset: int | None = None  # ONNX opset; default 20
    device: str = "cpu"  # cpu | cuda
    check: bool = True  # run the export-time parity check
    rtol: float | None = None  # override the precision's tolerance
    atol: float | None = None
    checkpoint: Path | None = None  # safetensors state_dict from `tk train`
    onnx_fusions: bool = True  # onnxruntime's transformer fusions on the ONNX graph (tk.export.onnx_optimize)
    keep_unfused: bool = False  # also ship the ONNX graph before fusion, as model.unfused.onnx
    int8_mode: str = "static"  # static (calibrated QDQ) | dynamic (activations quantized per call)
    calibrate: str | None = None  # static int8 calibration: "random:N" or an inputs file; default random:32
    calibration_data: dict[str, Any] | None = None  # the calibration arrays, read by tk.workflows.export
    # static int8 activation ranges: onnx minmax (default) | entropy | percentile; aoti histogram (default) | minmax
    calibration_method: str | None = None
    nodes_to_exclude: tuple[str, ...] = ()  # ONNX nodes kept in float32 by int8
    keep_fp32: tuple[str, ...] = ()  # module paths kept in float32 under a reduced precision (tk debug precision)
    report: Path | None = None  # where a failed capture's report goes; default: OUT.export-report.md beside OUT
    trt_workspace_gb: float = 4.0  # TensorRT builder workspace limit, GiB
    trt_optimization_level: int = 3  # TensorRT builder optimization level, 0-5
    trt_hardware_compatibility: str = "ampere+"  # none | ampere+ | same-compute-capability
    trt_timing_cache: Path | None = None  # default: ~/.cache/tk/trt-timing.cache


@dataclass
class ExportContext:
    """The model being exported and what the writers produced so far."""

    spec: ModelSpec
    module: nn.Module  # at the export precision (float32 edges)
    dims: dict[str, Dim]  # resolved ranges (all static when --static)
    options: ExportOptions
    staging: Path  # files are written here, then the directory is renamed into place
    example_inputs: tuple[torch.Tensor, ...]
    program: torch.export.ExportedProgram | None = None
    report: Path | None = None  # where a failed capture or conversion writes its report
    files: list[tuple[str, str]] = field(default_factory=list)  # (relative path, role)
    formats: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def add_file(self, relative: str, role: str) -> Path:
        self.files.append((relative, role))
        return self.staging / relative
