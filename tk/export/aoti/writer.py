"""The ``aoti`` format: the exported program compiled ahead of time by AOTInductor into ``model.aoti.pt2``.

The package holds native code and the weights. It runs only on the device it was compiled for,
on a CPU with the vector instructions it was compiled for, under the same torch minor version;
the manifest records all three so the engine can refuse a package it cannot run.

Why freezing for bf16 and fp16 on the CPU: without it the package keeps the float32 weights as
inputs of the graph, so every call casts all of them to the reduced precision again and runs each
linear as a plain ``addmm``. With Inductor's freezing the weights are constants: the casts are
folded at compile time (the package holds bfloat16 weights, so it is smaller), and the
linears become oneDNN linears on weights packed once, in the layout oneDNN picks for this CPU
(one more reason a package runs only where it was compiled), with bias and GELU fused into them:
a larger share of the bf16 matrix-product peak, for the same compile time. Inductor's C++ GEMM template (``max_autotune``) does not help there: without AMX
it computes bfloat16 products in float32, and autotuning the small model kept oneDNN's kernel
for every linear while doubling the compile time. Freezing only applies while gradients are
off, so the compile runs under ``torch.no_grad()``. float32 packages keep Inductor's defaults
unless ``--freeze`` asks: freezing's prepacked float32 linears ran MiniLM 1.4x slower on the AVX2
EPYC and 1.07x faster on the AVX-512 Xeon (``inductor_configs_for``), so ``tk optimize`` times
both. The settings used are recorded in the manifest (``inductor_configs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tk.errors import ConversionError, UsageError, first_line
from tk.export.aoti.constant_names import unique_constant_names
from tk.export.base import REDUCED, Writer, option
from tk.export.context import ExportContext, ExportOptions
from tk.formats.aoti import FILE, cpu_vector_isa, packing_features
from tk.formats.inductor_freezing import float_weight_packing

log = logging.getLogger("tk")


@dataclass(frozen=True)
class AotiOptions:
    """The ``aoti`` writer's settings; None means the default."""

    calibration_method: str | None = option("--calibration-method")  # int8: histogram (default) | minmax
    # Inductor's freezing (weights as constants, packed for this CPU); default on for bf16/fp16/int8 on the CPU,
    # off for float32 (``inductor_configs_for``)
    freeze: bool | None = option("--freeze/--no-freeze")
    # CPU packages of a model with an attention mask: per-token work on real tokens only
    # (``tk.export.aoti.unpadded``); default on
    remove_padding: bool | None = option("--remove-padding/--keep-padding")


