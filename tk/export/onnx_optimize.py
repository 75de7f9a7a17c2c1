"""onnxruntime's transformer fusions applied to the dynamo exporter's ONNX graph.

``onnxscript.rewriter.ort_fusions.optimize_for_ort`` rewrites the exporter's decomposed
LayerNorm + residual, GELU + bias and attention subgraphs into onnxruntime's contrib operators
(``SkipLayerNormalization``, ``BiasGelu``, ``MultiHeadAttention``/``Attention``...). We chose it
over ``onnxruntime.transformers.optimizer`` because the latter does not recognise attention or
embeddings in dynamo-exported graphs (see the README's performance section for the counts).

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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "applied": self.applied,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "fusions": self.fusions,
            "fused_ops": self.fused_ops,
        }
        if self.max_abs_diff is not None:
            out["max_abs_diff"] = self.max_abs_diff
        if self.reason:
            out["reason"] = self.reason
        return out


def fused_op_counts(model: Any) -> dict[str, int]:
    """Count of each onnxruntime contrib (``com.microsoft``) operator in an ``onnx_ir`` model's main graph."""
    counts = Counter(n.op_type for n in model.graph if n.domain == CONTRIB_DOMAIN)
    return dict(sorted(counts.items()))


def optimized_onnx_from_onnx(source: Path, target: Path) -> tuple[int, int, dict[str, int], dict[str, int]]:
    """Write ``source`` with onnxruntime's transformer fusions at ``target``.

    Returns (nodes before, nodes after, applied fusions, contrib operator counts).
    """
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.load(source)
    before = len(model.graph)
    model, counts = optimize_for_ort(model)
    ir.save(model, target)
    fusions = {k: int(v) for k, v in counts.items() if v}
    return before, len(model.graph), fusions, fused_op_counts(model)


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


def optimize_onnx_in_place(path: Path, feeds: dict[str, np.ndarray]) -> OptimizeResult:
    """Fuse the graph at ``path``; keep the fused one only if it matches the unfused one on ``feeds``."""
    fused = path.with_name(".fused." + path.name)
    try:
        before, after, fusions, ops = optimized_onnx_from_onnx(path, fused)
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
    return OptimizeResult(True, before, after, fusions, ops, diff)
