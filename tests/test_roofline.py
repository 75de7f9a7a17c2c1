"""Peaks at the model's own linear shapes, per precision, as a median with its spread; model FLOPs; shares."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tk.cli import cli
from tk.formats.products import ConvShape
from tk.measure.floor import LinearSplit, ModelFloor, Product, mixed_floor_seconds
from tk.measure.hardware import cpu_precision_reason
from tk.measure.roofline import (
    LinearShape,
    Roofline,
    ShapePeak,
    engine_precision,
    linear_shapes,
    model_flops,
    peak_unavailable_reason,
)
from tk.measure.timing import Spread, interleave, timed


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 16)
        x = x + self.down(torch.relu(self.up(x)))
        x = x + self.down(torch.relu(self.up(x)))  # the same shapes twice
        return self.head(x.mean(1))


def test_linear_shapes_walk_the_modules_linears_at_the_call_shape():
    shapes = linear_shapes(Tiny(), (torch.randn(3, 5, 16),))
    assert sorted(shapes, key=lambda s: (s.m, s.k)) == [
        LinearShape(3, 16, 4, 1),
        LinearShape(15, 16, 32, 2),
        LinearShape(15, 32, 16, 2),
    ]
    assert LinearShape(15, 16, 32, 2).at_batch(4) == LinearShape(60, 16, 32, 2)
    assert LinearShape(15, 16, 32, 2).flops == 2 * 15 * 16 * 32 * 2


class WeightProducts(nn.Module):
    """Linears written without nn.Linear: GPT-2's Conv1D (addmm with a weight stored in x out) and x @ weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 24)), nn.Parameter(torch.randn(24))
        self.w2 = nn.Parameter(torch.randn(24, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 16)
        h = torch.addmm(self.b1, x.reshape(-1, 16), self.w1).view(*x.shape[:-1], 24)
        return torch.relu(h) @ self.w2


def test_linears_written_as_products_with_a_weight_are_linears():
    x = torch.randn(2, 5, 16)
    assert sorted(linear_shapes(WeightProducts(), (x,)), key=lambda s: s.k) == [
        LinearShape(10, 16, 24, 1),
        LinearShape(10, 24, 8, 1),
    ]
    roofline = Roofline(WeightProducts(), (x,), ["fp32"])
    assert roofline.flops == 2 * 10 * (16 * 24 + 24 * 8)
    assert roofline.linear_share == 1.0


def _torch_encoder(layers: int = 2, width: int = 32, ffn: int = 64) -> nn.Module:
    layer = nn.TransformerEncoderLayer(width, 4, ffn, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def test_pytorchs_own_transformer_layers_are_counted_through_their_fast_path():
    """nn.TransformerEncoderLayer in eval runs one fused native call (its fast path) where neither the
    recorder nor FlopCounterMode sees a product: its in-projections were missing from the linears and
    its attention from the FLOPs."""
    batch, seq, width, ffn, layers = 2, 6, 32, 64, 2
    model, x = _torch_encoder(layers, width, ffn), torch.randn(batch, seq, width)
    assert torch.backends.mha.get_fastpath_enabled()
    roofline = Roofline(model, (x,), ["fp32"])
    assert torch.backends.mha.get_fastpath_enabled()  # restored
    rows = batch * seq
    assert sorted(roofline.shapes, key=lambda s: (s.k, s.n)) == [
        LinearShape(rows, width, width, layers),  # out projection
        LinearShape(rows, width, ffn, layers),
        LinearShape(rows, width, 3 * width, layers),  # in projection (a parameter of nn.MultiheadAttention)
        LinearShape(rows, ffn, width, layers),
    ]
    linear = sum(s.flops for s in roofline.shapes)
    attention = layers * 2 * (2 * batch * 4 * seq * seq * (width // 4))  # queries x keys, weights x values
    assert sum(p.flops for p in roofline.products if p.kind == "attention") == attention
    assert roofline.flops == linear + attention
    assert roofline.floor_skipped is None


class CrossAttention(nn.Module):
    def __init__(self, kdim: int | None = None) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True, kdim=kdim, vdim=kdim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.attn(x, memory, memory, need_weights=False)[0]


@pytest.mark.parametrize("kdim", [None, 8])
def test_cross_attentions_projections_are_counted_at_each_sides_rows(kdim):
    """Queries project 3 x 4 rows, keys and values the memory's 3 x 7 (packed as one product of 2 x 16 outputs
    where they share the width, else one each from their own width)."""
    width = kdim or 16
    x, memory = torch.randn(3, 4, 16), torch.randn(3, 7, width)
    roofline = Roofline(CrossAttention(kdim).eval(), (x, memory), ["fp32"])
    kv = LinearShape(21, 16, 32, 1) if kdim is None else LinearShape(21, width, 16, 2)
    want = [LinearShape(12, 16, 16, 2), kv]  # the query and out projections share a shape
    assert sorted(roofline.shapes, key=lambda s: (s.m, s.k, s.n)) == want
    attention = 2 * (2 * 3 * 2 * 4 * 7 * 8)
    assert roofline.flops == sum(s.flops for s in want) + attention


class MaskedAttention(nn.Module):
    """A linear over every position, then attention of 2 heads of 8 over the real keys."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # (B, T, 16), (B, T)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].bool()
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_the_floor_between_timed_calls_is_the_real_tokens_work_of_the_timed_feeds():
    """Counted at batch 1 over 10 positions, timed at batch 3 with 10, 4 and 4 real tokens: the floor's linear
    runs on 18 rows, its attention per sequence; without the feeds (or without a mask input) every position."""
    example = (torch.randn(1, 10, 16), torch.ones(1, 10, dtype=torch.int64))
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6, [1] * 4 + [0] * 6])

    def floor_products(roofline: Roofline, **feeds: torch.Tensor) -> set[tuple]:
        (floor,) = [m for m in roofline.between(3, feeds=feeds or None) if isinstance(m, ModelFloor)]
        return {(p.kind, p.batch, p.m, p.k, p.n, p.count) for p in floor.products}

    masked = Roofline(MaskedAttention().eval(), example, ["fp32"], mask_input="attention_mask")
    assert floor_products(masked, attention_mask=mask) == {
        ("linear", 1, 18, 16, 48, 1),
        ("attention", 2, 10, 8, 10, 1), ("attention", 4, 4, 8, 4, 1),  # scores: 2 heads x 1, x 2 sequences
        ("attention", 2, 10, 10, 8, 1), ("attention", 4, 4, 4, 8, 1),  # weights x values
    }  # fmt: skip
    padded = {("linear", 1, 30, 16, 48, 1), ("attention", 6, 10, 8, 10, 1), ("attention", 6, 10, 10, 8, 1)}
    assert floor_products(masked) == padded
    unmasked = Roofline(MaskedAttention().eval(), example, ["fp32"])
    assert floor_products(unmasked, attention_mask=mask) == padded


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_shape_peak_rates_are_positive_and_finite(precision):
    reason = peak_unavailable_reason(precision)
    if reason is not None:
        pytest.skip(reason)
    shapes = linear_shapes(Tiny(), (torch.randn(2, 8, 16),))
    peak = ShapePeak(precision, shapes)
    for _ in range(4):
        peak()
    assert len(peak.samples) == 4 and all(math.isfinite(r) and r > 0 for r in peak.samples)
    spread = peak.spread()
    assert spread.min <= spread.q1 <= spread.median <= spread.q3 <= spread.max and spread.n == 4
    data = peak.to_json()
    assert data["precision"] == precision and data["gflops"]["n"] == 4
    assert sorted(data["shapes_mknc"]) == sorted([s.m, s.k, s.n, s.count] for s in shapes)


def test_int8_peak_runs_onednn_quantized_linear_exactly():
    """The int8 product is oneDNN's quantized linear (not torch._int_mm), and it computes the right thing."""
    if (reason := peak_unavailable_reason("int8")) is not None:
        pytest.skip(reason)
    from tk.formats.products import INT8_X_SCALE, INT8_X_ZERO_POINT, packed_linear

    gen = torch.Generator().manual_seed(0)
    product = packed_linear("int8", 8, 32, 12, gen)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 128, (8, 32), dtype=torch.uint8, generator=gen)
    w = torch.randint(-127, 128, (12, 32), dtype=torch.int8, generator=gen)
    bias = torch.randn(12, generator=gen)
    want = ((x.float() - INT8_X_ZERO_POINT) * INT8_X_SCALE) @ (w.float() * 0.01).T + bias
    torch.testing.assert_close(product(), want, rtol=1e-4, atol=1e-4)


def test_bf16_peak_needs_its_cpu_flags():
    reason = peak_unavailable_reason("bf16")
    assert reason == cpu_precision_reason("bf16")
    assert peak_unavailable_reason("fp32") is None
    assert "no matrix-product peak" in peak_unavailable_reason("tf64")
    if reason is not None:
        with pytest.raises(ValueError, match="avx512_bf16"):
            ShapePeak("bf16", [LinearShape(4, 4, 4)])


def test_peaks_sampled_between_the_timed_calls_fill_the_shares(monkeypatch):
    monkeypatch.setattr("tk.measure.roofline.MIN_PEAK_GFLOP", 0.0)  # Tiny's products are too small to have a rate
    model = Tiny()
    roofline = Roofline(model, (torch.randn(1, 8, 16),), ["fp32", "nope", "fp32"])
    assert roofline.skipped == {"nope": "no matrix-product peak for precision 'nope'"}
    peaks = roofline.between(2)
    times = interleave({"eager": timed(lambda: model(torch.randn(2, 8, 16)))}, iters=3, between=peaks)
    assert len(times["eager"]) == 3 and len(peaks[0].samples) == 3

    row = SimpleNamespace(engine="eager", batch_size=2, p50_ms=1.0, gflops=None, peak_share=None)
    settings = roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "fp32")
    rate = roofline.flops * 2 / 1e-3 / 1e9
    assert row.gflops == pytest.approx(rate, rel=1e-3)
    assert row.peak_share == pytest.approx(rate / Spread.of(peaks[0].samples).median, rel=1e-3)
    assert settings["peaks"]["fp32"]["2"]["gflops"]["n"] == 3 and settings["flops_per_sample"] == roofline.flops
    assert roofline.median("fp32", 2) == Spread.of(peaks[0].samples).median and roofline.median("fp32", 4) is None
    floor = peaks[1]  # the model's products alone, sampled in the same rounds
    assert isinstance(floor, ModelFloor) and len(floor.samples) == 3
    assert [(p.m, p.k, p.n, p.count) for p in floor.products] == [(16, 16, 32, 2), (16, 32, 16, 2), (2, 16, 4, 1)]
    assert row.floor_share == pytest.approx(floor.spread().median / 1e-3, rel=1e-3)
    assert settings["floors"]["fp32"]["2"]["seconds"]["n"] == 3 and settings["floor_skipped"] is None


def _floor_with(precision: str, products: list[Product], samples: list[list[float]]) -> ModelFloor:
    floor = ModelFloor(precision, products)
    floor.product_samples = samples  # one call of each product per round, as if timed
    floor.samples = [sum(p.count * t for p, t in zip(products, s, strict=True)) for s in samples]
    return floor


def test_a_mixed_int8_artifact_is_priced_layer_by_layer(monkeypatch):
    monkeypatch.setattr("tk.measure.roofline.MIN_PEAK_GFLOP", 0.0)  # these products are too small to have a rate
    # two 16 x 32 linears, one 32 x 16, and an attention product; the artifact runs one 16 x 32 in int8
    products = [
        Product("linear", 1, 8, 16, 32, 2), Product("linear", 1, 8, 32, 16, 1), Product("attention", 2, 4, 8, 4, 1)
    ]  # fmt: skip
    int8 = _floor_with("int8", products, [[1.0, 2.0, 5.0], [3.0, 2.0, 7.0]])
    fp32 = _floor_with("fp32", products, [[10.0, 20.0, 50.0], [30.0, 20.0, 70.0]])
    split = LinearSplit({(16, 32): 1}, "fp32")
    # round 1: one 16 x 32 in int8 (1) and one in fp32 (10), the 32 x 16 in fp32 (20), attention as int8's (5)
    assert mixed_floor_seconds(products, {"int8": int8.product_samples, "fp32": fp32.product_samples}, split) == [
        1.0 + 10.0 + 20.0 + 5.0,
        3.0 + 30.0 + 20.0 + 7.0,
    ]
    every = LinearSplit({(16, 32): 2, (32, 16): 1}, "fp32")
    assert (
        mixed_floor_seconds(products, {"int8": int8.product_samples, "fp32": fp32.product_samples}, every)
        == int8.samples
    )  # all in int8: the int8 floor itself
    assert mixed_floor_seconds(
        products, {"int8": int8.product_samples, "fp32": fp32.product_samples}, LinearSplit({}, "fp32")
    ) == [
        45.0,
        87.0,
    ]  # none: fp32 linears, int8 attention
    with pytest.raises(ValueError, match="not recorded"):
        mixed_floor_seconds(products, {"int8": int8.product_samples, "fp32": fp32.product_samples}, LinearSplit(None))

    roofline = Roofline(Tiny(), (torch.randn(1, 8, 16),), ["fp32"])
    roofline.floors = {("int8", 1): int8, ("fp32", 1): fp32}
    row = SimpleNamespace(engine="aoti", batch_size=1, p50_ms=100.0, gflops=None, peak_share=None, floor_share=None)
    settings = roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "int8", lambda engine: split)
    assert row.floor_share == pytest.approx(Spread.of([36.0, 60.0]).median / 0.1)
    assert settings["floor_splits"]["aoti"] == {
        "int8_linear_shapes": [[16, 32, 1]],
        "fallback": "fp32",
        "convs": "int8",
        "floor_s": 48.0,
    }
    # the peak of the mix: the linears' FLOPs over their time at each precision's rate (Tiny at 8 tokens: one of
    # the two 16 x 32 calls in int8: 8192 of 32896 FLOPs, the head running on the mean of the tokens)
    rates = {"int8": 200.0, "fp32": 100.0}
    roofline.median = lambda precision, batch=1: rates.get(precision)
    roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "int8", lambda engine: split)
    mixed = 32896 / (8192 / 200.0 + (32896 - 8192) / 100.0)
    assert roofline.mixed_median(split) == pytest.approx(mixed)
    assert row.peak_share == pytest.approx(roofline.flops / 0.1 / 1e9 / mixed, rel=1e-3)
    assert roofline.mixed_median(LinearSplit({}, "bf16")) is None  # no bf16 rate sampled
    unknown = SimpleNamespace(engine="onnx", batch_size=1, p50_ms=100.0, gflops=None, peak_share=None, floor_share=None)
    roofline.fill(SimpleNamespace(rows=[unknown]), lambda engine: "int8", lambda engine: LinearSplit(None))
    assert unknown.floor_share is None  # layers left out of int8, not recorded which: no floor rather than int8's
    bf16 = SimpleNamespace(engine="ov", batch_size=1, p50_ms=100.0, gflops=None, peak_share=None, floor_share=None)
    roofline.fill(SimpleNamespace(rows=[bf16]), lambda engine: "int8", lambda engine: LinearSplit({}, "bf16"))
    assert bf16.floor_share is None  # its fallback's floor was not sampled


