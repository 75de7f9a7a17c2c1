"""Static int8: a QDQ graph calibrated on real (or random) inputs, with the costliest layers left in float32.

onnxruntime's ``quantize_static`` quantizes the weight MatMul/Gemm layers (int8 weights per output
channel, uint8 activations whose ranges come from calibration: minmax, entropy or percentile).
Activation-by-activation products (attention's QK^T and AV) stay float32 (``MatMulConstBOnly``):
quantizing them too cost SQNR for almost no speed.

The products' outputs stay float32 (``OpTypesToExcludeOutputQuantization``): without it every
product gets a QuantizeLinear/DequantizeLinear pair on its output, which onnxruntime runs as
``QLinearMatMul`` + ``DequantizeLinear`` and then adds the bias in float32 anyway; with it,
``DequantizeLinear -> MatMul`` becomes one ``MatMulIntegerToFloat`` (int8 product, float32 out):
faster, and one rounding fewer per layer. Weights are uint8 where this CPU's int8 products saturate
(``tk.export.onnx.dynamic_int8.weight_type``). The export fuses the float32 graph first (attention
into ``MultiHeadAttention``, bias + GELU), so quantization sees the fused graph, which runs faster.

Then the graph's signal is measured as the SQNR of its outputs against the float32 graph on the
calibration inputs. While it is below the floor (``MIN_SQNR_DB["int8"]`` plus ``MARGIN_DB``, so
the export check's fresh inputs also pass), layers are excluded from quantization: each layer's
cost is measured one layer at a time on the calibration batches (only that layer quantized, its
output SQNR against float32), and the costliest are excluded first, a few more per round, each
round judged on the calibration and held-out batches: the search every int8 writer runs
(``tk.export.int8.search``; ``QdqUnits`` is this format's adapter). Calibration and quantization run
once: each ranked or judged graph is the fully quantized one with some nodes reading float32 again
(``tk.export.onnx.qdq_variants``).
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import CannotWinError, ConversionError, UsageError, first_line
from tk.export.context import Int8Share
from tk.export.int8.evaluator import Evaluator, FeedsRunner
from tk.export.int8.search import MARGIN_DB, RoundsPolicy, search_exclusions
from tk.export.onnx.dynamic_int8 import quant_type, weight_record, weight_type
from tk.export.onnx.qdq_variants import QdqVariants
from tk.fileio import atomic_write_bytes
from tk.formats.products import conv_weight_key, weight_rows

log = logging.getLogger("tk.export")

METHODS = ("minmax", "entropy", "percentile")
QUANTIZED_OPS = ["MatMul", "Gemm", "Conv"]
# products that write float32 (MatMulIntegerToFloat), not int8 (QLinearMatMul); a Conv's output stays quantized:
# onnxruntime runs a QDQ Conv as QLinearConv only with a QuantizeLinear after it (resnet18 at 32 x 128 x 128
# on the AVX2 EPYC: 176-179 ms with uint8 weights, 114 with int8, against 204-207 in float32; with float outputs
# its convolutions would run in float32)
FLOAT_OUTPUT_OPS = ["MatMul", "Gemm"]
MAX_ROUNDS = 8  # exclusion rounds before giving up (the check then reports the SQNR)
# the search judges every batch each round (a session per candidate is quick): no screen
POLICY = RoundsPolicy(max_rounds=MAX_ROUNDS, screened=False, asks_before_ranking=True)
OUTPUT_QUANTIZATION = False  # FLOAT_OUTPUT_OPS write float32


@dataclass
class StaticInt8Result:
    sqnr_db: float  # min over outputs, on the calibration and judged inputs, of the shipped graph
    excluded: list[str] = field(default_factory=list)  # nodes left in float32 (given + automatic)
    automatic: list[str] = field(default_factory=list)  # the automatically excluded ones, costliest first
    layer_sqnr_db: dict[str, float] = field(default_factory=dict)  # node -> SQNR with only it quantized
    quantizable: int = 0  # weight MatMul/Gemm/Conv nodes in the graph
    method: str = "minmax"
    int8_nodes: int = 0  # of the quantizable nodes, the ones left in int8
    int8_linear_shapes: list[list[int]] = field(default_factory=list)  # [in, out, count] of the int8 nodes' weights
    int8_conv_shapes: list[list[int]] = field(default_factory=list)  # [*conv_weight_key, count] of the int8 Convs
    weights: str = "int8"  # or uint8 (a CPU whose int8 products saturate)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": "static",
            "method": self.method,
            "per_channel": True,
            "weights": weight_record(self.weights),
            "format": "QDQ",
            "outputs": "int8" if OUTPUT_QUANTIZATION else "float32",  # the matrix products' (a Conv's: int8)
            "sqnr_db_export": round(self.sqnr_db, 2),
            "quantizable_nodes": self.quantizable,
            "int8_linear_shapes": self.int8_linear_shapes,
            "int8_conv_shapes": self.int8_conv_shapes,
            "excluded": self.excluded,
            "automatic_exclusions": self.automatic,
        }


class _Reader:
    """onnxruntime's ``CalibrationDataReader`` protocol over prepared batches."""

    def __init__(self, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self._batches = list(batches)
        self._it: Iterator[dict[str, np.ndarray]] = iter(self._batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._it = iter(self._batches[start_index:end_index])


def _method(name: str) -> Any:
    from onnxruntime.quantization import CalibrationMethod

    if name not in METHODS:
        raise UsageError(f"--calibration-method: expected one of {', '.join(METHODS)}, got {name!r}")
    return {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[name]


def weight_matmul_nodes(path: Path) -> list[str]:
    """Names of the MatMul/Gemm/Conv nodes whose second input is a weight (an initializer)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    return [
        n.name for n in model.graph.node if n.op_type in QUANTIZED_OPS and len(n.input) > 1 and n.input[1] in weights
    ]


def weight_shapes(source: Path, names: Sequence[str]) -> list[list[int]]:
    """``[in_features, out_features, count]`` of the weights of the MatMul/Gemm nodes ``names`` of ``source``,
    by shape: the manifest's record of what an int8 graph runs in int8 (``tk.measure.floor.LinearSplit``)."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    wanted = set(names)
    keys = []
    for node in model.graph.node:
        if node.name not in wanted or len(node.input) < 2 or len(weights.get(node.input[1], [])) != 2:
            continue
        rows, cols = weights[node.input[1]]
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
        keys.append((int(cols), int(rows)) if trans_b else (int(rows), int(cols)))
    return weight_rows(keys)


def conv_shapes(source: Path, names: Sequence[str]) -> list[list[int]]:
    """``[*conv_weight_key, count]`` of the 1-D and 2-D Conv nodes ``names`` of ``source``: the manifest's
    record of the convolutions an int8 graph runs in int8 (``tk.measure.floor.LinearSplit``)."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    wanted = set(names)
    keys = []
    for node in model.graph.node:
        dims = weights.get(node.input[1], []) if node.op_type == "Conv" and len(node.input) > 1 else []
        if node.name not in wanted or len(dims) < 3:
            continue
        groups = next((a.i for a in node.attribute if a.name == "group"), 1)
        keys.append(conv_weight_key(dims[0], dims[1], dims[2:], groups))
    return weight_rows(key for key in keys if key is not None)


def unit_macs(source: Path, names: Sequence[str], feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Multiply-adds of each weight MatMul/Gemm/Conv node of ``names`` in ``source`` on ``feeds``: its output's
    elements (read by running the graph with those outputs exposed) times what each output element reduces
    (a matrix weight's input dimension; a Conv weight's input channels per group times its kernel)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(source))
    weights = {i.name: list(i.dims) for i in model.graph.initializer}
    wanted = set(names)
    reduced: dict[str, int] = {}  # the node's output name -> K
    by_output: dict[str, str] = {}
    for node in model.graph.node:
        if node.name not in wanted or len(node.input) < 2 or node.input[1] not in weights:
            continue
        dims = weights[node.input[1]]
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0) if node.op_type == "Gemm" else 0
        if node.op_type == "Conv":  # weights [out, in per group, *kernel]
            reduced[node.output[0]] = math.prod(int(d) for d in dims[1:])
        else:
            reduced[node.output[0]] = int(dims[-1] if trans_b else dims[-2]) if len(dims) >= 2 else 0
        by_output[node.output[0]] = node.name
    outputs = {o.name for o in model.graph.output}
    for name in reduced:
        if name not in outputs:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ordered = list(reduced)
    values = session.run(ordered, feeds)
    macs = {by_output[name]: int(np.asarray(v).size) * reduced[name] for name, v in zip(ordered, values, strict=True)}
    return {name: macs.get(name, 0) for name in names}


def _quantize(
    source: Path, target: Path, method: str, cache: Path, reader: _Reader | None, only: list[str], weights: str
) -> None:
    """Quantize the nodes ``only`` (weight MatMul/Gemm/Conv names: the quantizer would take attention's
    activation products too, whatever ``MatMulConstBOnly`` says); the others stay float32."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    if not only:
        shutil.copyfile(source, target)
        return
    if reader is not None:
        reader.rewind()
    quantize_static(
        str(source),
        str(target),
        calibration_data_reader=reader,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=QUANTIZED_OPS,
        per_channel=True,
        reduce_range=False,
        activation_type=QuantType.QUInt8,
        weight_type=quant_type(weights),
        nodes_to_quantize=only,
        calibrate_method=_method(method),
        extra_options={
            "MatMulConstBOnly": True,
            "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
            "OpTypesToExcludeOutputQuantization": [] if OUTPUT_QUANTIZATION else FLOAT_OUTPUT_OPS,
        },
        calibration_cache_path=str(cache),
    )


class GraphRunner(FeedsRunner):
    """The evaluator's runner for ONNX graphs: onnxruntime on the CPU, a session per candidate (a file, or a
    serialized model), the float32 graph's made once."""

    def open(self, model: Path | bytes) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        session = _session(model)
        return lambda batch: session.run(None, batch)


def _session(graph: Path | bytes) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    source = graph if isinstance(graph, bytes) else str(graph)
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def graph_evaluator(source: Path, batches: Sequence[dict[str, np.ndarray]]) -> Evaluator:
    """The int8 search's evaluator of graphs quantized from ``source`` (float32), on ``batches``."""
    return Evaluator.of(GraphRunner(source), batches)


@dataclass
class QdqUnits:
    """The search's adapter for a QDQ graph: its units are the weight MatMul/Gemm/Conv nodes ``quantize_static``
    was asked for; a candidate is the quantized graph with some of them reading float32 again
    (``QdqVariants``: calibration and quantization run once)."""

    source: Path  # the float32 graph
    quantized: Path  # the graph with every unit int8
    units: list[str]
    feeds: dict[str, np.ndarray]  # the first calibration batch: what the multiply-adds are counted on
    noun: str = "layers"
    excluded_dtype: str = "float32"

    @functools.cached_property
    def variants(self) -> QdqVariants:
        import onnx

        return QdqVariants(onnx.load(str(self.quantized)), onnx.load(str(self.source)), self.units)

    def without(self, excluded: Sequence[str]) -> bytes:
        return self.variants.with_float(excluded)

    def only(self, unit: str) -> bytes:
        return self.variants.with_float(n for n in self.units if n != unit)

    def unit_macs(self) -> dict[str, int]:
        return unit_macs(self.source, self.units, self.feeds)


def static_int8_onnx_from_onnx(
    source: Path,
    target: Path,
    calibration: Sequence[dict[str, np.ndarray]],
    *,
    method: str = "minmax",
    nodes_to_exclude: Sequence[str] = (),
    min_sqnr_db: float | None = None,
    judge: Sequence[dict[str, np.ndarray]] = (),
    weights: str | None = None,
    gate: Callable[[bytes], None] | None = None,
    share_gate: Callable[[Int8Share], None] | None = None,
) -> StaticInt8Result:
    """Write ``source`` statically quantized to int8 (QDQ) at ``target``, calibrated on ``calibration``.

    With ``min_sqnr_db``, layers are excluded automatically (``tk.export.int8.search``: costliest first,
    measured one layer at a time) until the outputs' SQNR reaches ``min_sqnr_db + MARGIN_DB`` on the
    calibration batches plus ``judge`` (held-out batches, e.g. at the shapes the export check uses).
    ``nodes_to_exclude`` are always left in float32. Default method: minmax.
    ``weights``: ``int8`` or ``uint8``; by default ``weight_type()`` (uint8 where int8 products saturate).
    ``gate`` (``tk.export.int8.search.int8_gate``) sees the all-int8 graph before it is judged (with a
    floor), and may end the export; ``share_gate`` is asked before the layers are ranked (one left out,
    at best the lightest) and after each exclusion round under the target, with the most the search can
    still keep in int8 (``Int8Share``, by ``unit_macs`` on the first calibration batch), and may end it too.
    """
    if not calibration:
        raise UsageError("--calibrate: expected at least one calibration sample, got none")
    _method(method)
    wtype = weight_type(weights)
    exclude = list(nodes_to_exclude)
    candidates = weight_matmul_nodes(source)
    unknown = [n for n in exclude if n not in candidates]
    if unknown:
        log.info("int8: nodes_to_exclude names no weight MatMul/Gemm/Conv: %s", unknown[:5])
    keep = [n for n in candidates if n not in exclude]
    try:
        with tempfile.TemporaryDirectory(prefix="tk-int8-") as tmp:
            reader = _Reader(calibration)
            _quantize(source, target, method, Path(tmp) / "ranges.json", reader, keep, wtype)  # calibrates once
            result = StaticInt8Result(
                math.nan, list(exclude), quantizable=len(candidates), method=method, weights=wtype
            )
            units = QdqUnits(source, target, keep, calibration[0])
            _judge_and_search(units, [*calibration, *judge], len(calibration), result, min_sqnr_db, gate, share_gate)
    except (UsageError, ConversionError, CannotWinError):
        raise
    except Exception as exc:  # the quantizer raises many types; each is a conversion failure
        raise ConversionError(
            f"onnxruntime could not quantize {source.name} to static int8: {first_line(exc)}"
        ) from exc
    result.excluded = exclude + result.automatic
    int8 = [n for n in candidates if n not in result.excluded]
    result.int8_nodes = len(int8)
    result.int8_linear_shapes = weight_shapes(source, int8)
    result.int8_conv_shapes = conv_shapes(source, int8)
    return result


def _judge_and_search(
    units: QdqUnits,
    batches: list[dict[str, np.ndarray]],
    calibration: int,
    result: StaticInt8Result,
    min_sqnr_db: float | None,
    gate: Callable[[bytes], None] | None,
    share_gate: Callable[[Int8Share], None] | None,
) -> None:
    """Judge the all-int8 graph at ``units.quantized``; under the floor plus the margin, search for the
    layers that leave int8 and write the graph without them there (``result`` is filled in)."""
    target_db = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
    if gate is not None and target_db is not None:
        gate(units.quantized.read_bytes())  # before the judge: a graph that cannot win needs no verdict
    evaluator = graph_evaluator(units.source, batches)
    result.sqnr_db = evaluator.sqnr_db(units.quantized, target_db=target_db)
    if min_sqnr_db is None or target_db is None or result.sqnr_db >= target_db:
        log.info("export int8   SQNR %.1f dB on %d batches", result.sqnr_db, len(batches))
        return
    log.info("export int8   SQNR %.1f dB on a batch, under the target %.1f dB", result.sqnr_db, target_db)
    found = search_exclusions(units, evaluator, min_sqnr_db, calibration, POLICY, share_gate=share_gate)
    result.layer_sqnr_db, result.automatic = found.costs, found.excluded
    if found.model is not None and found.sqnr_db is not None:
        atomic_write_bytes(units.quantized, found.model)
        result.sqnr_db = found.sqnr_db
