"""A model's floor on this machine: the time its matrix products take alone, each at its own shape, at the
rate this CPU runs that shape in a given precision, measured in the same run as the engines it judges.

Nothing that computes the model can beat the time of its products done back to back with nothing around
them (no softmax, no LayerNorm, no copies), so an engine's *share of the floor* (floor time / its time)
says how much of its time is spent outside the products, where a share of peak (its FLOP rate over one
wide product's) blames it for shapes that no kernel runs at peak.

- ``model_products`` runs the model once under a ``TorchFunctionMode`` and records every product it
  calls: each ``nn.Linear`` (M x K x N, M every leading dimension), each 2-D convolution (its geometry;
  M x K x N its output positions x inputs per group x kernel x output channels), and each attention's two
  batched products (``scaled_dot_product_attention``: queries x keys, then weights x values; a ``matmul`` or
  ``bmm`` of two activations in eager attention);
- ``ModelFloor`` builds each distinct product once in a precision: linears as the packages run them
  (``tk.formats.products.packed_linear``: oneDNN's packed linear; int8 oneDNN's quantized linear) and the
  convolutions as oneDNN's (``tk.formats.products.packed_conv``; int8 its quantized one), and the
  attention products as ``torch.matmul`` in the float precision the engine runs attention in (int8
  engines keep attention in floating point: bf16 where the CPU has bf16 products, float32 elsewhere);
  each call is one sample (every product once, times its count, after an untimed pass that pays for the
  previous engine's caches and sleeping threads); the floor is the median sample.
- an int8 artifact whose search left some linears out of int8 runs those in float32 or bf16:
  ``LinearSplit`` (the manifest's record of the weight shapes it runs in int8) and ``mixed_floor_seconds``
  price each of the model's linears in the precision the artifact runs it in, from the int8 floor's and the
  other precision's samples of the same rounds. The record names linear shapes only, so an int8
  artifact's convolutions are priced in int8 whether its search left them out or not (its floor then
  reads low, never high).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tk.formats.products import PRECISION_DTYPES, ConvShape, packed_conv, packed_linear
from tk.measure.hardware import cpu_precision_reason
from tk.measure.timing import Spread


@dataclass(frozen=True)
class Product:
    kind: str  # "linear" (weights), "conv" (weights, ``conv`` its geometry) or "attention" (two activations)
    batch: int  # independent products (batch x heads for attention; 1 for a linear or a convolution)
    m: int
    k: int
    n: int
    count: int = 1
    conv: ConvShape | None = None

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n * self.count

    def at_batch(self, batch: int) -> Product:
        """The product when the model runs ``batch`` samples where it was recorded at one."""
        if self.kind == "linear":
            return Product(self.kind, self.batch, self.m * batch, self.k, self.n, self.count)
        if self.conv is not None:
            return Product(self.kind, self.batch, self.m * batch, self.k, self.n, self.count, self.conv.at_batch(batch))
        return Product(self.kind, self.batch * batch, self.m, self.k, self.n, self.count)


class _ProductRecorder(TorchFunctionMode):
    """Notes the products of one call: linears by their layer, attention by its function."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, int, int, int, int, ConvShape | None], int] = {}

    def _add(self, kind: str, batch: int, m: int, k: int, n: int, conv: ConvShape | None = None) -> None:
        key = (kind, batch, m, k, n, conv)
        self.found[key] = self.found.get(key, 0) + 1

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1]
            self._add("linear", 1, x.numel() // x.shape[-1], weight.shape[1], weight.shape[0])
        elif func is torch.nn.functional.conv2d and args[0].dim() == 4:
            shape = _conv_shape(*args, **kwargs)
            if shape is not None:
                self._add("conv", 1, *shape.mkn, shape)
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


def _conv_shape(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> ConvShape | None:
    """``F.conv2d``'s arguments as a ``ConvShape``; None for a padding given by name other than the two
    with one meaning ("valid"; "same" at stride 1)."""

    def pair(value: Any) -> tuple[int, int]:
        return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))

    kernel, dilations = (int(weight.shape[2]), int(weight.shape[3])), pair(dilation)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        if any((d * (k - 1)) % 2 for d, k in zip(dilations, kernel, strict=True)):
            return None  # torch pads one side more: not one ConvShape
        padding = tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel, strict=True))
    elif isinstance(padding, str):
        return None
    n, c, h, w = (int(d) for d in x.shape)
    return ConvShape(n, c, h, w, int(weight.shape[0]), kernel, pair(stride), pair(padding), dilations, int(groups))


