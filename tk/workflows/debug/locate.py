"""``tk debug locate``: the first of the model's own modules whose output leaves the tolerance.

The float32 PyTorch model runs with a forward hook on every module; the engine's graph runs on
the same inputs with its intermediate values kept, and each value is mapped back to the module
that produced it:
- ``torch``: the saved ``torch.export`` program, run node by node (``torch.fx.Interpreter``);
  a node's module is the innermost entry of its ``nn_module_stack``.
- ``aoti``: a compiled package keeps no intermediates, so the program is captured again from the
  model at the artifact's precision (with its ``keep_fp32``) and compared the same way; the
  package's own outputs are compared as well.
- ``onnx``: a copy of the graph with the last values of each module added as graph outputs, run
  by onnxruntime; a node's module comes from the dynamo exporter's scope metadata. Extra outputs
  can change which fusions onnxruntime runs, so the copy's numbers may differ slightly from the
  engine's own (whose outputs are compared as well).
A module's output is the last value computed inside it whose shape is the shape the float32
module returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tk.errors import BackendUnavailableError, UsageError
from tk.formats.torch_program import load_artifact_program
from tk.manifest import Manifest, verify_artifact
from tk.parity import OutputParity, compare, compare_output
from tk.registries import ENGINE_FILE_ROLE
from tk.runtime import EngineChoice, open_engine
from tk.runtime.eager import module_from_manifest
from tk.runtime.inputs import random_inputs
from tk.signing import TrustPolicy, loads_native_code, require_trusted_code
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance
from tk.workflows.debug.onnx_values import linear_biases, onnx_values
from tk.workflows.user_inputs import read_user_inputs

GROWTH_FLOOR = 1e-7  # relative error treated as exact when computing growth (float32 rounding)
REDUCED = ("fp16", "bf16")  # captured through tk's cast-policy wrapper, whose module paths start with "module."


@dataclass
class ModuleRecord:
    """One module's output in the float32 model."""

    path: str
    kind: str  # the module's class name
    call: int  # call order (pre-hook)
    ready: int  # how many module outputs were complete when this module was called
    end: int  # completion order (hook): execution order of outputs
    output: np.ndarray


@dataclass
class ModuleError:
    module: str
    kind: str
    order: int  # position in execution order (when its output was complete)
    shape: list[int]
    max_abs: float
    max_rel: float
    sqnr_db: float | None
    nonfinite: int  # NaN and Inf in the engine's value
    passed: bool
    growth: float  # max_rel here / max_rel of the module that finished just before this one started
    problem: str | None = None


@dataclass
class LocateResult:
    engine: str
    precision: str
    via: str  # how the engine's intermediates were obtained
    notes: list[str]
    rtol: float
    atol: float
    min_sqnr_db: float | None
    rows: list[ModuleError]  # every compared module, in execution order
    unmatched: list[str]  # modules with no value of their output's shape in the engine's graph
    engine_outputs: list[OutputParity] = field(default_factory=list)  # the engine's own final outputs

    @property
    def first(self) -> ModuleError | None:
        return next((r for r in self.rows if not r.passed), None)

    def worst_growth(self, n: int = 10) -> list[ModuleError]:
        """The ``n`` modules whose error grows most over their input's (unknown growth last)."""
        rows = [r for r in self.rows if r.max_rel > 0 or not r.passed]
        return sorted(rows, key=lambda r: (math.isnan(r.growth), -_finite(r.growth), r.order))[:n]

    @property
    def engine_passed(self) -> bool:
        return all(o.passed for o in self.engine_outputs)

    def to_json(self) -> dict[str, Any]:
        def row(r: ModuleError) -> dict[str, Any]:
            d = asdict(r)
            for k in ("max_abs", "max_rel", "growth"):
                d[k] = None if not math.isfinite(d[k]) else d[k]
            return d

        first = self.first
        return {
            "engine": self.engine,
            "precision": self.precision,
            "via": self.via,
            "notes": self.notes,
            "rtol": self.rtol,
            "atol": self.atol,
            "min_sqnr_db": self.min_sqnr_db,
            "first_divergence": first.module if first else None,
            "modules": [row(r) for r in self.rows],
            "unmatched": self.unmatched,
            "engine_outputs": [
                {"name": o.name, "max_abs": o.max_abs, "max_rel": o.max_rel, "passed": o.passed, "problem": o.problem}
                for o in self.engine_outputs
            ],
        }


