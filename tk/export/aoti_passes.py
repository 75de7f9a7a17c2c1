"""Graph passes tk hands to Inductor when it compiles an ``aoti`` package.

``SizesFromInputs``: with dynamic dimensions, AOTAutograd's graph reads a symbolic size (the
sequence length, say) with ``sym_size`` from whichever tensor it met first, often the output of a
linear. That extra user stops torchao's x86 freezing patterns, which ask for the exact number of
users a linear's output has: the int8 ``qlinear`` + GELU + quantize fusion
(``torchao.quantization.pt2e.inductor_passes.x86._register_qlinear_unary_fusion``) never matched in
a package with dynamic batch and sequence, so each feed-forward's up-projection wrote float32 and a
separate kernel ran the GELU and quantized its output (19% of the small Transformer's int8 call on
the Xeon of issue 22). Static shapes fused it. The pass makes every such ``sym_size`` read the same
symbol from a graph input instead: the same value, and the linear's output keeps only its real users.

``attention_as_matmuls``: bfloat16 and float16 CPU packages compute ``scaled_dot_product_attention``
as two batched products in the low precision around a float32 softmax, not with aten's CPU flash
kernel. On the AVX512-BF16 EPYC (no AMX) the flash kernel ran bf16 attention at the small
Transformer's shape (32 x 4 heads x 128 x 64) at ~90 GFLOP/s, no faster than float32, and took
40% of the bf16 package's call; with the two products and Inductor's fused softmax between them
the package ran 1.13-1.20x faster (MiniLM's, 12 heads of 32: 1.03x), at the same accuracy
(benchmarks/history.md). Scores accumulate in float32 inside the product and are rounded
to the low precision once before the float32 softmax; the probabilities are rounded again for the
second product, as flash attention rounds them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

ATTENTION_AS_MATMULS = "tk.export.aoti_passes.attention_as_matmuls/1"


class SizesFromInputs(CustomGraphPass):
    """Inductor's ``joint_custom_post_pass``: symbolic sizes read from graph inputs, not from intermediate tensors."""

    moved = 0  # sym_size nodes the last call moved to an input

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.moved = 0
        inputs: dict[Any, tuple[torch.fx.Node, int]] = {}  # size expression -> (input, axis) that has it
        for node in graph.nodes:
            value = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(value, torch.Tensor):
                for axis, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        inputs.setdefault(size.node.expr, (node, axis))
        for node in graph.nodes:
            tensor = node.args[0] if node.target is torch.ops.aten.sym_size.int else None
            if not isinstance(tensor, torch.fx.Node) or tensor.op == "placeholder":
                continue
            size = node.meta.get("val")
            source = inputs.get(size.node.expr) if isinstance(size, torch.SymInt) else None
            if source is not None:
                node.args = source
                self.moved += 1

    def uuid(self) -> str:  # Inductor's FX graph cache keys compiled graphs on it
        return "tk.export.aoti_passes.SizesFromInputs/1"


def attention_as_matmuls(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with every ``aten.scaled_dot_product_attention`` decomposed into two products and a float32 softmax."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if not any(node.target is sdpa for node in program.graph.nodes):
        return program
    return program.run_decompositions({sdpa: _attention})


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention``'s inference semantics (no dropout), softmax in float32."""
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scores = torch.matmul(query, key.transpose(-2, -1)).float() * (query.size(-1) ** -0.5 if scale is None else scale)
    if is_causal:
        length, other = query.size(-2), key.size(-2)
        causal = torch.ones(length, other, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
