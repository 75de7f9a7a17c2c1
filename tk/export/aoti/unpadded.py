"""Padding removed between attentions: a program's per-token work run on its real tokens only.

A batch of texts is padded to its longest, and an encoder's linears, LayerNorms and activations then
run on every position, padding included, though nothing reads what they compute there: the attention
mask hides padded keys, and tk compares outputs at real tokens only (``tk.comparison.padding_positions``).
``padding_removed`` rewrites a program with an attention mask so that, from the first linear on, each
per-token tensor is held as its real tokens only (``index_select`` of the mask's nonzero positions, a
size known at run time) and is scattered back to the padded layout only where an operation mixes
positions (the attention, a pooling, the outputs), with zeros at the padding. This is the "remove
padding" of FasterTransformer and TensorRT's variable-length BERT, done on the captured graph: the
products are the same rows as before, fewer of them.

A node is run on real tokens when it is per-token (``_PER_TOKEN``: linears, LayerNorm, activations,
elementwise arithmetic, casts) and its output is laid out (batch, seq, ...) with the mask's two sizes;
a view keeping those two leading sizes stays packed; anything else gets its inputs scattered back.
Operands laid out (batch, seq, ...) or (1, seq, ...) are gathered, operands over trailing dimensions
only are used as they are, and any other operand sends the node back to the padded layout. What changes
is the values at padding positions (zeros where the padded layout is rebuilt), so a real token keeps its
values only where nothing it reads comes from a padding position, as under an attention mask that hides
padded keys: the packed module is run against the program on the example inputs with padding before it
is used (``_same_at_real_tokens``), and the export check compares the package with PyTorch at real
tokens as for any package.

Where batches are padded the linears' work shrinks with the padding; with none the gathers and scatters
cost a few percent. Measurements: benchmarks/history.md ("padding removed between attentions").
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.fx import Interpreter, Node
from torch.fx.node import map_aggregate

from tk.errors import first_line
from tk.export.capture import Dim, exported_program_from_module
from tk.spec import Signature

log = logging.getLogger("tk")
PADDING_REMOVED = "tk.export.aoti.unpadded.padding_removed/1"

_aten = torch.ops.aten
_PER_TOKEN = {
    _aten.linear.default,
    _aten.layer_norm.default,
    _aten.gelu.default,
    _aten.relu.default,
    _aten.silu.default,
    _aten.tanh.default,
    _aten.sigmoid.default,
    _aten.add.Tensor,
    _aten.sub.Tensor,
    _aten.mul.Tensor,
    _aten.div.Tensor,
    _aten.dropout.default,
    _aten.to.dtype,
    _aten.clone.default,
    _aten.contiguous.default,
}
# where a token's rows start running packed: a linear, or the quantize before an int8 linear, so that the
# quantize -> dequantize -> linear chain Inductor lowers to one int8 linear stays whole
_STARTS = {_aten.linear.default}


def _quantize_ops() -> tuple[Any, Any]:
    """An int8 program's per-tensor quantize and dequantize (None, None where torch has not loaded them:
    the program then has none)."""
    ops = torch.ops.quantized_decomposed
    try:
        return ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default
    except AttributeError:
        return None, None


_VIEWS = {_aten.view.default, _aten.reshape.default}
_ATOL, _RTOL = 1e-3, 1e-2  # of the largest reference value: the same rows computed in fewer, bit for bit here


class _Packed:
    """A per-token tensor held as its real tokens: (tokens, ...) for a (batch, seq, ...) value."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _size(value: Any) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else value


