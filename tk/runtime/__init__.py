"""One engine interface over PyTorch eager and compiled, exported programs, AOTInductor,
onnxruntime and TensorRT."""

from tk.runtime.base import Engine
from tk.runtime.registry import ENGINES, available_engines, engine_class, load, unavailable_reason

__all__ = ["ENGINES", "Engine", "available_engines", "engine_class", "load", "unavailable_reason"]
