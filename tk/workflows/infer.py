"""``tk infer`` as a library call: open the artifact with one engine (or the one ``auto`` picks) and
run every sample of a file, or random samples, through it in batches."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tk.errors import UsageError
from tk.manifest import verify_artifact
from tk.runtime import engine_options, load
from tk.runtime.batching import InferResult, infer_file
from tk.signing import TrustPolicy
from tk.workflows.auto import AutoChoice, choose_engine


def infer_artifact(
    root: str | Path,
    engine: str,
    out: str | Path,
    *,
    inputs: str | Path | None = None,
    random: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    options: dict[str, Any] | None = None,
    allow_failed: bool = False,
    on_choice: Callable[[AutoChoice], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    trust: TrustPolicy | None = None,
) -> InferResult:
    """Run the artifact at ``root`` over ``inputs`` (or ``random`` samples) and write ``out`` (.npz).

    ``engine="auto"`` first checks and times every engine here and takes the fastest that passes
    parity at ``batch_size`` (``on_choice`` hears which). ``options`` holds engine options by name.
    ``trust``: whose signatures let aoti/trt load (see ``tk.signing``).
    """
    if (inputs is None) == (random is None):
        raise UsageError("expected exactly one of --inputs FILE or --random N")
    if random is not None and random < 1:
        raise UsageError(f"--random: expected 1 or more samples, got {random}")
    manifest = verify_artifact(root)
    values = options or {}
    if engine == "auto":
        batch_dim = manifest.signature.dims.get("batch")
        batch = batch_size or (batch_dim.opt if batch_dim else 1)
        choice = choose_engine(
            root, manifest, batch_size=batch, device=device, options=values, allow_failed=allow_failed, trust=trust
        )
        if on_choice is not None:
            on_choice(choice)
        engine = choice.engine
    opts = engine_options(engine, values)
    with load(
        root, engine, device=device, allow_failed=allow_failed, manifest=manifest, options=opts, trust=trust
    ) as opened:
        return infer_file(
            opened, out, inputs=inputs, random=random, batch_size=batch_size, seed=seed, progress=progress
        )
