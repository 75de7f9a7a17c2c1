"""What int8 costs each layer, from one calibrated PT2E program: the SQNR of the layer's own output
when its input and weight are rounded the way the calibrated observers say, its input taken from the
float32 program.

Why local and not "the model's SQNR with only this layer quantized": that measure prepares,
calibrates, converts and runs the whole program once per layer (49 times on the base Transformer,
with histogram observers: its export was stopped after 36 minutes in that ranking and the rounds
after it; the small one's export took 89 s with it, 62 s with this). This one runs the calibration
batches once more through the already calibrated program. Both rank the
layers whose input has outliers (the ones per-tensor uint8 rounds coarsely) first; the exclusion
rounds that follow (``tk.export.calibration.exclude_costliest``) judge the whole program either way.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module (``blocks.0.attn.qkv``) a node of a captured program was called in."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def local_sqnr_db(
    prepared: torch.fx.GraphModule,
    batches: Iterable[tuple[torch.Tensor, ...]],
    targets: Sequence[Any],
    modules: Sequence[str],
) -> dict[str, float]:
    """Each of ``modules``' SQNR (dB, over all ``batches``; the worst of its nodes) of its ``targets``
    nodes' outputs with the observed input and weight fake-quantized, against their float outputs.

    ``prepared``: the program after ``prepare_pt2e`` and calibration, so each quantized node's first
    two arguments are its input's and weight's observers. The observers pass values through
    unchanged here (their statistics are read first and not updated)."""
    from torchao.quantization.pt2e.observer import ObserverBase  # the observers prepare_pt2e inserts

    wanted = set(modules)
    observers = {name: mod for name, mod in prepared.named_modules() if isinstance(mod, ObserverBase)}
    qparams = {name: obs.calculate_qparams() for name, obs in observers.items()}
    probed: dict[torch.fx.Node, str] = {}
    for node in prepared.graph.nodes:
        path = module_path(node)
        if node.op == "call_function" and node.target in targets and path in wanted and _observed(node, observers):
            probed[node] = path
    signal: dict[torch.fx.Node, float] = defaultdict(float)
    noise: dict[torch.fx.Node, float] = defaultdict(float)

    class Probe(torch.fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            return args[0] if target in observers else super().call_module(target, args, kwargs)

        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n in probed:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                x_obs, w_obs = n.args[0].target, n.args[1].target
                rounded = (
                    _fake_quant(args[0], observers[x_obs], qparams[x_obs]),
                    _fake_quant(args[1], observers[w_obs], qparams[w_obs]),
                    *args[2:],
                )
                ref = out.double()
                signal[n] += float((ref**2).sum())
                noise[n] += float(((ref - n.target(*rounded, **kwargs).double()) ** 2).sum())
            return out

    with torch.no_grad():
        for args in batches:
            Probe(prepared).run(*args)
    costs: dict[str, float] = {}
    for node, path in probed.items():
        db = math.inf if noise[node] == 0 else 10 * math.log10(max(signal[node], 1e-300) / noise[node])
        costs[path] = min(costs.get(path, math.inf), db)
    return costs


def _observed(node: torch.fx.Node, observers: dict[str, Any]) -> bool:
    return len(node.args) >= 2 and all(
        isinstance(a, torch.fx.Node) and a.op == "call_module" and a.target in observers for a in node.args[:2]
    )


def _fake_quant(value: torch.Tensor, observer: Any, qparams: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    scale, zero_point = qparams
    low, high = int(observer.quant_min), int(observer.quant_max)
    if scale.numel() == 1:
        return torch.fake_quantize_per_tensor_affine(value, float(scale), int(zero_point), low, high)
    axis = int(observer.ch_axis)
    return torch.fake_quantize_per_channel_affine(value, scale.float(), zero_point.to(torch.int32), axis, low, high)
