"""``tk debug locate``'s ONNX reader: each module's last value in a copy of the graph with those values added as
outputs, run by onnxruntime.

A node's module comes from the dynamo exporter's scope metadata; a module's value is the last one computed
inside it with the shape its float32 output has. Two rewrites of onnxruntime's fusions are undone: a product
whose bias a fusion adds outside it (BiasGelu, SkipLayerNormalization rewritten as Sum) gets its bias back,
and a module whose own output was fused away (a residual add moved into the next layer norm), so that its
last value is a submodule's output that differs from its own, is left unmatched rather than compared.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from tk.manifest import Manifest, read_verified
from tk.safefiles import private_copy


def linear_biases(model: Any) -> dict[str, np.ndarray]:
    """Each ``nn.Linear``'s bias by module path (float32), for products whose bias a fusion moved out of them."""
    return {
        name: module.bias.detach().float().cpu().numpy()
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.bias is not None
    }


# a product without its bias: onnxruntime's fusions (BiasGelu, SkipLayerNormalization, Sum) add a Linear's bias
# in a node outside the Linear's scope, so the Linear's last value is its product alone
BIASLESS_PRODUCTS = ("MatMul", "MatMulNBits", "MatMulInteger", "FusedMatMul", "DynamicQuantizeMatMul")


def onnx_values(
    root: Path,
    manifest: Manifest,
    feeds: Mapping[str, np.ndarray],
    records: Mapping[str, Any],
    biases: Mapping[str, np.ndarray] | None = None,
    *,
    wrapped: bool = False,
) -> dict[str, np.ndarray]:
    """Each module's value in the graph (see the module docstring); ``records``: locate's ``ModuleRecord`` of each
    module (its float32 ``output``); ``wrapped``: captured through tk's
    reduced-precision wrapper, whose module paths start with ``module.``."""
    import onnx_ir as ir
    import onnxruntime as ort

    from tk.formats.onnx_scopes import node_modules

    entries = [manifest.file("onnx"), *(e for e in manifest.files if e.role == "onnx-data")]
    with private_copy({e.path: read_verified(root, e) for e in entries}) as verified:  # the bytes that were hashed
        model = ir.load(verified / entries[0].path)
        for value in model.graph.initializers.values():  # read external data now, before the copy goes
            if value.const_value is not None:
                value.const_value = ir.Tensor(value.const_value.numpy())
    per_module: dict[str, list[Any]] = {}
    producers: dict[str, str] = {}
    owners: dict[str, str] = {}  # value -> the innermost module whose node computed it
    for node in model.graph:  # top-level nodes in graph (topological) order
        scopes = node_modules(dict(node.metadata_props), wrapped=wrapped)
        for value in node.outputs:
            producers[value.name] = node.op_type
            if scopes:
                owners[value.name] = scopes[-1]
        for module in scopes:
            if module in records:
                per_module.setdefault(module, []).extend(node.outputs)
    existing = {v.name for v in model.graph.outputs}
    added: dict[str, list[str]] = {}
    for module, values in per_module.items():
        tail = [v for v in values if v.name and v.type is not None][-4:]  # the module's output is among its last values
        added[module] = [v.name for v in tail]
        for v in tail:
            if v.name not in existing:
                model.graph.outputs.append(v)
                existing.add(v.name)
    with tempfile.TemporaryDirectory(prefix="tk-locate-") as tmp:
        copy = Path(tmp) / "model.onnx"
        ir.save(model, copy)
        session = ort.InferenceSession(str(copy), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        results = dict(zip(names, session.run(names, {k: np.asarray(v) for k, v in feeds.items()}), strict=True))
    return {
        module: picked
        for module, value_names in added.items()
        if (picked := _module_value(module, value_names, results, records, owners, producers, biases or {})) is not None
    }


def _module_value(module: str, value_names: list[str], results: Mapping[str, np.ndarray],
                  records: Mapping[str, Any], owners: Mapping[str, str], producers: Mapping[str, str],
                  biases: Mapping[str, np.ndarray]) -> np.ndarray | None:  # fmt: skip
    """``module``'s output: its last value of the float32 output's shape, its bias added back where a fusion
    moved it out; None where that value is a submodule's output that differs from the module's own."""
    want = records[module].output.shape
    for name in reversed(value_names):
        value = results.get(name)
        if value is None or value.shape != want or not np.issubdtype(value.dtype, np.floating):
            continue
        owner = owners.get(name, module)
        if owner != module and owner in records and not _same(records[owner].output, records[module].output):
            return None  # the module's own output was fused away (a residual add moved into the next node)
        bias = biases.get(owner)
        if bias is not None and producers.get(name) in BIASLESS_PRODUCTS and bias.shape == want[-1:]:
            return value.astype(np.float32) + bias
        return value.astype(np.float32)
    return None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a submodule's float32 output is its parent's too (a wrapper such as a feed-forward's last product)."""
    return a.shape == b.shape and bool(np.array_equal(a, b))
