"""One table of parity tolerances, keyed by precision; models and the command line may override.

Each entry is (rtol, atol): an output passes when |candidate - reference| <= atol + rtol * |reference|
everywhere, with NaN and Inf only where the reference has them. Reduced precisions (fp16, bf16,
int8) are also judged by the signal-to-quantization-noise ratio in dB (``MIN_SQNR_DB``), which
--rtol/--atol do not change. fp32 and tf32 add the reference's own noise floor (``NOISE_FLOOR_K``).
"""

from __future__ import annotations

import math
from typing import Any

from tk.errors import UsageError
from tk.registries import PRECISIONS

TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-5),  # whole-model float32: reordered sums stay near 1e-6 relative
    "tf32": (5e-3, 5e-3),  # float32 with TF32 matrix products on CUDA (10 mantissa bits, ~5e-4 per product)
    "fp16": (2e-2, 2e-2),
    "bf16": (5e-2, 5e-2),  # 8 mantissa bits: about 4e-3 per op, compounding over layers
    "int8": (2.5e-1, 1e-1),  # elementwise bounds are loose for int8; the SQNR floor decides
}

MIN_SQNR_DB: dict[str, float] = {"int8": 35.0, "bf16": 25.0, "fp16": 30.0, "tf32": 40.0}

# The noise floor (tk.parity.NoiseFloor): how far eager float32 itself is from the same model run in
# float64, per output and shape. A deep network's float32 rounding grows past any fixed atol (ResNet-50
# at 64x64: 2-3e-05 on logits up to 50, on every value, the near-zero ones too), so an fp32/tf32 output
# passes within atol + rtol x |reference| + NOISE_FLOOR_K x floor. Measured on the 2-core Xeon (AVX-512,
# AMX), torch 2.14.1, against eager float32 at the check's shapes (max abs error over the floor at the
# same shape): correct artifacts of ResNet-50 (64x64) were 1.5x on onnxruntime, 2.3x on OpenVINO and
# aoti, and of the 24-layer Transformer 1.6-2.0x (torch: 0x, eager's own kernels); the aoti package's
# batch-invariance probe moved 1.2x its floor. One weight tensor changed by 1% of its norm was
# 7,900x (ResNet-50) and 9,200x (Transformer), and 2,600-40,000x over five tensors of each, from the
# first layer to the head. 8 sits 3.5x above the worst correct artifact and 300x below the nearest wrong one.
NOISE_FLOOR_K = 8.0
FLOOR_PRECISIONS = ("fp32", "tf32")  # the others' tolerances sit far above float32's noise


def checked_tolerance(value: Any, what: str) -> float:
    """``value`` as a float when it is a finite tolerance of 0 or more; else ``UsageError`` naming ``what``.

    The one check every form of tolerance goes through (``--rtol``/``--atol``, ``--tol NAME=RTOL:ATOL``,
    a golden file's): a NaN tolerance compares false everywhere, which the parity check would read
    as "no error found", and an infinite one accepts anything.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{what}: expected a finite tolerance of 0 or more, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise UsageError(f"{what}: expected a finite tolerance of 0 or more, got {value}")
    return number


def checked_pair(rtol: Any, atol: Any, what: str) -> tuple[float, float]:
    """(rtol, atol) through ``checked_tolerance``, named ``what rtol`` and ``what atol``."""
    return checked_tolerance(rtol, f"{what} rtol"), checked_tolerance(atol, f"{what} atol")


def tolerance_for(
    precision: str,
    *,
    model_overrides: dict[str, tuple[float, float]] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[float, float]:
    """(rtol, atol) for ``precision``: the table, then the model's override, then explicit values."""
    if precision not in TOLERANCES:
        raise UsageError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    rtol = None if rtol is None else checked_tolerance(rtol, "--rtol")
    atol = None if atol is None else checked_tolerance(atol, "--atol")
    base_rtol, base_atol = (model_overrides or {}).get(precision, TOLERANCES[precision])
    return (base_rtol if rtol is None else rtol, base_atol if atol is None else atol)


def checked_sqnr_floor(value: float | None, precision: str) -> float | None:
    """``tk export --min-sqnr``: a finite number of dB, for a precision judged by SQNR; None stays None."""
    if value is None:
        return None
    if precision not in MIN_SQNR_DB:
        judged = "/".join(MIN_SQNR_DB)
        raise UsageError(f"--min-sqnr: applies to --precision {judged} (judged by SQNR); this export is {precision}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"--min-sqnr: expected a finite number of dB, got {value!r}")
    return float(value)


def sqnr_floor(precision: str, model_reference: dict[str, Any] | None = None) -> float | None:
    """The SQNR floor of an artifact at ``precision``: the one its export was given (``--min-sqnr``,
    recorded as ``model_reference["min_sqnr_db"]``), else the precision's row of ``MIN_SQNR_DB``."""
    given = (model_reference or {}).get("min_sqnr_db")
    return float(given) if given is not None and precision in MIN_SQNR_DB else MIN_SQNR_DB.get(precision)


def artifact_tolerance(
    precision: str, model_reference: dict[str, Any], *, rtol: float | None = None, atol: float | None = None
) -> tuple[float, float, float | None]:
    """(rtol, atol, min SQNR dB) for an artifact: its precision's row, the overrides its manifest
    recorded for the model (``model_reference["tolerances"]``, ``["min_sqnr_db"]``), then explicit values."""
    overrides = {p: (t[0], t[1]) for p, t in model_reference.get("tolerances", {}).items()}
    rtol, atol = tolerance_for(precision, model_overrides=overrides, rtol=rtol, atol=atol)
    return rtol, atol, sqnr_floor(precision, model_reference)