def test_dynamic_int8_prices_every_linear_in_int8_and_convolutions_in_float32():
    """onnxruntime's dynamic int8 quantizes every MatMul/Gemm and no convolution: a CNN's row is priced so
    (it read 46% of the all-int8 floor for resnet18, whose convolutions it runs in float32); a model without
    convolutions keeps the int8 floor as it is, with no float32 floor needed."""
    products = [Product("conv", 1, 8, 27, 16, 2, ConvShape(1, 3, 4, 4, 16, (3, 3), padding=(1, 1))),
                Product("linear", 1, 1, 16, 4, 1)]  # fmt: skip
    int8 = _floor_with("int8", products, [[1.0, 0.5], [3.0, 0.5]])
    fp32 = _floor_with("fp32", products, [[4.0, 2.0], [6.0, 2.0]])
    manifest = SimpleNamespace(
        precision="int8", formats={"onnx": {"quantization": "dynamic int8 (MatMul, Gemm), weights uint8"}}
    )
    split = LinearSplit.of_engine(manifest, "onnx")
    assert split == LinearSplit(None, "fp32", every_linear=True, convs="fp32") and split.priced
    assert mixed_floor_seconds(products, {"int8": int8.product_samples, "fp32": fp32.product_samples}, split) == [
        8.5,
        12.5,
    ]
    assert LinearSplit.from_json(split.to_json()) == split
    roofline = Roofline(Tiny(), (torch.randn(1, 8, 16),), ["fp32"])
    roofline.floors = {("int8", 1): int8, ("fp32", 1): fp32}
    assert roofline.floor_median("int8", 1, split) == pytest.approx(Spread.of([8.5, 12.5]).median)
    roofline.floors = {("int8", 1): _floor_with("int8", products[1:], [[0.5], [0.7]])}  # no convolution, no fp32
    assert roofline.floor_median("int8", 1, split) == pytest.approx(0.6)


