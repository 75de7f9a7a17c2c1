"""The inputs of an optimize run: calibration samples for int8 and held-out samples that judge.

With ``--data FILE`` (what ``tk infer --inputs`` reads, or for an ``hf:DIR`` model a ``.txt``/``.jsonl``
file of texts its tokenizer reads: ``tk.models.hf_text``) the first half calibrates (every other sample
of it held aside for the int8 searches' judge: ``tk.export.int8.calibration.split_calibration_samples``)
and the second half judges each candidate, at its own shape and across the
artifact's shape range, where each export's check runs it cut or padded to each shape
(``tk.spec.fitted_samples``);
an array named ``labels`` in the file (a ``"label"`` per ``.jsonl`` line) makes ``top1`` an accuracy
against it. Without a file both are synthetic: token ids drawn from the whole vocabulary and
right-padded attention masks of mixed lengths (never all ones), from the model's input specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tk.errors import UsageError
from tk.export.int8.calibration import require_finite
from tk.models import ModelSpec
from tk.runtime.inputs import random_inputs
from tk.spec import Dim
from tk.workflows.user_inputs import labels_spec, read_labeled_inputs

HELD_OUT_SAMPLES = 32  # synthetic samples that judge each candidate


@dataclass
class OptimizeData:
    held_out: dict[str, np.ndarray]
    calibration: dict[str, np.ndarray] | None  # None: the export's own random calibration (random:32)
    labels: np.ndarray | None = None
    source: str = "synthetic"

    @property
    def mask(self) -> np.ndarray | None:
        """The attention mask of the held-out samples, when the model takes one."""
        return next((v for k, v in self.held_out.items() if "mask" in k), None)

    @property
    def samples(self) -> int:
        return int(next(iter(self.held_out.values())).shape[0])


def optimize_data(
    spec: ModelSpec, dims: dict[str, Dim], sizes: dict[str, int], data: str | Path | None
) -> OptimizeData:
    """Held-out (and calibration) samples: from ``data``, else synthetic at ``sizes`` (other than the batch)."""
    inputs = spec.signature.inputs
    if data is None:
        other = {k: v for k, v in sizes.items() if k != "batch"}
        held = random_inputs(inputs, dims, HELD_OUT_SAMPLES, seed=4321, sizes=other)
        return OptimizeData(held, None)
    path = Path(data)
    arrays, labels = read_labeled_inputs(path, spec.name, inputs, dims, labels=lambda: labels_spec(spec.signature))
    require_finite(arrays, f"--data {path}", "judging the candidates")
    total = int(next(iter(arrays.values())).shape[0])
    if total < 2:
        raise UsageError(f"--data {path}: expected 2 or more samples (half calibrate, half judge), found {total}")
    cut = total - total // 2
    held = {k: np.ascontiguousarray(v[cut:]) for k, v in arrays.items()}
    calibration = {k: np.ascontiguousarray(v[:cut]) for k, v in arrays.items()}
    return OptimizeData(held, calibration, None if labels is None else labels[cut:], source=str(path))
