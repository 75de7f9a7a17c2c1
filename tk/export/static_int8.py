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
(``tk.export.quantize.weight_type``). The export fuses the float32 graph first (attention
into ``MultiHeadAttention``, bias + GELU), so quantization sees the fused graph, which runs faster.

Then the graph's signal is measured as the SQNR of its outputs against the float32 graph on the
calibration inputs. While it is below the floor (``MIN_SQNR_DB["int8"]`` plus ``MARGIN_DB``, so
the export check's fresh inputs also pass), layers are excluded from quantization: each layer's
cost is measured one layer at a time on the calibration batches (only that layer quantized, its
output SQNR against float32), and the costliest are excluded first, a few more per round, each
round judged on the calibration and held-out batches. Calibration and quantization run once: each
ranked or judged graph is the fully quantized one with some nodes reading float32 again
(``tk.export.qdq_variants``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import CannotWinError, ConversionError, UsageError, first_line
from tk.export.calibration import MARGIN_DB, exclude_costliest
from tk.export.context import Int8Share
from tk.export.qdq_variants import QdqVariants
from tk.export.quantize import quant_type, weight_record, weight_type
from tk.parity import worst_sqnr_db

log = logging.getLogger("tk.export")

METHODS = ("minmax", "entropy", "percentile")
QUANTIZED_OPS = ["MatMul", "Gemm"]
MAX_ROUNDS = 8  # exclusion rounds before giving up (the check then reports the SQNR)
OUTPUT_QUANTIZATION = False  # products write float32 (MatMulIntegerToFloat), not int8 (QLinearMatMul)


@dataclass
class StaticInt8Result:
    sqnr_db: float  # min over outputs, on the calibration and judged inputs, of the shipped graph
    excluded: list[str] = field(default_factory=list)  # nodes left in float32 (given + automatic)
    automatic: list[str] = field(default_factory=list)  # the automatically excluded ones, costliest first
    layer_sqnr_db: dict[str, float] = field(default_factory=dict)  # node -> SQNR with only it quantized
    quantizable: int = 0  # weight MatMul/Gemm nodes in the graph
    method: str = "minmax"
    int8_nodes: int = 0  # of the quantizable nodes, the ones left in int8
    weights: str = "int8"  # or uint8 (a CPU whose int8 products saturate)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": "static",
            "method": self.method,
            "per_channel": True,
            "weights": weight_record(self.weights),
            "format": "QDQ",
            "outputs": "int8" if OUTPUT_QUANTIZATION else "float32",  # the products' outputs
            "sqnr_db_export": round(self.sqnr_db, 2),
            "quantizable_nodes": self.quantizable,
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
    """Names of the MatMul/Gemm nodes whose second input is a weight (an initializer)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    return [
        n.name for n in model.graph.node if n.op_type in QUANTIZED_OPS and len(n.input) > 1 and n.input[1] in weights
    ]


def node_macs(source: Path, names: Sequence[str], feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Multiply-adds of each weight MatMul/Gemm node of ``names`` in ``source`` on ``feeds``: its output's
    elements (read by running the graph with those outputs exposed) times the weight's reduced dimension."""
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
    """Quantize the nodes ``only`` (weight MatMul/Gemm names: the quantizer would take attention's
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
            "OpTypesToExcludeOutputQuantization": [] if OUTPUT_QUANTIZATION else QUANTIZED_OPS,
        },
        calibration_cache_path=str(cache),
    )


class _Judge:
    """The float32 graph's outputs on some batches, and the SQNR of a candidate against them.

    A batch's reference is computed when it is first judged, in one session of the float32 graph shared
    with the judge's ``head``: a graph under the target on its first batch, or a gate that ends the
    export, never runs the float32 graph on the rest (benchmarks/history.md, "The int8 search's judge":
    a session per batch, every batch before the first verdict, had been most of the small Transformer's
    onnx int8 export)."""

    def __init__(self, source: Path, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self.source = source
        self.batches = list(batches)
        self._references: dict[int, list[np.ndarray]] = {}
        self._float: list[Any] = []  # the float32 graph's session, once made; shared with ``head``'s judges

    def head(self, count: int) -> _Judge:
        """A judge of the first ``count`` batches (the same references and session)."""
        judge = _Judge(self.source, self.batches[:count])
        judge._references, judge._float = self._references, self._float
        return judge

    def reference(self, index: int) -> list[np.ndarray]:
        if index not in self._references:
            if not self._float:
                self._float.append(self._session(self.source))
            self._references[index] = self._run(self.source, self.batches[index], self._float[0])
        return self._references[index]

    @staticmethod
    def _session(graph: Path | bytes) -> Any:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        source = graph if isinstance(graph, bytes) else str(graph)
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])

    def _run(self, graph: Path | bytes, feeds: dict[str, np.ndarray], session: Any = None) -> list[np.ndarray]:
        return (session or self._session(graph)).run(None, feeds)

    def sqnr_db(self, graph: Path | bytes, *, target_db: float | None = None) -> float:
        """The worst SQNR over batches and outputs of ``graph`` (a file, or a serialized model), as the
        export check judges; with ``target_db``, the first batch under it ends the judging (its SQNR is
        returned: the graph fails whatever the rest would say)."""
        session = self._session(graph)
        worst = float("inf")
        for index, feeds in enumerate(self.batches):
            worst = min(worst, worst_sqnr_db([self.reference(index)], [self._run(graph, feeds, session)]))
            if target_db is not None and worst < target_db:
                break
        return worst


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

    With ``min_sqnr_db``, layers are excluded automatically (costliest first, measured one layer
    at a time) until the outputs' SQNR on the calibration batches reaches ``min_sqnr_db + MARGIN_DB``.
    ``nodes_to_exclude`` are always left in float32. The SQNR is measured on the calibration batches
    plus ``judge`` (held-out batches, e.g. at the shapes the export check uses). Default method: minmax.
    ``weights``: ``int8`` or ``uint8``; by default ``weight_type()`` (uint8 where int8 products saturate).
    ``gate`` (``tk.export.calibration.int8_gate``) sees the all-int8 graph before it is judged (with a
    floor), and may end the export; ``share_gate`` is asked before the layers are ranked (one left out,
    at best the lightest) and after each exclusion round under the target, with the most the search can
    still keep in int8 (``Int8Share``, by ``node_macs`` on the first
    calibration batch), and may end it too.
    """
    judge_batches = list(judge)
    if not calibration:
        raise UsageError("--calibrate: expected at least one calibration sample, got none")
    _method(method)
    wtype = weight_type(weights)
    exclude = list(nodes_to_exclude)
    candidates = weight_matmul_nodes(source)
    unknown = [n for n in exclude if n not in candidates]
    if unknown:
        log.info("int8: nodes_to_exclude names no weight MatMul/Gemm: %s", unknown[:5])
    try:
        with tempfile.TemporaryDirectory(prefix="tk-int8-") as tmp:
            cache = Path(tmp) / "ranges.json"
            reader = _Reader(calibration)
            keep = [n for n in candidates if n not in exclude]
            _quantize(source, target, method, cache, reader, keep, wtype)  # calibrates once, fills the cache
            target_db = None if min_sqnr_db is None else min_sqnr_db + MARGIN_DB
            if gate is not None and target_db is not None:
                gate(target.read_bytes())  # before the judge: a graph that cannot win needs no verdict
            judge = _Judge(source, [*calibration, *judge_batches])
            sqnr = judge.sqnr_db(target, target_db=target_db)
            result = StaticInt8Result(sqnr, list(exclude), quantizable=len(candidates), method=method, weights=wtype)
            result.int8_nodes = len([n for n in candidates if n not in exclude])
            if target_db is None or sqnr >= target_db:
                log.info("export int8   SQNR %.1f dB on %d batches", sqnr, len(judge.batches))
                return result
            log.info("export int8   SQNR %.1f dB on a batch, under the target %.1f dB", sqnr, target_db)
            import onnx

            macs: dict[str, int] = {}  # counted at the first question

            def counted() -> bool:
                """Whether each layer's multiply-adds are known (counted at the first question)."""
                if not macs:
                    try:
                        macs.update(node_macs(source, keep, calibration[0]))
                    except Exception as exc:  # the gate saves time; a graph it cannot count is still searched
                        log.info("export int8   the speed gate is not asked: %s", first_line(exc))
                        macs.update(dict.fromkeys(keep, 0))
                return any(macs.values())

            def at_least(excluded: list[str]) -> None:
                assert share_gate is not None
                if not counted():
                    return
                left_out = set(excluded)
                total = sum(macs.values())
                kept = sum(v for n, v in macs.items() if n not in left_out)
                share = kept / total if total else 0.0
                share_gate(Int8Share(len([n for n in keep if n not in left_out]), len(keep), share, bound=True))

            if share_gate is not None and len(keep) > 1 and counted():
                # the search leaves out one layer at least: at best the lightest, asked before the ranking
                # (one quantized variant judged per layer: 25-40 s of the small Transformer's export)
                at_least([min(keep, key=macs.__getitem__)])
            variants = QdqVariants(onnx.load(str(target)), onnx.load(str(source)), keep)
            ranking = judge.head(len(calibration))  # ranks layers; the held-out batches judge each round
            for node in keep:
                result.layer_sqnr_db[node] = ranking.sqnr_db(variants.with_float(n for n in keep if n != node))
            trial = Path(tmp) / "trial.onnx"
            judged: dict[frozenset[str], float] = {}  # the bisection asks again for the set it keeps

            def judge_without(automatic: list[str]) -> float:
                graph = variants.with_float(automatic)
                trial.write_bytes(graph)
                key = frozenset(automatic)
                if key not in judged:
                    judged[key] = judge.sqnr_db(graph, target_db=target_db)
                    log.info(
                        "export int8   %d layers float32: SQNR %.1f dB%s",
                        len(exclude) + len(automatic),
                        judged[key],
                        "" if judged[key] >= target_db else " (a batch under the target: the rest not run)",
                    )
                trial.replace(target)
                return judged[key]

            result.automatic, last = exclude_costliest(
                result.layer_sqnr_db,
                judge_without,
                target_db,
                MAX_ROUNDS,
                at_least=at_least if share_gate is not None else None,
            )
            if last is not None:
                result.sqnr_db = last
            result.excluded = exclude + result.automatic
            result.int8_nodes = len([n for n in candidates if n not in result.excluded])
            return result
    except (UsageError, ConversionError, CannotWinError):
        raise
    except Exception as exc:  # the quantizer raises many types; each is a conversion failure
        raise ConversionError(
            f"onnxruntime could not quantize {source.name} to static int8: {first_line(exc)}"
        ) from exc