def test_linear_split_read_from_the_quantization_record():
    record = {"excluded": ["a"], "int8_linear_shapes": [[384, 1536, 5]], "automatic_exclusions_run_in": "bf16"}
    assert LinearSplit.from_record(record) == LinearSplit({(384, 1536): 5}, "bf16")
    assert LinearSplit.from_record({"excluded": [], "int8_modules": 4}) is None  # every linear int8
    assert LinearSplit.from_record({"excluded": ["a"]}) == LinearSplit(None, "fp32")  # exported before the record
    split = LinearSplit.from_record(record)
    assert LinearSplit.from_json(json.loads(json.dumps(split.to_json()))) == split
    manifest = SimpleNamespace(precision="int8", formats={"aoti": {"quantization": record}})
    assert LinearSplit.of_engine(manifest, "aoti") == LinearSplit({(384, 1536): 5}, "bf16")
    assert LinearSplit.of_engine(manifest, "eager") is None and LinearSplit.of_engine(manifest, "onnx") is None
    assert LinearSplit.of_engine(SimpleNamespace(precision="fp32", formats=manifest.formats), "aoti") is None


def test_a_cnns_floor_times_its_convolutions_as_onednn_runs_them(monkeypatch):
    """A CNN's products are its convolutions: each recorded with its geometry (m x k x n: output positions x
    inputs per group x kernel x output channels), timed at the row's batch, and its share filled even where
    its linear head is too small for a share of peak (resnet18's tables had no floor before)."""
    monkeypatch.setattr("tk.measure.roofline.MIN_PEAK_GFLOP", 1e-4)  # the head's 0.1 MFLOP: no peak share
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding="same", groups=4),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip
    roofline = Roofline(model, (torch.randn(1, 3, 16, 16),), ["fp32"])
    assert roofline.floor_skipped is None
    convs = [p for p in roofline.products if p.kind == "conv"]
    assert [(p.m, p.k, p.n) for p in convs] == [(64, 27, 16), (64, 36, 16)]
    assert [p.conv.padding for p in convs] == [(1, 1), (1, 1)] and convs[1].conv.groups == 4
    made = roofline.between(2)
    floor = next(m for m in made if isinstance(m, ModelFloor))
    assert [p.conv.batch for p in floor.products if p.kind == "conv"] == [2, 2]
    assert [p.m for p in floor.products if p.kind == "conv"] == [128, 128]
    for _ in range(3):
        for measured in made:
            measured()
    row = SimpleNamespace(engine="onnx", batch_size=2, p50_ms=10.0, gflops=None, peak_share=None, floor_share=None)
    settings = roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "fp32")
    assert row.peak_share is None and "no_share" in settings
    assert row.floor_share == pytest.approx(floor.spread().median / 1e-2, rel=1e-3)
    if peak_unavailable_reason("int8") is None:  # the int8 floor runs oneDNN's quantized convolution
        int8 = ModelFloor("int8", floor.products)
        int8()
        assert len(int8.samples) == 1 and int8.samples[0] > 0


