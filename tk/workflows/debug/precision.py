"""``tk debug precision``: a small set of modules that, kept in float32, make the check pass.

In the spirit of Polygraphy's ``debug precision``, but over the user's own modules: the modules
that actually run (found with forward hooks) form a tree; a bisection over the top level finds a
small set whose float32 keeps the check passing, then each chosen module is refined into its
children while the check still passes. Each trial is judged like the export check (the
artifact's tolerances and SQNR floor, on random inputs at the min, opt, max and an odd size of
every dimension):
- fp16/bf16: the model under tk's cast policy (``tk.export.casts``) with the trial's
  modules kept, run eagerly. That is the computation the torch and aoti programs capture;
  onnxruntime's CPU kernels compute float16 graphs in float32, so an ONNX fp16 check can pass
  where this one fails.
- int8: the float32 ONNX graph written once, then quantized per trial with the modules' nodes
  excluded (``nodes_to_exclude``), run by onnxruntime.
Trials run through the int8 search's evaluator (``tk.export.int8.evaluator``: each shape's reference
computed once) and its unranked bisection (``tk.export.int8.search.minimize``, ``refine``).
The result is what ``tk export --keep-fp32`` applies.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tk.errors import UsageError
from tk.export.int8.evaluator import Evaluator, FeedsRunner
from tk.export.int8.search import minimize, refine
from tk.manifest import Manifest, verify_artifact
from tk.parity import OutputParity, compare
from tk.runtime.eager import module_from_manifest
from tk.signing import TrustPolicy
from tk.spec import random_feeds
from tk.tolerances import artifact_tolerance
from tk.workflows.check import shapes_to_check
from tk.workflows.debug.locate import recording

log = logging.getLogger("tk.debug")

MAX_TRIALS = 200  # a bound on the search (each trial runs the model over every check shape)


@dataclass
class Trial:
    keep: tuple[str, ...]
    passed: bool
    max_abs: float
    sqnr_db: float | None
    nonfinite: int


@dataclass
class PrecisionResult:
    precision: str
    keep: list[str]  # modules to keep in float32; empty when the check already passes
    before: Trial  # nothing kept
    after: Trial | None  # ``keep`` kept
    trials: int
    seconds: float
    command: str  # the tk export command that applies ``keep``
    judged_by: str
    candidates: int  # modules that run in the model
    history: list[Trial] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.after is not None and self.after.passed

    def to_json(self) -> dict[str, Any]:
        def trial(t: Trial | None) -> dict[str, Any] | None:
            if t is None:
                return None
            return {
                "keep": list(t.keep),
                "passed": t.passed,
                "max_abs": None if not math.isfinite(t.max_abs) else t.max_abs,
                "sqnr_db": t.sqnr_db,
                "nonfinite": t.nonfinite,
            }

        return {
            "precision": self.precision,
            "keep_fp32": self.keep,
            "before": trial(self.before),
            "after": trial(self.after),
            "trials": self.trials,
            "seconds": round(self.seconds, 2),
            "command": self.command,
            "judged_by": self.judged_by,
            "candidates": self.candidates,
            "history": [trial(t) for t in self.history],
        }


def _summary(keep: tuple[str, ...], results: list[OutputParity]) -> Trial:
    finite = [o.max_abs for o in results if o.nan + o.inf == 0]
    nonfinite = sum(o.nan + o.inf for o in results)
    sqnr = min((o.sqnr_db for o in results), default=math.inf)
    return Trial(
        keep,
        all(o.passed for o in results),
        max(finite, default=0.0) if not nonfinite else math.inf,
        None if math.isinf(sqnr) else round(sqnr, 2),
        nonfinite,
    )


class _Judge:
    """Judges one trial (a set of modules kept in float32) and caches the verdict: the candidate is run by
    the int8 search's evaluator (``tk.export.int8.evaluator``: the reference outputs computed once), and
    compared output by output as the check compares them (tolerances and SQNR floor)."""

    def __init__(self, evaluator: Evaluator, names: list[str], tolerance: tuple[float, float, float | None]) -> None:
        self.evaluator = evaluator
        self.names = names
        self.rtol, self.atol, self.min_sqnr = tolerance
        self.cache: dict[frozenset[str], Trial] = {}
        self.history: list[Trial] = []

    def __call__(self, keep: Sequence[str]) -> Trial:
        key = frozenset(keep)
        if key not in self.cache:
            if len(self.cache) >= MAX_TRIALS:
                raise UsageError(f"tk debug precision: no answer within {MAX_TRIALS} trials")
            kept = tuple(sorted(key))
            results: list[OutputParity] = []
            for index in self.evaluator.indices:
                reference = dict(zip(self.names, self.evaluator.reference(index), strict=True))
                outputs = dict(zip(self.names, self.evaluator.outputs_on(kept, index), strict=True))
                results += compare(reference, outputs, rtol=self.rtol, atol=self.atol, min_sqnr_db=self.min_sqnr)
            trial = _summary(kept, results)
            self.cache[key] = trial
            self.history.append(trial)
            log.info("debug  keep %-40s %s", ",".join(trial.keep) or "(none)", "pass" if trial.passed else "fail")
        return self.cache[key]

    def passes(self, keep: Sequence[str]) -> bool:
        return self(keep).passed


# how a trial's candidate is built: the modules kept in float32 -> a function that runs it on a batch
Keeping = Callable[[tuple[str, ...]], Callable[[dict[str, np.ndarray]], list[np.ndarray]]]


class _Runner(FeedsRunner):
    """The evaluator's runner: the float model run eagerly for the references; a candidate is a set of
    modules kept in float32, run as ``keeping`` builds it (the model under a cast policy, or a graph
    quantized with their nodes left out)."""

    def __init__(self, model: nn.Module, manifest: Manifest, names: list[str]) -> None:
        super().__init__(model)
        self.manifest, self.names = manifest, names
        self.keeping: Keeping | None = None  # set once the references are recorded

    def reference(self, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(_run_module(self.model, self.manifest, batch, self.names).values())

    def open(self, model: tuple[str, ...]) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        assert self.keeping is not None
        return self.keeping(model)


def _tree(executed: list[str]) -> dict[str, list[str]]:
    """Each executed module's executed children (nearest executed ancestor), in call order; root is ''."""
    children: dict[str, list[str]] = {}
    seen: set[str] = set()
    for path in executed:
        parent = path
        while True:
            parent = parent.rpartition(".")[0]
            if parent in seen or parent == "":
                break
        children.setdefault(parent, []).append(path)
        seen.add(path)
    return children


