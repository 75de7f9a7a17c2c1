"""The ``onnx`` format: the exported program through torch's dynamo ONNX exporter.

Graph inputs and outputs carry the tk names, and dynamic axes carry the tk dimension names
("batch", "seq") as dim_params. Weights stay inside the one file unless the model passes
protobuf's 2 GiB limit: onnxruntime's quantization tools fail on models with external data.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tk.errors import ConversionError, UsageError, first_line
from tk.export.base import REDUCED, Writer, given, option
from tk.export.context import ExportContext, ExportOptions
from tk.export.onnx.steps import INT8_MODES, fuse, fuses, quantize
from tk.spec import Dim, Signature

log = logging.getLogger("tk.export")

FILE = "model.onnx"
DEFAULT_OPSET = 20
MIN_OPSET = 18
SINGLE_FILE_LIMIT = 2**31 - 2**26  # protobuf caps a file at 2 GiB; keep 64 MiB for the graph itself

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class OnnxFile:
    path: Path
    opset: int  # the default-domain opset actually written
    external_data: Path | None  # the weights file, when the model is too large for one file
    ir_version: int
    fallback: str | None = None  # how the program was converted when the exporter failed on it as captured


def resolve_opset(opset: int | None) -> int:
    """``opset`` (default 20) once it is one this onnx knows and the exporter supports (18 or newer)."""
    import onnx

    opset = DEFAULT_OPSET if opset is None else opset
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise UsageError(f"--opset: expected {MIN_OPSET} or newer, got {opset}")
    if opset > newest:
        raise UsageError(f"--opset: expected at most {newest} (the newest this onnx knows), got {opset}")
    return opset


@dataclass(frozen=True)
class OnnxOptions:
    """The ``onnx`` writer's settings; None means the default."""

    opset: int | None = option("--opset", shapes="onnx-plain")  # default 20, at least 18
    # onnxruntime's transformer fusions (tk.export.onnx.fusions); default on
    fusions: bool | None = option("--fuse/--no-fuse")
    keep_unfused: bool | None = option("--keep-unfused")  # also ship the graph before fusion, as model.unfused.onnx
    # static (calibrated QDQ, default) | dynamic (per call) | weights | weights-int4 (weight-only)
    int8_mode: str | None = option("--int8-mode")
    # static int8 activation ranges: minmax (default) | entropy | percentile
    calibration_method: str | None = option("--calibration-method")
    nodes_to_exclude: tuple[str, ...] = option("nodes_to_exclude", default=())  # ONNX nodes int8 keeps in float32