def test_packed_convolutions_compute_what_conv2d_does():
    from tk.formats.products import ConvShape, packed_conv

    shape = ConvShape(2, 8, 10, 12, 16, (3, 3), stride=(2, 2), padding=(1, 1), groups=2)
    gen = torch.Generator().manual_seed(0)
    bias, x, w = (
        torch.randn(16, generator=gen),
        torch.randn(2, 8, 10, 12, generator=gen),
        torch.randn(16, 4, 3, 3, generator=gen),
    )
    want = torch.nn.functional.conv2d(x, w, bias, (2, 2), (1, 1), 1, 2)
    got = packed_conv("fp32", shape, torch.Generator().manual_seed(0))()
    assert got.shape == want.shape == (2, 16, *shape.output_size) and shape.mkn == (2 * 5 * 6, 4 * 9, 16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if peak_unavailable_reason("int8") is None:  # oneDNN's quantized convolution, uint8 out at scale 0.05
        from tk.formats.products import INT8_CONV_X_ZERO_POINT, INT8_X_SCALE

        gen = torch.Generator().manual_seed(0)
        bias = torch.randn(16, generator=gen)
        x = torch.randint(0, 128, (2, 8, 10, 12), dtype=torch.uint8, generator=gen)
        w = torch.randint(-127, 128, (16, 4, 3, 3), dtype=torch.int8, generator=gen)
        real = torch.nn.functional.conv2d(
            (x.float() - INT8_CONV_X_ZERO_POINT) * INT8_X_SCALE, w.float() * 0.01, bias, (2, 2), (1, 1), 1, 2
        )
        quantized = packed_conv("int8", shape, torch.Generator().manual_seed(0))()
        assert quantized.dtype == torch.uint8 and quantized.shape == want.shape
        expected = torch.round(real / 0.05).clamp(0, 255)
        assert (quantized.float() - expected).abs().max() <= 1.0


def test_a_pointwise_convolutions_floor_is_the_faster_of_the_convolution_and_the_linear(monkeypatch):
    """A float 1 x 1 convolution is one matrix product over channels-last data: its floor is whichever of
    oneDNN's convolution and the packed linear runs it faster (timings injected: the linear returns 2-D)."""
    from tk.measure.floor import _conv_call

    def timed_as(linear_s: float, conv_s: float):
        return lambda calls: [linear_s if f().dim() == 2 else conv_s for _, f in calls]

    gen = torch.Generator().manual_seed(0)
    pointwise, spatial = ConvShape(2, 16, 3, 3, 8, (1, 1)), ConvShape(2, 16, 3, 3, 8, (3, 3))
    assert pointwise.pointwise and not spatial.pointwise
    monkeypatch.setattr("tk.measure.floor.each_product_seconds", timed_as(0.5, 1.0))
    assert _conv_call("fp32", pointwise, gen)().shape == (2 * 3 * 3, 8)  # the linear of its m x k x n
    assert _conv_call("fp32", spatial, gen)().shape == (2, 8, 1, 1)  # not a product of its mkn: never timed
    monkeypatch.setattr("tk.measure.floor.each_product_seconds", timed_as(1.0, 0.5))
    assert _conv_call("fp32", pointwise, gen)().shape == (2, 8, 3, 3)
    if peak_unavailable_reason("int8") is None:  # int8 keeps oneDNN's quantized convolution
        monkeypatch.setattr("tk.measure.floor.each_product_seconds", timed_as(0.5, 1.0))
        assert _conv_call("int8", pointwise, gen)().shape == (2, 8, 3, 3)


def test_a_model_of_other_products_has_no_floor():
    model = nn.Sequential(nn.Conv3d(3, 16, 3), nn.Flatten(), nn.Linear(16 * 6 * 6 * 6, 4))
    roofline = Roofline(model, (torch.randn(1, 3, 8, 8, 8),), ["fp32"])
    assert roofline.floor_skipped.startswith("its linear, 1-D and 2-D convolution and attention products are ")
    assert all(isinstance(m, ShapePeak) for m in roofline.between(1))


def test_a_1d_convolution_is_timed_as_a_2d_one_of_height_1():
    """Audio models' 1-D convolutions (a wav2vec2 feature encoder, Whisper's stem) had no floor: each is now
    recorded as a 2-D one of height 1, as oneDNN runs it, with its own multiply-adds and weight key."""
    from tk.formats.products import conv_weight_key, packed_conv

    model = nn.Sequential(
        nn.Conv1d(3, 16, 3, stride=2, padding=1), nn.GELU(), nn.Conv1d(16, 16, 5, padding="same", groups=4)
    )
    roofline = Roofline(model, (torch.randn(1, 3, 40),), ["fp32"])
    assert roofline.floor_skipped is None
    first, second = (p.conv for p in roofline.products)
    assert first == ConvShape(1, 3, 1, 40, 16, (1, 3), stride=(1, 2), padding=(0, 1))
    assert second == ConvShape(1, 16, 1, 20, 16, (1, 5), padding=(0, 2), groups=4)
    assert [(p.m, p.k, p.n) for p in roofline.products] == [(20, 9, 16), (20, 20, 16)]
    assert first.weight_key == (3, 16, 1, 3, 1) == conv_weight_key(16, 3, [3], 1)
    assert conv_weight_key(16, 3, [3, 3, 3], 1) is None  # a 3-D kernel: not timed, not recorded
    gen = torch.Generator().manual_seed(0)
    bias, x, w = (
        torch.randn(16, generator=gen),
        torch.randn(1, 3, 1, 40, generator=gen),
        torch.randn(16, 3, 1, 3, generator=gen),
    )
    want = torch.nn.functional.conv1d(x[:, :, 0], w[:, :, 0], bias, 2, 1)
    got = packed_conv("fp32", first, torch.Generator().manual_seed(0))()
    torch.testing.assert_close(got[:, :, 0], want, rtol=1e-4, atol=1e-4)


def test_a_model_of_convolutions_has_a_floor_share_and_no_share_of_its_linears_rate(monkeypatch):
    """The rate at a model's linear shapes describes it only where its linears do most of its work: a
    wav2vec2 whose convolutions did 92% of its FLOPs read 215% of peak. Its floor share stays."""
    monkeypatch.setattr("tk.measure.roofline.MIN_PEAK_GFLOP", 0.0)  # tiny products: a rate all the same
    model = nn.Sequential(nn.Conv1d(8, 32, 5, padding=2), nn.GELU(), nn.Linear(40, 8))
    roofline = Roofline(model, (torch.randn(1, 8, 40),), ["fp32"])
    assert roofline.floor_skipped is None
    linear = sum(s.flops for s in roofline.shapes)
    assert (linear, roofline.flops) == (2 * 32 * 40 * 8, linear + 2 * 40 * 8 * 5 * 32)  # 17% of it
    made = roofline.between(1)
    for _ in range(3):
        for measured in made:
            measured()
    row = SimpleNamespace(engine="onnx", batch_size=1, p50_ms=1.0, gflops=None, peak_share=None, floor_share=None)
    settings = roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "fp32")
    assert row.peak_share is None and row.floor_share is not None and row.floor_share > 0
    assert settings["no_share"].startswith("any batch: the model's linear products are 17% of its FLOPs")


