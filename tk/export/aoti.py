"""The ``aoti`` format: the exported program compiled ahead of time by AOTInductor into ``model.aoti.pt2``.

The package holds native code and the weights. It runs only on the device it was compiled for,
on a CPU with the vector instructions it was compiled for, under the same torch minor version;
the manifest records all three so the engine can refuse a package it cannot run.

Why freezing for bf16 and fp16 on the CPU: without it the package keeps the float32 weights as
inputs of the graph, so every call casts all of them to the reduced precision again and runs each
linear as a plain ``addmm``. With Inductor's freezing the weights are constants: the casts are
folded at compile time (the package holds bfloat16 weights, 40% smaller for BERT-base), and the
linears become oneDNN linears on weights packed once, in the layout oneDNN picks for this CPU
(one more reason a package runs only where it was compiled), with bias and GELU fused into them.
Measured on BERT-base bf16 at batch 32 x 128 on a 2-core AVX512-BF16 CPU, interleaved in one
process: 69% of the bf16 matrix-product peak without freezing, 77% with it, and the compile
takes as long. Inductor's C++ GEMM template (``max_autotune``) does not help there: without AMX
it computes bfloat16 products in float32, and autotuning the small model kept oneDNN's kernel
for every linear while doubling the compile time. Freezing only applies while gradients are
off, so the compile runs under ``torch.no_grad()``. float32 packages keep Inductor's defaults:
their 1e-5 parity is what the tests verify, and freezing's prepacked float32 kernels were not
measured against it. The settings used are recorded in the manifest (``inductor_configs``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from tk.errors import ConversionError, first_line
from tk.export.context import ExportContext
from tk.formats.aoti import FILE, cpu_vector_isa, packing_features


def unavailable_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "AOTInductor for cuda needs a CUDA GPU; none found"
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "AOTInductor needs a C++ compiler; none found (install g++, or set CXX)"
    return None


def write(ctx: ExportContext) -> None:
    assert ctx.program is not None
    configs = inductor_configs_for(ctx.options.precision, ctx.options.device)
    program, quantization = ctx.program, None
    if ctx.options.precision == "int8":
        program, quantization = _int8_program(ctx)
    aoti_package_from_exported_program(program, ctx.add_file(FILE, "aoti"), inductor_configs=configs)
    ctx.formats["aoti"] = {"file": FILE, "device": ctx.options.device, "inductor_configs": configs}
    if quantization is not None:
        ctx.formats["aoti"]["quantization"] = quantization
    if ctx.options.device == "cpu":
        isa = cpu_vector_isa()
        if isa is not None:
            ctx.formats["aoti"]["cpu_isa"] = isa
        features = packing_features()
        if configs.get("freezing") and features is not None:  # weights packed by oneDNN for this CPU
            ctx.formats["aoti"]["packed_for"] = features


def _int8_program(ctx: ExportContext) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """The captured program quantized by torchao's PT2E x86 quantizer (``tk.export.aoti_int8``)."""
    from tk.export.aoti_int8 import DEFAULT_METHOD, int8_program
    from tk.export.calibration import calibration_feeds, judge_feeds
    from tk.tolerances import MIN_SQNR_DB

    assert ctx.program is not None
    program, result = int8_program(
        ctx.program,
        ctx.spec.signature,
        ctx.dims,
        ctx.example_inputs,
        calibration_feeds(ctx),
        method=ctx.options.calibration_method or DEFAULT_METHOD,
        keep_fp32=ctx.options.keep_fp32,
        min_sqnr_db=MIN_SQNR_DB["int8"],
        judge=judge_feeds(ctx),
    )
    return program, result.to_json()


def inductor_configs_for(precision: str, device: str) -> dict[str, Any]:
    """Inductor settings an ``aoti`` package is compiled with: freezing for bf16, fp16 and int8 on the CPU.

    Freezing makes the weights constants, so their casts are folded and the linears run on weights
    packed once for oneDNN (see the module docstring); for int8 it is what lowers each quantized
    linear to one oneDNN ``qlinear`` (``tk.export.aoti_int8``). float32 and CUDA packages keep
    Inductor's defaults, which is what their tolerances were verified with.
    """
    if device == "cpu" and precision in ("bf16", "fp16", "int8"):
        return {"freezing": True}
    return {}


def aoti_package_from_exported_program(
    program: torch.export.ExportedProgram, path: Path, *, inductor_configs: dict[str, Any] | None = None
) -> None:
    """Compile ``program`` for the device its tensors live on and package it at ``path``.

    ``inductor_configs`` are passed to AOTInductor (``torch._inductor.config`` names); default none.
    The compile runs with gradients off, which freezing needs and inference packages never use.
    """
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=dict(inductor_configs or {})
            )
    except Exception as exc:  # Inductor and the C++ toolchain raise many types
        raise ConversionError(
            f"AOTInductor could not compile the program ({type(exc).__name__}: {first_line(exc)}); check that `g++ --version` works, "
            "or export --format torch or onnx instead"
        ) from exc