def model_products(call: Callable[[], Any]) -> list[Product]:
    """Every matrix product one ``call()`` of a PyTorch model runs, by kind and shape, with its count."""
    recorder = _ProductRecorder()
    with torch.inference_mode(), recorder:
        call()
    return [
        Product(kind, batch, m, k, n, count, conv) for (kind, batch, m, k, n, conv), count in recorder.found.items()
    ]


def attention_precision(precision: str) -> str:
    """The float precision an engine of ``precision`` runs attention's products in."""
    if precision in PRECISION_DTYPES:
        return precision
    return "bf16" if cpu_precision_reason("bf16") is None else "fp32"


def products_seconds(calls: list[tuple[int, Callable[[], Any]]]) -> float:
    """Seconds of one pass over ``calls`` (count, product): each product timed once, times its count."""
    return sum(count * seconds for (count, _), seconds in zip(calls, each_product_seconds(calls), strict=True))


def each_product_seconds(calls: list[tuple[int, Callable[[], Any]]]) -> list[float]:
    """Seconds of one call of each product of ``calls`` (count, product), in order."""
    seconds = []
    for _, call in calls:
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


@dataclass(frozen=True)
class LinearSplit:
    """How many of a model's linears of each weight shape (in_features, out_features) an int8 artifact runs
    in int8 (``int8``); its other linears run in ``fallback`` (fp32 or bf16). ``int8`` None: not recorded
    (an artifact exported before the record, with layers left out of int8), so no floor can be priced,
    unless ``every_linear`` (onnxruntime's dynamic int8: every MatMul/Gemm). ``convs``: the precision its
    convolutions run in (int8 where the writer quantizes them; dynamic int8 leaves them in float32)."""

    int8: dict[tuple[int, int], int] | None
    fallback: str = "fp32"
    every_linear: bool = False
    convs: str = "int8"

    @property
    def priced(self) -> bool:
        """Whether each linear's precision is known."""
        return self.int8 is not None or self.every_linear

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> LinearSplit | None:
        """From a manifest's quantization record: None where every linear runs in int8 (nothing left out
        and no shapes recorded: the int8 floor as it is)."""
        fallback = record.get("automatic_exclusions_run_in") or "fp32"
        shapes = record.get("int8_linear_shapes")
        if shapes is not None:
            return cls({(int(k), int(n)): int(count) for k, n, count in shapes}, fallback)
        return cls(None, fallback) if record.get("excluded") else None

    @classmethod
    def of_engine(cls, manifest: Any, engine: str) -> LinearSplit | None:
        """What ``engine`` runs in int8 of an int8 artifact (``manifest``: its format's quantization record);
        None where the artifact is not int8, the engine runs its weights (eager, compile), or every linear
        runs in int8."""
        from tk.registries import ENGINE_FILE_ROLE

        if manifest.precision != "int8" or engine not in ENGINE_FILE_ROLE:
            return None
        record = manifest.formats.get(ENGINE_FILE_ROLE[engine], {}).get("quantization")
        if isinstance(record, str) and record.startswith("dynamic int8"):  # its MatMul/Gemm only
            return cls(None, "fp32", every_linear=True, convs="fp32")
        return cls.from_record(record) if isinstance(record, dict) else None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinearSplit:
        """The inverse of ``to_json``."""
        shapes = data.get("int8_linear_shapes")
        int8 = None if shapes is None else {(int(k), int(n)): int(c) for k, n, c in shapes}
        return cls(int8, data.get("fallback", "fp32"), bool(data.get("every_linear")), data.get("convs", "int8"))

    def to_json(self) -> dict[str, Any]:
        shapes = None if self.int8 is None else [[k, n, c] for (k, n), c in sorted(self.int8.items())]
        extra = {"every_linear": True} if self.every_linear else {}
        return {"int8_linear_shapes": shapes, "fallback": self.fallback, **extra, "convs": self.convs}

    def int8_counts(self, linears: list[tuple[int, int, int]]) -> list[int]:
        """For each of a model's ``linears`` ((in_features, out_features, count), in order), how many run in
        int8: the record's count of that shape, handed out to the model's linears of it in turn."""
        if self.every_linear:
            return [count for _, _, count in linears]
        if self.int8 is None:
            raise ValueError("LinearSplit: the artifact's int8 linears are not recorded")
        left = dict(self.int8)
        counts = []
        for k, n, count in linears:
            counts.append(min(count, left.get((k, n), 0)))
            left[(k, n)] = left.get((k, n), 0) - counts[-1]
        return counts