def _finite(x: float) -> float:
    return 0.0 if math.isnan(x) else (x if math.isfinite(x) else 1e300)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


@contextmanager
def recording(model: nn.Module) -> Iterator[dict[str, ModuleRecord]]:
    """Forward hooks on every submodule of ``model``: its first floating output of the call, in order."""
    records: dict[str, ModuleRecord] = {}
    ready: dict[str, tuple[int, int]] = {}
    counter = {"end": 0, "call": 0}
    handles = []

    def pre(path: str) -> Any:
        def hook(*_: Any) -> None:
            if path not in ready:
                ready[path] = (counter["call"], counter["end"])
                counter["call"] += 1

        return hook

    def post(path: str, module: nn.Module) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            tensor = _first_tensor(out)
            if path in records or tensor is None or not tensor.is_floating_point():
                return
            counter["end"] += 1
            array = tensor.detach().float().cpu().numpy().copy()
            records[path] = ModuleRecord(path, type(module).__name__, *ready.get(path, (0, 0)), counter["end"], array)

        return hook

    try:
        for path, module in model.named_modules():
            if path:
                handles.append(module.register_forward_pre_hook(pre(path)))
                handles.append(module.register_forward_hook(post(path, module)))
        yield records
    finally:
        for h in handles:
            h.remove()


def choose_feeds(
    manifest: Manifest, *, inputs: str | Path | None, samples: int | None, seed: int
) -> dict[str, np.ndarray]:
    """The user's file, ``samples`` random samples, or valid random inputs at every dimension's opt size."""
    sig = manifest.signature
    if inputs is not None and samples is not None:
        raise UsageError("expected at most one of --inputs FILE and --samples N")
    if inputs is not None:
        return read_user_inputs(inputs, manifest.model["name"], sig.inputs, sig.dims)
    if samples is not None:
        return random_inputs(sig.inputs, sig.dims, samples, seed=seed)
    return random_feeds(sig.inputs, sig.opt_sizes(), seed=seed)


def _args(manifest: Manifest, feeds: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(feeds[s.name])) for s in manifest.signature.inputs]


# ----------------------------------------------------------------- torch.export programs (torch, aoti)
def _program_values(
    program: torch.export.ExportedProgram, args: list[torch.Tensor], wrapped: bool
) -> list[tuple[str, Any]]:
    """(innermost module path, value) for every node of ``program``, in graph order."""
    gm = program.module()
    found: list[tuple[str, Any]] = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            stack = n.meta.get("nn_module_stack") or {}
            if stack and isinstance(value, torch.Tensor):
                paths = [_user_path(str(p[0]), wrapped) for p in stack.values()]
                found.append(("\x00".join(p for p in paths if p), value.detach()))
            return value

    with torch.inference_mode():
        Recorder(gm).run(*args)
    return found


def _user_path(path: str, wrapped: bool) -> str | None:
    if not wrapped:
        return path
    if path.startswith("module."):
        return path[len("module.") :]
    return None  # the wrapper itself, or its ``module`` attribute (the user's root)


def _outputs_from_program(values: list[tuple[str, Any]], records: dict[str, ModuleRecord]) -> dict[str, np.ndarray]:
    """Per module: the last value computed inside it (in any submodule) with the module's output shape."""
    out: dict[str, np.ndarray] = {}
    for paths, value in values:
        for path in paths.split("\x00"):
            rec = records.get(path)
            if rec is not None and tuple(value.shape) == rec.output.shape and value.is_floating_point():
                out[path] = value  # later values overwrite earlier ones
    return {p: v.float().cpu().numpy() for p, v in out.items()}


def _recaptured_program(model: nn.Module, manifest: Manifest) -> torch.export.ExportedProgram:
    from tk.export.capture import exported_program_from_module
    from tk.export.casts import module_at_precision

    keep = tuple(manifest.model.get("keep_fp32") or ())
    module = module_at_precision(model, manifest.precision, "cpu", keep)
    sig = manifest.signature
    at_opt = random_feeds(sig.inputs, sig.opt_sizes())  # as export captures: a size-1 example would fix the dimension
    example = tuple(torch.from_numpy(at_opt[s.name]) for s in sig.inputs)
    return exported_program_from_module(module, example, sig, sig.dims)


