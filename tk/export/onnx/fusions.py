"""onnxruntime's transformer fusions applied to the dynamo exporter's ONNX graph.

``onnxscript.rewriter.ort_fusions.optimize_for_ort`` rewrites the exporter's decomposed
LayerNorm + residual, GELU + bias and attention subgraphs into onnxruntime's contrib operators
(``SkipLayerNormalization``, ``BiasGelu``, ``MultiHeadAttention``/``Attention``...). We chose it
over ``onnxruntime.transformers.optimizer`` because the latter does not recognise attention or
embeddings in dynamo-exported graphs (docs/int8-and-hf.md; the counts in benchmarks/history.md).

For onnxruntime's CPU provider (the default), the residual sums then go back to standard
``Sum`` + ``LayerNormalization`` (``layer_norms_for_cpu``): onnxruntime 1.32's CPU
``SkipLayerNormalization`` kernel is a scalar loop, several times slower than ``Add`` +
``LayerNormalization`` (measured in benchmarks/history.md), which made tk's fused all-MiniLM-L6-v2
slower than Optimum's unfused export. ``Sum`` rather than ``Add``
because onnxruntime's own session-level ``SkipLayerNormFusion`` matches ``Add`` -> ``LayerNormalization``
and would fuse it back. CUDA exports keep ``SkipLayerNormalization`` (a fused kernel there).

The fused graph is verified against the unfused one on the export's example inputs before it
replaces it; when it differs by more than ``VERIFY_ATOL`` (or fusion fails), the unfused graph
ships and the manifest says why. The export check then runs on whatever ships.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import first_line

log = logging.getLogger("tk.export")

VERIFY_ATOL = 1e-4  # fused vs unfused graph, float32, on the example inputs
CONTRIB_DOMAIN = "com.microsoft"


@dataclass
class OptimizeResult:
    applied: bool  # whether the fused graph replaced the source
    nodes_before: int
    nodes_after: int
    fusions: dict[str, int] = field(default_factory=dict)  # rule name -> times applied (non-zero only)
    fused_ops: dict[str, int] = field(default_factory=dict)  # com.microsoft operator -> count in the graph
    max_abs_diff: float | None = None  # fused vs unfused on the example inputs
    reason: str | None = None  # why the unfused graph ships
    cpu_rewrites: dict[str, int] = field(default_factory=dict)  # layer_norms_for_cpu's counts (non-zero only)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "applied": self.applied,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "fusions": self.fusions,
            "fused_ops": self.fused_ops,
        }
        if self.cpu_rewrites:
            out["cpu_rewrites"] = self.cpu_rewrites
        if self.max_abs_diff is not None:
            out["max_abs_diff"] = self.max_abs_diff
        if self.reason:
            out["reason"] = self.reason
        return out


def fused_op_counts(model: Any) -> dict[str, int]:
    """Count of each onnxruntime contrib (``com.microsoft``) operator in an ``onnx_ir`` model's main graph."""
    counts = Counter(n.op_type for n in model.graph if n.domain == CONTRIB_DOMAIN)
    return dict(sorted(counts.items()))


