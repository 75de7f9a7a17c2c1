"""The ``aoti`` format: the exported program compiled ahead of time by AOTInductor into ``model.aoti.pt2``.

The package holds native code and the weights. It runs only on the device it was compiled for,
on a CPU with the vector instructions it was compiled for, under the same torch minor version;
the manifest records all three so the engine can refuse a package it cannot run.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from tk.errors import ConversionError, first_line
from tk.export.context import ExportContext
from tk.formats.aoti import FILE, cpu_vector_isa


def unavailable_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "AOTInductor for cuda needs a CUDA GPU; none found"
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "AOTInductor needs a C++ compiler; none found (install g++, or set CXX)"
    return None


def write(ctx: ExportContext) -> None:
    assert ctx.program is not None
    aoti_package_from_exported_program(ctx.program, ctx.add_file(FILE, "aoti"))
    ctx.formats["aoti"] = {"file": FILE, "device": ctx.options.device}
    if ctx.options.device == "cpu":
        isa = cpu_vector_isa()
        if isa is not None:
            ctx.formats["aoti"]["cpu_isa"] = isa


def aoti_package_from_exported_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """Compile ``program`` for the device its tensors live on and package it at ``path``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    except Exception as exc:  # Inductor and the C++ toolchain raise many types
        raise ConversionError(
            f"AOTInductor could not compile the program ({type(exc).__name__}: {first_line(exc)}); check that `g++ --version` works, "
            "or export --format torch or onnx instead"
        ) from exc