def export_command(manifest: Manifest, keep: list[str], root: str | Path) -> str:
    model = manifest.model
    size = f" --size {model['size']}" if model.get("size") else ""
    inputs = "".join(f" --input {d}" for d in model.get("input_descriptions") or ())
    formats = "".join(f" --format {f}" for f in manifest.formats)
    # the int8 trials quantize dynamically (static int8 excludes its costliest layers by itself)
    mode = " --int8-mode dynamic" if manifest.precision == "int8" else ""
    return (
        f"tk export {model['name']}{size}{inputs} --precision {manifest.precision}{mode}{formats} "
        f"--device {manifest.device} --keep-fp32 {','.join(keep)} --out {root}"
    )


def find_fp32_modules(
    root: str | Path, *, seed: int = 0, trust_model_code: bool = False, trust: TrustPolicy | None = None
) -> PrecisionResult:
    """Bisect over the model's modules for a small set that, kept in float32, passes the check (CPU)."""
    start = time.perf_counter()
    manifest = verify_artifact(root)
    if manifest.precision == "fp32":
        raise UsageError(f"{root}: a float32 artifact has nothing to keep in float32; expected fp16, bf16 or int8")
    model = module_from_manifest(root, manifest, trust_model_code=trust_model_code, trust=trust)
    tolerance = artifact_tolerance(manifest.precision, manifest.model)
    shapes = shapes_to_check(manifest.signature.dims)
    feeds = [random_feeds(manifest.signature.inputs, sizes, seed=seed + i) for i, sizes in enumerate(shapes)]
    names = [s.name for s in manifest.signature.outputs]
    runner = _Runner(model, manifest, names)
    evaluator = Evaluator.of(runner, feeds)
    with recording(model) as records:
        for index in evaluator.indices:
            evaluator.reference(index)
    executed = [r.path for r in sorted(records.values(), key=lambda r: r.call)]
    children = _tree(executed)
    with tempfile.TemporaryDirectory(prefix="tk-debug-int8-") as tmp:  # the int8 trials' graphs, removed after
        if manifest.precision == "int8":
            runner.keeping, judged_by = _int8_keeping(model, manifest, names, Path(tmp))
        else:
            runner.keeping, judged_by = _mixed_keeping(model, manifest, names)
        judge = _Judge(evaluator, names, tolerance)
        keep, before, after = _search(root, judge, children, executed)
    return PrecisionResult(
        manifest.precision,
        keep,
        before,
        after,
        len(judge.cache),
        time.perf_counter() - start,
        export_command(manifest, keep, root) if keep else "",
        judged_by,
        len(executed),
        judge.history,
    )


