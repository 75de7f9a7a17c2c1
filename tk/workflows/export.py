"""The checked export: write an artifact's formats, then check each one through the engines users get."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tk.export import ExportOptions, ExportResult, write_artifact
from tk.models import ModelSpec
from tk.workflows.check import run_export_check


def export(spec: ModelSpec, out: str | Path, options: ExportOptions | None = None) -> ExportResult:
    """Export ``spec`` to ``out`` in ``options.formats`` and check each format against PyTorch.

    Raises ``ParityError`` (after writing the artifact, marked failed) when a check fails;
    ``options.check=False`` writes it unchecked.
    """
    options = options or ExportOptions()
    if options.precision == "int8" and options.calibrate and not options.calibrate.startswith("random:"):
        options = dataclasses.replace(options, calibration_data=calibration_file(spec, options))
    if options.check_inputs is not None and options.check_data is None:
        options = dataclasses.replace(options, check_data=samples_file(spec, options, options.check_inputs))
    return write_artifact(spec, out, options, check=run_export_check)


def calibration_file(spec: ModelSpec, options: ExportOptions) -> dict[str, np.ndarray]:
    """The static int8 calibration samples of ``options.calibrate`` (``samples_file``)."""
    assert options.calibrate is not None
    return samples_file(spec, options, options.calibrate)


def samples_file(spec: ModelSpec, options: ExportOptions, path: str | Path) -> dict[str, np.ndarray]:
    """The samples of ``path``, read and checked like ``tk infer --inputs``; for an ``hf:DIR`` model a
    ``.txt``/``.jsonl`` file of texts, tokenized by its tokenizer (tk.models.hf_text)."""
    from tk.export import resolve_dims
    from tk.runtime.inputs import check_arrays
    from tk.workflows.user_inputs import read_user_inputs

    dims = resolve_dims(spec, options.dims, options.dynamic)
    arrays = read_user_inputs(path, spec.name, spec.signature.inputs, dims)  # a labels array left out
    check_arrays(arrays, spec.signature.inputs, dims=dims, source=str(path))
    return arrays
