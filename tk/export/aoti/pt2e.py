"""PT2E quantization of a captured program for the CPU: torchao's x86 Inductor quantizer on copies of one
float32 program calibrated once (``Quantizer``: observer statistics shared between copies), the modules it
quantizes (``quantizable_modules``, ``unit_macs``), the excluded linears in bfloat16 (``run_linears_in_bf16``),
and the copy the int8 search judges (``judged_module``, run by ``ProgramRunner``). ``tk.export.aoti.int8``
builds the aoti format's int8 package from them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tk.export.aoti.smoothing import SmoothingPlan, apply_smoothing
from tk.export.int8.evaluator import Evaluator
from tk.formats.products import conv_weight_key, saturating_int8_products, weight_rows

QUANTIZED_TARGETS = (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv1d.default)


def quantizable_modules(graph_module: torch.fx.GraphModule) -> list[str]:
    """Paths of the modules (``blocks.0.attn.qkv``) whose linear or convolution the quantizer takes, in order."""
    names: list[str] = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target in QUANTIZED_TARGETS:
            path = module_path(node)
            if path and path not in names:
                names.append(path)
    return names


def run_linears_in_bf16(graph_module: torch.fx.GraphModule, modules: Sequence[str]) -> int:
    """Cast the inputs, weights and bias of the linears of ``modules`` to bfloat16 and their outputs back
    to float32, in place; returns how many linears changed. Freezing folds the weight casts, so the
    package holds those weights in bfloat16 and runs them as oneDNN bfloat16 linears."""
    wanted = set(modules)
    graph = graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default:
            continue
        if module_path(node) not in wanted:
            continue
        with graph.inserting_before(node):
            node.args = tuple(
                graph.call_function(torch.ops.aten._to_copy.default, (a,), {"dtype": torch.bfloat16})
                if isinstance(a, torch.fx.Node)
                else a
                for a in node.args
            )
        with graph.inserting_after(node):
            back = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float32})
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        changed += 1
    graph.lint()
    graph_module.recompile()
    return changed


def judged_module(converted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``converted`` (torchao's int8 program) that computes the same values faster in PyTorch,
    for the search's judge only (the package is compiled from ``converted`` itself): each activation's
    quantize/dequantize pair as one call of ``fake_quantized``, and each int8 weight dequantized (and cast,
    where its linear runs in bfloat16) once here instead of on every call. Written because the judge runs
    each candidate on up to 44 batches, and the decomposed pairs made the int8 program's call about half
    again as long as the float32 one's (benchmarks/history.md, "The int8 search's judge")."""
    from torch.fx import GraphModule, Node

    decomposed = torch.ops.quantized_decomposed
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(converted.graph, {}))  # graph_copy leaves the output node out
    graph.set_codegen(copy.deepcopy(converted.graph._codegen))  # and the outputs' pytree structure
    judged = GraphModule(converted, graph)
    constants: dict[Node, torch.Tensor] = {}
    for node in list(graph.nodes):
        if node.op == "get_attr":
            constants[node] = attribute_of(judged, str(node.target))
        elif node.op != "call_function":
            continue
        elif node.target in (decomposed.dequantize_per_channel.default, torch.ops.aten._to_copy.default) and all(
            arg in constants for arg in node.all_input_nodes
        ):
            value = node.target(*torch.fx.node.map_arg(node.args, constants.__getitem__), **node.kwargs)
            name = f"_tk_judged_{len(constants)}"
            judged.register_buffer(name, value)
            with graph.inserting_before(node):
                folded = graph.get_attr(name)
            node.replace_all_uses_with(folded)
            graph.erase_node(node)
            constants[folded] = value
        elif node.target == decomposed.dequantize_per_tensor.default and not node.kwargs:
            source = node.args[0]
            if not isinstance(source, Node) or source.target != decomposed.quantize_per_tensor.default:
                continue
            if source.kwargs or tuple(source.args[1:]) != tuple(node.args[1:]):
                continue
            if not all(isinstance(a, (int, float)) for a in source.args[1:5]):
                continue
            with graph.inserting_before(node):
                fake = graph.call_function(fake_quantized, tuple(source.args))
            node.replace_all_uses_with(fake)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    judged.recompile()
    return judged


QUANTIZED_DTYPES = {(torch.uint8, 0, 255): torch.quint8, (torch.int8, -128, 127): torch.qint8}


