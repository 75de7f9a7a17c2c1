"""Dtype names as the specs write them, for torch tensors and NumPy arrays alike."""

from __future__ import annotations

import functools

import numpy as np
import torch

Array = np.ndarray | torch.Tensor

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def dtype_name(array: Array) -> str:
    if isinstance(array, torch.Tensor):
        return _TORCH_NAMES.get(array.dtype) or str(array.dtype).removeprefix("torch.")
    return _numpy_dtype_name(array.dtype)


@functools.cache
def _numpy_dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # NumPy builds the name in Python on every access (4 us, twice per input per call)