class AotiWriter(Writer):
    """``model.aoti.pt2``: the program compiled by AOTInductor; frozen under bf16/fp16/int8 on the CPU,
    quantized by torchao's PT2E x86 quantizer under int8 (``tk.export.aoti.int8``)."""

    name = "aoti"
    Options = AotiOptions
    precisions = (*REDUCED, "int8")
    int8_rank = 0  # beat onnxruntime's static QDQ graph on every CPU measured (benchmarks/history.md)
    int8_probe_compiles = True  # timing its all-int8 model means compiling a package
    int8_excludes_modules = True  # quantization.excluded lists module paths

    def variants(self, precision: str) -> list[AotiOptions]:
        # Inductor's freezing for float32 is faster on some CPUs, slower on others (inductor_configs_for)
        return [AotiOptions(), AotiOptions(freeze=True)] if precision == "fp32" else [AotiOptions()]

    def variant_words(self, options: AotiOptions, precision: str) -> list[str]:
        return [*super().variant_words(options, precision), *(["frozen"] if options.freeze else [])]

    def int8_float_part(self) -> str:
        """bfloat16 where this CPU's bfloat16 products outrun float32's (``excluded_run_in_bf16``)."""
        from tk.export.aoti.int8 import excluded_run_in_bf16

        return "bf16" if excluded_run_in_bf16() else "fp32"

    def unavailable_reason(self, device: str, precision: str) -> str | None:
        if precision == "int8":
            from tk.export.aoti.int8 import unavailable_reason as int8_reason

            reason = int8_reason(device)
            if reason:
                return reason
        if device == "cuda" and not torch.cuda.is_available():
            return "AOTInductor for cuda needs a CUDA GPU; none found"
        if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            return "AOTInductor needs a C++ compiler; none found (install g++, or set CXX)"
        return None

    def validate(self, options: AotiOptions, export: ExportOptions) -> None:
        if options.freeze is not None and export.device != "cpu":
            raise UsageError(f"--freeze/--no-freeze: applies to CPU packages only; this export is for {export.device}")
        if options.freeze is False and export.precision == "int8":
            raise UsageError(
                "--no-freeze: int8 packages need Inductor's freezing to lower their quantized linears; drop it"
            )
        if options.remove_padding is not None and export.device != "cpu":
            raise UsageError(
                f"--remove-padding/--keep-padding: applies to CPU packages only; this export is for {export.device}"
            )
        method = options.calibration_method
        if method is None:
            return
        if export.precision != "int8":
            raise UsageError(
                f"--calibration-method: applies to --precision int8 only; this export is {export.precision}"
            )
        from tk.export.aoti.int8 import METHODS

        if method not in METHODS:
            raise UsageError(
                f"--calibration-method: int8 aoti packages calibrate with {' or '.join(METHODS)}, got {method!r}"
            )

    def write(self, ctx: ExportContext) -> None:
        assert ctx.program is not None
        options: AotiOptions = ctx.settings[self.name]
        program, quantization, passes = ctx.program, None, []
        if ctx.options.precision == "int8":  # compiled as its search settled its float part
            program, quantization, passes = _int8_program(ctx, options)
            in_bf16 = quantization["automatic_exclusions_run_in"] == "bf16"
            configs = inductor_configs_for("int8", ctx.options.device, float_part_in_bf16=in_bf16)
        else:
            configs = inductor_configs_for(ctx.options.precision, ctx.options.device, freeze=options.freeze)
        unpadded, removed = None, []
        if ctx.options.device == "cpu" and options.remove_padding is not False:
            unpadded, removed = _padding_removed(ctx, program)
        path = ctx.add_file(FILE, "aoti")
        compile_options = {
            "inductor_configs": configs,
            "precision": ctx.options.precision,
            "device": ctx.options.device,
        }
        try:
            compiled = aoti_package_from_exported_program(
                program if unpadded is None else unpadded, path, **compile_options
            )
        except ConversionError as exc:
            if unpadded is None:
                raise
            log.info("export aoti: padding kept: the program on real tokens did not compile (%s)", exc)
            removed, compiled = [], aoti_package_from_exported_program(program, path, **compile_options)
        passes = [*removed, *passes, *compiled]
        info: dict[str, Any] = {"file": FILE, "device": ctx.options.device, "inductor_configs": configs}
        if passes:
            info["graph_passes"] = passes
        if quantization is not None:
            info["quantization"] = quantization
        if ctx.options.device == "cpu":
            isa = cpu_vector_isa()
            if isa is not None:
                info["cpu_isa"] = isa
            features = packing_features()
            if configs.get("freezing") and features is not None:  # weights packed by oneDNN for this CPU
                info["packed_for"] = features
        ctx.formats["aoti"] = info


WRITER = AotiWriter()


def unavailable_reason(device: str) -> str | None:
    """Why this machine cannot compile a float package for ``device`` (None when it can)."""
    return WRITER.unavailable_reason(device, "fp32")


def _padding_removed(ctx: ExportContext, program: torch.export.ExportedProgram) -> tuple[Any, list[str]]:
    """``program`` with its per-token work on real tokens only where it has an attention mask that allows
    it (``tk.export.aoti.unpadded``), and the pass's name in a list; (None, []) where it does not apply."""
    from tk.export.aoti.unpadded import PADDING_REMOVED, padding_removed

    unpadded = padding_removed(program, ctx.spec.signature, ctx.dims, ctx.example_inputs)
    return (None, []) if unpadded is None else (unpadded, [PADDING_REMOVED])


