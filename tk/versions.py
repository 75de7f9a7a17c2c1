"""Versions of the libraries an artifact or a measurement depends on."""

from __future__ import annotations

import importlib.metadata as md
import platform

import torch

PACKAGES = ("numpy", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tensorrt", "torchvision", "openvino")


def library_versions(device: str = "cpu") -> dict[str, object]:
    """Python, torch and each installed package of ``PACKAGES``; CUDA and the GPU when ``device`` is cuda."""
    found: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in PACKAGES:
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    if device == "cuda" and torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
        found["gpu"] = torch.cuda.get_device_name()
        found["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    return found
