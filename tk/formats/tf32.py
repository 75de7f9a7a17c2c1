"""Float32 that stays float32 on CUDA, for writers (compiles) and engines (calls) alike.

cuBLAS and cuDNN run float32 matrix products and convolutions in TF32 when torch's flags allow
it (cuDNN's flag is on by default), and cuDNN picks its algorithm per batch size, so a float32
resnet18 differed by 5e-4 between batch 1 and 64 on an H200. ``matmul_precision`` sets both
flags for one engine call, or one export, and restores them after, so ``tk`` keeps true float32
(and ``--precision tf32`` gets TF32) without changing the process for anyone else. The flags are
process-wide: another thread running torch code at the same moment sees them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def matmul_precision(allow_tf32: bool) -> Iterator[None]:
    """cuBLAS and cuDNN TF32 allowed (or not) inside the block, restored after."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    if matmul == allow_tf32 and cudnn == allow_tf32:
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