class OnnxWriter(Writer):
    """``model.onnx`` from the exported program; fused for onnxruntime, then quantized under int8.

    Provides ``onnx-plain``: the exporter's standard-op graph, before fusion and quantization.
    """

    name = "onnx"
    Options = OnnxOptions
    precisions = (*REDUCED, "int8")  # int8: onnxruntime's quantization of the graph
    provides = ("onnx-plain",)
    device_free = True  # one file for any execution provider
    int8_rank = 1  # static QDQ lost to the aoti int8 package on every CPU measured (benchmarks/history.md)

    def variants(self, precision: str) -> list[OnnxOptions]:
        # dynamic int8 quantizes per call; the unfused graph is faster where onnxruntime's fusions are not
        if precision == "int8":
            return [OnnxOptions(), OnnxOptions(int8_mode="dynamic")]
        return [OnnxOptions(), OnnxOptions(fusions=False)]

    def variant_words(self, options: OnnxOptions, precision: str) -> list[str]:
        if precision == "int8":
            return [options.int8_mode or "static"]
        return ["unfused"] if options.fusions is False else []

    def unavailable_reason(self, device: str, precision: str) -> str | None:
        missing = [p for p in ("onnx", "onnxscript") if importlib.util.find_spec(p) is None]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            return f"{' and '.join(missing)} {verb} not installed (pip install onnx onnxscript)"
        if precision == "int8" and importlib.util.find_spec("onnxruntime") is None:
            return "int8 uses onnxruntime's quantization tools: pip install 'tk[cpu]'"
        return None

    def validate(self, options: OnnxOptions, export: ExportOptions) -> None:
        resolve_opset(options.opset)
        for name in ("int8_mode", "calibration_method", "nodes_to_exclude"):
            if export.precision != "int8" and getattr(options, name) not in (None, ()):
                flag = given(options)[name]
                raise UsageError(f"{flag}: applies to --precision int8 only; this export is {export.precision}")
        mode = options.int8_mode or "static"
        if mode not in INT8_MODES:
            raise UsageError(f"--int8-mode: expected one of {', '.join(INT8_MODES)}, got {mode!r}")
        method = options.calibration_method
        if method is not None and mode != "static":
            raise UsageError(f"--calibration-method: {mode} int8 is not calibrated; drop it or give --int8-mode static")
        if method is not None:
            from tk.export.onnx.static_int8 import METHODS

            if method not in METHODS:
                raise UsageError(
                    f"--calibration-method: static int8 ONNX calibrates with {', '.join(METHODS)}, got {method!r}"
                )
        if options.keep_unfused and options.fusions is False:
            raise UsageError("--keep-unfused: with --no-fuse the shipped model.onnx is the unfused graph already")
        if options.keep_unfused and not fuses(export.precision, mode):
            raise UsageError("--keep-unfused: dynamic int8 quantizes the unfused graph; no fused graph is made")

    def write(self, ctx: ExportContext) -> None:
        options: OnnxOptions = ctx.settings[self.name]
        plain: OnnxFile = ctx.require("onnx-plain")
        shutil.copyfile(plain.path, ctx.add_file(FILE, "onnx"))
        if plain.external_data is not None:
            shutil.copyfile(plain.external_data, ctx.add_file(plain.external_data.name, "onnx-data"))
        ctx.formats["onnx"] = {
            "file": FILE,
            "opset": plain.opset,
            "ir_version": plain.ir_version,
            "external_data": plain.external_data.name if plain.external_data else None,
            **({"fallback": plain.fallback} if plain.fallback else {}),
        }
        import onnx
        import onnxscript

        ctx.versions.setdefault("onnx", onnx.__version__)
        ctx.versions.setdefault("onnxscript", onnxscript.__version__)
        mode = options.int8_mode or "static"
        if options.fusions is not False and fuses(ctx.options.precision, mode):
            ctx.timed("fuse", lambda: fuse(ctx, keep_unfused=bool(options.keep_unfused)))
        if ctx.options.precision == "int8":
            method, exclude = options.calibration_method, options.nodes_to_exclude
            ctx.timed("int8", lambda: quantize(ctx, mode=mode, method=method, nodes_to_exclude=exclude))

    def provide(self, product: str, ctx: ExportContext) -> OnnxFile:
        assert product == "onnx-plain" and ctx.program is not None
        options: OnnxOptions = ctx.settings[self.name]
        return onnx_from_exported_program(
            ctx.program, ctx.scratch / FILE, ctx.spec.signature, ctx.dims, opset=options.opset, report_path=ctx.report
        )


WRITER = OnnxWriter()


