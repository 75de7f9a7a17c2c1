"""Batched inference: any number of samples through any engine, in batches it accepts.

``BatchRunner`` wraps an ``Engine``: it splits the samples into batches inside the engine's
batch range, pads a short last batch (repeating its last sample) and strips the padding from
the outputs, cuts right-padded sequences to the longest real one in each batch, and writes each
batch's outputs into arrays allocated once. ``infer_file`` reads a file (or makes random
samples), runs it and writes the outputs as ``.npz``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import InputError, UsageError
from tk.fileio import atomic_open
from tk.runtime.base import Engine
from tk.runtime.inputs import file_samples, random_inputs, read_inputs, sample_dim
from tk.spec import Dim, TensorSpec, count_nonfinite, numpy_dtype

DEFAULT_BATCH = 8  # batch size when the engine names no range for its batch dimension
MASK_CHUNK_ELEMENTS = 1 << 22  # mask elements read at a time when measuring sequence lengths


class BatchRunner:
    """Run whole files through ``engine`` batch by batch; outputs keep the samples' order.

    ``batch_size`` defaults to the engine's batch opt size, clamped to its max. A batch smaller
    than the engine's batch min (the last one, or every one when the batch is static) is padded
    by repeating its last sample, and the padding is dropped from the outputs.

    Variable-length sequences: when an input has kind ``"mask"`` and its last dimension (``seq``)
    is dynamic, each batch is cut to the longest real sequence in it (trailing columns where
    every mask of the batch is 0 are dropped from every input with that dimension). Outputs with
    that dimension are padded back to the file's length with zeros. This assumes the model
    ignores trailing padding, as any model that honours its attention mask does. A static
    ``seq`` is left as it is. ``batches`` is the number of batches of the last ``run``.
    """

    def __init__(self, engine: Engine, batch_size: int | None = None) -> None:
        self.engine = engine
        self.batch_dim = sample_dim(engine.inputs)
        limits = engine.dims.get(self.batch_dim) or Dim(self.batch_dim, 1, DEFAULT_BATCH, 2**31 - 1)
        self.min_batch = limits.min
        if batch_size is None:
            batch_size = min(limits.opt, limits.max)
        elif not limits.min <= batch_size <= limits.max:
            if limits.static:
                raise UsageError(
                    f"--batch-size {batch_size}: this artifact was exported with a fixed batch of {limits.min}; "
                    f"use --batch-size {limits.min}, or re-export with a dynamic batch"
                )
            raise UsageError(
                f"--batch-size {batch_size}: expected a size in this artifact's batch range "
                f"[{limits.min}, {limits.max}]"
            )
        self.batch_size = batch_size
        self.mask, self.seq_dim = _cuttable_mask(engine)
        self.batches = 0

    def run(
        self, inputs: Mapping[str, np.ndarray], progress: Callable[[int], None] | None = None
    ) -> dict[str, np.ndarray]:
        """Outputs for every sample of ``inputs``; ``progress(samples_done)`` after each batch.

        Raises ``InputError`` for arrays that do not fit the engine (checked before any batch runs).
        """
        specs = self.engine.inputs
        free = (self.seq_dim,) if self.seq_dim else ()
        samples = file_samples(inputs, specs, dims=self.engine.dims, free=free)
        lengths, file_seq = self._lengths(inputs) if self.seq_dim else (None, None)
        rows = max(self.batch_size, self.min_batch)
        buffers = {s.name: np.empty(rows * math.prod(inputs[s.name].shape[1:]), numpy_dtype(s.dtype)) for s in specs}
        outputs: dict[str, np.ndarray] | None = None
        self.batches = 0
        for start in range(0, samples, self.batch_size):
            stop = min(start + self.batch_size, samples)
            seq = self._batch_seq(lengths[start:stop]) if lengths is not None else None
            feeds = {s.name: self._fill(buffers[s.name], inputs[s.name], s, start, stop, seq) for s in specs}
            result = self.engine.run(feeds)
            if outputs is None:
                outputs = self._allocate(result, samples, file_seq)
            for name, value in result.items():
                target = outputs[name][start:stop]
                target[self._seq_index(self._output_spec(name), seq)] = np.asarray(value)[: stop - start]
            self.batches += 1
            if progress is not None:
                progress(stop)
        assert outputs is not None  # samples >= 1
        return outputs

    # -- sequences -------------------------------------------------------------------------------
    def _lengths(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, int]:
        """Each sample's real length (last nonzero mask column + 1), checked against the seq range."""
        assert self.mask is not None and self.seq_dim is not None
        mask = inputs[self.mask.name]
        samples, seq = mask.shape[0], mask.shape[-1]
        flat = mask.reshape(samples, -1, seq)
        step = max(1, MASK_CHUNK_ELEMENTS // max(1, flat[0].size))
        lengths = np.empty(samples, dtype=np.int64)
        for start in range(0, samples, step):
            used = (flat[start : start + step] != 0).any(axis=1)  # (rows, seq)
            last = seq - np.argmax(used[:, ::-1], axis=1)
            lengths[start : start + step] = np.where(used.any(axis=1), last, 0)
        limits = self.engine.dims.get(self.seq_dim)
        if limits is not None:
            too_long = np.flatnonzero(lengths > limits.max)
            if too_long.size:
                first = int(too_long[0])
                raise InputError(
                    f"inputs: {too_long.size} sample(s) are longer than this artifact's {self.seq_dim!r} max of "
                    f"{limits.max} (sample {first} has {lengths[first]}, by {self.mask.name!r}); "
                    f"truncate them, or re-export with a larger --{self.seq_dim} range"
                )
            if seq < limits.min:
                raise InputError(
                    f"inputs: dimension {self.seq_dim!r} must be at least {limits.min} for this artifact, "
                    f"found {seq} (input {self.mask.name!r})"
                )
        return lengths, seq

    def _batch_seq(self, lengths: np.ndarray) -> int:
        limits = self.engine.dims.get(self.seq_dim or "")
        return max(int(lengths.max()), limits.min if limits else 1, 1)

    def _seq_index(self, spec: TensorSpec | None, seq: int | None) -> tuple[slice, ...]:
        if seq is None or spec is None:
            return (slice(None),)
        return tuple(slice(0, seq) if d == self.seq_dim else slice(None) for d in spec.shape)

    # -- buffers ----------------------------------------------------------------------------------
    def _fill(
        self, buffer: np.ndarray, array: np.ndarray, spec: TensorSpec, start: int, stop: int, seq: int | None
    ) -> np.ndarray:
        """The batch ``array[start:stop]`` (cut to ``seq``, padded to the batch min) in ``buffer``."""
        source = array[start:stop][self._seq_index(spec, seq)]
        count = stop - start
        shape = (max(count, self.min_batch), *source.shape[1:])
        view = buffer[: math.prod(shape)].reshape(shape)
        view[:count] = source
        view[count:] = source[-1]
        return view

    def _allocate(self, first: Mapping[str, Any], samples: int, file_seq: int | None) -> dict[str, np.ndarray]:
        """Output arrays for every sample, shaped like the first batch's (seq axes at the file's length)."""
        outputs = {}
        for name, value in first.items():
            value = np.asarray(value)
            spec = self._output_spec(name)
            shape = [samples, *value.shape[1:]]
            padded = file_seq is not None and spec is not None and self.seq_dim in spec.shape
            if padded:
                for axis, dim in enumerate(spec.shape):
                    if dim == self.seq_dim:
                        shape[axis] = file_seq
            outputs[name] = (np.zeros if padded else np.empty)(shape, dtype=value.dtype)
        return outputs

    def _output_spec(self, name: str) -> TensorSpec | None:
        return next((s for s in self.engine.outputs if s.name == name), None)


def _cuttable_mask(engine: Engine) -> tuple[TensorSpec | None, str | None]:
    """The mask input and its sequence dimension, when that dimension is dynamic."""
    for spec in engine.inputs:
        if spec.kind == "mask" and len(spec.shape) >= 2 and isinstance(spec.shape[-1], str):
            limits = engine.dims.get(spec.shape[-1])
            if limits is None or not limits.static:
                return spec, spec.shape[-1]
    return None, None


@dataclass
class InferResult:
    samples: int
    batches: int
    seconds: float  # time spent running batches; reading and writing files excluded
    nonfinite_inputs: dict[str, int]  # NaN/Inf count per floating-point input
    nonfinite_outputs: dict[str, int]  # NaN/Inf count per floating-point output
    out: Path

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


def infer_file(
    engine: Engine,
    out: str | Path,
    *,
    inputs: str | Path | Mapping[str, np.ndarray] | None = None,
    random: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    sizes: dict[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> InferResult:
    """Run every sample of ``inputs`` (a file, see ``read_inputs``, or arrays already read and checked)
    or ``random`` random samples.

    Writes the outputs to ``out`` (``.npz``, one array per output name) atomically.
    ``progress(done, total)`` is called after each batch. ``sizes`` sets the non-batch dimensions
    of random samples. Defaults: the engine's batch opt size, seed 0, other dimensions at their opt.
    """
    out = Path(out)
    if (inputs is None) == (random is None):
        raise UsageError("expected exactly one of --inputs FILE or --random N")
    if out.suffix != ".npz":
        raise UsageError(f"--out {out}: expected a file name ending in .npz")
    runner = BatchRunner(engine, batch_size)
    if isinstance(inputs, Mapping):  # already read (texts tokenized by tk.workflows.user_inputs)
        arrays = dict(inputs)
    elif inputs is not None:
        arrays = read_inputs(Path(inputs), engine.inputs)
    else:
        arrays = random_inputs(engine.inputs, engine.dims, int(random or 0), seed=seed, sizes=sizes)
    total = len(next(iter(arrays.values())))
    nonfinite_inputs = count_nonfinite(arrays)
    started = time.perf_counter()
    report = (lambda done: progress(done, total)) if progress is not None else None
    outputs = runner.run(arrays, progress=report)
    seconds = time.perf_counter() - started
    save_npz(out, outputs)
    return InferResult(total, runner.batches, seconds, nonfinite_inputs, count_nonfinite(outputs), out)


def save_npz(path: str | Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` as ``.npz``, atomically (a temporary file beside ``path``, then a rename)."""
    with atomic_open(path) as f:
        np.savez(f, **arrays)