def fake_quantized(
    x: torch.Tensor, scale: float, zero_point: int, low: int, high: int, dtype: torch.dtype
) -> torch.Tensor:
    """The values of torchao's decomposed ``quantize_per_tensor`` then ``dequantize_per_tensor`` of ``x``
    (float32): round(x / scale) + zero_point clamped to [low, high], less zero_point, times scale.
    Over a whole dtype's range, PyTorch's quantized tensors compute it in one vectorized pass (about 9x
    faster than the pair, and than ``fake_quantize_per_tensor_affine``: benchmarks/history.md); torch
    deprecates those tensors, so elsewhere, or once they are gone, the same arithmetic in place."""
    if x.dtype != torch.float32:
        quantize, dequantize = (
            torch.ops.quantized_decomposed.quantize_per_tensor,
            torch.ops.quantized_decomposed.dequantize_per_tensor,
        )
        return dequantize(quantize(x, scale, zero_point, low, high, dtype), scale, zero_point, low, high, dtype)
    quantized_dtype = QUANTIZED_DTYPES.get((dtype, low, high))
    if quantized_dtype is not None and hasattr(torch, "quantize_per_tensor"):
        return torch.quantize_per_tensor(x, scale, zero_point, quantized_dtype).dequantize()
    return torch.round(x * (1.0 / scale)).add_(zero_point).clamp_(low, high).sub_(zero_point).mul_(scale)


def attribute_of(module: torch.nn.Module, target: str) -> torch.Tensor:
    for part in target.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def _torchao_x86() -> Any:
    """torchao's x86 Inductor quantizer module, imported without the deprecation warning torchao 0.18
    logs through torch's pytree logger on import (it is about torchao's own code, not the user's)."""
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
    finally:
        pytree_log.setLevel(level)
    return x86


def x86_quantizer(method: str, only: Sequence[str] | None, exclude: Sequence[str]) -> Any:
    """The x86 quantizer for every quantizable module (``only`` None) or just ``only``, minus ``exclude``."""
    x86 = _torchao_x86()
    from torchao.quantization.pt2e import MinMaxObserver

    # oneDNN's uint8 x int8 products saturate on x86 CPUs without VNNI/AMX (vpmaddubsw adds pairs into
    # int16): 7-bit activations keep every pair sum in range, as torchao's own docstring advises there
    config = x86.get_default_x86_inductor_quantization_config(reduce_range=saturating_int8_products())
    if method == "minmax":
        minmax = dataclasses.replace(
            config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12)
        )
        config = dataclasses.replace(config, input_activation=minmax, output_activation=minmax)
    quantizer = x86.X86InductorQuantizer()
    if only is None:
        quantizer.set_global(config)
    else:
        for name in only:
            quantizer.set_module_name_qconfig(name, config)
    for name in exclude:
        quantizer.set_module_name_qconfig(name, None)
    # torchao's recipe also quantizes the inputs of products of two activations (matmul) and of an
    # element-wise mul of two same-shaped ones (GPT-2's tanh GELU, a gated FFN's gate x up): no module path
    # holds them, so the search could not leave them out (GPT-2 stayed at 30 dB with every linear in
    # float32), and they ran no faster (benchmarks/history.md: "GPT-2's Conv1D")
    for function in (torch.matmul, torch.mul):
        quantizer.set_function_type_qconfig(function, None)
    return quantizer


