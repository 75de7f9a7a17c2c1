"""``tk infer`` as a library call: open the artifact with one engine (or the one ``auto`` picks) and
run every sample of a file, or random samples, through it in batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tk.errors import UsageError
from tk.manifest import verify_artifact
from tk.runtime import EngineChoice, available_engines, open_engine
from tk.runtime.batching import InferResult, infer_file
from tk.workflows.auto import AutoChoice, choose_engine
from tk.workflows.user_inputs import read_user_inputs


def infer_artifact(
    root: str | Path,
    choice: EngineChoice,
    out: str | Path,
    *,
    inputs: str | Path | None = None,
    random: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    on_choice: Callable[[AutoChoice], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> InferResult:
    """Run the artifact at ``root`` over ``inputs`` (or ``random`` samples) and write ``out`` (.npz).

    ``choice.name == "auto"`` first checks and times every engine here and takes the fastest that
    passes parity at ``batch_size`` (``on_choice`` hears which), or the one ``tk optimize`` recommended with the
    engine settings it chose under the options given; the options then apply to the engines that declare them.
    """
    if (inputs is None) == (random is None):
        raise UsageError("expected exactly one of --inputs FILE or --random N")
    if random is not None and random < 1:
        raise UsageError(f"--random: expected 1 or more samples, got {random}")
    manifest = verify_artifact(root)
    engine, among = choice.name, [choice.name]
    if engine == "auto":
        batch_dim = manifest.signature.dims.get("batch")
        batch = batch_size or (batch_dim.opt if batch_dim else 1)
        auto = choose_engine(root, manifest, choice, batch_size=batch)
        if on_choice is not None:
            on_choice(auto)
        engine, among = auto.engine, available_engines(manifest, choice.device)
        choice = choice.with_defaults(auto.options, [engine])
    feeds = inputs
    if inputs is not None:  # before any engine opens: a bad file is one line (a labels array is left out)
        feeds = read_user_inputs(inputs, manifest.model["name"], manifest.signature.inputs, manifest.signature.dims)
    with open_engine(root, choice, engine, manifest=manifest, among=among) as opened:
        return infer_file(opened, out, inputs=feeds, random=random, batch_size=batch_size, seed=seed, progress=progress)