def onnx_from_exported_program(
    program: torch.export.ExportedProgram,
    path: Path,
    signature: Signature,
    dims: dict[str, Dim],
    *,
    opset: int | None = None,
    report_path: Path | None = None,
) -> OnnxFile:
    """Write ``program`` as ONNX at ``path`` and validate it with ``onnx.checker`` (full check).

    ``opset`` defaults to 20 and must be at least 18. When the conversion fails and
    ``report_path`` is given, the exporter's own error report is written there.
    """
    import onnx
    import onnx_ir as ir

    opset = resolve_opset(opset)
    fallback = None
    try:
        onnx_program = _dynamo_export(program, signature, dims, opset)
    except Exception as exc:  # the exporter raises many types; each is a conversion failure
        try:
            onnx_program = _dynamo_export(views_as_reshapes(program.run_decompositions()), signature, dims, opset)
            fallback = f"decomposed to core ATen first, views written as reshapes (as captured: {failure_site(exc)})"
            log.warning("export onnx   the exporter failed on the program as captured (%s); converted it %s",
                        failure_site(exc), "decomposed first, its views written as reshapes")  # fmt: skip
        except Exception:  # the fallback failed too: report the first failure, which is the exporter's own
            message = (
                f"torch.onnx could not convert the exported program (opset {opset}; {failure_site(exc)}), nor with it "
                f"decomposed and its views as reshapes; {_next_step(exc)}"
            )
            written = _exporter_report(program, report_path, message, opset) if report_path is not None else None
            raise ConversionError(message + (f" (report: {written})" if written else "")) from exc
    model = onnx_program.model
    written = model.opset_imports.get("", opset)
    if written != opset:
        raise ConversionError(
            f"--opset {opset}: the exporter wrote opset {written} instead (torch.onnx converts only to the opsets it "
            "has rules for); choose another --opset"
        )
    _check_io_names(model, signature)
    _name_dynamic_axes(model, signature, dims)
    external = _initializer_bytes(model) > SINGLE_FILE_LIMIT
    data_path = path.with_name(path.name + ".data") if external else None
    ir.save(model, path, external_data=data_path.name if data_path else None)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # ValidationError, InferenceError, or a protobuf error
        raise ConversionError(
            f"{path.name}: the exported ONNX model fails onnx.checker: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return OnnxFile(path, model.opset_imports.get("", opset), data_path, model.ir_version, fallback)


def _dynamo_export(
    program: torch.export.ExportedProgram, signature: Signature, dims: dict[str, Dim], opset: int
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter warns about every axis that shares a name
        return torch.onnx.export(
            program,
            (),
            dynamo=True,
            opset_version=opset,
            input_names=[s.name for s in signature.inputs],
            output_names=[s.name for s in signature.outputs],
            dynamic_shapes=_axis_names(signature, dims),  # names the ONNX axes; the program is already captured
            optimize=True,
            verbose=False,
        )


def views_as_reshapes(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with every ``aten.view`` a ``reshape``: the same values (ONNX's Reshape copies anyway), and
    no stride check. torch.onnx's own decomposition pass re-checks views on fake tensors whose strides the
    capture did not keep, and fails on some (T5's attention: "Cannot view a tensor with shape ... and strides")."""
    changed = False
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
                changed = True
        if changed and isinstance(module, torch.fx.GraphModule):
            module.recompile()
    return program


_EXECUTING = re.compile(r"While executing %(\S+) : .*?target=([\w.:]+)")
_NO_FUNCTION = re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)', overload='([^']+)'\)>")
_SOURCE = re.compile(r"File: (\S+?):(\d+) in (\w+), code: (.*)")


def failure_site(exc: BaseException) -> str:
    """Where the exporter failed, from its messages: the operator, the user's source line, and the cause's
    first line (``aten.view.default (modeling_t5.py:306 ...): ValueError: Cannot view ...``)."""
    texts, seen = [], set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:  # the exporter's own chain (raise ... from ...)
        seen.add(id(cause))
        texts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__
    text = "\n".join(texts)
    missing = _NO_FUNCTION.search(text)
    if missing:
        return f"{missing.group(1)}.{missing.group(2)} has no ONNX function"
    op = _EXECUTING.search(text)
    source = _SOURCE.search(text)
    root = texts[-1].splitlines()[0] if texts else type(exc).__name__
    where = f"{op.group(2)}" if op else ""
    if source:
        where += f" ({Path(source.group(1)).name}:{source.group(2)} in {source.group(3)}: {source.group(4).strip()})"
    return f"{where + ': ' if where else ''}{root[:300]}"


def _next_step(exc: BaseException) -> str:
    """What would work: another opset only where the failure is an operator the opset lacks."""
    text = str(exc) + str(exc.__cause__ or "")
    if _NO_FUNCTION.search(text):  # torch.onnx's rules for an operator do not change with the opset
        return "no opset has it: export --format torch, aoti or openvino instead, or replace the operator in the model"
    if "opset" in text.lower() or "not supported" in text.lower():
        return "try another --opset, or export --format torch, aoti or openvino instead"
    return "export --format torch, aoti or openvino instead (they run the captured program without torch.onnx)"


def _axis_names(signature: Signature, dims: dict[str, Dim]) -> tuple[dict[int, str], ...] | None:
    """Per input, ``{axis: dimension name}`` for the dynamic axes; None when every axis is static."""
    names = tuple(
        {axis: d for axis, d in enumerate(spec.shape) if isinstance(d, str) and _dynamic(d, dims)}
        for spec in signature.inputs
    )
    return names if any(names) else None


def _dynamic(name: str, dims: dict[str, Dim]) -> bool:
    dim = dims.get(name)
    return dim is None or not dim.static


def _check_io_names(model: Any, signature: Signature) -> None:
    got_in = [v.name for v in model.graph.inputs]
    got_out = [v.name for v in model.graph.outputs]
    want_in = [s.name for s in signature.inputs]
    want_out = [s.name for s in signature.outputs]
    if got_in != want_in or got_out != want_out:
        raise ConversionError(
            f"the ONNX graph has inputs {got_in} and outputs {got_out}; the model's signature expects "
            f"{want_in} and {want_out} (does forward take inputs the model ignores, or return extra values?)"
        )


def _name_dynamic_axes(model: Any, signature: Signature, dims: dict[str, Dim]) -> None:
    """Rename the exporter's symbols (``s0``, ``s43``) to the tk dimension names everywhere in the graph.

    The exporter usually names the axes already; this covers the axes it does not.
    """
    import onnx_ir as ir

    mapping: dict[str, str] = {}
    pairs = [(s, v, True) for s, v in zip(signature.inputs, model.graph.inputs, strict=True)]
    pairs += [(s, v, False) for s, v in zip(signature.outputs, model.graph.outputs, strict=True)]
    for spec, value, is_input in pairs:
        shape = value.shape
        if shape is None or len(shape) != len(spec.shape):
            raise ConversionError(
                f"ONNX {value.name!r} has shape {shape}; the signature expects rank {len(spec.shape)}"
            )
        for axis, want in enumerate(spec.shape):
            if not isinstance(want, str) or not _dynamic(want, dims):
                continue
            got = shape[axis]
            if isinstance(got, ir.SymbolicDim) and got.value is not None:
                if got.value != want:
                    mapping.setdefault(got.value, want)
            elif is_input:
                raise ConversionError(
                    f"the exporter fixed axis {axis} ({want!r}) of input {spec.name!r} to {got}; "
                    f"export with --static, or check that the model keeps {want!r} dynamic"
                )
    if mapping:
        for value in _all_values(model):
            _rename_shape(value, mapping)


def _all_values(model: Any) -> list[Any]:
    import onnx_ir as ir

    values = [*model.graph.inputs, *model.graph.outputs]
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        values.extend(node.outputs)
    return values


def _rename_shape(value: Any, mapping: dict[str, str]) -> None:
    import onnx_ir as ir

    if value.shape is None:
        return
    dims = []
    changed = False
    for dim in value.shape:
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            new = _SYMBOL.sub(lambda m: mapping.get(m.group(0), m.group(0)), dim.value)  # also "2*s0", "s0 + 1"
            changed |= new != dim.value
            dims.append(new)
        else:
            dims.append(dim)
    if changed:
        value.shape = ir.Shape(dims)


def _initializer_bytes(model: Any) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _exporter_report(program: torch.export.ExportedProgram, path: Path, message: str, opset: int) -> Path | None:
    """Run the exporter again with ``report=True`` and keep its Markdown report at ``path``.

    The report names the operator that failed to translate, the program with the user's source
    lines, and the exporter's analysis of unsupported operators. None if it wrote no report.
    """
    import tempfile

    from tk.fileio import atomic_write_bytes

    with tempfile.TemporaryDirectory(prefix="tk-onnx-report-") as tmp:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    program, (), dynamo=True, opset_version=opset, report=True, artifacts_dir=tmp, verbose=False
                )
        except Exception:  # expected: the same failure, now with a report in tmp
            pass
        reports = sorted(Path(tmp).glob("*.md"))
        if not reports:
            return None
        header = f"# tk export: torch.onnx could not convert the program\n\n**Error:** {message}\n\n"
        atomic_write_bytes(path, header.encode() + reports[-1].read_bytes())
    return path
