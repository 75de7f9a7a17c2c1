"""Checkpoints: a state_dict in safetensors plus a JSON sidecar; pickles are never trusted."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.errors import IntegrityError, UsageError, first_line
from tk.fileio import atomic_write_bytes, atomic_write_json

SIDECAR_SUFFIX = ".json"


def original_module(module: nn.Module) -> nn.Module:
    """The module under a ``torch.compile`` wrapper, so saved keys carry no ``_orig_mod.``."""
    return getattr(module, "_orig_mod", module)


# safetensors metadata key holding the state_dict's ``_metadata`` (each submodule's ``version``), which
# ``load_state_dict`` hands to ``_load_from_state_dict``: torchvision's MNASNet refuses a state without it
VERSIONS_KEY = "tk.state_dict_metadata"


def state_dict_bytes(module: nn.Module) -> bytes:
    from safetensors.torch import save

    own = original_module(module).state_dict()
    state = {k: v.detach().cpu().contiguous().clone() for k, v in own.items()}
    versions = _checked_versions(getattr(own, "_metadata", None))
    return save(state, metadata={VERSIONS_KEY: json.dumps(versions)} if versions else None)


def _checked_versions(value: Any) -> dict[str, dict[str, Any]] | None:
    """``value`` when it is a state_dict's ``_metadata`` of plain values (prefix -> {key: int, str or bool}), else None."""
    if not isinstance(value, dict):
        return None
    plain = (int, str, bool, type(None))
    for prefix, meta in value.items():
        if not isinstance(prefix, str) or not isinstance(meta, dict):
            return None
        if not all(isinstance(k, str) and isinstance(v, plain) for k, v in meta.items()):
            return None
    return dict(value)


def saved_versions(data: bytes) -> dict[str, dict[str, Any]] | None:
    """The ``_metadata`` a safetensors file's header holds under ``VERSIONS_KEY`` (None when it has none)."""
    if len(data) < 8:
        return None
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + size]) if 2 <= size <= len(data) - 8 else {}
        text = header.get("__metadata__", {}).get(VERSIONS_KEY) if isinstance(header, dict) else None
        return _checked_versions(json.loads(text)) if isinstance(text, str) else None
    except (ValueError, AttributeError, RecursionError):
        return None


def save_checkpoint(module: nn.Module, path: str | Path, meta: dict[str, Any]) -> Path:
    """Save the weights as safetensors at ``path`` and ``meta`` in ``path`` + ``.json``."""
    path = Path(path)
    data = state_dict_bytes(module)
    atomic_write_bytes(path, data)
    meta = {**meta, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_json(sidecar_path(path), meta)
    return path


def sidecar_path(path: str | Path) -> Path:
    return Path(str(path) + SIDECAR_SUFFIX)


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Weights from safetensors, or from a torch file with ``weights_only=True``; never a pickle with code."""
    path = Path(path)
    if not path.is_file():
        found = "a directory" if path.is_dir() else "nothing"
        raise UsageError(f"checkpoint: expected a file, found {found} at {path}")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and _looks_like_safetensors(path, head):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise IntegrityError(f"checkpoint {path}: damaged safetensors file ({exc})") from exc
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler's refusal comes in several types
        raise IntegrityError(
            f"checkpoint {path}: expected safetensors or a weights-only torch file; refused to load it "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise IntegrityError(f"checkpoint {path}: expected a state_dict of tensors, found {type(state).__name__}")
    return state


def _looks_like_safetensors(path: Path, head: bytes) -> bool:
    header_len = int.from_bytes(head, "little")
    return 2 <= header_len <= path.stat().st_size - 8 and header_len < 100_000_000


def state_dict_from_safetensors(data: bytes, source: str) -> dict[str, torch.Tensor]:
    """Weights from the bytes of a safetensors file (already read and verified by the caller)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError, OSError) as exc:
        raise IntegrityError(f"{source}: damaged safetensors data ({first_line(exc)})") from exc


def require_checkpoint_fits(module: nn.Module, path: str | Path) -> None:
    """Refuse (one line) a checkpoint whose names or shapes are not ``module``'s, loading nothing into it."""
    _require_fit(original_module(module).state_dict(), load_state_dict(path), path)


def _require_fit(own: dict[str, Any], state: dict[str, Any], path: str | Path) -> None:
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {path}: does not fit this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "expected one saved by `tk train` for the same model and size"
        )
    for key, value in state.items():
        if own[key].shape != value.shape:
            raise UsageError(
                f"checkpoint {path}: {key} has shape {tuple(value.shape)}, the model expects {tuple(own[key].shape)}"
            )


def load_weights(module: nn.Module, path: str | Path | bytes, *, source: str | None = None) -> None:
    """Load a checkpoint (a path, or the verified bytes of a safetensors file) into ``module``; every key must match."""
    if isinstance(path, bytes):
        state = state_dict_from_safetensors(path, source or "weights")
        versions = saved_versions(path)
        path = source or "weights"
    else:
        state = load_state_dict(path)
        versions = _versions_of_file(path)
    own = original_module(module).state_dict()
    _require_fit(own, state, path)
    ordered = collections.OrderedDict(state)
    # the submodules' versions as saved, else this code's own (a checkpoint tk saved before it kept them)
    ordered._metadata = versions or getattr(own, "_metadata", None)  # type: ignore[attr-defined]
    try:
        original_module(module).load_state_dict(ordered)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # the module's own loading hooks refuse it
        raise UsageError(
            f"checkpoint {path}: the model refused these weights ({type(exc).__name__}: {first_line(exc)})"
        ) from exc


def _versions_of_file(path: str | Path) -> dict[str, dict[str, Any]] | None:
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        return saved_versions(head + f.read(size)) if 2 <= size < 100_000_000 else None


def read_sidecar(path: str | Path) -> dict[str, Any] | None:
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        return json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise IntegrityError(f"checkpoint sidecar {side}: expected JSON, found damaged text ({exc})") from exc
