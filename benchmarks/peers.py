"""A comparison with peers that cannot flatter tk (issue 47): one harness for every goal script that puts tk's
artifact beside other tools' engines of the same encoder.

- **Fed as each graph wants, on realistic inputs.** Every engine gets exactly the inputs its graph takes
  (Optimum's ONNX of a BERT leaves out ``token_type_ids``) from one set of feeds that looks like a tokenizer's:
  prompts of different lengths padded on the right with the pad id, the mask 0 there, ``token_type_ids``
  all 0 (``realistic_feeds``).
- **Accuracy on those very feeds.** Each engine's first output is compared with the framework's float32
  model on the same feeds (the lowest cosine of a sample over its real tokens); an engine below the bar the
  pick is held to is *invalid*: its row says so and no speed-up is claimed against it.
- **Timed in alternating blocks, the others idle.** ``block`` calls of one engine, then ``block`` of the
  next, round after round, the order rotating every round (``time_both_ways``); onnxruntime sessions do
  not spin between runs (``plain_session``), so no runtime's threads busy-wait while another runs. Each
  round runs a second time in the reverse order right after, and each engine is timed again **alone in a
  fresh process** (``python -m benchmarks.peers alone``; one pass before the blocks, one between their
  halves in the reverse order, one after them): the table shows all three medians and the largest gap,
  and the pick's speed-up is the lower of its ratio in the blocks and alone.
  The caption says whether each engine's medians in order and reversed agree within 5% (whichever engine
  goes first), whether its lone median does too, and whether the pick's ratio to each rival does: a slow
  minute moves every engine's timings, an engine favoured by its turn moves a ratio.
  Alone is the clean number: in one process torch's OpenMP threads, OpenVINO's oneTBB threads (which wait
  actively after an inference, OpenVINO's docs say) and onnxruntime's share the cores, and MiniLM's OpenVINO
  engines ran 6-10% faster alone than in the shared process (benchmarks/history.md).
- **One malloc for all.** tk's command line sets glibc's malloc to keep what a call frees
  (``tk.runtime.allocator``); every process here sets it before any engine opens, the rivals' lone
  processes and the floor's included, so no engine runs with a malloc another did not get (transformers'
  MiniLM ran 100-108 ms in a fresh process with glibc's defaults and 83-88 with it).
- **The model's floor.** ``tk.measure.floor.ModelFloor`` samples between blocks: the time of the model's
  linear and attention products at their shapes in each engine's precision, counted for the real tokens
  (``tk.measure.floor.at_real_tokens``: linears on the real tokens alone, attention per sequence at its
  length; with the padding counted, an aoti package that removes it read 107% of its "floor"); and again
  in a process of its own (``python -m benchmarks.peers floor``). The lower median is the floor: each row
  shows its share.

``Recipe`` says how to open an engine in any process (a kind, a path, options): ``tk`` (an artifact, opened
with ``tk.runtime.load``; its native code trusted: name only your own), ``onnxruntime`` (an ONNX file),
``openvino`` (an ONNX file or IR compiled for the CPU with ``options`` as its configuration: ``{}`` is
OpenVINO's default) and ``transformers`` (a directory, float32: the reference).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.measure.timing import time_in_blocks
from tk.runtime.allocator import keep_freed_memory

KINDS = ("tk", "onnxruntime", "openvino", "transformers")
AGREE_WITHIN = 0.05  # the orders' and the lone process's medians within 5% of each other


@dataclass(frozen=True)
class Recipe:
    name: str
    kind: str
    path: str
    precision: str = "fp32"  # what its products run in: picks its floor
    # an int8 artifact that runs some linears in another precision: ``LinearSplit.to_json()``, which prices its
    # floor layer by layer (None: every product in ``precision``; so too a split whose int8 linears are unknown)
    split: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"recipe {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass
class Opened:
    """An engine opened from its recipe: the inputs its graph takes and a call on exactly those."""

    recipe: Recipe
    inputs: list[str]
    call: Callable[[dict[str, np.ndarray]], np.ndarray]

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.call({name: feeds[name] for name in self.inputs})


def open_recipe(recipe: Recipe, threads: int | None = None) -> Opened:
    """``recipe``'s engine, opened in this process with ``threads`` (default: torch's) where it takes a count."""
    threads = threads or torch.get_num_threads()
    if recipe.kind == "tk":
        from tk.manifest import read_manifest
        from tk.runtime import load
        from tk.runtime.registry import engine_class
        from tk.signing import TrustPolicy

        name = read_manifest(recipe.path).recommended_engine or "onnx"
        quiet = {"spinning": False} if "spinning" in engine_class(name).option_names() else {}  # as the rivals
        # no engine named: the recommended one, with the engine settings tk optimize chose for it (streams)
        engine = load(recipe.path, None, trust=TrustPolicy(trust_artifact_code=True, warn=False), **quiet)
        output = engine.outputs[0].name
        return Opened(recipe, [i.name for i in engine.inputs],
                      lambda feeds: np.asarray(engine.run(feeds, check=False)[output]))  # fmt: skip
    if recipe.kind == "onnxruntime":
        from tk.workflows.ort_session import plain_session

        session = plain_session(recipe.path, threads)
        return Opened(recipe, [i.name for i in session.get_inputs()], lambda feeds: session.run(None, feeds)[0])
    if recipe.kind == "openvino":
        import openvino as ov

        core = ov.Core()
        compiled = core.compile_model(core.read_model(recipe.path), "CPU", dict(recipe.options))
        request = compiled.create_infer_request()
        return Opened(recipe, [p.get_any_name() for p in compiled.inputs],
                      lambda feeds: np.array(request.infer(feeds)[compiled.output(0)]))  # fmt: skip
    from transformers import AutoModel

    model = AutoModel.from_pretrained(recipe.path, local_files_only=True, dtype=torch.float32).eval()
    takes = inspect.signature(model.forward).parameters
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in takes]

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            return model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()

    return Opened(recipe, names, run)


def realistic_feeds(batch: int, seq: int, vocab: int, seed: int, *, cls: int = 101, sep: int = 102,
                    pad: int = 0) -> dict[str, np.ndarray]:  # fmt: skip
    """A tokenizer's batch: lengths from a quarter of ``seq`` to ``seq`` (the longest exactly ``seq``), ``cls``
    first and ``sep`` last, random word ids between, ``pad`` after with the mask 0, ``token_type_ids`` all 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(2, seq // 4), seq + 1, size=batch)
    lengths[0] = seq
    ids = np.full((batch, seq), pad, dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(max(sep, cls) + 1, vocab, size=length)
        ids[row, 0], ids[row, length - 1] = cls, sep
        mask[row, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def min_cosines(engines: dict[str, Opened], reference: Opened, feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Each engine's lowest cosine against ``reference`` over every sample of ``feeds``, at real tokens."""
    from tk.accuracy import measure_outputs

    worst = dict.fromkeys(engines, math.inf)
    for batch in feeds:
        want = reference(batch)
        for name, engine in engines.items():
            values, _ = measure_outputs({"out": want}, {"out": engine(batch)}, mask=batch["attention_mask"])
            worst[name] = min(worst[name], float(values["cosine"] if values["cosine"] is not None else -1.0))
    return {name: round(v, 7) for name, v in worst.items()}


def time_alone(recipe: Recipe, feeds_file: Path, calls: int, threads: int) -> list[float]:
    """``recipe``'s call times in a fresh Python process where it is the only engine."""
    command = [sys.executable, "-m", "benchmarks.peers", "alone", json.dumps(asdict(recipe)), str(feeds_file),
               str(calls), str(threads)]  # fmt: skip
    return _worker(command)


def _worker(command: list[str]) -> list[float]:
    """The times a ``python -m benchmarks.peers`` worker printed last; its stderr's end if it failed."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[3:5])[:200]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def floor_alone(precision: str, products: list[Any], samples: int, threads: int) -> list[list[float]]:
    """The floor of ``products`` in ``precision`` sampled in a fresh Python process that runs nothing else: per
    sample, one call of each product (``ModelFloor.product_samples``)."""
    listed = json.dumps([asdict(p) for p in products])
    command = [sys.executable, "-m", "benchmarks.peers", "floor", precision, listed, str(samples), str(threads)]
    return _worker(command)


def _floor_main(precision: str, listed: str, samples: str, threads: str) -> None:
    from tk.measure.floor import ModelFloor, Product

    torch.set_num_threads(int(threads))
    keep_freed_memory(asked=True)
    floor = ModelFloor(precision, [Product(**p) for p in json.loads(listed)])
    for _ in range(int(samples)):
        floor()
    print(json.dumps(floor.product_samples))


def _alone_main(recipe_json: str, feeds_file: str, calls: str, threads: str) -> None:
    torch.set_num_threads(int(threads))
    keep_freed_memory(asked=True)  # the rivals' processes run with the malloc tk's command line gives its engines
    engine = open_recipe(Recipe(**json.loads(recipe_json)), int(threads))
    with np.load(feeds_file) as stored:
        feeds = {k: stored[k] for k in stored.files}
    for _ in range(3):
        engine(feeds)
    times = []
    for _ in range(int(calls)):
        start = time.perf_counter()
        engine(feeds)
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def time_both_ways(calls: Mapping[str, Callable[[], object]], *, rounds: range, block: int, order: Sequence[str],
                   between: Sequence[Callable[[], object]] = ()) -> tuple[dict[str, list[float]], dict[str, list[float]]]:  # fmt: skip
    """Each call's times in blocks (``time_in_blocks``) in ``order`` and in the reverse order, one round of each
    in turn (in order, reversed, in order...) so both see the same minutes, the order rotated by the round's
    number: in order each call follows its predecessor in ``order``, reversed its successor. The reversed round
    starts two places on, so that with three calls or more no call follows its own block."""
    forward: dict[str, list[float]] = {name: [] for name in order}
    backward: dict[str, list[float]] = {name: [] for name in order}

    def rotated(by: int) -> list[str]:
        return [*order[by % len(order) :], *order[: by % len(order)]]

    for r in rounds:
        for times, this_way in ((forward, rotated(r)), (backward, rotated(r + 2)[::-1])):
            for name, got in time_in_blocks(calls, rounds=1, block=block, order=this_way, between=between).items():
                times[name] += got
    return forward, backward


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


@dataclass
class PeerSettings:
    batch: int = 8
    seq: int = 128
    rounds: int = 6  # rounds of blocks, in each order
    block: int = 5  # calls of one engine in a row
    samples: int = 64  # inputs each engine's accuracy is measured on (batches of 8), besides the timed batch
    bar: float = 0.9999  # the lowest cosine the pick is held to: a rival below it is invalid
    alone_calls: int = 30
    vocab: int = 30522
    seed: int = 7


def compare_peers(recipes: list[Recipe], reference: Recipe, pick: str, s: PeerSettings, work: Path) -> dict[str, Any]:
    """One table: ``recipes`` (the pick among them) and the ``reference`` (the framework's float32 model), each
    judged on the same realistic feeds and timed in blocks both ways, alone, and against the model's floor."""
    from tk.measure.floor import LinearSplit, ModelFloor, at_real_tokens, model_products

    threads = torch.get_num_threads()
    keep_freed_memory(asked=True)  # as tk's command line sets glibc's malloc, for every engine here alike
    engines = {r.name: open_recipe(r, threads) for r in [*recipes, reference]}
    feeds = realistic_feeds(s.batch, s.seq, s.vocab, seed=s.seed)  # the timed batch, judged with the others
    accuracy_feeds = [feeds] + [realistic_feeds(8, s.seq, s.vocab, seed=s.seed + 1 + i) for i in range(s.samples // 8)]
    cosines = min_cosines({r.name: engines[r.name] for r in recipes}, engines[reference.name], accuracy_feeds)
    # the work of the real tokens: an engine that removes the padding runs under the padded products' time
    products = at_real_tokens(
        model_products(lambda: engines[reference.name](feeds)), torch.from_numpy(feeds["attention_mask"])
    )
    splits = {r.name: LinearSplit.from_json(r.split) for r in recipes if r.split is not None and r.precision == "int8"}
    splits = {name: split for name, split in splits.items() if split.int8 is not None}
    precisions = {r.precision for r in [*recipes, reference]}.union(*(split.float_floors for split in splits.values()))
    floors = {p: ModelFloor(p, products) for p in sorted(precisions)}
    order = list(engines)
    between = list(floors.values())
    calls = {name: functools.partial(engine, feeds) for name, engine in engines.items()}
    work.mkdir(parents=True, exist_ok=True)
    feeds_file = work / "peer-feeds.npz"
    np.savez(feeds_file, **feeds)
    everyone = [*recipes, reference]
    alone: dict[str, list[list[float]]] = {r.name: [] for r in everyone}  # one list of times per process

    def lone_pass(turn: list[Recipe]) -> None:
        for r in turn:
            alone[r.name].append(time_alone(r, feeds_file, s.alone_calls, threads))

    # three lone passes bracket the two halves of the blocks (the middle one in the reverse order) and the two
    # orders alternate round by round, so that all three medians span the same minutes: the VM's speed drifts
    # over a run by more than the 5% the orders are compared within, and one process of an engine can run a
    # few percent faster or slower than the next (benchmarks/history.md, 2026-12-06)
    forward: dict[str, list[float]] = {name: [] for name in order}
    backward: dict[str, list[float]] = {name: [] for name in order}
    half = s.rounds // 2
    for turn, first, last in ((everyone, 0, half), (everyone[::-1], half, s.rounds), (everyone, 0, 0)):
        lone_pass(turn)
        if last > first:
            ways = time_both_ways(calls, rounds=range(first, last), block=s.block, order=order, between=between)
            for times, got in zip((forward, backward), ways, strict=True):
                for name in order:
                    times[name] += got[name]
    # a floor cannot flatter: the lower of its median in the run and in a process of its own
    in_run = {p: f.product_samples for p, f in floors.items()}
    lone = {p: floor_alone(p, products, 10, threads) for p in floors}

    def floor_ms(r: Recipe) -> float:
        return recipe_floor_ms(products, r.precision, splits.get(r.name), in_run, lone)

    rows = [_row(r, forward, backward, alone, floor_ms(r), engines[r.name].inputs,
                 None if r is reference else cosines[r.name], s.bar) for r in everyone]  # fmt: skip
    plain = {p: round(recipe_floor_ms(products, p, None, in_run, lone), 3) for p in floors}  # each alone
    return {"rows": rows, "pick": pick, "verdict": verdict(rows, pick, reference.name),
            "floors": {p: f.to_json() | {"floor_ms": plain[p]} for p, f in floors.items()},
            "splits": {name: split.to_json() for name, split in splits.items()},
            "settings": asdict(s)}  # fmt: skip


def recipe_floor_ms(products: list[Any], precision: str, split: Any, in_run: dict[str, list[list[float]]],
                    lone: dict[str, list[list[float]]]) -> float:  # fmt: skip
    """A recipe's floor in ms, the lower of its median in the run (``in_run``) and in a process of its own
    (``lone``), both per precision and per sample one call of each of ``products``: every product in
    ``precision``, or with ``split`` (a ``LinearSplit``) each linear in the precision the artifact runs it in."""
    from tk.measure.floor import mixed_floor_seconds

    def seconds(samples: dict[str, list[list[float]]]) -> list[float]:
        if split is not None:
            return mixed_floor_seconds(products, samples, split)
        return [sum(p.count * t for p, t in zip(products, each, strict=True)) for each in samples[precision]]

    return 1e3 * min(statistics.median(seconds(in_run)), statistics.median(seconds(lone)))


def _row(r: Recipe, forward: dict[str, list[float]], backward: dict[str, list[float]],
         alone: dict[str, list[list[float]]], floor_ms: float, inputs: list[str], cosine: float | None,
         bar: float) -> dict[str, Any]:  # fmt: skip
    both = forward[r.name] + backward[r.name]
    lone = [t for process in alone[r.name] for t in process]
    medians = [median_ms(forward[r.name]), median_ms(backward[r.name]), median_ms(lone)]
    return {
        "engine": r.name, "kind": r.kind, "precision": r.precision, "inputs": inputs, "min_cosine": cosine,
        "valid": cosine is None or cosine >= bar,
        "ms": round(median_ms(both), 3), "q1_ms": round(1e3 * float(np.quantile(both, 0.25)), 3),
        "q3_ms": round(1e3 * float(np.quantile(both, 0.75)), 3),
        "ms_in_order": round(medians[0], 3), "ms_reversed": round(medians[1], 3), "ms_alone": round(medians[2], 3),
        "ms_alone_processes": [round(median_ms(process), 3) for process in alone[r.name]],
        "gap": round(max(medians) / min(medians) - 1, 4),
        "floor_ms": round(floor_ms, 3), "floor_share": round(floor_ms / median_ms(both), 4),
    }  # fmt: skip


def verdict(rows: list[dict[str, Any]], pick: str, reference: str) -> dict[str, Any]:
    """The pick against the faster valid rival (an invalid one is named, never counted as beaten) as the lower of
    the two ratios, in the blocks and alone; whether every engine's medians in order and reversed agree within
    ``AGREE_WITHIN`` (whichever engine goes first), whether its three timings do (alone too), and whether the
    pick's ratio to each rival does (in order, reversed, alone). The lone processes move the most: one
    engine's process to the next by up to 9% (19% OpenVINO with NNCF int8), and a process of its own often a
    few percent faster than the shared one (benchmarks/history.md, 2026-12-06); a ratio moves only when an engine gains or loses from
    where it is timed, which is what the orders test."""
    by_name = {r["engine"]: r for r in rows}
    rivals = [r for r in rows if r["engine"] not in (pick, reference)]
    valid = [r for r in rivals if r["valid"]]
    faster = min(valid, key=lambda r: r["ms"]) if valid else None
    mine = by_name[pick]
    in_blocks = faster["ms"] / mine["ms"] if faster else None
    alone = min(r["ms_alone"] for r in valid) / mine["ms_alone"] if valid else None
    return {
        "pick_valid": mine["valid"],
        "faster_valid_rival": faster["engine"] if faster else None,
        "speedup": round(min(in_blocks, alone), 3) if in_blocks and alone else None,
        "speedup_in_blocks": round(in_blocks, 3) if in_blocks else None,
        "speedup_alone": round(alone, 3) if alone else None,
        "speedup_vs_reference": round(by_name[reference]["ms"] / mine["ms"], 3),
        "invalid_rivals": [r["engine"] for r in rivals if not r["valid"]],
        "orders_agree": all(_orders_gap(r) <= AGREE_WITHIN for r in rows),
        "timings_agree": all(r["gap"] <= AGREE_WITHIN for r in rows),
        "ratio_gaps": (gaps := {r["engine"]: _ratio_gap(mine, r) for r in valid}),
        "ratios_agree": all(g <= AGREE_WITHIN for g in gaps.values()),
    }


def _orders_gap(row: dict[str, Any]) -> float:
    """How far apart an engine's medians are timed in order and reversed: whichever engine went first."""
    medians = (row["ms_in_order"], row["ms_reversed"])
    return max(medians) / min(medians) - 1


def _ratio_gap(mine: dict[str, Any], rival: dict[str, Any]) -> float:
    """How far apart the pick's speed-ups over ``rival`` are, timed in order, reversed and alone."""
    ratios = [rival[k] / mine[k] for k in ("ms_in_order", "ms_reversed", "ms_alone")]
    return round(max(ratios) / min(ratios) - 1, 4)


def render_peers(result: dict[str, Any], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title, caption=_caption(result))
    for column in ("engine", "precision", "inputs", "min cosine", "ms (q1-q3)", "in order", "reversed", "alone",
                   "gap", "floor ms", "of floor", "vs pick"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("engine", "inputs") else "right")
    pick_ms = next(r["ms"] for r in result["rows"] if r["engine"] == result["pick"])
    for r in result["rows"]:
        cosine = (
            "reference" if r["min_cosine"] is None else f"{r['min_cosine']:.6f}" + ("" if r["valid"] else " INVALID")
        )
        table.add_row(
            r["engine"], r["precision"], str(len(r["inputs"])), cosine, f"{r['ms']:.2f} ({r['q1_ms']:.2f}-{r['q3_ms']:.2f})",
            f"{r['ms_in_order']:.2f}", f"{r['ms_reversed']:.2f}", f"{r['ms_alone']:.2f}", f"{100 * r['gap']:.1f}%",
            f"{r['floor_ms']:.2f}", f"{100 * r['floor_share']:.0f}%", f"{r['ms'] / pick_ms:.2f}x",
        )  # fmt: skip
    return table


def _caption(result: dict[str, Any]) -> str:
    v, s = result["verdict"], result["settings"]
    against = (f"{v['speedup']}x the faster valid rival ({v['faster_valid_rival']}; {v['speedup_in_blocks']}x in the "
               f"blocks, {v['speedup_alone']}x alone: the lower counts)" if v["speedup"] else "no valid rival")  # fmt: skip
    invalid = (
        f"; invalid (below min cosine {s['bar']}): {', '.join(v['invalid_rivals'])}" if v["invalid_rivals"] else ""
    )
    orders, agree, ratios = (
        "agree" if v[k] else "DO NOT agree" for k in ("orders_agree", "timings_agree", "ratios_agree")
    )
    return (f"pick {result['pick']}: {against}, {v['speedup_vs_reference']}x the reference{invalid}; timings in "
            f"order and reversed {orders} within {AGREE_WITHIN:.0%} (with alone: {agree}), the pick's ratios to each "
            f"rival {ratios}; {s['batch']}x{s['seq']}, {s['rounds']} rounds "
            f"of {s['block']} calls each way, accuracy on the timed batch and {s['samples']} more padded inputs")  # fmt: skip


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] in ("alone", "floor"):
    (_alone_main if sys.argv[1] == "alone" else _floor_main)(*sys.argv[2:])