def layer_norms_for_cpu(model: Any) -> dict[str, int]:
    """Rewrite an ``onnx_ir`` model's residual LayerNorms into the form onnxruntime's CPU runs fastest.

    Each ``SkipLayerNormalization(x, skip, gamma[, beta[, bias]])`` becomes
    ``LayerNormalization(Sum(Add(x, bias), skip), gamma[, beta])`` (its ``x + skip + bias`` output,
    when used, is the ``Sum``), and each remaining ``Add`` whose only use is a ``LayerNormalization`` becomes
    a ``Sum``, so onnxruntime's session-level ``SkipLayerNormFusion`` (which matches ``Add``) leaves
    them alone. A ``SkipLayerNormalization`` whose mean or inverse-deviation outputs are used stays.

    Returns {"skip_layer_norm_to_sum_layer_norm": n, "add_to_sum_before_layer_norm": m}.
    """
    import onnx_ir as ir

    graph = model.graph
    undone = 0
    for node in list(graph):
        if node.domain != CONTRIB_DOMAIN or node.op_type != "SkipLayerNormalization":
            continue
        outputs = list(node.outputs)
        if any(o.uses() or o.is_graph_output() for o in outputs[1:3]):
            continue
        inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
        x, skip, gamma, beta, bias = inputs[:5]
        new_nodes = []
        if bias is not None:  # Add first: Sum(x, skip, bias) cost ~3% more CPU per run (MiniLM, 8 x 128)
            new_nodes.append(ir.Node("", "Add", [x, bias], num_outputs=1))
            x = new_nodes[-1].outputs[0]
        total = ir.Node("", "Sum", [x, skip], num_outputs=1)
        epsilon = node.attributes.get_float("epsilon", 1e-12)  # onnxruntime's default for this operator
        norm = ir.Node(
            "",
            "LayerNormalization",
            [total.outputs[0], gamma] + ([beta] if beta is not None else []),
            attributes=[ir.AttrFloat32("epsilon", epsilon), ir.AttrInt64("axis", -1)],
            num_outputs=1,
        )
        old, new = [outputs[0]], [norm.outputs[0]]
        if len(outputs) > 3 and (outputs[3].uses() or outputs[3].is_graph_output()):
            old.append(outputs[3])
            new.append(total.outputs[0])
        ir.convenience.replace_nodes_and_values(graph, node, [node], [*new_nodes, total, norm], old, new)
        undone += 1
    renamed = 0
    for node in graph:
        if node.domain != "" or node.op_type != "LayerNormalization" or node.inputs[0] is None:
            continue
        add = node.inputs[0].producer()
        if add is not None and add.domain == "" and add.op_type == "Add" and len(node.inputs[0].uses()) == 1:
            if not node.inputs[0].is_graph_output():
                add.op_type = "Sum"  # same values: Sum broadcasts like Add
                renamed += 1
    counts = {"skip_layer_norm_to_sum_layer_norm": undone, "add_to_sum_before_layer_norm": renamed}
    return {k: v for k, v in counts.items() if v}


def optimized_onnx_from_onnx(
    source: Path, target: Path, *, for_cpu: bool = True
) -> tuple[int, int, dict[str, int], dict[str, int], dict[str, int]]:
    """Write ``source`` with onnxruntime's transformer fusions at ``target``.

    ``for_cpu`` (default True): also ``layer_norms_for_cpu``. Returns (nodes before, nodes after,
    applied fusions, contrib operator counts, CPU rewrites).
    """
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.load(source)
    before = len(model.graph)
    model, counts = optimize_for_ort(model)
    rewrites = layer_norms_for_cpu(model) if for_cpu else {}
    ir.save(model, target)
    fusions = {k: int(v) for k, v in counts.items() if v}
    return before, len(model.graph), fusions, fused_op_counts(model), rewrites


def _max_abs_diff(a: Path, b: Path, feeds: dict[str, np.ndarray]) -> float:
    import onnxruntime as ort

    def run(path: Path) -> list[np.ndarray]:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)

    return max(
        float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
        for x, y in zip(run(a), run(b), strict=True)
    )


def optimize_onnx_in_place(path: Path, feeds: dict[str, np.ndarray], *, for_cpu: bool = True) -> OptimizeResult:
    """Fuse the graph at ``path``; keep the fused one only if it matches the unfused one on ``feeds``.

    ``for_cpu``: rewrite the residual LayerNorms for onnxruntime's CPU provider (``layer_norms_for_cpu``);
    default True.
    """
    fused = path.with_name(".fused." + path.name)
    try:
        before, after, fusions, ops, rewrites = optimized_onnx_from_onnx(path, fused, for_cpu=for_cpu)
    except Exception as exc:  # the rewriter raises many types; the unfused graph still works
        fused.unlink(missing_ok=True)
        log.info("export fuse   skipped: %s", first_line(exc))
        return OptimizeResult(False, 0, 0, reason=f"fusion failed: {type(exc).__name__}: {first_line(exc)}")
    if not fusions:
        fused.unlink(missing_ok=True)
        return OptimizeResult(False, before, before, reason="no fusion applies to this graph")
    try:
        diff = _max_abs_diff(path, fused, feeds)
    except Exception as exc:  # onnxruntime refuses the fused graph: ship the unfused one
        fused.unlink(missing_ok=True)
        return OptimizeResult(
            False, before, after, fusions, ops, reason=f"onnxruntime cannot run the fused graph: {first_line(exc)}"
        )
    if not diff <= VERIFY_ATOL:
        fused.unlink(missing_ok=True)
        return OptimizeResult(
            False, before, after, fusions, ops, diff, f"fused graph differs by {diff:.2e} > {VERIFY_ATOL:g}"
        )
    fused.replace(path)
    return OptimizeResult(True, before, after, fusions, ops, diff, cpu_rewrites=rewrites)