# ------------------------------------------------------------------------------------- locate
def locate(
    root: str | Path,
    engine: str,
    *,
    inputs: str | Path | None = None,
    samples: int | None = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    trust_model_code: bool = False,
    trust: TrustPolicy | None = None,
) -> LocateResult:
    """Compare the intermediate outputs of ``engine``'s graph with the float32 model's, module by module.

    Inputs: the file ``inputs``, ``samples`` random samples, or random inputs at the opt sizes.
    Tolerances: the artifact's (as ``tk check``), or ``rtol``/``atol``. CPU only. ``trust``:
    whose signatures let the aoti package load (checked first, before any work).
    """
    if engine not in READERS:
        raise UsageError(f"--engine: expected one of {', '.join(READERS)}, got {engine!r}")
    root = Path(root)
    manifest = verify_artifact(root)
    manifest.file(ENGINE_FILE_ROLE[engine])  # a clear error, naming what it holds, when the artifact lacks the format
    if manifest.precision == "int8" and not READERS[engine].reads_int8:
        int8 = ", ".join(name for name, reader in READERS.items() if reader.reads_int8)
        raise UsageError(f"--engine {engine}: its graph is read at float precision, not int8; use --engine {int8}")
    if loads_native_code(root, manifest, ENGINE_FILE_ROLE[engine]):
        require_trusted_code(root, manifest, trust, engine)
    rtol, atol, min_sqnr = artifact_tolerance(manifest.precision, manifest.model, rtol=rtol, atol=atol)
    feeds = choose_feeds(manifest, inputs=inputs, samples=samples, seed=seed)
    model = module_from_manifest(root, manifest, trust_model_code=trust_model_code, trust=trust)
    args = _args(manifest, feeds)
    with recording(model) as records, torch.inference_mode():
        final = _arrays(model(*args))  # the float32 model runs once: its outputs are the engine's reference too
    nan = sum(int(np.isnan(np.asarray(a, dtype=np.float64)).sum()) for a in final)
    if nan:  # every comparison below would match NaN with NaN and call it a pass
        raise UsageError(
            f"the PyTorch model itself produces {nan} NaN values on these inputs, so no divergence can be located; "
            "check the inputs (NaN or Inf in them?) or the checkpoint"
        )
    notes: list[str] = []
    values, via = _graph_values(root, manifest, engine, model, args, feeds, records, notes, trust)
    rows, unmatched = _module_rows(records, values, rtol, atol, min_sqnr)
    if unmatched:
        notes.append(
            f"{len(unmatched)} module(s) have no value of their output's shape in the graph (fused, folded, "
            "or nodes without scope metadata such as onnxruntime's quantized ones): listed under unmatched"
        )
    found = LocateResult(engine, manifest.precision, via, notes, rtol, atol, min_sqnr, rows, unmatched)
    with open_engine(root, EngineChoice(engine, allow_failed=True, trust=trust), manifest=manifest) as candidate:
        reference_out = dict(zip([s.name for s in manifest.signature.outputs], final, strict=True))
        found.engine_outputs = compare(reference_out, candidate.run(feeds), rtol=rtol, atol=atol, min_sqnr_db=min_sqnr)
    if found.first is not None and found.engine_passed:
        notes.append(
            f"the {engine} engine's own outputs are within tolerance: the divergence above appears only in the "
            f"instrumented graph{READERS[engine].divergence}"
        )
    return found


@dataclass(frozen=True)
class GraphReader:
    """How one engine's graph gives up its intermediate values: ``read(root, manifest, model, args, feeds,
    records, trust)`` -> values by module path; ``via`` says how; ``note`` goes under the table; ``divergence``
    is added where only the instrumented graph diverges."""

    read: Callable[..., dict[str, Any]]
    via: str
    note: str = ""
    divergence: str = ""
    reads_int8: bool = False  # the values read are the int8 graph's own (a recaptured program is float)


def _program_reader(root: Path, manifest: Manifest, model: Any, args: tuple[Any, ...], feeds: dict[str, np.ndarray],
                    records: dict[str, Any], trust: TrustPolicy | None) -> dict[str, Any]:  # fmt: skip
    program = load_artifact_program(root, manifest, trust)
    return _outputs_from_program(_program_values(program, args, manifest.precision in REDUCED), records)