def test_convolutions_left_out_of_int8_are_priced_in_the_precision_they_run_in():
    """An int8 CNN whose search left convolutions out runs those in float32 (aoti: its bf16 fallback is the
    linears') or in the IR's fallback (OpenVINO): the record names them by weight, and the floor prices each
    as it runs (before, every convolution was priced in int8, so the share read low)."""
    stem = ConvShape(1, 3, 4, 4, 16, (3, 3), padding=(1, 1))
    depthwise = ConvShape(1, 16, 4, 4, 16, (3, 3), padding=(1, 1), groups=16)
    products = [
        Product("conv", 1, 16, 27, 16, 2, stem), Product("conv", 1, 16, 9, 16, 1, depthwise),
        Product("linear", 1, 1, 16, 4, 1),
    ]  # fmt: skip
    samples = {"int8": [[1.0, 2.0, 0.5]], "bf16": [[3.0, 4.0, 1.5]], "fp32": [[5.0, 6.0, 2.5]]}
    record = {
        "excluded": ["stem.1", "head"], "int8_linear_shapes": [], "int8_conv_shapes": [[3, 16, 3, 3, 1, 1]],
        "automatic_exclusions_run_in": "bf16", "excluded_convolutions_run_in": "fp32",
    }  # fmt: skip
    aoti = LinearSplit.from_record(record)
    assert aoti.int8_convs == {(3, 16, 3, 3, 1): 1} and aoti.conv_fallback == "fp32"
    assert aoti.float_floors == {"bf16", "fp32"} and LinearSplit.from_json(aoti.to_json()) == aoti
    # one stem in int8 (1), the other in fp32 (5); the depthwise in fp32 (6); the head in bf16 (1.5)
    assert mixed_floor_seconds(products, samples, aoti) == [1.0 + 5.0 + 6.0 + 1.5]
    with pytest.raises(ValueError, match="fp32"):
        mixed_floor_seconds(products, {"int8": samples["int8"], "bf16": samples["bf16"]}, aoti)
    openvino = LinearSplit.from_record({**record, "excluded_convolutions_run_in": None})
    assert openvino.conv_fallback == "bf16" and openvino.float_floors == {"bf16"}
    assert mixed_floor_seconds(products, samples, openvino) == [1.0 + 3.0 + 4.0 + 1.5]
    everything = LinearSplit.from_record({**record, "int8_linear_shapes": [[16, 4, 1]],
                                          "int8_conv_shapes": [[3, 16, 3, 3, 1, 2], [1, 16, 3, 3, 16, 1]]})  # fmt: skip
    assert mixed_floor_seconds(products, {"int8": samples["int8"]}, everything) == [2.0 + 2.0 + 0.5]
    unrecorded = LinearSplit.from_record({**record, "int8_conv_shapes": None})  # exported before the record
    assert unrecorded.int8_convs is None
    assert mixed_floor_seconds(products, samples, unrecorded) == [2.0 + 2.0 + 1.5]  # convolutions in int8


