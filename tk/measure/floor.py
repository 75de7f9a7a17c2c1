"""A model's floor on this machine: the time its matrix products take alone, each at its own shape, at the
rate this CPU runs that shape in a given precision, measured in the same run as the engines it judges.

Nothing that computes the model can beat the time of its products done back to back with nothing around
them (no softmax, no LayerNorm, no copies), so an engine's *share of the floor* (floor time / its time)
says how much of its time is spent outside the products, where a share of peak (its FLOP rate over one
wide product's) blames it for shapes that no kernel runs at peak.

- ``model_products`` runs the model once under a ``TorchFunctionMode`` and records every product it
  calls: each linear (``F.linear``, so ``nn.Linear`` and ``nn.MultiheadAttention``'s projections, or an
  ``addmm`` or ``matmul`` with a 2-D parameter; M x K x N, M every leading dimension), each 1-D and 2-D
  convolution (its geometry, a 1-D one as height 1; M x K x N its output positions x inputs per group x
  kernel x output channels), and each attention's two batched products (``scaled_dot_product_attention``:
  queries x keys, then weights x values; a ``matmul`` or ``bmm`` of two activations in eager attention);
- ``ModelFloor`` builds each distinct product once in a precision: linears as the packages run them
  (``tk.formats.products.packed_linear``: oneDNN's packed linear; int8 oneDNN's quantized linear) and the
  convolutions as oneDNN's (``tk.formats.products.packed_conv``; int8 its quantized one; a float pointwise
  one as the faster of that and the packed linear of the same product), and the
  attention products as ``torch.matmul`` in the float precision the engine runs attention in (int8
  engines keep attention in floating point: bf16 where the CPU has bf16 products, float32 elsewhere);
  each call is one sample (every product once, times its count, after an untimed pass that pays for the
  previous engine's caches and sleeping threads); the floor is the median sample.
- ``at_real_tokens`` turns products recorded on a padded batch into the work its real tokens need (linears
  on the real tokens, attention per sequence at its length): the floor of padded feeds wherever one is
  timed (``tk.measure.roofline.Roofline.between``, ``benchmarks.peers``), since an engine that removes the
  padding runs under the padded products' time;
- an int8 artifact whose search left some layers out of int8 runs those in float32 or bf16:
  ``LinearSplit`` (the manifest's record of the linear and convolution weights it runs in int8) and
  ``mixed_floor_seconds`` price each of the model's linears and convolutions in the precision the artifact
  runs it in, from the int8 floor's and the other precision's samples of the same rounds. An artifact
  whose record names linear shapes only (exported before convolutions were recorded) has its convolutions
  priced in int8 (its floor then reads low, never high).
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
        elif func in (torch.addmm, torch.Tensor.addmm) and len(args) >= 3 and _is_weight(args[2]):
            x, weight = args[1], args[2]  # a linear written as addmm(bias, x, weight stored in x out)
            self._add("linear", 1, x.shape[0], weight.shape[0], weight.shape[1])
        elif (func is torch.nn.functional.conv2d and args[0].dim() == 4) or (
            func is torch.nn.functional.conv1d and args[0].dim() == 3
        ):
            shape = _conv_shape(*args, **kwargs)
            if shape is not None:
                self._add("conv", 1, *shape.mkn, shape)
        elif func is torch.nn.functional.multi_head_attention_forward:
            for product in _multi_head_attention_products(*args, **kwargs):
                self._add(*product)
        elif func is torch.nn.functional.scaled_dot_product_attention:
            query, key, value = (*args, *(kwargs[n] for n in ("query", "key", "value")[len(args) :]))[:3]
            batch = query.numel() // (query.shape[-2] * query.shape[-1])
            tokens, keys, dim = query.shape[-2], key.shape[-2], query.shape[-1]
            self._add("attention", batch, tokens, dim, keys)  # queries x keys
            self._add("attention", batch, tokens, keys, value.shape[-1])  # weights x values
        elif func in (torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) >= 2:
            a, b = args[0], args[1]
            if _is_weight(b) and a.dim() >= 2:  # x @ weight: a linear without a bias
                self._add("linear", 1, a.numel() // a.shape[-1], b.shape[0], b.shape[1])
            elif not any(isinstance(t, nn.Parameter) for t in (a, b)) and a.dim() >= 3 and b.dim() >= 3:
                self._add("attention", a.numel() // (a.shape[-2] * a.shape[-1]), a.shape[-2], a.shape[-1], b.shape[-1])
        return func(*args, **kwargs)


def _multi_head_attention_products(*args: Any, **kwargs: Any) -> list[tuple[str, int, int, int, int]]:
    """The products of ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``), which runs its
    projections and attention inside one overridable function, where a ``TorchFunctionMode`` sees none of
    them: (kind, batch, m, k, n) each, the in-projection packed as it runs (one linear for self-attention,
    query apart from key and value for cross-attention)."""
    bound = inspect.signature(torch.nn.functional.multi_head_attention_forward).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key = a["query"], a["key"]
    tokens, memory = int(query.shape[0]), int(key.shape[0])  # the query's and the key's lengths
    keys = memory + (a["bias_k"] is not None) + bool(a["add_zero_attn"])
    batch = int(query.shape[1]) if query.dim() == 3 else 1
    width, heads = int(query.shape[-1]), int(a["num_heads"])
    if a["use_separate_proj_weight"]:
        weights = [(a["q_proj_weight"], tokens), (a["k_proj_weight"], memory), (a["v_proj_weight"], memory)]
    elif query is key and key is a["value"]:
        weights = [(a["in_proj_weight"], tokens)]
    elif key is a["value"]:
        q, kv = a["in_proj_weight"].split([width, 2 * width])
        weights = [(q, tokens), (kv, memory)]
    else:
        q, k, v = a["in_proj_weight"].chunk(3)
        weights = [(q, tokens), (k, memory), (v, memory)]
    products = [("linear", 1, rows * batch, int(w.shape[1]), int(w.shape[0])) for w, rows in weights]
    head_dim = width // heads
    products += [
        ("attention", batch * heads, tokens, head_dim, keys),
        ("attention", batch * heads, tokens, keys, head_dim),
    ]
    out = a["out_proj_weight"]
    return [*products, ("linear", 1, tokens * batch, int(out.shape[1]), int(out.shape[0]))]


def _conv_shape(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> ConvShape | None:
    """``F.conv2d``'s (or ``F.conv1d``'s, as height 1) arguments as a ``ConvShape``; None for a padding given
    by name other than the two with one meaning ("valid"; "same" at stride 1)."""
    one_d = x.dim() == 3

    def pair(value: Any, flat: int = 0) -> tuple[int, int]:
        """A 2-D convolution's argument; a 1-D one's with ``flat`` for its height."""
        if one_d:
            return (flat, int(value if isinstance(value, int) else value[0]))
        return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))

    kernel = (1, int(weight.shape[2])) if one_d else (int(weight.shape[2]), int(weight.shape[3]))
    dilations = pair(dilation, 1)
    if padding == "valid":
        padding = pair(0)
    elif padding == "same":
        if any((d * (k - 1)) % 2 for d, k in zip(dilations, kernel, strict=True)):
            return None  # torch pads one side more: not one ConvShape
        padding = tuple(d * (k - 1) // 2 for d, k in zip(dilations, kernel, strict=True))
    elif isinstance(padding, str):
        return None
    else:
        padding = pair(padding)
    n, c, h, w = (int(x.shape[0]), int(x.shape[1]), 1, int(x.shape[2])) if one_d else (int(d) for d in x.shape)
    return ConvShape(n, c, h, w, int(weight.shape[0]), kernel, pair(stride, 1), padding, dilations, int(groups))


def _is_weight(value: Any) -> bool:
    return isinstance(value, nn.Parameter) and value.dim() == 2


@contextlib.contextmanager
def attention_unfused() -> Iterator[None]:
    """PyTorch's ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` without their inference fast path:
    a layer there is one native call (``_transformer_encoder_layer_fwd``) whose products neither a
    ``TorchFunctionMode`` nor ``FlopCounterMode`` sees, so a model of such layers counted none of its
    attention's FLOPs; unfused, they run as ``F.linear`` and ``scaled_dot_product_attention``."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def model_products(call: Callable[[], Any]) -> list[Product]:
    """Every matrix product one ``call()`` of a PyTorch model runs, by kind and shape, with its count."""
    recorder = _ProductRecorder()
    with torch.inference_mode(), attention_unfused(), recorder:
        call()
    return [
        Product(kind, batch, m, k, n, count, conv) for (kind, batch, m, k, n, conv), count in recorder.found.items()
    ]


