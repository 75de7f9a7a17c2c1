"""Engine names to classes. Adding a backend is adding a module and one line here.

Modules are imported on first use, so ``import tk.runtime`` stays light.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from tk.errors import BackendUnavailableError, IntegrityError, UsageError
from tk.manifest import Manifest, verify_artifact
from tk.runtime.base import Engine

ENGINES: dict[str, str] = {
    "eager": "tk.runtime.eager:EagerEngine",
    "compile": "tk.runtime.eager:CompiledEngine",
    "torch": "tk.runtime.exported:ExportedProgramEngine",
    "aoti": "tk.runtime.aoti:AOTInductorEngine",
    "onnx": "tk.runtime.onnxrt:OnnxRuntimeEngine",
    "trt": "tk.runtime.tensorrt:TensorRTEngine",
}

# The artifact file each engine needs (eager and compile rebuild the model from its weights).
ENGINE_FILE_ROLE: dict[str, str] = {
    "eager": "weights",
    "compile": "weights",
    "torch": "torch",
    "aoti": "aoti",
    "onnx": "onnx",
    "trt": "trt",
}


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
    module_name, _, cls_name = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def unavailable_reason(name: str, device: str = "cpu") -> str | None:
    return engine_class(name).unavailable_reason(device)


def available_engines(manifest: Manifest | None = None, device: str = "cpu") -> list[str]:
    """Engines this machine can run (and, given a manifest, whose file the artifact holds)."""
    names = []
    roles = {e.role for e in manifest.files} if manifest is not None else None
    for name in ENGINES:
        if roles is not None and ENGINE_FILE_ROLE[name] not in roles:
            continue
        if unavailable_reason(name, device) is None:
            names.append(name)
    return names


def load(
    root: str | Path,
    engine: str = "onnx",
    *,
    device: str = "cpu",
    allow_failed: bool = False,
    manifest: Manifest | None = None,
    **options: Any,
) -> Engine:
    """Open the artifact at ``root`` with ``engine``, after verifying every file's size and sha256.

    An artifact whose export-time check failed is refused unless ``allow_failed`` is set.
    """
    cls = engine_class(engine)
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailableError(f"engine {engine!r} cannot run here: {reason}")
    if manifest is None:
        manifest = verify_artifact(root)
    if manifest.status == "failed" and not allow_failed:
        raise IntegrityError(
            f"{root}: this artifact failed its export-time parity check (see `tk inspect {root}`); "
            "re-export it, or pass --allow-failed to inspect it anyway"
        )
    manifest.file(ENGINE_FILE_ROLE[engine])  # a clear error when the artifact lacks the format
    return cls(root, manifest, device=device, **options)