def _int8_program(
    ctx: ExportContext, options: AotiOptions
) -> tuple[torch.export.ExportedProgram, dict[str, Any], list[str]]:
    """The captured program quantized by torchao's PT2E x86 quantizer (``tk.export.aoti.int8``), and the
    graph passes applied before: where the CPU's bfloat16 products outrun its float32 ones
    (``excluded_run_in_bf16``), attention in bfloat16: by aten's flash kernel where the CPU has AMX for
    bfloat16 (``flash_attention_in``), else as two bfloat16 products (``attention_as_matmuls``), either faster
    than aten's float32 flash kernel (benchmarks/history.md); applied before quantizing so that the
    exclusion search judges what the package computes."""
    from tk.export.aoti.int8 import DEFAULT_METHOD, excluded_run_in_bf16, int8_program
    from tk.export.aoti.passes import (
        ATTENTION_IN_BF16,
        FLASH_ATTENTION_IN_BF16,
        attention_as_matmuls,
        flash_attention_in,
        flash_attention_preferred,
    )
    from tk.export.int8.calibration import calibration_feeds, judge_feeds
    from tk.export.int8.search import int8_floor_db, int8_gate, require_int8_layers

    assert ctx.program is not None
    in_bf16 = ctx.options.device == "cpu" and excluded_run_in_bf16()
    flash = in_bf16 and flash_attention_preferred("bf16")
    attention = flash_attention_in if flash else attention_as_matmuls
    source = attention(ctx.program, torch.bfloat16) if in_bf16 else ctx.program
    program, result = int8_program(
        source,
        ctx.spec.signature,
        ctx.dims,
        ctx.example_inputs,
        calibration_feeds(ctx),
        method=options.calibration_method or DEFAULT_METHOD,
        keep_fp32=ctx.options.keep_fp32,
        min_sqnr_db=int8_floor_db(ctx),
        judge=judge_feeds(ctx),
        excluded_in_bf16=in_bf16,
        float32_program=ctx.program,  # where bf16 cannot keep the target: the float part in float32
        gate=_package_gate(int8_gate(ctx, "aoti")) if ctx.options.device == "cpu" else None,
        share_gate=int8_gate(ctx, "aoti") if ctx.options.device == "cpu" else None,
    )
    require_int8_layers(result.int8_modules, result.quantizable, "aoti")
    named = FLASH_ATTENTION_IN_BF16 if flash else ATTENTION_IN_BF16
    passes = [named] if source is not ctx.program and result.excluded_dtype == "bf16" else []
    return program, result.to_json(), passes


