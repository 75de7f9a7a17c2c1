"""One engine interface over PyTorch eager and compiled, exported programs, AOTInductor,
onnxruntime and TensorRT."""

from tk.registries import ENGINES
from tk.runtime.base import Engine, EngineOptions
from tk.runtime.choice import EngineChoice, open_engine, open_engines
from tk.runtime.registry import available_engines, engine_class, load, trusted_engines, unavailable_reason

__all__ = [
    "ENGINES",
    "Engine",
    "EngineChoice",
    "EngineOptions",
    "available_engines",
    "engine_class",
    "load",
    "open_engine",
    "open_engines",
    "trusted_engines",
    "unavailable_reason",
]
