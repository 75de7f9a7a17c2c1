"""Engine names to classes (the names live in ``tk.registries``), and ``load``, which opens one.

Modules are imported on first use, so ``import tk.runtime.registry`` stays light.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tk.errors import BackendUnavailableError, IntegrityError, UsageError
from tk.manifest import Manifest, verify_artifact
from tk.registries import ENGINE_FILE_ROLE, ENGINES
from tk.signing import (
    TrustPolicy,
    check_signature,
    how_to_trust,
    loads_native_code,
    require_trusted_code,
    untrusted_reason,
)

if TYPE_CHECKING:
    from tk.runtime.base import Engine, EngineOptions

log = logging.getLogger("tk.runtime")


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
    module_name, _, cls_name = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def unavailable_reason(name: str, device: str = "cpu", precision: str | None = None) -> str | None:
    """Why engine ``name`` cannot run here (given ``precision``: an artifact of that precision), or None."""
    cls = engine_class(name)
    reason = cls.unavailable_reason(device)
    if reason is None and precision is not None:
        reason = cls.precision_reason(precision, device)
    return reason


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
    engine: str | None = None,
    *,
    device: str = "cpu",
    allow_failed: bool = False,
    manifest: Manifest | None = None,
    options: EngineOptions | Mapping[str, Any] | None = None,
    trust: TrustPolicy | None = None,
    **option_values: Any,
) -> Engine:
    """Open the artifact at ``root`` with ``engine``, after verifying every file's size and sha256.

    Options come as the engine's ``Options`` dataclass, a mapping, or keywords; a name the engine
    does not declare is refused with the list of those it does. An artifact whose export-time
    check failed is refused unless ``allow_failed`` is set. ``engine=None``: the engine the
    manifest recommends (``tk optimize``), with the engine settings it was timed at under the
    ones given (as a mapping or keywords; an ``Options`` dataclass is taken as it is), else onnx.
    An engine that runs the artifact's native code (aoti, trt) is refused unless its signature
    verifies against a key ``trust`` trusts (default: the user's own and the trusted-keys settings)
    or ``trust.trust_artifact_code``; the engine checks it again when it loads.
    """
    if option_values:
        if options is not None:
            raise UsageError("load: give engine options either as options= or as keywords, not both")
        options = option_values
    if engine is None:
        manifest = manifest if manifest is not None else verify_artifact(root)
        engine = manifest.recommended_engine or "onnx"
        if manifest.recommended_engine and (options is None or isinstance(options, Mapping)):
            given = {k: v for k, v in (options or {}).items() if v is not None}  # None: not given, as EngineChoice
            options = {**manifest.recommended_engine_options, **given}  # the caller's own win
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
    if loads_native_code(root, manifest, ENGINE_FILE_ROLE[engine]):
        require_trusted_code(root, manifest, trust, engine)
    return cls(root, manifest, device=device, options=options, trust=trust)


def trusted_engines(
    root: str | Path, manifest: Manifest, names: list[str], trust: TrustPolicy | None = None
) -> list[str]:
    """``names`` less the engines that would run native code the user does not trust, each left
    out with a note on stderr: what ``--engine all`` and ``auto`` run."""
    native = [n for n in names if n in ENGINE_FILE_ROLE and loads_native_code(root, manifest, ENGINE_FILE_ROLE[n])]
    policy = trust or TrustPolicy()
    if not native or policy.trust_artifact_code:
        return names
    found = check_signature(root, manifest, policy)
    if found.trusted:
        return names
    for name in native:
        log.warning(
            "note: skipping %s, which runs the artifact's native code, because %s; %s",
            name,
            untrusted_reason(found),
            how_to_trust(root),
        )
    return [n for n in names if n not in native]
