"""Issue 22's first goal: the engine ``tk optimize`` recommends for a Hugging Face encoder, against
Optimum's ONNX in onnxruntime and OpenVINO's default compile of the same graph.

The pick is the artifact of ``tk optimize hf:DIR --accuracy cosine>=0.9999 --out PICK``, opened with
the engine its manifest recommends (``tk.runtime.load(PICK)``; its native code is trusted: name only an
artifact you made). The rivals are what a user of those tools gets without tuning: Optimum's
``model.onnx`` in an onnxruntime session with the same options and threads as tk's sessions, and that
file compiled by ``openvino.Core().compile_model(model, "CPU")`` with no hints (bf16 on a CPU with
bf16 products, float32 elsewhere). Without Optimum's file, tk's own unfused ONNX export stands in for
both (the row says so). Each engine's accuracy is the lowest cosine, over ``samples`` padded random
inputs at the row's sequence length, of its mask-pooled first output against transformers' float32
forward; all are timed interleaved, call by call, under the load guard, with transformers' eager
forward as the fourth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.accuracy import measure_outputs
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.export.onnx.writer import OnnxOptions
from tk.measure.load_guard import LoadGuard
from tk.measure.timing import interleave_calls, ms
from tk.models import build_model
from tk.signing import TrustPolicy
from tk.spec import random_feeds
from tk.workflows.export import export
from tk.workflows.ort_session import plain_session

PICK_SPEEDUP_GOAL = 1.3  # x the faster rival
PICK_COSINE_GOAL = 0.9999
PICK, OPTIMUM, OPENVINO, EAGER = "tk pick", "optimum onnx (onnxruntime)", "openvino default", "transformers eager"


@dataclass
class PickSettings:
    shapes: list[tuple[int, int]] = field(default_factory=lambda: [(8, 128), (1, 128)])  # batch x seq
    iters: int = 30  # interleaved rounds at batch 8 (x 8 / batch below)
    samples: int = 64  # inputs each engine's cosine is measured on, per sequence length
    guard: LoadGuard = field(default_factory=LoadGuard)


def bench_pick(pick: Path, directory: Path, optimum_onnx: Path | None, s: PickSettings, work: Path) -> list[dict]:
    """One row per batch x seq of ``s.shapes``: the pick, both rivals and eager, timed and judged."""
    import openvino as ov
    from transformers import AutoModel

    from tk.runtime import load

    spec = build_model(f"hf:{directory}")
    names = [i.name for i in spec.signature.inputs]
    engine = load(pick, trust=TrustPolicy(trust_artifact_code=True, warn=False))
    picked = [i.name for i in engine.inputs]
    if picked != names:
        raise UsageError(f"--pick {pick}: expected an artifact of {directory} (inputs {names}), found inputs {picked}")
    recommended = engine.manifest.optimize.get("recommended") or {}
    pick_output = engine.outputs[0].name
    rival_onnx, rival_source = _rival_onnx(spec, optimum_onnx, work)
    session = plain_session(rival_onnx, torch.get_num_threads())
    optimum_inputs = [i.name for i in session.get_inputs()]  # Optimum leaves out inputs its graph does not use
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(rival_onnx)), "CPU")
    openvino_inputs = [p.get_any_name() for p in compiled.inputs]
    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()

    def run_pick(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(engine.run(feeds, check=False)[pick_output])

    def run_optimum(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return session.run(None, {name: feeds[name] for name in optimum_inputs})[0]

    def run_openvino(feeds: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(compiled({name: feeds[name] for name in openvino_inputs})[0])

    def run_eager(feeds: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            return model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()

    runners = {PICK: run_pick, OPTIMUM: run_optimum, OPENVINO: run_openvino, EAGER: run_eager}
    rows: list[dict] = []
    cosines: dict[int, dict[str, float]] = {}
    for batch, seq in s.shapes:
        if seq not in cosines:
            cosines[seq] = _min_cosines(runners, spec.signature.inputs, names, seq, s.samples)
        feeds = random_feeds(spec.signature.inputs, {"batch": batch, "seq": seq}, seed=7)  # padded masks
        iters = s.iters * max(1, 8 // batch)
        calls = {name: (lambda run=run, feeds=feeds: run(feeds)) for name, run in runners.items()}
        times, mark = interleave_calls(calls, iters=iters, guard=s.guard)
        median = {name: ms([t.total_s for t in samples]) for name, samples in times.items()}
        rival = min(OPTIMUM, OPENVINO, key=median.__getitem__)
        speedup = round(median[rival] / median[PICK], 3)  # the verdict follows the number the row shows
        cos = cosines[seq]
        rows.append(
            {
                "goal": f"optimize pick vs rivals, {directory.name}",
                "shape": f"{batch}x{seq}",
                "iters": iters,
                "pick": {
                    "engine": engine.name,
                    "format": recommended.get("format"),
                    "precision": recommended.get("precision", engine.manifest.precision),
                },
                "rival_onnx": rival_source,
                "ms": {name: round(v, 4) for name, v in median.items()},
                "min_cosine": cos,
                "samples": s.samples,
                "faster_rival": rival,
                "speedup_vs_faster_rival": speedup,
                "speedup_vs_eager": round(median[EAGER] / median[PICK], 3),
                "goal_text": f">= {PICK_SPEEDUP_GOAL:g}x the faster rival at min cosine >= {PICK_COSINE_GOAL:g}",
                "met": bool(speedup >= PICK_SPEEDUP_GOAL and cos[PICK] >= PICK_COSINE_GOAL),
            }
            | mark.to_json()
        )
    return rows


def _rival_onnx(spec: Any, optimum_onnx: Path | None, work: Path) -> tuple[Path, str]:
    """Optimum's ``model.onnx``, else tk's own unfused ONNX export written under ``work``."""
    if optimum_onnx is not None:
        if not (optimum_onnx / "model.onnx").is_file():
            raise UsageError(f"--optimum-onnx {optimum_onnx}: expected Optimum's export with a model.onnx, found none")
        return optimum_onnx / "model.onnx", "optimum"
    root = work / "rival"
    export(spec, root, ExportOptions(formats=("onnx",), check=False, settings={"onnx": OnnxOptions(fusions=False)}))
    return root / "model.onnx", "tk onnx unfused (no Optimum export given)"


def _min_cosines(
    runners: dict[str, Any], inputs: list[Any], names: list[str], seq: int, samples: int
) -> dict[str, float]:
    """Each runner's lowest cosine against transformers (the ``EAGER`` runner) over ``samples`` padded
    random inputs at ``seq`` tokens, run 8 at a time."""
    worst = {name: math.inf for name in runners if name != EAGER}
    all_feeds = random_feeds(inputs, {"batch": samples, "seq": seq}, seed=11)
    mask = next((v for k, v in all_feeds.items() if "mask" in k), None)
    for start in range(0, samples, 8):
        feeds = {k: np.ascontiguousarray(all_feeds[k][start : start + 8]) for k in names}
        part = None if mask is None else mask[start : start + 8]
        want = runners[EAGER](feeds)
        for name in worst:
            values, _ = measure_outputs({"out": want}, {"out": runners[name](feeds)}, mask=part)
            worst[name] = min(worst[name], float(values["cosine"] if values["cosine"] is not None else -1.0))
    return {name: round(v, 7) for name, v in worst.items()}
