"""What one export run shares between its format writers: the common options and the context."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.models import ModelSpec
from tk.spec import Dim

log = logging.getLogger("tk.export")

# Asked by an int8 writer before its exclusion search, with the format's name and its all-int8 model (ONNX
# bytes, an OpenVINO model, a function that compiles the aoti package); by the aoti and openvino writers
# after each round of their search that stays under the target, with the most ``Int8Share`` the search can
# still keep (``bound``); and by the aoti writer after the search, before its compile, with the share it
# kept: why the result cannot be the fastest candidate, or None (tk optimize's speed gate). A reason ends
# the export with CannotWinError.
Int8Gate = Callable[[str, Any], str | None]


@dataclass(frozen=True)
class Int8Share:
    """What an exclusion search kept in int8: layers, and their share of the multiply-adds of the layers
    the all-int8 model ran in int8 (measured on a calibration batch)."""

    int8_layers: int
    layers: int  # the all-int8 model's int8 layers
    share: float  # 0..1
    bound: bool = False  # asked mid-search: the most the search can still keep (its result keeps no more)


@dataclass
class ExportOptions:
    """How to export: the options every format shares, and each format's own in ``settings``.

    ``settings`` maps a format name to its writer's options dataclass, e.g.
    ``{"onnx": OnnxOptions(fusions=False), "trt": TrtOptions(workspace_gb=2)}``; a format not in
    it uses its defaults. ``None`` means the default, resolved by the writer that reads it.
    """

    formats: tuple[str, ...] = ("onnx",)  # names in tk.registries.FORMATS, or all
    precision: str = "fp32"  # fp32 | tf32 | fp16 | bf16 | int8
    dynamic: bool = True  # False: every dimension fixed at its opt size
    dims: dict[str, Dim] = field(default_factory=dict)  # overrides of the model's dimension ranges
    device: str = "cpu"  # cpu | cuda
    check: bool = True  # run the export-time parity check
    rtol: float | None = None  # override the precision's tolerance
    atol: float | None = None
    checkpoint: Path | None = None  # safetensors state_dict from `tk train`
    calibrate: str | None = None  # int8 calibration: "random:N" or an inputs file; default random:32
    calibration_data: dict[str, Any] | None = None  # the calibration arrays, read by tk.workflows.export
    check_inputs: Path | None = None  # a file of samples for the check, read into check_data by tk.workflows.export
    # samples the check and the int8 searches' judges run, fitted to each shape (tk.spec.fitted_samples)
    # where they fit; None: random inputs
    check_data: dict[str, Any] | None = None
    keep_fp32: tuple[str, ...] = ()  # module paths kept in float32 under a reduced precision (tk debug precision)
    min_sqnr_db: float | None = None  # SQNR floor of the check and of int8's exclusion search (default: by precision)
    report: Path | None = None  # where a failed capture's report goes; default: OUT.export-report.md beside OUT
    settings: Mapping[str, Any] = field(default_factory=dict)  # format -> its writer's options dataclass
    int8_gate: Int8Gate | None = None  # see Int8Gate; None: every int8 search runs
    force: bool = False  # replace an --out artifact that holds other files too, deleting them (tk.outdir)


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
    settings: dict[str, Any] = field(default_factory=dict)  # format -> its options (given, else defaults)
    providers: dict[str, Callable[[ExportContext], Any]] = field(default_factory=dict)  # product -> maker
    products: dict[str, Any] = field(default_factory=dict)  # products made so far
    failed: dict[str, str] = field(default_factory=dict)  # format -> why its conversion failed (the others stay)
    failed_errors: dict[str, Exception] = field(default_factory=dict)  # format -> the error itself

    @property
    def scratch(self) -> Path:
        """A directory for intermediate files; removed before the manifest is written."""
        path = self.staging / ".scratch"
        path.mkdir(exist_ok=True)
        return path

    def timed(self, step: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, its duration recorded in ``timings[step]`` and logged as one line."""
        start = time.perf_counter()
        result = fn()
        self.timings[step] = round(time.perf_counter() - start, 3)
        log.info("export %-6s ok %.1f s", step, self.timings[step])
        return result

    def add_file(self, relative: str, role: str) -> Path:
        self.files.append((relative, role))
        return self.staging / relative

    def require(self, product: str) -> Any:
        """Another writer's output by name (``onnx-plain``: the standard-op ONNX graph), made once."""
        if product not in self.products:
            if product not in self.providers:
                raise KeyError(f"no format provides {product!r} (known: {', '.join(self.providers) or 'none'})")
            try:
                self.products[product] = self.providers[product](self)
            except Exception as exc:  # made once: a second writer asking gets the same failure, not a second try
                self.products[product] = exc
        made = self.products[product]
        if isinstance(made, Exception):
            raise made
        return made

    def shipped_copy(self, path: Path) -> str | None:
        """The artifact file (relative path) whose bytes equal ``path``'s, if one ships."""
        from tk.fileio import sha256_file

        digest = sha256_file(path)
        for relative, _ in self.files:
            candidate = self.staging / relative
            if candidate.is_file() and candidate.stat().st_size == path.stat().st_size:
                if sha256_file(candidate) == digest:
                    return relative
        return None