def at_real_tokens(products: list[Product], mask: torch.Tensor) -> list[Product]:
    """``products``, recorded on a batch padded as ``mask`` (batch x seq, nonzero at real tokens) says, as the
    work its real tokens need: a linear over every position on the real tokens alone, and each attention
    product per sequence at that sequence's length. An engine that removes the padding (tk's ``aoti``
    packages between attentions) runs under the padded products' time, so they are no floor for it. Other
    products stay as recorded, as does an attention product whose head size equals the sequence length
    (its two products cannot be told apart, so it keeps the padded, higher, time)."""
    if mask.dim() != 2:
        return products
    batch, seq = mask.shape
    lengths = [int(n) for n in (mask != 0).sum(dim=1)]
    tokens = sum(lengths)
    if tokens == batch * seq:
        return products
    out: list[Product] = []
    for p in products:
        if p.kind == "linear" and p.m == batch * seq:
            out.append(Product(p.kind, p.batch, tokens, p.k, p.n, p.count))
        elif p.kind == "attention" and p.batch % batch == 0 and p.m == seq and (p.k == seq) != (p.n == seq):
            heads = p.batch // batch
            for length, rows in sorted(Counter(n for n in lengths if n).items()):
                k, n = (length, p.n) if p.k == seq else (p.k, length)
                out.append(Product(p.kind, heads * rows, length, k, n, p.count))
        else:
            out.append(p)
    return out


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
    unless ``every_linear`` (onnxruntime's dynamic int8: every MatMul/Gemm). Its convolutions: how many of
    each weight (``ConvShape.weight_key``) run in int8 (``int8_convs``; the rest in ``conv_fallback``) where
    recorded, else all in ``convs`` (int8 where the writer quantizes them; dynamic int8 leaves them in
    float32)."""

    int8: dict[tuple[int, int], int] | None
    fallback: str = "fp32"
    every_linear: bool = False
    convs: str = "int8"
    int8_convs: dict[tuple[int, ...], int] | None = None
    convs_left_out: str | None = None  # what its convolutions outside int8 run in, where not ``fallback``

    @property
    def conv_fallback(self) -> str:
        """The precision its convolutions outside int8 run in: float32 where ``convs`` says so (dynamic
        int8), else as recorded (the aoti writer's bf16 fallback is the linears': its convolutions stay
        float32) or the fallback."""
        return "fp32" if self.convs == "fp32" else self.convs_left_out or self.fallback

    @property
    def float_floors(self) -> set[str]:
        """The float precisions whose floors price this split's layers outside int8."""
        return {self.fallback} | (
            {self.conv_fallback} if self.int8_convs is not None or self.convs != "int8" else set()
        )

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
            return cls(
                _by_shape(shapes),
                fallback,
                int8_convs=_conv_counts(record.get("int8_conv_shapes")),
                convs_left_out=record.get("excluded_convolutions_run_in"),
            )
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
        int8 = None if shapes is None else _by_shape(shapes)
        return cls(
            int8,
            data.get("fallback", "fp32"),
            bool(data.get("every_linear")),
            data.get("convs", "int8"),
            _conv_counts(data.get("int8_conv_shapes")),
            data.get("convs_left_out"),
        )

    def to_json(self) -> dict[str, Any]:
        shapes = None if self.int8 is None else [[k, n, c] for (k, n), c in sorted(self.int8.items())]
        extra: dict[str, Any] = {"every_linear": True} if self.every_linear else {}
        if self.int8_convs is not None:
            extra["int8_conv_shapes"] = [[*key, c] for key, c in sorted(self.int8_convs.items())]
        if self.convs_left_out is not None:
            extra["convs_left_out"] = self.convs_left_out
        return {"int8_linear_shapes": shapes, "fallback": self.fallback, **extra, "convs": self.convs}

    def int8_counts(self, linears: list[tuple[int, int, int]]) -> list[int]:
        """For each of a model's ``linears`` ((in_features, out_features, count), in order), how many run in
        int8: the record's count of that shape, handed out to the model's linears of it in turn."""
        if self.every_linear:
            return [count for _, _, count in linears]
        if self.int8 is None:
            raise ValueError("LinearSplit: the artifact's int8 linears are not recorded")
        return _hand_out(self.int8, [((k, n), count) for k, n, count in linears])

    def conv_int8_counts(self, convs: list[tuple[tuple[int, ...], int]]) -> list[int]:
        """For each of a model's convolutions ((``ConvShape.weight_key``, count), in order), how many run in
        int8: as recorded where the record names convolutions, else all or none by ``convs``."""
        if self.int8_convs is None:
            return [count if self.convs == "int8" else 0 for _, count in convs]
        return _hand_out(self.int8_convs, convs)


def _by_shape(shapes: list[list[int]]) -> dict[tuple[int, int], int]:
    return {(int(k), int(n)): int(count) for k, n, count in shapes}


def _conv_counts(shapes: list[list[int]] | None) -> dict[tuple[int, ...], int] | None:
    """A record's ``int8_conv_shapes`` (the weight key, then the count) by key; None where not recorded."""
    return None if shapes is None else {tuple(int(d) for d in row[:-1]): int(row[-1]) for row in shapes}


def _hand_out(recorded: dict[Any, int], wanted: list[tuple[Any, int]]) -> list[int]:
    """For each (key, count) of ``wanted`` in turn, how many of the ``recorded`` count of its key are left
    for it."""
    left = dict(recorded)
    counts = []
    for key, count in wanted:
        counts.append(min(count, left.get(key, 0)))
        left[key] = left.get(key, 0) - counts[-1]
    return counts


def mixed_floor_seconds(
    products: list[Product], samples: dict[str, list[list[float]]], split: LinearSplit
) -> list[float]:
    """The floor of an artifact that runs ``split``'s layers in int8 and the model's others in their fallback
    precision, one value per round: ``samples`` holds, by precision, per round, one call of each of
    ``products`` (``ModelFloor.product_samples``). Each linear and convolution is priced at its own
    precision's time (``LinearSplit``), attention at the int8 floor's (the float precision int8 engines run
    it in). Raises ValueError where a precision it needs was not sampled."""
    linears = iter(split.int8_counts([(p.k, p.n, p.count) for p in products if p.kind == "linear"]))
    convs = iter(split.conv_int8_counts([(p.conv.weight_key, p.count) for p in products if p.conv is not None]))
    n8s = [next(linears) if p.kind == "linear" else next(convs) if p.conv is not None else p.count for p in products]
    floats = [split.conv_fallback if p.conv is not None else split.fallback for p in products]
    missing = {f for p, n8, f in zip(products, n8s, floats, strict=True) if n8 < p.count} - set(samples)
    if "int8" not in samples or missing:
        raise ValueError(f"mixed_floor_seconds: no floor sampled in {sorted(missing | ({'int8'} - set(samples)))}")
    rounds = min(len(each) for each in samples.values())
    return [
        sum(
            n8 * samples["int8"][r][i] + (p.count - n8) * (samples[f][r][i] if n8 < p.count else 0.0)
            for i, (p, n8, f) in enumerate(zip(products, n8s, floats, strict=True))
        )
        for r in range(rounds)
    ]


def _conv_call(precision: str, shape: ConvShape, gen: torch.Generator) -> Callable[[], Any]:
    """One convolution as oneDNN's convolution runs it; a float pointwise one as the faster of that and the
    packed linear of its ``mkn`` (the same product over channels-last data): at MobileNetV3's shapes the
    linear ran up to 1.9x faster in float32 (8 x 144 x 576: 58 us against 108; AVX2 EPYC), and a floor an
    engine beats is no floor. int8 keeps the convolution (the linear, zero point 64, ran up to 2x slower)."""
    conv = packed_conv(precision, shape, gen)
    if precision == "int8" or not shape.pointwise:
        return conv
    linear = packed_linear(precision, *shape.mkn, gen)
    with torch.inference_mode():
        conv(), linear()
        conv_s, linear_s = (statistics.median(each_product_seconds([(1, f)] * 3)) for f in (conv, linear))
    return linear if linear_s < conv_s else conv


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
                self._calls.append((p.count, _conv_call(precision, p.conv, gen)))
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
