"""Golden files: inputs, reference outputs and tolerances, to check an engine without the model.

One ``.npz`` (NumPy's zip of arrays, read with ``allow_pickle=False``: never unpickled) holds
``in.<run>.<input>`` and ``out.<run>.<output>`` arrays for each run (one per checked shape, or
one for the user's samples) and ``meta``: UTF-8 JSON as a uint8 array, with the format's name
and version, the artifact's model and precision, the signature, the reference engine and the
tolerances the reference was judged with. A CI job on another machine checks any engine against
it (``tk check --golden FILE``) without rebuilding the PyTorch model.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import UsageError, first_line
from tk.fileio import atomic_write_bytes
from tk.runtime.inputs import load_npz
from tk.spec import Signature, require_names
from tk.tolerances import checked_pair

FORMAT = "tk-golden"
VERSION = 1


@dataclass
class Golden:
    feeds: list[dict[str, np.ndarray]]
    outputs: list[dict[str, np.ndarray]]
    shapes: list[dict[str, int]]
    precision: str  # the precision of the artifact the tolerances were chosen for
    rtol: float
    atol: float
    min_sqnr_db: float | None
    reference: str  # the engine that produced ``outputs``
    model: dict[str, Any] = field(default_factory=dict)  # name, size, config of the model (for people)
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)  # per-output (rtol, atol)
    signature: dict[str, Any] = field(default_factory=dict)


def save_golden(path: str | Path, golden: Golden) -> Path:
    """Write ``golden`` atomically as one ``.npz``."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    for i, (feeds, outputs) in enumerate(zip(golden.feeds, golden.outputs, strict=True)):
        arrays.update({f"in.{i}.{name}": np.asarray(v) for name, v in feeds.items()})
        arrays.update({f"out.{i}.{name}": np.asarray(v) for name, v in outputs.items()})
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "runs": len(golden.feeds),
        "shapes": golden.shapes,
        "precision": golden.precision,
        "rtol": golden.rtol,
        "atol": golden.atol,
        "min_sqnr_db": golden.min_sqnr_db,
        "tolerances": {k: list(v) for k, v in golden.tolerances.items()},
        "reference": golden.reference,
        "model": golden.model,
        "signature": golden.signature,
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta, indent=1).encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def load_golden(path: str | Path, signature: Signature) -> Golden:
    """Read a golden file and check that its inputs and outputs are ``signature``'s."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--golden {path}: no such file")
    arrays = load_npz(path)
    if "meta" not in arrays:
        raise UsageError(f"--golden {path}: expected a golden file written by `tk check --save-golden`, found no meta")
    try:
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"--golden {path}: its meta is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        meta = meta if isinstance(meta, dict) else {}
        raise UsageError(
            f"--golden {path}: expected format {FORMAT} version {VERSION}, found {meta.get('format')} {meta.get('version')}"
        )
    try:
        return _golden_from(arrays, meta, signature, path)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UsageError(f"--golden {path}: malformed golden file ({type(exc).__name__}: {first_line(exc)})") from exc


def _golden_from(arrays: dict[str, np.ndarray], meta: dict[str, Any], signature: Any, path: Path) -> Golden:
    runs = int(meta["runs"])
    if not 1 <= runs <= len(arrays):
        raise UsageError(
            f"--golden {path}: expected 1 to {len(arrays)} runs for its {len(arrays)} arrays, found {runs}"
        )
    feeds: list[dict[str, np.ndarray]] = [{} for _ in range(runs)]
    outputs: list[dict[str, np.ndarray]] = [{} for _ in range(runs)]
    for key, value in arrays.items():
        kind, _, rest = key.partition(".")
        index, _, name = rest.partition(".")
        if kind not in ("in", "out") or not index.isdigit() or int(index) >= runs:
            raise UsageError(f"--golden {path}: unexpected array {key!r}")
        (feeds if kind == "in" else outputs)[int(index)][name] = value
    for i in range(runs):
        require_names([s.name for s in signature.inputs], sorted(feeds[i]), f"--golden {path} run {i} inputs")
        require_names([s.name for s in signature.outputs], sorted(outputs[i]), f"--golden {path} run {i} outputs")
    where = f"--golden {path}:"
    rtol, atol = checked_pair(meta["rtol"], meta["atol"], where)
    per_output = meta.get("tolerances", {})
    if not isinstance(per_output, dict):
        raise UsageError(f"{where} expected its tolerances as an object of NAME: [RTOL, ATOL], found {per_output!r}")
    tolerances = {}
    for key, pair in per_output.items():
        if not (isinstance(pair, list) and len(pair) == 2):
            raise UsageError(f"{where} tolerance of {key}: expected [RTOL, ATOL], found {pair!r}")
        tolerances[str(key)] = checked_pair(pair[0], pair[1], f"{where} tolerance of {key}")
    min_sqnr = meta.get("min_sqnr_db")
    if min_sqnr is not None and not (isinstance(min_sqnr, (int, float)) and math.isfinite(min_sqnr)):
        raise UsageError(f"{where} min_sqnr_db: expected a finite number or null, found {min_sqnr!r}")
    return Golden(
        feeds,
        outputs,
        [dict(s) for s in meta.get("shapes", [])],
        meta["precision"],
        rtol,
        atol,
        min_sqnr,
        meta.get("reference", "eager"),
        meta.get("model", {}),
        tolerances,
        meta.get("signature", {}),
    )


def parse_tolerances(items: tuple[str, ...] | list[str]) -> dict[str, tuple[float, float]]:
    """``NAME=RTOL:ATOL`` items (``--tol logits=1e-3:1e-4``) as ``{name: (rtol, atol)}``."""
    parsed: dict[str, tuple[float, float]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        rtol_text, colon, atol_text = value.partition(":")
        try:
            if not (sep and colon and name):
                raise ValueError
            parsed[name] = (float(rtol_text), float(atol_text))
        except ValueError:
            raise UsageError(f"--tol: expected NAME=RTOL:ATOL such as logits=1e-3:1e-4, got {item!r}") from None
        parsed[name] = checked_pair(*parsed[name], f"--tol {name}")
    return parsed