def _package_gate(ask: Callable[[Any], None] | None) -> Callable[[Callable[[], Any]], None] | None:
    """The int8 search's gate: given a function that captures the all-int8 program, asks ``ask``
    (``int8_gate``) with a function that compiles it as this writer compiles int8 packages."""
    if ask is None:
        return None

    def gate(capture: Callable[[], Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="tk-int8-gate-") as tmp:
            path = Path(tmp) / "all-int8.pt2"

            def package() -> Path:
                aoti_package_from_exported_program(
                    capture(), path, inductor_configs=inductor_configs_for("int8", "cpu"), precision="int8"
                )
                return path

            ask(package)

    return gate


def inductor_configs_for(
    precision: str, device: str, *, freeze: bool | None = None, float_part_in_bf16: bool | None = None
) -> dict[str, Any]:
    """Inductor settings an ``aoti`` package is compiled with: freezing for bf16, fp16 and int8 on the CPU,
    and for float32 where ``freeze`` asks for it (``--freeze``; ``False`` turns it off for bf16/fp16).

    Freezing makes the weights constants, so their casts are folded and the linears run on weights
    packed once for oneDNN (see the module docstring); for int8 it is what lowers each quantized
    linear to one oneDNN ``qlinear`` (``tk.export.aoti.int8``). CUDA packages keep Inductor's defaults.

    float32 keeps Inductor's defaults unless asked: whether oneDNN's packed float32 linears beat the
    plain ones depends on the CPU (MiniLM's frozen package ran 1.4x slower on the AVX2 EPYC, and
    ``cpp.enable_concat_linear``'s one product for q, k and v with freezing 1.07x faster on the
    AVX-512 Xeon without AMX; benchmarks/history.md), so ``tk optimize`` times both (``aoti fp32
    frozen``). A frozen float32 package concatenates the linears that share an input
    (``cpp.enable_concat_linear``): q, k and v become one wider product, which runs closer to the
    product rate than three narrow ones.

    An int8 package whose left-out layers run in float32 (``excluded_run_in_bf16`` False: no bfloat16
    dot products, or none faster than float32's) would have freezing hand those to oneDNN's packed
    float32 linear (``cpp.weight_prepack``): on the AVX2 EPYC that made MiniLM's package with 1 of 36
    layers int8 302 ms against 217 ms with the float32 linears left as the float32 package runs them
    (benchmarks/history.md; on the AVX-512 Xeon without AMX packed and plain float32 linears ran
    within 7% of each other). ``cpp.weight_prepack`` gates only Inductor's float packing; the int8
    linears are packed by torchao's own freezing pass either way. ``float_part_in_bf16``: what the
    int8 search settled (default: ``excluded_run_in_bf16()``, where it starts).
    """
    from tk.export.aoti.int8 import excluded_run_in_bf16

    if device != "cpu":
        return {}
    if precision == "int8":
        in_bf16 = excluded_run_in_bf16() if float_part_in_bf16 is None else float_part_in_bf16
        return {"freezing": True} if in_bf16 else {"freezing": True, "cpp.weight_prepack": False}
    if precision in ("bf16", "fp16"):
        return {} if freeze is False else {"freezing": True}
    return {"freezing": True, "cpp.enable_concat_linear": True} if freeze else {}


def aoti_package_from_exported_program(
    program: torch.export.ExportedProgram,
    path: Path,
    *,
    inductor_configs: dict[str, Any] | None = None,
    precision: str = "fp32",
    device: str = "cpu",
) -> list[str]:
    """Compile ``program`` (its tensors on ``device``) and package it at ``path``, with tk's graph
    passes for ``precision`` (``tk.export.aoti.passes``); returns their names, the manifest's ``graph_passes``.

    ``inductor_configs`` are passed to AOTInductor (``torch._inductor.config`` names); default none.
    bf16/fp16 on the CPU: attention decomposed into two products (``attention_as_matmuls``), except where the
    CPU has AMX for the precision (aten's flash kernel: ``flash_attention_preferred``). int8: a
    quantized program, compiled with ``SizesFromInputs`` so that torchao's fusions match under dynamic
    shapes. The compile runs with gradients off, which freezing needs and inference packages never use.
    """
    from tk.export.aoti.passes import (
        ATTENTION_AS_MATMULS,
        SizesFromInputs,
        attention_as_matmuls,
        flash_attention_preferred,
    )

    names, passes = [], {}
    if device == "cpu" and precision in ("bf16", "fp16") and not flash_attention_preferred(precision):
        program = attention_as_matmuls(program)
        names.append(ATTENTION_AS_MATMULS)
    if precision == "int8":
        passes["joint_custom_post_pass"] = SizesFromInputs()
        names.append(SizesFromInputs().uuid())
    configs = dict(inductor_configs or {})
    try:
        with (
            warnings.catch_warnings(),
            torch.no_grad(),
            torch._inductor.config.patch(passes),
            _packing(configs),
            unique_constant_names(),  # so the engine can move every constant onto cache lines
        ):
            warnings.simplefilter("ignore")
            torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    except Exception as exc:  # Inductor and the C++ toolchain raise many types
        raise ConversionError(
            f"AOTInductor could not compile the program ({type(exc).__name__}: {first_line(exc)}); check that `g++ --version` works, "
            "or export --format torch or onnx instead"
        ) from exc
    return names


def _packing(configs: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """A frozen compile packs float weights as its ``cpp.weight_prepack`` says, not as the process's
    first frozen compile did (``tk.formats.inductor_freezing``)."""
    inductor = torch._inductor.config
    if not configs.get("freezing", inductor.freezing):
        return contextlib.nullcontext()
    return float_weight_packing(bool(configs.get("cpp.weight_prepack", inductor.cpp.weight_prepack)))