def test_spread_is_median_quartiles_and_range():
    spread = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (spread.median, spread.q1, spread.q3, spread.min, spread.max, spread.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert Spread.of([7.0]).to_json() == {"median": 7.0, "q1": 7.0, "q3": 7.0, "min": 7.0, "max": 7.0, "n": 1}


def test_model_flops_counts_matrix_products():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    assert model_flops(model, (torch.randn(3, 16),)) == 2 * 3 * (16 * 32 + 32 * 4)


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)


def test_model_flops_counts_attention_on_the_cpu():
    """FlopCounterMode has formulas for the CUDA attention kernels only: the CPU's counted 0."""
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 10, 8)
    assert model_flops(Attention(), (q, k, k)) == 2 * (2 * 2 * 4 * 6 * 10 * 8)


def test_model_flops_counts_a_parametrized_weight():
    """wav2vec2's positional convolution is weight-normed (a parametrization): counted under inference_mode
    it raised "'ParametrizedConv1d' object has no attribute 'weight'" and tk optimize stopped."""
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1))
    roofline = Roofline(nn.Sequential(conv, nn.GELU()), (torch.randn(2, 4, 10),), ["fp32"])
    assert roofline.flops == 2 * 2 * 10 * 8 * 4 * 3
    assert [p.conv.weight_key for p in roofline.products] == [(4, 8, 1, 3, 1)]


