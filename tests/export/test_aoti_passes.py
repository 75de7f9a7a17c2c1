"""The graph passes tk applies before Inductor compiles a package: same values, other kernels."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tk.export.aoti.passes import SizesFromInputs, _attention, attention_as_matmuls, flash_attention_in


def _up_gelu_then_flatten(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A feed-forward's shape: a linear, GELU, then a reshape that needs the sequence length."""
    y = torch.nn.functional.gelu(x @ w)
    return y.reshape(y.shape[0] * y.shape[1], y.shape[2]) + y.shape[1]


def test_sizes_are_read_from_inputs_so_the_linear_output_feeds_only_its_gelu():
    graph_module = make_fx(_up_gelu_then_flatten, tracing_mode="symbolic")(torch.randn(2, 5, 4), torch.randn(4, 3))
    gelu = next(n for n in graph_module.graph.nodes if n.target is torch.ops.aten.gelu.default)
    product = gelu.args[0]
    assert len(product.users) == 2  # the GELU, and a sym_size of the sequence length traced from it

    graph_pass = SizesFromInputs()
    graph_pass(graph_module.graph)
    graph_module.recompile()

    assert graph_pass.moved == 1 and list(product.users) == [gelu]
    sizes = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert all(n.args[0].op == "placeholder" for n in sizes)
    for shape in ((3, 7, 4), (1, 2, 4)):  # other sizes than traced: the values are unchanged
        x, w = torch.randn(shape), torch.randn(4, 3)
        torch.testing.assert_close(graph_module(x, w), _up_gelu_then_flatten(x, w), rtol=0, atol=0)


def test_the_pass_has_a_stable_cache_key():
    assert SizesFromInputs().uuid() == SizesFromInputs().uuid() == "tk.export.aoti.passes.SizesFromInputs/1"


@pytest.mark.parametrize(
    "mask, causal, heads_kv, scale",
    [
        ("float", False, 4, None),
        ("bool", False, 4, None),
        (None, True, 4, None),
        (None, False, 2, 0.3),
        ("float rows", False, 4, None),
        ("bool keys", False, 4, 0.5),
    ],
)
def test_attention_as_matmuls_computes_what_sdpa_computes(mask, causal, heads_kv, scale):
    torch.manual_seed(0)
    q = torch.randn(3, 4, 7, 8)
    k, v = torch.randn(3, heads_kv, 7, 8), torch.randn(3, heads_kv, 7, 8)
    keep = torch.arange(7)[None, :] < torch.tensor([7, 4, 1])[:, None]  # padding of mixed lengths
    attn_mask = {
        "bool": keep[:, None, None, :],
        "float": torch.zeros(3, 1, 1, 7).masked_fill(~keep[:, None, None, :], -1e4),
        "float rows": torch.randn(7, 7),  # one bias per query and key (2-D), broadcast over batch and heads
        "bool keys": (torch.arange(7) < 5)[None],  # 1 x keys: the same keys hidden for every query
    }.get(mask)
    gqa = heads_kv != 4
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    got = _attention(q, k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_attention_with_a_float32_minimum_mask_stays_finite_and_close(dtype):
    """Hugging Face masks hidden keys with float32's lowest value, which rounds to -inf in bf16:
    held at the low precision's lowest finite value, a row of only hidden keys stays finite."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    keep = torch.arange(16)[None, :] < torch.tensor([16, 6])[:, None]
    attn_mask = torch.zeros(2, 1, 1, 16).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    got = _attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05)
    hidden_all = torch.full((1, 1, 16, 16), torch.finfo(torch.float32).min)
    assert torch.isfinite(_attention(q.to(dtype), k.to(dtype), v.to(dtype), hidden_all)).all()


class _Attend(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum(1)


def test_the_decomposed_program_has_no_sdpa_and_the_same_outputs_the_original_keeps_its_own():
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = -1e4
    program = torch.export.export(_Attend(), (x, mask))
    decomposed = attention_as_matmuls(program)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default

    def targets(p):
        return [n.target for n in p.graph.nodes]

    assert sdpa in targets(program) and sdpa not in targets(decomposed)  # a new program; the captured one is unchanged
    assert attention_as_matmuls(decomposed) is decomposed  # nothing left to decompose
    torch.testing.assert_close(decomposed.module()(x, mask), _Attend()(x, mask), rtol=1e-5, atol=1e-5)


def test_attention_in_bf16_runs_its_products_in_bf16_and_returns_float32():
    """An int8 package's float32 attention as two bfloat16 products (``ATTENTION_IN_BF16``)."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    decomposed = attention_as_matmuls(torch.export.export(_Attend(), (x, mask)), torch.bfloat16)
    products = [
        n for n in decomposed.graph.nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)
    ]
    assert len(products) == 2 and all(n.meta["val"].dtype == torch.bfloat16 for n in products)
    got, expected = decomposed.module()(x, mask), _Attend()(x, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # bfloat16's 8-bit mantissa, twice rounded
    assert torch.isfinite(got).all()


class _AttendWith(torch.nn.Module):
    """Attention with a boolean mask or the causal triangle, and grouped key/value heads."""

    def forward(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(q, kv, kv, attn_mask=mask, enable_gqa=True) + sdpa(q, kv, kv, is_causal=True, enable_gqa=True)


def test_flash_attention_in_bf16_runs_aten_flash_kernel_and_returns_float32():
    """An int8 package's float32 attention by aten's CPU flash kernel in bfloat16 (``FLASH_ATTENTION_IN_BF16``)."""
    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min  # below bf16's range: held at its lowest, not -inf
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    kept = flash_attention_in(torch.export.export(_Attend(), (x, mask)), torch.bfloat16)
    kernels = [n for n in kept.graph.nodes if n.target is flash]
    assert len(kernels) == 1 and all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in kernels)
    assert torch.ops.aten.scaled_dot_product_attention.default not in [n.target for n in kept.graph.nodes]
    got, expected = kept.module()(x, mask), _Attend()(x, mask)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # bfloat16's 8-bit mantissa
    q, kv = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)  # 4 query heads over 2 key/value heads
    seen = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    seen[0, ..., 4:] = False
    grouped = flash_attention_in(torch.export.export(_AttendWith(), (q, kv, seen)), torch.bfloat16)
    assert sum(n.target is flash for n in grouped.graph.nodes) == 2
    torch.testing.assert_close(grouped.module()(q, kv, seen), _AttendWith()(q, kv, seen), rtol=0.05, atol=0.05)