class Quantizer:
    """Quantizes copies of one float32 program, calibrated on the same batches each time.

    An observer only reads the float32 value it observes, so its statistics are the same in every
    copy that observes that value with that configuration, whichever modules the copy quantizes:
    they are kept after the first calibration and copied into later copies (for one smoothing plan),
    which then run no calibration batch. The search quantizes the program dozens of times, and
    calibrating each copy anew (HistogramObserver on every activation) was most of each quantize's time.
    """

    def __init__(
        self,
        program: torch.export.ExportedProgram,
        calibration: Sequence[tuple[torch.Tensor, ...]],
        method: str,
        keep_fp32: Sequence[str],
        excluded_in_bf16: bool,
    ) -> None:
        self.program = program
        self.float_module = live_module(program)
        self.calibration = list(calibration)
        self.method = method
        self.keep_fp32 = list(keep_fp32)
        self.excluded_in_bf16 = excluded_in_bf16
        self._smoothing: SmoothingPlan | None = None
        self._statistics: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}  # _observer_key -> its buffers
        self.calibrations = 0  # how many copies ran the calibration batches

    @property
    def smoothing(self) -> SmoothingPlan | None:
        """Applied to every fresh module (``tk.export.aoti.smoothing``); another plan observes other values."""
        return self._smoothing

    @smoothing.setter
    def smoothing(self, plan: SmoothingPlan | None) -> None:
        if plan is not self._smoothing:
            self._statistics.clear()
        self._smoothing = plan

    def fresh(self) -> torch.fx.GraphModule:
        module = live_module(self.program)
        return apply_smoothing(module, self.smoothing) if self.smoothing is not None else module

    def prepare(self, *, only: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> torch.fx.GraphModule:
        """The program with observers for every quantizable module (or ``only`` those) but the
        ``keep_fp32`` ones and ``exclude``, calibrated."""
        quantizer = x86_quantizer(self.method, only, [*self.keep_fp32, *exclude])  # imports torchao first
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

        # a fresh module of the program for each trial, not a deep copy: its parameters are the
        # program's own tensors (the quantizer writes new int8 constants and never changes them). Each
        # trial's module stays reachable after it (a reference inside torch.fx or torchao, not traced),
        # so deep copies grew by a whole model per trial; fresh modules add almost nothing
        prepared = prepare_pt2e(self.fresh(), quantizer)
        observers = observers_of(prepared)
        if all(key in self._statistics for key in observers):
            for key, observer in observers.items():
                for name, value in self._statistics[key].items():
                    observer._buffers[name] = value.clone()
            return prepared
        for args in self.calibration:
            prepared(*args)
        self.calibrations += 1
        for key, observer in observers.items():
            self._statistics[key] = {name: b.clone() for name, b in observer._buffers.items() if b is not None}
        return prepared

    def convert(self, prepared: torch.fx.GraphModule, exclude: Sequence[str] = ()) -> torch.fx.GraphModule:
        """``prepared`` (changed in place) with quantize/dequantize pairs; ``exclude`` in bfloat16
        where ``excluded_in_bf16``."""
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        converted = convert_pt2e(prepared)
        if self.excluded_in_bf16 and exclude:
            run_linears_in_bf16(converted, exclude)
        return converted

    def quantize(self, *, only: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> torch.fx.GraphModule:
        """Every quantizable module (or ``only`` those) in int8, but the ``keep_fp32`` ones (float32) and
        ``exclude`` (bfloat16 where ``excluded_in_bf16``, else float32)."""
        return self.convert(self.prepare(only=only, exclude=exclude), exclude)


def observers_of(prepared: torch.fx.GraphModule) -> dict[tuple[Any, ...], torch.nn.Module]:
    """The observers of a prepared module, each keyed by what decides its statistics: the values it
    observes (the names of its nodes' inputs: a shared observer observes several) and its configuration."""
    from torchao.quantization.pt2e import ObserverBase

    def is_observer(node: Any) -> bool:
        return (
            isinstance(node, torch.fx.Node)
            and node.op == "call_module"
            and isinstance(getattr(prepared, node.target, None), ObserverBase)
        )

    observed: dict[str, list[str]] = {}
    for node in prepared.graph.nodes:
        if is_observer(node):
            source = node.args[0]
            while is_observer(source):  # an observer passes its input through: name the value itself
                source = source.args[0]
            observed.setdefault(node.target, []).append(source.name if isinstance(source, torch.fx.Node) else "?")
    keys = {}
    for target, sources in observed.items():
        observer = getattr(prepared, target)
        config = tuple(
            str(getattr(observer, a, None)) for a in ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis", "bins")
        )
        keys[(type(observer).__name__, tuple(sorted(sources)), config)] = observer
    return keys


def live_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """A fresh module of ``program`` without nodes whose results nothing uses, and with the later calls of
    a module called more than once told apart (``separate_repeated_calls``).

    Hugging Face encoders compute a pooler (dense, then tanh) that a model returning only
    ``last_hidden_state`` never reads; torch.export keeps it, and torchao's x86 quantizer then
    fails on the tanh's partition, which has no output node (``partition.output_nodes[0]``).
    """
    module = program.module()
    if module.graph.eliminate_dead_code():
        module.recompile()
    separate_repeated_calls(module)
    return module


def separate_repeated_calls(module: torch.fx.GraphModule) -> int:
    """Mark each later call of a module called more than once (torchvision's ResNet blocks call one ReLU
    twice) as a source of its own; returns how many nodes were marked.

    torchao's x86 quantizer finds its patterns with torch's ``get_source_partitions``. A non-strict
    capture leaves ``source_fn_stack`` out, and torch then groups nodes by the module path of their
    ``nn_module_stack``, which two calls of one module share: the two calls' ReLUs form one partition
    with two outputs, and the quantizer stops ("Input partition has more than one output node").
    ``nn_module_stack``'s own key tells the calls apart (``layer1.0.relu@1``); a ``source_fn_stack`` under
    that key puts each later call in a partition of its own, as a strict capture would.
    """
    marked = 0
    for node in module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack or "source_fn_stack" in node.meta:
            continue
        key, (_, kind) = next(reversed(stack.items()))
        if "@" not in key:
            continue
        kind = _loaded_class(kind) if isinstance(kind, str) else kind
        if isinstance(kind, type):
            node.meta["source_fn_stack"] = [(key, kind)]
            marked += 1
    return marked


def _loaded_class(path: str) -> Any:
    """The class a module stack names (``torch.nn.modules.activation.ReLU``) where its module is imported
    already (the captured model's own classes are); None otherwise: nothing is imported by a name."""
    module, _, name = path.rpartition(".")
    return getattr(sys.modules.get(module), name, None)


class ProgramRunner:
    """The evaluator's runner for PT2E programs: run in PyTorch, a candidate program through its
    ``judged_module`` (the same values, faster)."""

    def __init__(self, float_module: Callable[..., Any]) -> None:
        self.float_module = float_module

    def reference(self, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        return outputs_of(self.float_module, batch)

    def candidate(self, model: Callable[..., Any]) -> Callable[[tuple[torch.Tensor, ...]], list[np.ndarray]]:
        fast = judged_module(model) if isinstance(model, torch.fx.GraphModule) else model
        return functools.partial(outputs_of, fast)

    def shape(self, batch: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
        return tuple(batch[0].shape)


def program_evaluator(float_module: Callable[..., Any], batches: Sequence[tuple[torch.Tensor, ...]]) -> Evaluator:
    """The int8 search's evaluator of programs quantized from ``float_module``, on ``batches`` (argument tuples)."""
    return Evaluator.of(ProgramRunner(float_module), batches)


def outputs_of(module: torch.fx.GraphModule, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    out = module(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach().float().numpy() for o in outs if isinstance(o, torch.Tensor)]


def unit_macs(graph_module: torch.fx.GraphModule, args: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Multiply-adds of the linears and convolutions of each module of ``graph_module`` called on ``args``:
    output elements times the weight's elements per output channel."""
    macs: dict[str, int] = {}

    class Counter(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            out = super().run_node(node)
            if node.op == "call_function" and node.target in QUANTIZED_TARGETS:
                weight = self.fetch_args_kwargs_from_env(node)[0][1]
                path = module_path(node) or node.name
                macs[path] = macs.get(path, 0) + out.numel() * weight[0].numel()
            return out

    with torch.no_grad():
        Counter(graph_module).run(*args)
    return macs


def linear_weight_shapes(graph_module: torch.fx.GraphModule, modules: Collection[str]) -> list[list[int]]:
    """``[in_features, out_features, count]`` of the linears of ``modules`` in ``graph_module``, by weight shape:
    the manifest's record of what an int8 package runs in int8 (``tk.measure.floor.LinearSplit``)."""
    weights = (value for _, value in _weights_of(graph_module, modules, (torch.ops.aten.linear.default,)))
    return weight_rows((int(w.shape[1]), int(w.shape[0])) for w in weights if len(w.shape) == 2)


CONVOLUTIONS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default)


def conv_weight_shapes(graph_module: torch.fx.GraphModule, modules: Collection[str]) -> list[list[int]]:
    """``[*conv_weight_key, count]`` of the 1-D and 2-D convolutions of ``modules`` in ``graph_module``: the
    manifest's record of the convolutions an int8 package runs in int8 (``tk.measure.floor.LinearSplit``)."""
    keys = (
        conv_weight_key(value.shape[0], value.shape[1], value.shape[2:], _groups(node))
        for node, value in _weights_of(graph_module, modules, CONVOLUTIONS)
    )
    return weight_rows(key for key in keys if key is not None)


def _groups(node: torch.fx.Node) -> int:
    """A captured ``aten.conv1d``/``conv2d``'s groups (its seventh argument)."""
    return int(node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1))


def _weights_of(
    graph_module: torch.fx.GraphModule, modules: Collection[str], targets: tuple[Any, ...]
) -> Iterator[tuple[torch.fx.Node, torch.Tensor]]:
    """Each call of ``targets`` in ``modules`` of ``graph_module`` whose weight (its second argument) is known,
    with that weight (its fake value or the tensor itself)."""
    wanted = set(modules)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in targets or module_path(node) not in wanted:
            continue
        weight = node.args[1]
        value = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else weight
        if value is None and isinstance(weight, torch.fx.Node) and weight.op == "get_attr":
            value = functools.reduce(getattr, str(weight.target).split("."), graph_module)
        if value is not None:
            yield node, value


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module (``blocks.0.attn.qkv``) a node of a captured program was called in."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None