def mixed_floor_seconds(
    products: list[Product], int8: list[list[float]], fallback: list[list[float]], split: LinearSplit
) -> list[float]:
    """The floor of an artifact that runs ``split``'s linears in int8 and the model's others in its fallback
    precision, one value per round: ``int8`` and ``fallback`` hold, per round, one call of each of ``products``
    in that precision (``ModelFloor.product_samples``). Each linear is priced at its own precision's time,
    attention at the int8 floor's (the float precision int8 engines run it in), and convolutions in the
    split's ``convs`` precision (the record names linear shapes only: all of them or none)."""
    linears = iter(split.int8_counts([(p.k, p.n, p.count) for p in products if p.kind == "linear"]))
    conv8 = split.convs == "int8"
    n8s = [next(linears) if p.kind == "linear" else p.count if p.kind != "conv" or conv8 else 0 for p in products]
    return [
        sum(n8 * t8 + (p.count - n8) * tf for p, n8, t8, tf in zip(products, n8s, in_int8, in_fallback, strict=True))
        for in_int8, in_fallback in zip(int8, fallback, strict=False)
    ]


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
            if p.conv is not None:
                self._calls.append((p.count, packed_conv(precision, p.conv, gen)))
                continue
            a = torch.randn(p.batch, p.m, p.k, generator=gen).to(float_dtype)
            b = torch.randn(p.batch, p.k, p.n, generator=gen).to(float_dtype)
            self._calls.append((p.count, lambda a=a, b=b: torch.matmul(a, b)))
        self.samples: list[float] = []
        self.product_samples: list[list[float]] = []  # per sample, one call of each product (``products``' order)
        with torch.inference_mode():
            for _, call in self._calls:
                call()

    def __call__(self) -> None:
        with torch.inference_mode():
            # an untimed pass first: right after another runtime's call the first pass ran 1.5x the next ones
            # (MiniLM's bf16 products after an OpenVINO call, AMX Xeon: 20.3 ms, then 14.0 and 13.5)
            for _, call in self._calls:
                call()
            each = each_product_seconds(self._calls)
        self.product_samples.append(each)
        self.samples.append(sum(p.count * t for p, t in zip(self.products, each, strict=True)))

    def release(self) -> None:
        """Free the operands; the samples stay."""
        self._calls = []

    def spread(self) -> Spread:
        return Spread.of(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "attention_precision": attention_precision(self.precision),
            "products": [[p.kind, p.batch, p.m, p.k, p.n, p.count] for p in self.products],
            "flops": sum(p.flops for p in self.products),
            "seconds": self.spread().to_json() if self.samples else None,
        }
