"""A model's floor on this machine: the time its matrix products take alone, each at its own shape, at the
rate this CPU runs that shape in a given precision, measured in the same run as the engines it judges.

Nothing that computes the model can beat the time of its products done back to back with nothing around
them (no softmax, no LayerNorm, no copies), so an engine's *share of the floor* (floor time / its time)
says how much of its time is spent outside the products, where a share of peak (its FLOP rate over one
wide product's) blames it for shapes that no kernel runs at peak.

- ``model_products`` runs the model once under a ``TorchFunctionMode`` and records every product it
  calls: each ``nn.Linear`` (M x K x N, M every leading dimension), and each attention's two batched
  products (``scaled_dot_product_attention``: queries x keys, then weights x values; a ``matmul`` or
  ``bmm`` of two activations in eager attention);
- ``ModelFloor`` builds each distinct product once in a precision: linears as the packages run them
  (``tk.formats.products.packed_linear``: oneDNN's packed linear; int8 oneDNN's quantized linear) and the
  attention products as ``torch.matmul`` in the float precision the engine runs attention in (int8
  engines keep attention in floating point: bf16 where the CPU has bf16 products, float32 elsewhere);
  each call is one sample (every product once, times its count, after an untimed pass that pays for the
  previous engine's caches and sleeping threads); the floor is the median sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tk.formats.products import PRECISION_DTYPES, packed_linear
from tk.measure.hardware import cpu_precision_reason
from tk.measure.timing import Spread


@dataclass(frozen=True)
class Product:
    kind: str  # "linear" (weights) or "attention" (two activations)
    batch: int  # independent products (batch x heads for attention; 1 for a linear)
    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n * self.count

    def at_batch(self, batch: int) -> Product:
        """The product when the model runs ``batch`` samples where it was recorded at one."""
        if self.kind == "linear":
            return Product(self.kind, self.batch, self.m * batch, self.k, self.n, self.count)
        return Product(self.kind, self.batch * batch, self.m, self.k, self.n, self.count)


class _ProductRecorder(TorchFunctionMode):
    """Notes the products of one call: linears by their layer, attention by its function."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, int, int, int, int], int] = {}

    def _add(self, kind: str, batch: int, m: int, k: int, n: int) -> None:
        key = (kind, batch, m, k, n)
        self.found[key] = self.found.get(key, 0) + 1

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1]
            self._add("linear", 1, x.numel() // x.shape[-1], weight.shape[1], weight.shape[0])
        elif func is torch.nn.functional.scaled_dot_product_attention:
            query, key, value = (*args, *(kwargs[n] for n in ("query", "key", "value")[len(args) :]))[:3]
            batch = query.numel() // (query.shape[-2] * query.shape[-1])
            tokens, keys, dim = query.shape[-2], key.shape[-2], query.shape[-1]
            self._add("attention", batch, tokens, dim, keys)  # queries x keys
            self._add("attention", batch, tokens, keys, value.shape[-1])  # weights x values
        elif func in (torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) >= 2:
            a, b = args[0], args[1]
            if not any(isinstance(t, nn.Parameter) for t in (a, b)) and a.dim() >= 3 and b.dim() >= 3:
                self._add("attention", a.numel() // (a.shape[-2] * a.shape[-1]), a.shape[-2], a.shape[-1], b.shape[-1])
        return func(*args, **kwargs)


def model_products(call: Callable[[], Any]) -> list[Product]:
    """Every matrix product one ``call()`` of a PyTorch model runs, by kind and shape, with its count."""
    recorder = _ProductRecorder()
    with torch.inference_mode(), recorder:
        call()
    return [Product(kind, batch, m, k, n, count) for (kind, batch, m, k, n), count in recorder.found.items()]


def attention_precision(precision: str) -> str:
    """The float precision an engine of ``precision`` runs attention's products in."""
    if precision in PRECISION_DTYPES:
        return precision
    return "bf16" if cpu_precision_reason("bf16") is None else "fp32"


def products_seconds(calls: list[tuple[int, Callable[[], Any]]]) -> float:
    """Seconds of one pass over ``calls`` (count, product): each product timed once, times its count."""
    seconds = 0.0
    for count, call in calls:
        start = time.perf_counter()
        call()
        seconds += (time.perf_counter() - start) * count
    return seconds


class ModelFloor:
    """``products`` built in ``precision`` (fp32, bf16, int8); each call times every product once and keeps
    the sum (each times its count) as one sample, in seconds."""

    def __init__(self, precision: str, products: list[Product], seed: int = 0) -> None:
        if not products:
            raise ValueError("ModelFloor: expected at least one product")
        gen = torch.Generator().manual_seed(seed)
        self.precision, self.products = precision, products
        float_dtype = PRECISION_DTYPES[attention_precision(precision)]
        self._calls: list[tuple[int, Callable[[], Any]]] = []
        for p in products:
            if p.kind == "linear":
                self._calls.append((p.count, packed_linear(precision, p.m, p.k, p.n, gen)))
                continue
            a = torch.randn(p.batch, p.m, p.k, generator=gen).to(float_dtype)
            b = torch.randn(p.batch, p.k, p.n, generator=gen).to(float_dtype)
            self._calls.append((p.count, lambda a=a, b=b: torch.matmul(a, b)))
        self.samples: list[float] = []
        with torch.inference_mode():
            for _, call in self._calls:
                call()

    def __call__(self) -> None:
        with torch.inference_mode():
            # an untimed pass first: right after another runtime's call the first pass ran 1.5x the next ones
            # (MiniLM's bf16 products after an OpenVINO call, AMX Xeon: 20.3 ms, then 14.0 and 13.5)
            for _, call in self._calls:
                call()
            seconds = products_seconds(self._calls)
        self.samples.append(seconds)

    def release(self) -> None:
        """Free the operands; the samples stay."""
        self._calls = []

    def spread(self) -> Spread:
        return Spread.of(self.samples)

    def share(self, seconds: float) -> float | None:
        """The floor's median over ``seconds`` (an engine's time for the same work), or None before a sample."""
        return self.spread().median / seconds if self.samples and seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "attention_precision": attention_precision(self.precision),
            "products": [[p.kind, p.batch, p.m, p.k, p.n, p.count] for p in self.products],
            "flops": sum(p.flops for p in self.products),
            "seconds": self.spread().to_json() if self.samples else None,
        }
