"""Issue 47's pick goals: the engine ``tk optimize`` recommends for a Hugging Face encoder, against Optimum's
ONNX in onnxruntime, OpenVINO's default compile of it and (``nncf``) OpenVINO with NNCF's int8, in the fair
harness (``benchmarks.peers``: each fed the inputs its graph takes on realistic padded feeds, judged on those
feeds against transformers' float32 forward, timed in blocks both ways and alone, beside the model's floor).

The pick is the artifact of ``tk optimize hf:DIR --accuracy cosine>=BAR --out PICK``, opened with the
engine its manifest recommends (its native code is trusted: name only an artifact you made), and every
engine is held to that bar: ``GOALS`` says what the pick must do at 0.9999 (float) and at 0.999 (int8
allowed). The rivals are
what a user of those tools gets without tuning: Optimum's ``model.onnx`` in an onnxruntime session with
tk's session options and threads; that file compiled by ``openvino.Core().compile_model(model, "CPU")``
with no hints (bf16 on a CPU with bf16 products, float32 elsewhere); and, with ``nncf``, that model
quantized by ``nncf.quantize`` (its defaults, transformer model type) on 32 realistic inputs. Without
Optimum's file, tk's own unfused ONNX export stands in (the row's engine says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers import PeerSettings, Recipe, compare_peers, realistic_feeds
from tk.errors import UsageError
from tk.export import ExportOptions
from tk.export.onnx.writer import OnnxOptions
from tk.formats.openvino import precision_name
from tk.manifest import read_manifest
from tk.measure.floor import LinearSplit
from tk.models import build_model
from tk.workflows.export import export

PICK, OPTIMUM, OPENVINO, NNCF, EAGER = (
    "tk pick", "optimum onnx (onnxruntime)", "openvino default", "openvino nncf int8", "transformers eager",
)  # fmt: skip


@dataclass(frozen=True)
class PickGoal:
    """One of issue 47's pick goals: at min cosine >= ``bar`` against transformers' float32, ``speedup`` x
    ``against`` (a rival's engine name; None: the faster valid rival). Where the bar lets int8 in
    (``beat_int8``), the pick must also run ahead of OpenVINO + NNCF int8 when that rival holds the bar, at a
    cosine no lower than its own; an NNCF row under the bar is reported invalid, never beaten."""

    bar: float
    speedup: float
    against: str | None = None
    beat_int8: bool = False

    @property
    def text(self) -> str:
        rival = "the faster valid rival" if self.against is None else self.against
        int8 = f", and ahead of {NNCF} where it holds the bar" if self.beat_int8 else ""
        return f">= {self.speedup:g}x {rival} at min cosine >= {self.bar:g}{int8}"


GOALS = {0.9999: PickGoal(0.9999, 1.1), 0.999: PickGoal(0.999, 1.3, against=OPENVINO, beat_int8=True)}
PICK_COSINE_GOAL = 0.9999


@dataclass
class PickSettings:
    shapes: list[tuple[int, int]] = field(default_factory=lambda: [(8, 128)])  # batch x seq
    rounds: int = 6
    block: int = 5
    samples: int = 64  # inputs each engine's accuracy is measured on, per shape
    bar: float = PICK_COSINE_GOAL  # one of GOALS' bars: the goal the pick is judged by
    nncf: bool = False  # an OpenVINO + NNCF int8 rival too
    alone_calls: int = 30


def bench_pick(pick: Path, directory: Path, optimum_onnx: Path | None, s: PickSettings, work: Path) -> list[dict]:
    """One result of ``benchmarks.peers.compare_peers`` per batch x seq of ``s.shapes``, with the goal's verdict."""
    import openvino as ov

    if s.bar not in GOALS:
        raise UsageError(
            f"expected a pick bar of {' or '.join(f'{b:g}' for b in GOALS)} (issue 47's goals), found {s.bar:g}"
        )
    goal = GOALS[s.bar]
    spec = build_model(f"hf:{directory}")
    names = [i.name for i in spec.signature.inputs]
    manifest = read_manifest(pick)
    picked = [i.name for i in manifest.signature.inputs]
    if picked != names:
        raise UsageError(f"--pick {pick}: expected an artifact of {directory} (inputs {names}), found inputs {picked}")
    rival_onnx, rival_source = _rival_onnx(spec, optimum_onnx, work)
    default_precision = precision_name(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
    recommended = manifest.optimize.get("recommended") or {}
    vocab = int(spec.signature.inputs[0].high or 30522)
    recipes = [
        Recipe(PICK, "tk", str(pick), recommended.get("precision", manifest.precision), split=_split(manifest, recommended)),
        Recipe(OPTIMUM if rival_source == "optimum" else f"{rival_source} (onnxruntime)", "onnxruntime", str(rival_onnx)),
        Recipe(OPENVINO, "openvino", str(rival_onnx), "bf16" if default_precision == "bf16" else "fp32"),
    ]  # fmt: skip
    results = []
    for batch, seq in s.shapes:
        shape_recipes = list(recipes)
        if s.nncf:
            shape_recipes.append(Recipe(NNCF, "openvino", str(_nncf_int8(rival_onnx, seq, vocab, work)), "int8"))
        settings = PeerSettings(batch, seq, s.rounds, s.block, s.samples, s.bar, s.alone_calls, vocab)
        result = compare_peers(shape_recipes, Recipe(EAGER, "transformers", str(directory)), PICK, settings,
                               work / f"peers-{batch}x{seq}")  # fmt: skip
        pick_row = next(r for r in result["rows"] if r["engine"] == PICK)
        checks = judge(result, goal)
        result |= {
            "goal": f"optimize pick vs rivals, {directory.name}", "shape": f"{batch}x{seq}",
            "pick_artifact": {"format": recommended.get("format"), "precision": pick_row["precision"],
                              "engine_options": recommended.get("engine_options", {}),
                              "optimized_for": manifest.optimize.get("accuracy")},
            "goal_text": goal.text, "goal_checks": checks, "met": all(c["met"] for c in checks),
        }  # fmt: skip
        results.append(result)
    return results


def judge(result: dict[str, Any], goal: PickGoal) -> list[dict[str, Any]]:
    """Each of ``goal``'s conditions on ``result`` (``compare_peers``' rows and verdict): what was asked, what
    was measured, and whether it holds. A speed-up is the lower of the ratios in the blocks and alone."""
    rows = {r["engine"]: r for r in result["rows"]}
    mine = rows[PICK]
    checks = [{"check": f"pick's min cosine >= {goal.bar:g}", "value": mine["min_cosine"],
               "met": mine["min_cosine"] is not None and mine["min_cosine"] >= goal.bar}]  # fmt: skip
    if goal.against is None:
        speedup, rival = result["verdict"]["speedup"], result["verdict"]["faster_valid_rival"]
    else:
        rival = goal.against
        speedup = _speedup(mine, rows[rival]) if rows[rival]["valid"] else None
    checks.append({"check": f">= {goal.speedup:g}x {rival or 'a valid rival'}", "value": speedup,
                   "met": speedup is not None and speedup >= goal.speedup})  # fmt: skip
    int8 = rows.get(NNCF)
    if goal.beat_int8 and int8 is not None and int8["valid"]:
        ahead = _speedup(mine, int8)
        checks.append({"check": f"ahead of {NNCF} at a cosine >= its {int8['min_cosine']}", "value": ahead,
                       "met": ahead > 1.0 and mine["min_cosine"] >= int8["min_cosine"]})  # fmt: skip
    return checks


def _speedup(mine: dict[str, Any], rival: dict[str, Any]) -> float:
    """The pick's speed-up over ``rival``: the lower of the ratios in the blocks and alone."""
    return round(min(rival["ms"] / mine["ms"], rival["ms_alone"] / mine["ms_alone"]), 3)


def _split(manifest: Any, recommended: dict[str, Any]) -> dict[str, Any] | None:
    """What the pick runs in int8 where it is an int8 artifact with layers in another precision (its floor's
    layer-by-layer price), else None."""
    split = LinearSplit.of_engine(manifest, recommended.get("engine") or "")
    return None if split is None or split.int8 is None else split.to_json()


def _rival_onnx(spec: Any, optimum_onnx: Path | None, work: Path) -> tuple[Path, str]:
    """Optimum's ``model.onnx``, else tk's own unfused ONNX export written under ``work``."""
    if optimum_onnx is not None:
        if not (optimum_onnx / "model.onnx").is_file():
            raise UsageError(f"--optimum-onnx {optimum_onnx}: expected Optimum's export with a model.onnx, found none")
        return optimum_onnx / "model.onnx", "optimum"
    root = work / "rival"
    if not (root / "model.onnx").is_file():
        export(spec, root, ExportOptions(formats=("onnx",), check=False, settings={"onnx": OnnxOptions(fusions=False)}))
    return root / "model.onnx", "tk onnx unfused"


def _nncf_int8(onnx_file: Path, seq: int, vocab: int, work: Path) -> Path:
    """``onnx_file`` quantized by NNCF for OpenVINO (``nncf.quantize``, transformer model type) on 32 realistic
    inputs of ``seq`` tokens, saved as an IR under ``work``."""
    import nncf
    import openvino as ov

    out = work / f"nncf-int8-{seq}" / "model.xml"
    if out.is_file():
        return out
    model = ov.Core().read_model(str(onnx_file))
    inputs = [p.get_any_name() for p in model.inputs]
    samples = [realistic_feeds(1, seq, vocab, seed=1000 + i) for i in range(32)]
    dataset = nncf.Dataset(samples, lambda feeds: {k: np.ascontiguousarray(feeds[k]) for k in inputs})
    quantized = nncf.quantize(model, dataset, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples))
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out))
    return out
