"""The ``trt`` format: a TensorRT plan, ``model.plan``; what building and running one needs.

The requirement checks and TensorRT's process-wide logger serve both the writer and the engine.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

FILE = "model.plan"
MIN_COMPUTE_CAPABILITY = (8, 0)


@functools.cache
def _import_error() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "tensorrt is not installed (pip install 'tk[gpu]')"
    except OSError as exc:  # the package is there, its libraries are not
        return f"tensorrt is installed but cannot load its libraries ({exc})"
    return None


def missing_requirements(device: str = "cuda") -> list[str]:
    """Everything this machine lacks to build or run TensorRT engines on ``device``; empty when nothing."""
    missing = []
    problem = _import_error()
    if problem:
        missing.append(problem)
    if not torch.cuda.is_available():
        missing.append("TensorRT needs a CUDA GPU; none found")
    else:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < MIN_COMPUTE_CAPABILITY:
            missing.append(
                f"TensorRT engines from tk need compute capability 8.0 or newer (Ampere+); "
                f"{torch.cuda.get_device_name()} has {major}.{minor}"
            )
        if device != "cuda":
            missing.append("TensorRT engines run on the GPU; use --device cuda")
    return missing


def unavailable_reason(device: str) -> str | None:
    missing = missing_requirements(device)
    return "; ".join(missing) if missing else None


@functools.cache
def trt_logger() -> Any:
    """The one ``trt.ILogger`` of this process (TensorRT treats its logger as a singleton that must
    outlive every builder, runtime and engine); it sends TensorRT's messages to the ``tk.trt`` logger."""
    import tensorrt as trt

    levels = {
        trt.ILogger.INTERNAL_ERROR: logging.ERROR,
        trt.ILogger.ERROR: logging.ERROR,
        trt.ILogger.WARNING: logging.WARNING,
        trt.ILogger.INFO: logging.DEBUG,
        trt.ILogger.VERBOSE: logging.DEBUG,
    }
    target = logging.getLogger("tk.trt")

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            target.log(levels.get(severity, logging.INFO), "TensorRT: %s", msg)

    return Logger()