class _Packing(Interpreter):
    """Runs the program's graph with per-token tensors packed (see the module's docstring)."""

    def __init__(self, module: torch.fx.GraphModule, batch: Any, seq: Any, mask_index: int) -> None:
        super().__init__(module)
        self.batch, self.seq, self.mask_index = batch, seq, mask_index
        quantize, dequantize = _quantize_ops()
        self.quantizing = {quantize, dequantize} - {None}
        self.per_token, self.starts = _PER_TOKEN | self.quantizing, _STARTS | ({quantize} - {None})

    def run(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        mask = args[self.mask_index]
        self.sizes = mask.shape
        self.real = mask.reshape(-1).nonzero().squeeze(1)  # the real tokens' positions in batch * seq
        self.gathered: dict[Node, torch.Tensor] = {}
        self.scattered: dict[Node, torch.Tensor] = {}
        return super().run(*args, **kwargs)

    def layout(self, node: Any) -> str | None:
        """ "tokens" for a (batch, seq, ...) value, "seq" for (1, seq, ...), else None."""
        value = node.meta.get("val") if isinstance(node, Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or _size(value.shape[1]) != self.seq:
            return None
        first = _size(value.shape[0])
        return "tokens" if first == self.batch else "seq" if first == 1 else None

    def gather(self, node: Node, value: torch.Tensor) -> torch.Tensor:
        if node not in self.gathered:
            if self.layout(node) == "seq":
                value = value.expand(self.sizes[0], *value.shape[1:])
            rows = value.reshape(self.sizes[0] * self.sizes[1], *value.shape[2:])
            self.gathered[node] = rows.index_select(0, self.real)
        return self.gathered[node]

    def scatter(self, node: Node, packed: _Packed) -> torch.Tensor:
        if node not in self.scattered:
            rows = packed.tensor
            full = rows.new_zeros(self.sizes[0] * self.sizes[1], *rows.shape[1:]).index_copy(0, self.real, rows)
            self.scattered[node] = full.view(*self.sizes, *rows.shape[1:])
        return self.scattered[node]

    def run_node(self, n: Node) -> Any:
        if n.op not in ("call_function", "output"):
            return super().run_node(n)
        if n.target is _aten._assert_tensor_metadata.default:
            return None  # it asserts the padded layout; the export check compares the whole package
        packed = self._packed(n)
        if packed is not None:
            return packed

        def padded(a: Any) -> Any:
            if not isinstance(a, Node):
                return a
            value = self.env[a]
            return self.scatter(a, value) if isinstance(value, _Packed) else value

        args, kwargs = map_aggregate(n.args, padded), map_aggregate(n.kwargs, padded)
        if n.op == "output":
            return args[0]
        return n.target(*args, **kwargs)  # type: ignore[operator]

    def _packed(self, n: Node) -> _Packed | None:
        """``n`` run on real tokens, or None where it must see the padded layout."""
        if self.layout(n) != "tokens":
            return None
        inputs = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node)]
        any_packed = any(isinstance(self.env[a], _Packed) for a in inputs)
        if n.target in _VIEWS and isinstance(self.env[n.args[0]], _Packed):
            trailing = [int(s) for s in n.meta["val"].shape[2:]]
            return _Packed(self.env[n.args[0]].tensor.reshape(-1, *trailing))
        first = n.args[0] if n.args else None
        starts = n.target in self.starts and self.layout(first) is not None
        if n.target not in self.per_token or not (any_packed or starts):
            return None
        trailing_dims = n.meta["val"].dim() - 2
        if n.target is _aten.layer_norm.default and len(n.args[1]) > trailing_dims:
            return None
        # a linear's weight and bias, a quantize's scale, are not broadcast against the tokens: only the input is
        per_token = [first] if n.target in self.starts or n.target in self.quantizing else inputs
        for a in per_token:
            value = self.env[a]
            if self.layout(a) is None and isinstance(value, torch.Tensor) and value.dim() > trailing_dims:
                return None  # broadcast over batch or seq in a way the packed rows cannot take
        operands: dict[Node, Any] = {a: self.env[a] for a in inputs}
        for a in per_token:
            value = self.env[a]
            if isinstance(value, _Packed):
                operands[a] = value.tensor
            elif self.layout(a) is not None:
                operands[a] = self.gather(a, value)
        args = map_aggregate(n.args, lambda a: operands[a] if isinstance(a, Node) else a)
        kwargs = map_aggregate(n.kwargs, lambda a: operands[a] if isinstance(a, Node) else a)
        return _Packed(n.target(*args, **kwargs))  # type: ignore[operator]


