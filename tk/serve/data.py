"""``tk infer --ray``: batched inference over a directory of shards on Ray Data.

Each shard (``.npz``, ``.npy``, a directory of ``<input>.npy`` files, or a ``.parquet`` file with
one column per input) is one row of a Ray dataset; ``map_batches`` hands the rows to a pool of
``actors`` actors, each of which opens the engine once (``tk.runtime.open_engine``, with its integrity
checks) and runs each shard through ``tk.runtime.batching.infer_file``, the same code as
single-process ``tk infer``, so every output array holds the same bytes. Each shard's outputs are
written atomically to ``OUT/<shard name>.npz``. Rows come back in input order and drive the
progress callback as shards finish.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tk import limits
from tk.errors import InputError, TkError, UsageError, first_line
from tk.limits import require_within_budget
from tk.manifest import verify_artifact
from tk.runtime.batching import BatchRunner, infer_file, save_npz
from tk.runtime.choice import EngineChoice, open_engine
from tk.runtime.inputs import file_samples, sample_dim
from tk.serve.cluster import connect, disconnect
from tk.signing import explicit_policy
from tk.spec import TensorSpec, numpy_dtype

SHARD_SUFFIXES = (".npz", ".npy", ".parquet")


@dataclass
class RayInferResult:
    shards: int
    samples: int
    seconds: float  # engine time summed over shards (the actors run in parallel)
    wall_seconds: float  # from the first shard submitted to the last written
    out: Path
    files: list[Path]

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "out": str(self.out), "files": [str(p) for p in self.files]}


def list_shards(inputs: str | Path) -> list[Path]:
    """The shards of ``inputs``, sorted by name: files ending in .npz/.npy/.parquet and directories of .npy."""
    inputs = Path(inputs)
    if not inputs.is_dir():
        raise UsageError(f"--inputs {inputs}: with --ray, expected a directory of .npz/.npy/.parquet shards")
    shards = sorted(
        p
        for p in inputs.iterdir()
        if (p.is_file() and p.suffix in SHARD_SUFFIXES) or (p.is_dir() and any(p.glob("*.npy")))
    )
    if not shards:
        raise UsageError(f"--inputs {inputs}: found no .npz, .npy or .parquet shard (or directory of .npy files)")
    stems: dict[str, Path] = {}
    for shard in shards:
        if shard.stem in stems:
            raise UsageError(
                f"--inputs: shards {stems[shard.stem].name} and {shard.name} would both write {shard.stem}.npz"
            )
        stems[shard.stem] = shard
    return shards


# bytes per decoded value of Parquet's physical types (strings: their encoded size, plus a pointer each)
_PHYSICAL_WIDTH = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def parquet_decoded_bytes(path: Path) -> int:
    """What reading the Parquet file ``path`` would allocate, from its footer alone: every column
    chunk's value count times its decoded width, twice (the Arrow table and its NumPy copy). A
    small file can decode to far more than its size (dictionary and run-length encodings)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise UsageError(f"{path}: cannot read it as Parquet ({first_line(exc)})") from exc
    total = 0
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            width = _PHYSICAL_WIDTH.get(column.physical_type)
            if width is None:  # BYTE_ARRAY, FIXED_LEN_BYTE_ARRAY: no fixed width in the footer
                total += column.total_uncompressed_size + 16 * column.num_values
            else:
                total += width * column.num_values
        total += 8 * group.num_rows * group.num_columns  # list offsets and validity
    return 2 * total


def require_parquet_within_budget(path: Path) -> None:
    """One line before any row group is read when decoding ``path`` would exceed tk's memory budget."""
    require_within_budget(parquet_decoded_bytes(path), f"{path} (the values its Parquet footer declares)")