def test_engine_precisions_follow_the_artifact():
    assert engine_precision("eager", "bf16") == "fp32"
    assert engine_precision("compile", "bf16") == "bf16"
    assert engine_precision("compile", "int8") == "fp32"
    assert engine_precision("onnx", "int8") == "int8"


def test_reduced_precision_needs_its_cpu_flags():
    avx2_only = frozenset({"avx2", "fma"})
    assert "avx512_bf16 or amx_bf16" in cpu_precision_reason("bf16", avx2_only)
    assert "avx512_vnni" in cpu_precision_reason("int8", avx2_only)
    assert cpu_precision_reason("bf16", frozenset({"avx512f", "avx512_bf16"})) is None
    assert cpu_precision_reason("int8", frozenset({"amx_int8"})) is None
    assert cpu_precision_reason("fp32", avx2_only) is None


@pytest.mark.slow
def test_products_too_small_to_have_a_rate_give_no_share():
    model = Tiny()
    roofline = Roofline(model, (torch.randn(1, 8, 16),), ["fp32"])
    peaks = roofline.between(2)
    interleave({"eager": timed(lambda: model(torch.randn(2, 8, 16)))}, iters=3, between=peaks)
    row = SimpleNamespace(engine="eager", batch_size=2, p50_ms=1e-3, gflops=None, peak_share=None)
    settings = roofline.fill(SimpleNamespace(rows=[row]), lambda engine: "fp32")
    assert row.gflops is not None and row.peak_share is None  # not a share of a "peak" the call overhead set
    assert settings["no_share"].startswith("batch 2: the model's linear products are under 0.05 GFLOP a call")


def test_bench_roofline_reports_each_engines_share_of_the_measured_peak(exported, tmp_path, monkeypatch):
    monkeypatch.setattr("tk.measure.roofline.MIN_PEAK_GFLOP", 0.0)  # the tiny model's products: no rate, no share
    root = exported("transformer", ("onnx",)).root
    out = tmp_path / "bench.json"
    args = ["bench", str(root), "--engine", "onnx", "--batch-sizes", "2", "--iters", "3", "--roofline"]
    result = CliRunner().invoke(cli, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "of peak" in result.output and "matmul rate at the model's linear shapes" in result.output
    data = json.loads(out.read_text())
    roofline = data["settings"]["roofline"]
    peak = roofline["peaks"]["fp32"]["2"]["gflops"]
    assert 0 < peak["min"] <= peak["median"] <= peak["max"] and peak["n"] == 3
    assert roofline["flops_per_sample"] > 0
    for row in data["results"]["rows"]:
        rate = roofline["flops_per_sample"] * row["batch_size"] / (row["p50_ms"] / 1e3) / 1e9
        assert row["gflops"] == pytest.approx(rate, rel=1e-2, abs=0.1)
        assert row["peak_share"] == pytest.approx(rate / peak["median"], rel=1e-2, abs=1e-4)
