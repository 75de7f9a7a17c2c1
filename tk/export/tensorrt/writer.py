"""The ``trt`` format: a TensorRT engine (``model.plan``) built from the exporter's standard-op ONNX graph.

The network is strongly typed (TensorRT 11 builds nothing else): each layer runs in the dtype the
ONNX graph gives it, and tk puts reduced precision into the graph (``tk.export.casts``), so
no precision flag is set here. TF32 is turned off where TensorRT still has the flag, so float32
engines keep float32 parity. One optimization profile spans every dimension's min/opt/max. The
timing cache is read before and written after each build (atomically), so rebuilds are faster.
Works with TensorRT 10.x and 11.x.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tk.errors import ConversionError, UsageError
from tk.export.base import Writer, option
from tk.export.context import ExportContext, ExportOptions
from tk.fileio import atomic_write_bytes
from tk.formats.tensorrt import FILE, trt_logger, unavailable_reason
from tk.spec import Dim, Signature

log = logging.getLogger("tk.export")

HARDWARE_COMPATIBILITY = {  # tk option -> trt.HardwareCompatibilityLevel member
    "none": "NONE",
    "ampere+": "AMPERE_PLUS",
    "same-compute-capability": "SAME_COMPUTE_CAPABILITY",
}
DEFAULT_TIMING_CACHE = Path("~/.cache/tk/trt-timing.cache")
DEFAULT_WORKSPACE_GB = 4.0
DEFAULT_OPTIMIZATION_LEVEL = 3
DEFAULT_HARDWARE_COMPATIBILITY = "ampere+"


@dataclass(frozen=True)
class TrtOptions:
    """The ``trt`` writer's settings; None means the default."""

    workspace_gb: float | None = option("--trt-workspace")  # builder workspace limit, GiB; default 4
    optimization_level: int | None = option("--trt-opt-level")  # builder optimization level 0-5; default 3
    # none | ampere+ (default) | same-compute-capability
    hardware_compatibility: str | None = option("--trt-hardware-compat")
    # default: ~/.cache/tk/trt-timing.cache
    timing_cache: Path | None = option("--trt-timing-cache")  # noqa: RUF009 (its default is None)

    def resolved(self) -> TrtOptions:
        return TrtOptions(
            DEFAULT_WORKSPACE_GB if self.workspace_gb is None else self.workspace_gb,
            DEFAULT_OPTIMIZATION_LEVEL if self.optimization_level is None else self.optimization_level,
            self.hardware_compatibility or DEFAULT_HARDWARE_COMPATIBILITY,
            Path(self.timing_cache or DEFAULT_TIMING_CACHE).expanduser(),
        )


class TrtWriter(Writer):
    """``model.plan``: a TensorRT engine built from the exporter's standard-op ONNX graph
    (``onnx-plain``, which TensorRT's parser takes), never from a fused or quantized ``model.onnx``."""

    name = "trt"
    Options = TrtOptions
    requires = ("onnx-plain",)

    def unavailable_reason(self, device: str, precision: str) -> str | None:
        return unavailable_reason(device)

    def validate(self, options: TrtOptions, export: ExportOptions) -> None:
        if options.workspace_gb is not None and not options.workspace_gb > 0:
            raise UsageError(f"--trt-workspace: expected a size in GiB above 0, got {options.workspace_gb}")
        level = options.optimization_level
        if level is not None and not 0 <= level <= 5:
            raise UsageError(f"--trt-opt-level: expected 0 to 5, got {level}")
        compat = options.hardware_compatibility
        if compat is not None and compat not in HARDWARE_COMPATIBILITY:
            raise UsageError(
                f"--trt-hardware-compat: expected one of {', '.join(HARDWARE_COMPATIBILITY)}, got {compat!r}"
            )

    def write(self, ctx: ExportContext) -> None:
        import tensorrt as trt

        plain = ctx.require("onnx-plain")
        options = ctx.settings[self.name].resolved()
        settings = engine_from_onnx(plain.path, ctx.add_file(FILE, "trt"), ctx.spec.signature, ctx.dims, options)
        settings["onnx"] = ctx.shipped_copy(plain.path)  # the artifact's copy of the graph built from, if one ships
        ctx.formats["trt"] = {"file": FILE, **settings}
        ctx.versions["tensorrt"] = trt.__version__
        ctx.versions["gpu"] = settings["gpu"]
        ctx.versions["compute_capability"] = settings["compute_capability"]


WRITER = TrtWriter()