def read_parquet(path: Path, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """A Parquet file's columns as arrays: one column per input, one row per sample (lists for axes > 0).
    Sized against the memory budget from the file's footer before any row group is read."""
    import pyarrow.parquet as pq

    require_parquet_within_budget(path)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise UsageError(f"{path}: cannot read it as Parquet ({first_line(exc)})") from exc
    arrays = {name: _column_array(table.column(name), path, name) for name in table.column_names}
    file_samples(arrays, specs, source=str(path))
    return {s.name: arrays[s.name].astype(numpy_dtype(s.dtype), copy=False) for s in specs}


def _column_array(column: Any, path: Path, name: str) -> np.ndarray:
    """One Parquet column as one array: nested lists of equal lengths become trailing axes, read in
    one flat copy (arrow's offsets checked once per level, no Python loop over rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks()
    shape = [len(array)]
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            raise InputError(f"{path}: column {name!r} has {array.null_count} missing (null) rows")
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise InputError(
                f"{path}: column {name!r}: expected rows of one length, found lengths "
                f"{int(lengths.min())} to {int(lengths.max())}"
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        array = pc.list_flatten(array)
    if array.null_count:
        raise InputError(f"{path}: column {name!r} has {array.null_count} missing (null) values")
    return array.to_numpy(zero_copy_only=False).reshape(shape)


class ShardRunner:
    """A Ray Data actor: opens the engine once, then runs whole shards (``batch_size=1`` rows)."""

    def __init__(self, root: str, choice: EngineChoice, batch_size: int | None) -> None:
        self.engine = open_engine(root, choice).load()
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        samples, seconds = [], []
        for shard, out in zip(batch["shard"], batch["out"], strict=True):
            path = Path(str(shard))
            if path.suffix == ".parquet":
                import time

                runner = BatchRunner(self.engine, self.batch_size)
                arrays = read_parquet(path, self.engine.inputs)
                started = time.perf_counter()
                outputs = runner.run(arrays)
                seconds.append(time.perf_counter() - started)
                save_npz(str(out), outputs)
                samples.append(len(next(iter(arrays.values()))))
            else:
                result = infer_file(self.engine, str(out), inputs=path, batch_size=self.batch_size)
                samples.append(result.samples)
                seconds.append(result.seconds)
        return {"shard": batch["shard"], "samples": np.array(samples), "seconds": np.array(seconds)}


def infer_ray(
    root: str | Path,
    choice: EngineChoice,
    inputs: str | Path,
    out: str | Path,
    *,
    actors: int = 2,
    cpus_per_actor: float = 1.0,
    gpus_per_actor: float = 0.0,
    batch_size: int | None = None,
    address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RayInferResult:
    """Run every shard of the directory ``inputs`` on ``actors`` Ray actors; write ``out/<shard>.npz``.

    Starts a local Ray instance unless one is running or ``address`` names a cluster (which is
    left running). ``choice``: one engine; its ``threads`` option defaults to ``cpus_per_actor``.
    ``progress(shards_done, shards)`` after each shard.
    """
    import time

    try:
        import ray.data  # noqa: F401  (present before anything is checked or started)
    except ImportError as exc:
        raise UsageError(f"tk infer --ray needs Ray Data: pip install 'tk[serve]' ({first_line(exc)})") from exc
    choice = _actor_choice(root, choice, actors=actors, cpus_per_actor=cpus_per_actor, batch_size=batch_size)
    shards = list_shards(inputs)
    out = Path(out)
    targets = _targets(shards, out)
    budget = os.environ.get(limits.ENV)  # the actors hold the same memory budget as this process
    connection = connect(address=address, env_vars={limits.ENV: budget} if budget else None)
    started = time.perf_counter()
    try:
        samples, engine_seconds = _run_shards(
            root, choice, shards, targets, actors=actors, cpus=cpus_per_actor, gpus=gpus_per_actor,
            batch_size=batch_size, progress=progress,
        )  # fmt: skip
    except Exception as exc:
        cause = _tk_error_in(exc)  # a bad shard: the actor's one-line TkError, not Ray's wrapping
        if cause is not None:
            raise type(cause)(first_line(cause)) from exc
        raise
    finally:
        disconnect(connection)
    return RayInferResult(len(shards), samples, engine_seconds, time.perf_counter() - started, out, targets)


def _actor_choice(
    root: str | Path, choice: EngineChoice, *, actors: int, cpus_per_actor: float, batch_size: int | None
) -> EngineChoice:
    """``choice`` as each actor opens it, after what an actor would refuse is refused here, before Ray starts."""
    if choice.name == "auto":
        raise UsageError("--ray: name an engine (--engine onnx, torch, ...); auto is for single-process tk infer")
    if actors < 1:
        raise UsageError(f"--actors: expected 1 or more, got {actors}")
    manifest = verify_artifact(root)
    sample_dim(manifest.signature.inputs)
    choice = choice.with_defaults({"threads": max(1, int(cpus_per_actor))}, [choice.name])
    choice = choice.replace(trust=explicit_policy(choice.trust))  # actors may not share this process's settings
    probe = open_engine(root, choice, manifest=manifest)  # what an actor would refuse, refused before Ray starts
    if batch_size is not None:  # the same refusal single-process tk infer gives
        BatchRunner(probe, batch_size)
    return choice


def _run_shards(
    root: str | Path,
    choice: EngineChoice,
    shards: list[Path],
    targets: list[Path],
    *,
    actors: int,
    cpus: float,
    gpus: float,
    batch_size: int | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[int, float]:
    """Each shard through a pool of ``actors`` ``ShardRunner``s, in order; the samples and engine seconds."""
    import ray.data

    samples = 0
    engine_seconds = 0.0
    done = 0
    with _ordered_quiet(ray.data.DataContext.get_current()):
        dataset = ray.data.from_items(
            [{"shard": str(s.resolve()), "out": str(t.resolve())} for s, t in zip(shards, targets, strict=True)]
        )
        results = dataset.map_batches(
            ShardRunner,
            fn_constructor_kwargs={"root": str(Path(root).resolve()), "choice": choice, "batch_size": batch_size},
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=cpus,
            num_gpus=gpus or None,
        )
        for row in results.iter_rows():
            samples += int(row["samples"])
            engine_seconds += float(row["seconds"])
            done += 1
            if progress is not None:
                progress(done, len(shards))
    return samples, engine_seconds


def _targets(shards: list[Path], out: Path) -> list[Path]:
    """``out/<shard>.npz`` for each shard, after what would fail in an actor is refused here, before Ray starts."""
    for shard in shards:  # each actor checks again (its budget is its own)
        if shard.suffix == ".parquet":
            require_parquet_within_budget(shard)
    if out.suffix == ".npz":
        raise UsageError(f"--out {out}: with --ray, expected a directory (one .npz per shard)")
    out.mkdir(parents=True, exist_ok=True)
    return [out / f"{s.stem}.npz" for s in shards]


@contextlib.contextmanager
def _ordered_quiet(context: Any) -> Iterator[None]:
    """Ray Data's ``context`` set for tk inside the block, restored after."""
    saved = (
        context.execution_options.preserve_order,
        context.enable_progress_bars,
        context.raise_original_map_exception,
    )
    context.execution_options.preserve_order = True  # rows come back in shard order
    context.enable_progress_bars = False  # the caller's progress callback is the one bar
    context.raise_original_map_exception = True  # a bad shard's TkError, not Ray's wrapping of it
    try:
        yield
    finally:
        (
            context.execution_options.preserve_order,
            context.enable_progress_bars,
            context.raise_original_map_exception,
        ) = saved


def _tk_error_in(exc: BaseException) -> TkError | None:
    """The first ``TkError`` in ``exc``'s chain of causes (Ray wraps an actor's exception in its own)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        inner = getattr(current, "cause", None)  # Ray's RayTaskError(InputError) keeps the original as .cause
        if isinstance(current, TkError) and not isinstance(inner, TkError):
            return current
        todo.extend([getattr(current, "cause", None), current.__cause__, current.__context__])
    return None
