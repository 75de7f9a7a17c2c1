"""``tk bench --roofline``: each engine's speed as a share of this machine's matrix-product peak.

The peak is measured in the same run (CPUs of the same name differ, and a shared machine's
speed changes by the minute): ``torch.mm`` at a transformer-like shape in float32, bfloat16 or
float16, and ``torch._int_mm`` for int8, best of a few timed repeats. The model's work is counted
by ``torch.utils.flop_counter.FlopCounterMode`` on the eager model at the bench shape (matrix
products and attention; a multiply-add is two operations), at batch 1 and scaled by the batch
size (exact for models whose samples are independent, which the export check's batch-invariance
probe verifies).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

PEAK_SHAPE = (2048, 768, 3072)  # (M, K, N): a BERT-base feed-forward product at 16 x 128 tokens
PEAK_REPEATS = 5  # timed products after one warm-up; the best one counts
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Peak:
    precision: str
    gflops: float  # billions of multiply-add operations x2 per second (GOP/s for int8)
    shape: tuple[int, int, int]
    seconds: float  # best time of one product

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "gflops": round(self.gflops, 1),
            "shape_mkn": list(self.shape),
            "best_s": self.seconds,
        }


def matmul_peak(precision: str, shape: tuple[int, int, int] = PEAK_SHAPE, repeats: int = PEAK_REPEATS) -> Peak:
    """The best matrix-product rate of this process (its torch threads) at ``shape`` in ``precision``."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    if precision == "int8":
        a = torch.randint(-128, 127, (m, k), dtype=torch.int8, generator=gen)
        b = torch.randint(-128, 127, (k, n), dtype=torch.int8, generator=gen)

        def product() -> torch.Tensor:
            return torch._int_mm(a, b)
    else:
        dtype = PRECISION_DTYPES["fp32" if precision == "tf32" else precision]  # on the CPU tf32 is float32
        a = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(k, n, generator=gen).to(dtype)

        def product() -> torch.Tensor:
            return torch.mm(a, b)

    with torch.inference_mode():
        product()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return Peak(precision, 2.0 * m * k * n / best / 1e9, shape, best)


def model_flops(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    """Floating-point operations of one forward of ``module`` on ``args`` (FlopCounterMode's count)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        module(*args)
    return int(counter.get_total_flops())


def engine_precision(engine: str, artifact_precision: str) -> str:
    """The precision an engine's matrix products run in: eager is the float32 reference; compile
    follows a bf16/fp16 artifact (its autocast), and the artifact's own engines its precision."""
    if engine == "eager":
        return "fp32"
    if engine == "compile":
        return artifact_precision if artifact_precision in ("bf16", "fp16") else "fp32"
    return artifact_precision


def roofline(
    report: Any, eager_module: torch.nn.Module, feeds_at_batch_1: dict[str, torch.Tensor], artifact_precision: str
) -> dict[str, Any]:
    """Fill each row's ``gflops`` and ``peak_share`` and return the roofline settings for the JSON."""
    flops_1 = model_flops(eager_module, tuple(feeds_at_batch_1.values()))
    precisions = {engine_precision(r.engine, artifact_precision) for r in report.rows}
    peaks = {p: matmul_peak(p) for p in sorted(precisions)}
    for row in report.rows:
        peak = peaks[engine_precision(row.engine, artifact_precision)]
        rate = flops_1 * row.batch_size / (row.p50_ms / 1e3) / 1e9
        row.gflops = float(f"{rate:.4g}")  # 4 significant digits: tiny models run at a fraction of a GFLOP/s
        row.peak_share = float(f"{rate / peak.gflops:.4g}")
    return {
        "flops_per_sample": flops_1,
        "peaks": {p: peak.to_json() for p, peak in peaks.items()},
        "torch_threads": torch.get_num_threads(),
    }