def profile_shapes(signature: Signature, dims: dict[str, Dim]) -> dict[str, dict[str, list[int]]]:
    """Per input, its shape at every dimension's min, opt and max."""
    shapes: dict[str, dict[str, list[int]]] = {}
    for spec in signature.inputs:
        shapes[spec.name] = {
            which: list(spec.concrete_shape({n: getattr(d, which) for n, d in dims.items()}))
            for which in ("min", "opt", "max")
        }
    return shapes


def engine_from_onnx(
    onnx_path: Path, plan_path: Path, signature: Signature, dims: dict[str, Dim], options: TrtOptions
) -> dict[str, Any]:
    """Build a serialized engine from ``onnx_path`` into ``plan_path`` with ``options`` (resolved);
    returns the settings used."""
    import tensorrt as trt

    level = _compatibility_level(trt, options)
    logger = trt_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)).strip() for i in range(parser.num_errors)]
        first = errors[0] if errors else "no reason given"
        raise ConversionError(
            f"TensorRT {trt.__version__}'s ONNX parser rejected the model ({len(errors)} error(s); first: {first}); "
            "try another --opset, or export --format onnx and run it with onnxruntime"
        )
    shapes = profile_shapes(signature, dims)
    config = _builder_config(trt, builder, network, options, level, shapes)
    cache_path = Path(options.timing_cache or DEFAULT_TIMING_CACHE)
    _attach_timing_cache(config, cache_path)
    try:
        plan = builder.build_serialized_network(network, config)
    except Exception as exc:  # the bindings raise for some build failures instead of returning None
        raise ConversionError(f"TensorRT {trt.__version__} could not build an engine: {exc}") from exc
    if plan is None:
        raise ConversionError(
            f"TensorRT {trt.__version__} could not build an engine (its log above says why); "
            "a larger --trt-workspace or another --trt-opt-level may help"
        )
    with open(plan_path, "wb") as f:
        f.write(memoryview(plan))
    _save_timing_cache(config, cache_path)
    major, minor = torch.cuda.get_device_capability()
    return {
        "tensorrt": trt.__version__,
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "hardware_compatibility": options.hardware_compatibility,
        "optimization_level": options.optimization_level,
        "workspace_gb": options.workspace_gb,
        "strongly_typed": True,
        "tf32": False,
        "profile": shapes,
        "timing_cache": str(cache_path),
    }


def _compatibility_level(trt: Any, options: TrtOptions) -> Any:
    """The ``trt.HardwareCompatibilityLevel`` of ``--trt-hardware-compat``; one line where this TensorRT lacks it."""
    level = getattr(trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[options.hardware_compatibility], None)
    if level is None:
        raise UsageError(
            f"--trt-hardware-compat {options.hardware_compatibility}: TensorRT {trt.__version__} does not offer it"
        )
    return level


def _builder_config(
    trt: Any, builder: Any, network: Any, options: TrtOptions, level: Any, shapes: dict[str, dict[str, list[int]]]
) -> Any:
    """The build's settings: workspace, optimization and compatibility levels, no TF32, and one
    optimization profile spanning every input's min, opt and max ``shapes``."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * 2**30))
    config.builder_optimization_level = options.optimization_level
    config.hardware_compatibility_level = level
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None:
        config.clear_flag(tf32)  # TF32 rounds float32 products to 10 mantissa bits: no float32 parity
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in shapes:
            raise ConversionError(f"the ONNX graph has input {name!r}, which the signature lacks ({', '.join(shapes)})")
        profile.set_shape(name, shapes[name]["min"], shapes[name]["opt"], shapes[name]["max"])
    config.add_optimization_profile(profile)
    return config


def _network_flags(trt: Any) -> int:
    # TensorRT 10 builds strongly typed networks on request; 11 always does and deprecates the flag.
    if int(trt.__version__.split(".")[0]) >= 11:
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def _attach_timing_cache(config: Any, path: Path) -> None:
    data = b""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("TensorRT timing cache %s unreadable (%s); starting an empty one", path, exc)
    cache = None
    if data:
        try:
            cache = config.create_timing_cache(data)
        except Exception:  # a damaged cache is only a slower build
            cache = None
        if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
            log.warning("TensorRT timing cache %s is damaged or from another GPU/version; starting an empty one", path)
            cache = None
    if cache is None:
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _save_timing_cache(config: Any, path: Path) -> None:
    cache = config.get_timing_cache()
    if cache is None:
        return
    try:
        atomic_write_bytes(path, bytes(memoryview(cache.serialize())))
    except UsageError as exc:  # the engine is built; a cache we cannot save is only a warning
        log.warning("could not save the TensorRT timing cache: %s", exc)