def _recapture_reader(root: Path, manifest: Manifest, model: Any, args: tuple[Any, ...], feeds: dict[str, np.ndarray],
                      records: dict[str, Any], trust: TrustPolicy | None) -> dict[str, Any]:  # fmt: skip
    program = _recaptured_program(model, manifest)
    return _outputs_from_program(_program_values(program, args, manifest.precision in REDUCED), records)


def _onnx_reader(root: Path, manifest: Manifest, model: Any, args: tuple[Any, ...], feeds: dict[str, np.ndarray],
                 records: dict[str, Any], trust: TrustPolicy | None) -> dict[str, Any]:  # fmt: skip
    try:
        return onnx_values(root, manifest, feeds, records, linear_biases(model), wrapped=manifest.precision in REDUCED)
    except ImportError as exc:
        raise BackendUnavailableError(f"--engine onnx needs onnxruntime and onnx_ir: {exc}") from exc


# engine -> how its graph is read; the engines tk debug locate takes (a registry: nothing else names them)
READERS: dict[str, GraphReader] = {
    "torch": GraphReader(_program_reader, "the saved torch.export program, node by node"),
    "aoti": GraphReader(
        _recapture_reader,
        "the exported program captured again at the artifact's precision (aoti's compiled kernels keep no intermediates)",
        "aoti: module errors come from the torch.export program at the artifact's precision, not from the compiled "
        "package; the package's own outputs are compared below",
    ),
    "onnx": GraphReader(
        _onnx_reader,
        "a copy of the ONNX graph with module outputs added, on onnxruntime (CPU)",
        "onnx: the module outputs were added as graph outputs of a copy; this can change which fusions onnxruntime "
        "runs, so the engine's own outputs are compared below",
        " (its extra outputs keep float16 values onnxruntime otherwise computes in float32)",
        reads_int8=True,
    ),
}


def _graph_values(
    root: Path,
    manifest: Manifest,
    engine: str,
    model: Any,
    args: tuple[Any, ...],
    feeds: dict[str, np.ndarray],
    records: dict[str, Any],
    notes: list[str],
    trust: TrustPolicy | None = None,
) -> tuple[dict[str, Any], str]:
    """The module outputs ``engine``'s graph computes (matched to ``records``), and how they were read; adds notes."""
    reader = READERS[engine]
    manifest.file(ENGINE_FILE_ROLE[engine])  # a clear error when the artifact lacks the format
    values = reader.read(root, manifest, model, args, feeds, records, trust)
    if reader.note:
        notes.append(reader.note)
    return values, reader.via


def _module_rows(
    records: dict[str, Any], values: dict[str, Any], rtol: float, atol: float, min_sqnr: float | None
) -> tuple[list[ModuleError], list[str]]:
    """One row per recorded module the graph has a value for, in execution order, and the modules it has none for."""
    rows: list[ModuleError] = []
    ordered = sorted(records.values(), key=lambda r: r.end)
    errors_by_end: list[tuple[int, float]] = []
    for rec in ordered:
        if rec.path not in values:
            continue
        result = compare_output(rec.path, rec.output, values[rec.path], rtol, atol, min_sqnr)
        rel = result.max_rel if (result.nan + result.inf) == 0 else math.inf
        before = [err for end, err in errors_by_end if end <= rec.ready]  # what fed this module
        prior = before[-1] if before else math.nan
        if math.isnan(prior):  # nothing compared feeds it (the first module, or unmatched predecessors)
            growth = math.nan
        elif math.isinf(rel):
            growth = 1.0 if math.isinf(prior) else math.inf
        else:
            growth = rel / max(prior, GROWTH_FLOOR)
        rows.append(
            ModuleError(
                rec.path,
                rec.kind,
                len(rows),
                list(rec.output.shape),
                result.max_abs,
                rel,
                None if math.isinf(result.sqnr_db) else round(result.sqnr_db, 2),
                result.nan + result.inf,
                result.passed,
                growth,
                result.problem,
            )
        )
        errors_by_end.append((rec.end, rel))
    unmatched = [r.path for r in ordered if r.path not in values]
    return rows, unmatched


def _arrays(out: Any) -> list[np.ndarray]:
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    return [v.float().numpy() for v in values]
