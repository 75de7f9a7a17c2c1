"""The graph passes tk hands to Inductor: same values, fewer users on intermediate tensors."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tk.export.aoti_passes import SizesFromInputs


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
    assert SizesFromInputs().uuid() == SizesFromInputs().uuid() == "tk.export.aoti_passes.SizesFromInputs/1"
