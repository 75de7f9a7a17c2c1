"""Shared fixtures and the one hardware gate every GPU/TensorRT test uses."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def missing_requirements(
    *, cuda: bool = False, tensorrt: bool = False, min_compute_capability: tuple[int, int] | None = None
) -> list[str]:
    """Every requirement of a hardware-gated test that this machine lacks."""
    missing = []
    has_cuda = torch.cuda.is_available()
    if (cuda or tensorrt or min_compute_capability) and not has_cuda:
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if tensorrt and importlib.util.find_spec("tensorrt") is None:
        missing.append("the tensorrt package (pip install 'tk[gpu]')")
    if min_compute_capability and has_cuda and torch.cuda.get_device_capability() < min_compute_capability:
        got = "{}.{}".format(*torch.cuda.get_device_capability())
        missing.append(f"compute capability >= {min_compute_capability[0]}.{min_compute_capability[1]} (found {got})")
    return missing


def requires(**kwargs: object) -> pytest.MarkDecorator:
    """``@requires(cuda=True, tensorrt=True)``: skip with every missing requirement in the reason."""
    missing = missing_requirements(**kwargs)  # type: ignore[arg-type]
    return pytest.mark.skipif(bool(missing), reason="needs " + "; ".join(missing) if missing else "")
