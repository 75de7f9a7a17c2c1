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

``attention_as_matmuls``: bfloat16 and float16 CPU packages compute ``scaled_dot_product_attention`` as
two batched products in the low precision around a float32 softmax, not with aten's CPU flash kernel,
which ran bf16 attention on the AVX512-BF16 EPYC (no AMX) no faster than float32. Where the CPU has AMX
for the precision (``flash_attention_preferred``) the flash kernel keeps the attention: its blocks run on
AMX tiles, and MiniLM's and the small Transformer's bf16 packages ran faster with it than with the two
products on the AMX Xeon (benchmarks/history.md). The mask goes into the first product as ``baddbmm``'s
input, so Inductor's softmax kernel reads one tensor of the scores' shape and keeps each row's
exponentials in a row-sized buffer; with the mask applied in the softmax, Inductor split it into two loop
nests around a float32 buffer of B * H * L * S exponentials, which cost 3x the time. Scores accumulate in
float32 inside the product and are rounded to the low precision once before the float32 softmax; the
probabilities are rounded again for the second product, as flash attention rounds them. An int8 package's
attention (float32 around its int8 linears) runs the same way in bfloat16 where the CPU's bfloat16
products outrun its float32 ones (``attention_as_matmuls(program, torch.bfloat16)``, before quantizing:
``tk.export.aoti.writer``), or by the flash kernel in bfloat16 where the CPU has AMX for it
(``flash_attention_in``). Measurements: benchmarks/history.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

ATTENTION_AS_MATMULS = "tk.export.aoti.passes.attention_as_matmuls/2"
ATTENTION_IN_BF16 = "tk.export.aoti.passes.attention_as_matmuls/2+bf16"  # an int8 package's attention
FLASH_ATTENTION_IN_BF16 = "tk.export.aoti.passes.flash_attention_in/1+bf16"  # the same, on AMX


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
        return "tk.export.aoti.passes.SizesFromInputs/1"


AMX_FLAGS = {"bf16": "amx_bf16", "fp16": "amx_fp16"}  # the tiles that run aten's flash kernel's blocks


def flash_attention_preferred(precision: str) -> bool:
    """Whether a ``precision`` CPU package keeps aten's flash attention kernel (this CPU has AMX for it) rather
    than ``attention_as_matmuls``' two products."""
    from tk.formats.aoti import cpu_flags

    return AMX_FLAGS.get(precision, "") in cpu_flags()


def attention_as_matmuls(
    program: torch.export.ExportedProgram, dtype: torch.dtype | None = None
) -> torch.export.ExportedProgram:
    """``program`` with every ``aten.scaled_dot_product_attention`` decomposed into two products and a
    float32 softmax; with ``dtype``, the products run in it (query, key and value cast to it, the
    output cast back): the int8 packages' float32 attention in bfloat16."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if not any(node.target is sdpa for node in program.graph.nodes):
        return program
    return program.run_decompositions({sdpa: _attention if dtype is None else functools.partial(_attention_in, dtype)})


def flash_attention_in(program: torch.export.ExportedProgram, dtype: torch.dtype) -> torch.export.ExportedProgram:
    """``program`` with every ``aten.scaled_dot_product_attention`` run by aten's CPU flash kernel in ``dtype``
    (query, key, value and a float mask cast to it, the output cast back): an int8 package's float32
    attention on a CPU with AMX for ``dtype``, where the flash kernel's blocks run on AMX tiles."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    if not any(node.target is sdpa for node in program.graph.nodes):
        return program
    return program.run_decompositions({sdpa: functools.partial(_flash_attention_in, dtype)})


def _flash_attention_in(dtype: torch.dtype, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                        scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
    key, value = _shared_heads_repeated(query, key, value, enable_gqa)
    bias = _additive_bias(attn_mask, False, query.size(-2), key.size(-2), dtype, query.device)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out = flash(query.to(dtype), key.to(dtype), value.to(dtype), 0.0, is_causal, attn_mask=bias, scale=scale)[0]
    return out.to(query.dtype)


def _shared_heads_repeated(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value with each head repeated for the query heads that share it (SDPA's ``enable_gqa``)."""
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        return key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    return key, value


def _attention_in(dtype: torch.dtype, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    return _attention(query.to(dtype), key.to(dtype), value.to(dtype), *args, **kwargs).to(query.dtype)


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
    """``scaled_dot_product_attention``'s inference semantics (no dropout), softmax in float32.

    The mask (and the causal triangle) is added inside the first product, as ``baddbmm``'s
    input, so the softmax reads one tensor of the scores' own shape: Inductor then runs it row by
    row in one loop nest with a row-sized buffer, where a mask indexed apart from the scores split
    it into two loop nests around a float32 buffer of all the exponentials (B * H * L * S).
    """
    key, value = _shared_heads_repeated(query, key, value, enable_gqa)
    batch, length, other = query.shape[:-2], query.size(-2), key.size(-2)
    factor = query.size(-1) ** -0.5 if scale is None else scale
    queries = query.reshape(-1, length, query.size(-1))
    keys = key.reshape(-1, other, key.size(-1)).transpose(-2, -1)
    bias = _additive_bias(attn_mask, is_causal, length, other, query.dtype, query.device)
    if bias is None:
        scores = torch.bmm(queries, keys).float() * factor
    else:
        rows = bias.size(-2)  # 1 (one mask row for every query) or the query length
        bias = bias.expand(*batch, rows, other).reshape(-1, rows, other)
        scores = torch.baddbmm(bias, queries, keys, alpha=factor).float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.bmm(probs, value.reshape(-1, other, value.size(-1))).reshape(*batch, length, value.size(-1))


def _additive_bias(
    attn_mask: torch.Tensor | None, is_causal: bool, length: int, other: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """What the mask and the causal triangle add to the scores, in ``dtype``: 0 where a key is seen,
    -inf where a boolean mask or the triangle hides it (as SDPA); a float mask as given, its values
    below ``dtype``'s range held at its lowest finite value (a float32 minimum would round to -inf)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(~attn_mask, float("-inf"))
        else:
            bias = attn_mask.clamp(min=torch.finfo(dtype).min).to(dtype)
    if is_causal:
        hidden = ~torch.ones(length, other, dtype=torch.bool, device=device).tril()
        causal = torch.zeros(length, other, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))
        bias = causal if bias is None else bias + causal
    return bias
