"""Matrix products as CPU packages run them, and whether bfloat16's outrun float32's on this CPU.

``packed_linear`` builds one linear the way a frozen AOTInductor package calls it: oneDNN's packed
linear (``mkldnn._linear_pointwise`` on a ``_reorder_linear_weight``) for float32, bfloat16 and
float16, oneDNN's quantized linear (``onednn.qlinear_pointwise`` on a ``qlinear_prepack``-ed weight,
float32 out) for int8; ``packed_conv`` one 2-D convolution likewise. The roofline and the floor
(``tk.measure.roofline``, ``tk.measure.floor``) time them at a model's own shapes.

``bf16_outruns_fp32`` answers the question a flag cannot: an AVX512-BF16 flag says that bfloat16 dot
products exist, not that they are faster. On an Intel Xeon (model 207) with AVX512-BF16 and no AMX,
oneDNN's bfloat16 linear ran 0.65-0.70x its float32 linear at the small Transformer's shapes
(``vdpbf16ps`` issues on one port where float32 FMAs issue on two), while on the AVX512-BF16 AMD
EPYC it ran about 2x (benchmarks/history.md). The int8 aoti writer asks it before running the
layers it leaves out of int8, and attention, in bfloat16.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tk.formats.aoti import runs_natively

X86 = ("x86_64", "amd64", "i386", "i686")  # platform.machine() of the x86 CPUs

log = logging.getLogger("tk.formats")

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8_X_SCALE, INT8_X_ZERO_POINT = 0.02, 64  # activations in [0, 127]: no u8 x s8 saturation without VNNI
# a CNN's convolutions read a ReLU's output, quantized with zero point 0, and oneDNN then skips the zero point's
# compensation: resnet18's 21 at 32 x 128 x 128 took 95 ms with it at 0 against 122 at 64 (AVX2 EPYC)
INT8_CONV_X_ZERO_POINT = 0

# The probe: one product the size of a Transformer's up projection at a few thousand tokens; enough work
# (4.3 GFLOP) that a call's overhead does not decide, small enough to take about half a second.
PROBE_MKN = (2048, 1024, 1024)
PROBE_ROUNDS = 5
# a reduced float's products over float32's that make it worth running (tk optimize's race uses it too):
# bfloat16 measured 0.65-0.70x on the Xeon without AMX, about 2x on the EPYC, 5x and more with AMX
OUTRUNS_BY = 1.2


def packed_linear(precision: str, m: int, k: int, n: int, gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One linear of ``m`` rows, ``k`` in and ``n`` out features in ``precision`` (fp32, bf16, fp16, int8),
    weights prepacked as the packages hold them; the plain product where oneDNN cannot pack them here."""
    if precision == "int8":
        x = torch.randint(0, 128, (m, k), dtype=torch.uint8, generator=gen)
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        packed = torch.ops.onednn.qlinear_prepack(w, [m, k])
        w_scale, w_zero = torch.full((n,), 0.01), torch.zeros(n, dtype=torch.int64)
        bias = torch.randn(n, generator=gen)
        return lambda: torch.ops.onednn.qlinear_pointwise(
            x, INT8_X_SCALE, INT8_X_ZERO_POINT, packed, w_scale, w_zero, bias, 1.0, 0, torch.float32, "none", [], ""
        )
    dtype = PRECISION_DTYPES[precision]
    x, w, b = (torch.randn(size, generator=gen).to(dtype) for size in ((m, k), (n, k), (n,)))
    # float16 packed only where oneDNN runs it (as Inductor's freezing decides: is_mkldnn_fp16_supported)
    packs = precision != "fp16" or torch.ops.mkldnn._is_mkldnn_fp16_supported()
    if torch.backends.mkldnn.is_available() and packs:
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(w, m)
        except RuntimeError:  # this CPU lacks oneDNN's kernels for the dtype: the plain product
            return lambda: F.linear(x, w, b)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, weight, b, "none", [], "")
    return lambda: F.linear(x, w, b)


