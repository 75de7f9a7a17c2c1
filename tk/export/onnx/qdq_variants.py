"""Variants of one quantized QDQ graph with some of its quantized nodes back in float32.

The static int8 search needs the graph with one layer quantized (to rank layers) and with a few
left out (each round). Asking onnxruntime's ``quantize_static`` for each took one pass over the
whole model apiece (17 + rounds on the small Transformer: most of a 153 s search); every such graph
is the one fully quantized graph with some nodes' inputs read from their float32 sources again,
the same ranges, the same weights. So each variant is made here from the fully quantized graph and
the float32 one: the chosen nodes take their float32 inputs back (the activation before its
QuantizeLinear, the float32 weight and bias initializers), and the QuantizeLinear/DequantizeLinear
nodes and quantized initializers no node reads any more are dropped.

An activation is quantized once for all its readers: where a layer's input also feeds a node that
is not quantized (a post-LayerNorm encoder's residual reads the FFN's input), that node reads the
dequantized tensor too. ``quantize_static`` asked without the layer would not quantize the tensor
at all, so once no quantized node reads a dequantized activation, every reader takes the float32
tensor back (without this, MiniLM's search failed: benchmarks/history.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


class QdqVariants:
    """``quantized`` (a QDQ ``onnx.ModelProto`` from ``quantize_static``) and ``source`` (the float32
    graph it was quantized from, same node names): ``with_float(nodes)`` serializes the quantized
    graph with ``nodes`` reading their float32 inputs again."""

    def __init__(self, quantized: Any, source: Any, quantized_nodes: Iterable[str] | None = None) -> None:
        self.quantized = quantized
        self.float_inputs = {n.name: list(n.input) for n in source.graph.node if n.name}
        self.float_initializers = {i.name: i for i in source.graph.initializer}
        # the nodes quantize_static was asked for (default: every node that reads a dequantized tensor)
        dequantized = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        readers = {n.name for n in quantized.graph.node if n.name and any(i in dequantized for i in n.input)}
        self.quantized_nodes = set(quantized_nodes) if quantized_nodes is not None else readers

    def with_float(self, nodes: Iterable[str]) -> bytes:
        import onnx

        restore = set(nodes)
        unknown = restore - self.float_inputs.keys()
        if unknown:
            raise KeyError(f"nodes not in the float32 graph: {sorted(unknown)[:5]}")
        model = onnx.ModelProto()
        model.CopyFrom(self.quantized)
        graph = model.graph
        present = {i.name for i in graph.initializer}
        produced = {name for node in graph.node for name in node.output}
        for node in graph.node:
            if node.name not in restore:
                continue
            inputs = []
            for name in self.float_inputs[node.name]:
                if name in self.float_initializers:
                    # the quantizer may name a DequantizeLinear's output after the float tensor it replaced
                    # (a Gemm's bias): the float32 value then enters under a name of its own
                    renamed = f"{name}_float32" if name in produced else name
                    if renamed not in present:
                        initializer = onnx.TensorProto()
                        initializer.CopyFrom(self.float_initializers[name])
                        initializer.name = renamed
                        graph.initializer.append(initializer)
                        present.add(renamed)
                    name = renamed
                inputs.append(name)
            del node.input[:]
            node.input.extend(inputs)
        _unquantize_orphans(graph, self.quantized_nodes - restore)
        _drop_unread(graph)
        return model.SerializeToString()


def _unquantize_orphans(graph: Any, quantized: set[str]) -> None:
    """Every reader of a dequantized activation that no node of ``quantized`` reads takes the float32
    tensor back (the input of the QuantizeLinear before it)."""
    quantize_input = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "QuantizeLinear"}
    float_of = {
        n.output[0]: quantize_input[n.input[0]]
        for n in graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in quantize_input
    }
    still_read = {i for n in graph.node if n.name in quantized for i in n.input if i in float_of}
    for node in graph.node:
        if node.op_type in QDQ_OPS:
            continue
        for index, name in enumerate(node.input):
            if name in float_of and name not in still_read:
                node.input[index] = float_of[name]


def _drop_unread(graph: Any) -> None:
    """Remove Q/DQ nodes whose outputs nothing reads (repeatedly: a DequantizeLinear's QuantizeLinear
    goes with it), then initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if n.op_type in QDQ_OPS and not any(o in read for o in n.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = {name for node in graph.node for name in node.input} | outputs
    for init in [i for i in graph.initializer if i.name not in read]:
        graph.initializer.remove(init)
