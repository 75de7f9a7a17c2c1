"""tk.formats.products: the packed products the roofline times, and the bf16-against-fp32 probe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tk.formats import products
from tk.formats.products import PRECISION_DTYPES, packed_linear, product_ratio
from tk.measure.hardware import cpu_precision_reason

# float16 on a CPU without AVX512-FP16 is emulated but still computed; bf16 likewise where oneDNN lacks it
TOLERANCE = {"fp32": 1e-4, "bf16": 0.1, "fp16": 0.02}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_packed_float_linears_compute_the_linear(precision):
    """The packed product (oneDNN's, where it packs this dtype) equals F.linear on the same operands."""
    if precision == "bf16" and (reason := cpu_precision_reason("bf16")) is not None:
        pytest.skip(reason)
    product = packed_linear(precision, 24, 64, 40, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    dtype = PRECISION_DTYPES[precision]
    x, w, b = (torch.randn(size, generator=gen).to(dtype) for size in ((24, 64), (40, 64), (40,)))
    with torch.inference_mode():
        got = product()
    assert got.shape == (24, 40) and got.dtype == dtype
    want = F.linear(x.float(), w.float(), b.float())
    assert (got.float() - want).abs().max().item() <= TOLERANCE[precision] * want.abs().max().item()


def test_product_ratio_of_a_precision_against_itself_is_near_one():
    """Interleaved pairs of the same product: the median ratio is 1 within this machine's noise (0.5-2)."""
    ratio = product_ratio("fp32", "fp32", mkn=(256, 256, 256), rounds=5)
    assert 0.5 <= ratio <= 2.0


@pytest.mark.parametrize(("ratio", "outruns"), [(0.68, False), (1.19, False), (1.2, True), (2.0, True)])
def test_bf16_outruns_fp32_only_by_the_measured_margin(monkeypatch, ratio, outruns):
    """An AVX512-BF16 flag is not enough: the measured ratio decides (0.65-0.70x on a Xeon without AMX)."""
    monkeypatch.setattr(products, "runs_natively", lambda precision: True)
    monkeypatch.setattr(products, "product_ratio", lambda precision, against: ratio)
    products.bf16_outruns_fp32.cache_clear()
    try:
        assert products.bf16_outruns_fp32() is outruns
    finally:
        products.bf16_outruns_fp32.cache_clear()


def test_no_bf16_dot_products_is_never_faster(monkeypatch):
    monkeypatch.setattr(products, "runs_natively", lambda precision: False)
    monkeypatch.setattr(products, "product_ratio", lambda *_: pytest.fail("measured without bf16 dot products"))
    products.bf16_outruns_fp32.cache_clear()
    try:
        assert products.bf16_outruns_fp32() is False
    finally:
        products.bf16_outruns_fp32.cache_clear()
