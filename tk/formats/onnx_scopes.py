"""Which of the user's modules an ONNX node comes from, read from the dynamo exporter's metadata.

torch.onnx (dynamo) writes each node's module scopes into its ``metadata_props``
(``pkg.torch.onnx.name_scopes``: the root, each enclosing module path, then the node's own
name). ``tk debug locate`` uses them to compare an ONNX graph module by module, and int8 export
uses them to leave the nodes of ``--keep-fp32`` modules unquantized.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
WRAPPER = "module"  # the attribute under which tk's reduced-precision wrapper holds the user's model


def node_modules(metadata: dict[str, str], *, wrapped: bool) -> list[str]:
    """The module paths enclosing a node, outermost first, as the user's model names them.

    ``wrapped``: the graph was captured through tk's reduced-precision wrapper (fp16/bf16), whose
    ``module.`` prefix is removed.
    """
    text = metadata.get(SCOPES_KEY)
    if not text:
        return []
    try:
        scopes = ast.literal_eval(text)  # a Python list literal of strings; never evaluated as code
    except (ValueError, SyntaxError):
        return []
    if not isinstance(scopes, list) or len(scopes) < 2:
        return []
    paths = [str(s) for s in scopes[1:-1]]  # drop the root ('') and the node's own name
    if wrapped:
        paths = [p[len(WRAPPER) + 1 :] for p in paths if p.startswith(WRAPPER + ".")]
    return paths


def proto_metadata(node: Any) -> dict[str, str]:
    """``metadata_props`` of an ``onnx.NodeProto`` as a dict."""
    return {p.key: p.value for p in node.metadata_props}


def nodes_in_modules(model: Any, modules: Iterable[str], *, wrapped: bool = False) -> list[str]:
    """Names of the nodes of ``model`` (an ``onnx.ModelProto``) inside any of ``modules`` (or their submodules)."""
    wanted = tuple(modules)
    names = []
    for node in model.graph.node:
        paths = node_modules(proto_metadata(node), wrapped=wrapped)
        if any(p == m or p.startswith(m + ".") for p in paths for m in wanted):
            names.append(node.name)
    return names