class PaddingRemoved(torch.nn.Module):
    """``program`` run with per-token tensors packed to the real tokens of input ``mask_index``."""

    def __init__(self, program: torch.export.ExportedProgram, mask_index: int) -> None:
        super().__init__()
        self.graph_module = program.module()
        mask = _user_inputs(program)[mask_index].meta["val"]
        self.batch, self.seq = _size(mask.shape[0]), _size(mask.shape[1])
        self.mask_index = mask_index

    def train(self, mode: bool = True) -> PaddingRemoved:
        return self  # a program's module is in eval mode already and refuses train() and eval()

    def forward(self, *args: torch.Tensor) -> Any:
        return _Packing(self.graph_module, self.batch, self.seq, self.mask_index).run(*args)


def _user_inputs(program: torch.export.ExportedProgram) -> list[Node]:
    names = set(program.graph_signature.user_inputs)
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]


def removable_mask(program: torch.export.ExportedProgram, signature: Signature) -> int | None:
    """The index of the input whose mask the padding can be removed by: the signature's one (batch, seq)
    mask, both sizes dynamic and distinct in ``program``, with a linear over (batch, seq, ...) values;
    None where there is none."""
    masks = [i for i, s in enumerate(signature.inputs) if s.kind == "mask"]
    inputs = _user_inputs(program)
    if len(masks) != 1 or len(inputs) != len(signature.inputs):
        return None
    value = inputs[masks[0]].meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    batch, seq = value.shape
    if not (isinstance(batch, torch.SymInt) and isinstance(seq, torch.SymInt)) or _size(batch) == _size(seq):
        return None
    tokens = (_size(batch), _size(seq))
    for node in program.graph.nodes:
        x = node.args[0].meta.get("val") if node.target is _aten.linear.default else None
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and (_size(x.shape[0]), _size(x.shape[1])) == tokens:
            return masks[0]
    return None


def padded_example(example_inputs: tuple[torch.Tensor, ...], mask_index: int) -> tuple[torch.Tensor, ...] | None:
    """``example_inputs`` with right padding in the mask (row i keeps ``seq - 1 - i * seq // (2 * batch)``
    tokens, at least 1, so every row has padding), or None where a sequence of 1 leaves nothing to pad."""
    mask = example_inputs[mask_index]
    batch, seq = mask.shape
    if seq < 2:
        return None
    lengths = torch.tensor([max(1, seq - 1 - i * seq // (2 * batch)) for i in range(batch)])
    padded = (torch.arange(seq)[None, :] < lengths[:, None]).to(mask.dtype)
    return (*example_inputs[:mask_index], padded, *example_inputs[mask_index + 1 :])


def _same_at_real_tokens(want: Any, got: Any, mask: torch.Tensor) -> str | None:
    """Why ``got`` differs from ``want`` at real tokens (None where it does not)."""
    wants, gots = torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)
    if len(wants) != len(gots):
        return f"{len(gots)} outputs, expected {len(wants)}"
    real = mask.bool()
    for w, g in zip(wants, gots, strict=True):
        if not isinstance(w, torch.Tensor):
            continue
        if w.shape != g.shape:
            return f"an output of shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if w.dim() >= 2 and w.shape[:2] == real.shape:
            w, g = w[real], g[real]
        w, g = w.float(), g.float()
        error = (w - g).abs().max().item() if w.numel() else 0.0
        if not error <= _ATOL + _RTOL * (w.abs().max().item() if w.numel() else 0.0):
            return f"max abs error {error:.3g} at real tokens"
    return None


def padding_removed(
    program: torch.export.ExportedProgram,
    signature: Signature,
    dims: dict[str, Dim],
    example_inputs: tuple[torch.Tensor, ...],
) -> torch.export.ExportedProgram | None:
    """``program`` captured again with the padding removed between attentions, or None where it has no
    removable mask or where the rewrite changed what a real token computes (logged)."""
    mask_index = removable_mask(program, signature)
    example = padded_example(example_inputs, mask_index) if mask_index is not None else None
    if mask_index is None or example is None:
        return None
    module = PaddingRemoved(program, mask_index)
    try:
        with torch.no_grad():
            want, got = program.module()(*example), module(*example)
        why = _same_at_real_tokens(want, got, example[mask_index])
        if why is None:
            return exported_program_from_module(module, example_inputs, signature, dims)
    except Exception as exc:  # an operation the rewrite does not know how to feed: the program as it was
        why = f"{type(exc).__name__}: {first_line(exc)}"
    log.info("export aoti: padding kept: run on real tokens only, the program gave %s", why)
    return None