@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution: its input ``batch x channels x height x width``, its weight ``out_channels x
    channels / groups x kernel``, and its geometry; a 1-D one as height 1 (as oneDNN runs it)."""

    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    @property
    def output_size(self) -> tuple[int, int]:
        return tuple(  # type: ignore[return-value]
            (size + 2 * pad - dil * (k - 1) - 1) // step + 1
            for size, pad, dil, k, step in zip(
                (self.height, self.width), self.padding, self.dilation, self.kernel, self.stride, strict=True
            )
        )

    @property
    def mkn(self) -> tuple[int, int, int]:
        """The convolution as one matrix product: an output position per row, its inputs per group times the
        kernel reduced, an output channel per column (its multiply-adds are m x k x n)."""
        out_h, out_w = self.output_size
        return (
            self.batch * out_h * out_w,
            self.channels // self.groups * self.kernel[0] * self.kernel[1],
            self.out_channels,
        )

    def at_batch(self, batch: int) -> ConvShape:
        return dataclasses.replace(self, batch=self.batch * batch)

    @property
    def pointwise(self) -> bool:
        """A 1 x 1 convolution at stride 1 without padding or groups: over a channels-last input, one matrix
        product of its ``mkn``."""
        return self.kernel == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0) and self.groups == 1

    @property
    def weight_key(self) -> tuple[int, int, int, int, int]:
        """What an int8 record names this convolution by (``conv_weight_key``)."""
        key = conv_weight_key(self.out_channels, self.channels // self.groups, self.kernel, self.groups)
        assert key is not None  # a ConvShape's kernel has two dimensions
        return key


def conv_weight_key(
    out_channels: int, in_per_group: int, kernel: Sequence[int], groups: int
) -> tuple[int, int, int, int, int] | None:
    """A convolution's weight as int8 records name it: ``(inputs per group, output channels, kernel height,
    kernel width, groups)``, a 1-D kernel as height 1 (``ConvShape`` holds a 1-D convolution so); None for
    other kernels (3-D), which the floor does not time."""
    if len(kernel) not in (1, 2):
        return None
    height, width = (1, kernel[0]) if len(kernel) == 1 else kernel
    return (int(in_per_group), int(out_channels), int(height), int(width), int(groups))


def weight_rows(keys: Iterable[tuple[int, ...]]) -> list[list[int]]:
    """An int8 record's rows: each distinct weight key (``[in, out]`` of a linear, ``conv_weight_key`` of a
    convolution), sorted, with how many times it occurs last."""
    return [[*key, count] for key, count in sorted(Counter(keys).items())]


def packed_conv(precision: str, shape: ConvShape, gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """One convolution in ``precision`` the way Inductor's frozen packages call it: oneDNN's convolution on a
    reordered weight (``mkldnn._convolution_pointwise``) over a channels-last input for float32 and bfloat16,
    oneDNN's quantized convolution (``onednn.qconv_pointwise`` on a ``qconv_prepack``-ed weight, uint8 out, as
    each of an int8 ResNet's feeds the next) for int8; the plain ``F.conv2d`` where oneDNN cannot run it here."""
    geometry = (list(shape.stride), list(shape.padding), list(shape.dilation), shape.groups)
    stride, padding, dilation, groups = geometry
    size = [shape.batch, shape.channels, shape.height, shape.width]
    weight_size = (shape.out_channels, shape.channels // shape.groups, *shape.kernel)
    bias = torch.randn(shape.out_channels, generator=gen)
    if precision == "int8":
        x = torch.randint(0, 128, size, dtype=torch.uint8, generator=gen).contiguous(memory_format=torch.channels_last)
        w = torch.randint(-127, 128, weight_size, dtype=torch.int8, generator=gen)
        w_scale, w_zero = torch.full((shape.out_channels,), 0.01), torch.zeros(shape.out_channels, dtype=torch.int64)
        packed = torch.ops.onednn.qconv_prepack(w, w_scale, INT8_X_SCALE, INT8_CONV_X_ZERO_POINT, *geometry, size)
        return lambda: torch.ops.onednn.qconv_pointwise(
            x, INT8_X_SCALE, INT8_CONV_X_ZERO_POINT, packed, w_scale, w_zero, bias, *geometry, 0.05, 0, torch.uint8,
            "none", [], "",
        )  # fmt: skip
    dtype = PRECISION_DTYPES[precision]
    x = torch.randn(size, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(weight_size, generator=gen).to(dtype), bias.to(dtype)
    if torch.backends.mkldnn.is_available() and precision != "fp16":
        try:
            packed = torch.ops.mkldnn._reorder_convolution_weight(w, padding, stride, dilation, groups, size)
        except RuntimeError:  # this CPU lacks oneDNN's kernels for the dtype: the plain convolution
            return lambda: F.conv2d(x, w, b, stride, padding, dilation, groups)
        return lambda: torch.ops.mkldnn._convolution_pointwise(
            x, packed, b, padding, stride, dilation, groups, "none", [], ""
        )
    return lambda: F.conv2d(x, w, b, stride, padding, dilation, groups)


def product_ratio(precision: str, against: str, mkn: tuple[int, int, int] = PROBE_MKN,
                  rounds: int = PROBE_ROUNDS) -> float:  # fmt: skip
    """How many times faster ``precision``'s packed linear at ``mkn`` runs than ``against``'s: the median
    over ``rounds`` interleaved pairs (one warm-up each), so a busy minute slows both alike."""
    gen = torch.Generator().manual_seed(0)
    first, second = (packed_linear(p, *mkn, gen) for p in (precision, against))
    ratios = []
    with torch.inference_mode():
        first(), second()
        for _ in range(rounds):
            start = time.perf_counter()
            first()
            middle = time.perf_counter()
            second()
            ratios.append((time.perf_counter() - middle) / (middle - start))
    return statistics.median(ratios)


@functools.lru_cache(maxsize=1)
def bf16_outruns_fp32() -> bool:
    """Whether this CPU's bfloat16 products run at least ``OUTRUNS_BY`` float32's (measured once a
    process, ``product_ratio``); False where it has no bfloat16 dot products or oneDNN."""
    if not runs_natively("bf16") or not torch.backends.mkldnn.is_available():
        return False
    ratio = product_ratio("bf16", "fp32")
    log.info("bf16 products ran %.2fx float32's at %s (oneDNN, packed)", ratio, "x".join(map(str, PROBE_MKN)))
    return ratio >= OUTRUNS_BY


def saturating_int8_products(machine: str | None = None, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU's uint8 x int8 products saturate (x86 without VNNI or AMX int8 instructions)."""
    from tk.formats.aoti import NATIVE_FLAGS, cpu_flags

    machine = (machine if machine is not None else platform.machine()).lower()
    flags = cpu_flags() if flags is None else flags
    return machine in X86 and not any(f in flags for f in NATIVE_FLAGS["int8"])