def _search(
    root: str | Path, judge: _Judge, children: dict[str, list[str]], executed: list[str]
) -> tuple[list[str], Trial, Trial | None]:
    """The modules to keep (``minimize`` over the top level, then ``refine`` into children), the trial with
    none kept and the one with them kept."""
    before = judge([])
    if before.passed:
        return [], before, before
    top = children.get("", [])
    if not judge.passes(top):
        every = judge(executed)
        if not every.passed:
            raise UsageError(
                f"{root}: the check fails even with every module kept in float32 (max abs error "
                f"{every.max_abs:.3g}); the difference is not in the modules' precision"
            )
        top = executed
    keep = refine(minimize(top, [], judge.passes), children, judge.passes)
    return keep, before, judge(keep)


def _run_module(
    module: nn.Module, manifest: Manifest, feeds: dict[str, np.ndarray], names: list[str]
) -> dict[str, np.ndarray]:
    args = [torch.from_numpy(feeds[s.name]) for s in manifest.signature.inputs]
    with torch.inference_mode():
        out = module(*args)
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    return {n: v.float().numpy() for n, v in zip(names, values, strict=True)}


def _mixed_keeping(model: nn.Module, manifest: Manifest, names: list[str]) -> tuple[Keeping, str]:
    from tk.export.casts import module_at_precision

    def keeping(keep: tuple[str, ...]) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        wrapped = module_at_precision(model, manifest.precision, "cpu", keep)
        return lambda feeds: list(_run_module(wrapped, manifest, feeds, names).values())

    return keeping, f"the model under tk's {manifest.precision} cast policy, run eagerly (what torch and aoti capture)"


def _int8_keeping(model: nn.Module, manifest: Manifest, names: list[str], tmp: Path) -> tuple[Keeping, str]:
    import onnx
    import onnxruntime as ort

    from tk.export.capture import exported_program_from_module
    from tk.export.onnx.dynamic_int8 import int8_onnx_from_onnx
    from tk.export.onnx.writer import onnx_from_exported_program
    from tk.formats.onnx_scopes import nodes_in_modules

    sig = manifest.signature
    at_opt = random_feeds(sig.inputs, sig.opt_sizes())  # a size-1 example would fix the dimension
    example = tuple(torch.from_numpy(at_opt[s.name]) for s in sig.inputs)
    program = exported_program_from_module(model, example, sig, sig.dims)
    opset = (manifest.formats.get("onnx") or {}).get("opset")
    fp32 = tmp / "fp32.onnx"
    onnx_from_exported_program(program, fp32, sig, sig.dims, opset=opset)
    graph = onnx.load(str(fp32))

    def keeping(keep: tuple[str, ...]) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        excluded = nodes_in_modules(graph, keep) if keep else []
        excluded += [f"{n}_MatMul" for n in excluded]
        target = tmp / "int8.onnx"
        int8_onnx_from_onnx(fp32, target, nodes_to_exclude=excluded)
        session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(names, feeds)

    return keeping, "the float32 ONNX graph quantized per trial (onnxruntime dynamic int8), on onnxruntime"
