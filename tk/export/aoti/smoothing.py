"""SmoothQuant-style smoothing of a captured program's linears before per-tensor int8 activations.

Transformer activations carry a few channels far larger than the rest (Hugging Face's MiniLM: a
channel near 30 where the median channel peaks near 2, at the inputs of every attention block), and
per-tensor int8 spends its steps on them. Smoothing divides each input channel ``j`` of a linear by
``s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)`` and multiplies the weight's column ``j`` by it, which
leaves the float product unchanged and moves the range from the activation, quantized per tensor,
into the weight, quantized per output channel (Xiao et al., SmoothQuant, 2023).

The division is a ``mul`` by a constant inserted before the linears of one input (q, k and v share
one, their columns scaled by the largest of their three weights), not folded into a LayerNorm: a
post-norm encoder (BERT) also adds that LayerNorm's output to its residual, which must not change.
Inductor fuses the ``mul`` into the kernel that quantizes the activation, except where the activation is
a GELU's or ReLU's output: there the ``mul`` sits between the unary and the quantize that torchao's x86
fusion folds into the linear before it (``qlinear`` + unary + quantize), and MiniLM's smoothed all-int8
package ran each feed-forward's GELU in a kernel of its own on a float32 output, slower than with those
inputs left as captured (benchmarks/history.md): ``plan_smoothing(after_unary=False)`` leaves them.
Written here rather than taken from a library: torchao's SmoothQuant is for its eager ``quantize_``
flow, onnxruntime's needs Intel Neural Compressor, and NNCF's runs on its own graphs; this one works on
the PT2E program the x86 quantizer annotates. Whether it helps is measured per model (``tk.export.aoti.int8``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

LINEAR = torch.ops.aten.linear.default
# what torchao's x86 fusions fold, with the quantize after it, into the int8 linear that feeds them
FUSED_UNARY = (torch.ops.aten.gelu.default, torch.ops.aten.relu.default)
SMOOTHING_PREFIX = "_tk_smooth_"


@dataclass(frozen=True)
class SmoothedInput:
    """One activation and the linears that read it: its node's name, theirs, and the per-channel scale."""

    input_node: str
    linears: tuple[str, ...]
    scale: torch.Tensor  # s: the input is divided by it, the weights' columns multiplied


@dataclass(frozen=True)
class SmoothingPlan:
    alpha: float
    inputs: tuple[SmoothedInput, ...]
    weights: dict[str, torch.Tensor]  # the linears' weight attribute -> the scaled weight (computed once)
    after_unary: bool = True  # whether the inputs that are a FUSED_UNARY's output are smoothed

    @property
    def name(self) -> str:
        """How the manifest and the log name it: the alpha, and where a ``FUSED_UNARY``'s output is left."""
        return f"{self.alpha:g}" if self.after_unary else f"{self.alpha:g} not after a unary"


def _linear_groups(module: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Input node -> the linears reading it whose weight is a constant of the module."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target == LINEAR and len(node.args) >= 2:
            x, weight = node.args[0], node.args[1]
            if isinstance(x, torch.fx.Node) and isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
                groups.setdefault(x, []).append(node)
    return groups


def _attr(module: torch.nn.Module, target: str) -> torch.Tensor:
    owner, _, leaf = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def input_channel_maxima(
    module: torch.fx.GraphModule, batches: Iterable[tuple[torch.Tensor, ...]]
) -> dict[str, torch.Tensor]:
    """Each linear input's largest magnitude per channel (its last axis) over ``batches``, by node name."""
    watched = set(_linear_groups(module))
    maxima: dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            if n in watched and isinstance(out, torch.Tensor) and out.is_floating_point():
                seen = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).float()
                maxima[n.name] = torch.maximum(maxima[n.name], seen) if n.name in maxima else seen
            return out

    with torch.no_grad():
        for args in batches:
            Recorder(module).run(*args)
    return maxima


def plan_smoothing(
    module: torch.fx.GraphModule, batches: Iterable[tuple[torch.Tensor, ...]], alpha: float,
    *, after_unary: bool = True, maxima: dict[str, torch.Tensor] | None = None,
) -> SmoothingPlan:  # fmt: skip
    """Scales for every linear input of ``module`` (a program's module, float32) from ``batches``; without
    ``after_unary``, not for the inputs that are a ``FUSED_UNARY``'s output. ``maxima``: the inputs'
    ``input_channel_maxima`` over ``batches`` where the caller has them (one pass serves every alpha)."""
    maxima = input_channel_maxima(module, batches) if maxima is None else maxima
    inputs, weights = [], {}
    for x, linears in _linear_groups(module).items():
        if x.name not in maxima or (not after_unary and x.target in FUSED_UNARY):
            continue
        columns = [_attr(module, str(lin.args[1].target)).detach().float() for lin in linears]  # type: ignore[union-attr]
        if any(w.ndim != 2 or w.shape[1] != maxima[x.name].numel() for w in columns):
            continue
        w_max = torch.stack([w.abs().amax(0) for w in columns]).amax(0)
        a_max = maxima[x.name]
        scale = (a_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(1e-3, 1e3)
        scale = torch.where((a_max > 0) & (w_max > 0), scale, torch.ones_like(scale))
        for lin, w in zip(linears, columns, strict=True):
            weights[str(lin.args[1].target)] = (w * scale).contiguous()  # type: ignore[union-attr]
        inputs.append(SmoothedInput(x.name, tuple(lin.name for lin in linears), scale))
    return SmoothingPlan(alpha, tuple(inputs), weights, after_unary)


def apply_smoothing(module: torch.fx.GraphModule, plan: SmoothingPlan) -> torch.fx.GraphModule:
    """``module`` (a fresh module of the planned program) with ``plan``'s scales, in place."""
    nodes = {n.name: n for n in module.graph.nodes}
    graph = module.graph
    for target, weight in plan.weights.items():
        owner, _, leaf = target.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        setattr(holder, leaf, torch.nn.Parameter(weight, requires_grad=False))
    for i, entry in enumerate(plan.inputs):
        x = nodes[entry.input_node]
        name = f"{SMOOTHING_PREFIX}{i}"
        module.register_buffer(
            name, (1.0 / entry.scale).to(x.meta["val"].dtype) if "val" in x.meta else 1.0 / entry.scale
        )
        with graph.inserting_after(x):
            inverse = graph.get_attr(name)
        with graph.inserting_after(inverse):
            smoothed = graph.call_function(torch.ops.aten.mul.Tensor, (x, inverse))
        # the quantizer reads shapes from meta["val"]; a real (not fake) tensor on the constant keeps its
        # mul out of the x86 quantizer's int8 mul annotation, so only the linears' inputs are quantized
        inverse.meta["val"] = getattr(module, name)
        if "val" in x.meta:
            smoothed.meta["val"] = x.meta["val"]
        for lin in entry.linears:
            node = nodes[lin]
            node.args = (smoothed, *node.args[1:])
    graph.lint()
    module.recompile()
    return module
