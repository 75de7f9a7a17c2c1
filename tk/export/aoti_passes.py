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
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


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
