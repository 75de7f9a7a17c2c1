"""What ``tk serve`` runs: ``ServeConfig``, its checks against the artifact (``resolve``) and the machine
(``require_room``), and the settings file that ``tk serve --config`` reads and ``--tune`` writes.

Every check happens here, in the process that runs ``tk serve``, before Ray starts or a replica
loads anything: a replica that would refuse its config is refused in one line instead.

The settings file is JSON: ``{"max_batch": 8, "max_delay_ms": 2.0, "replicas": 2, ...}`` with keys
from ``SETTINGS``; ``tk serve --config FILE`` starts from it, and flags given on the command line
win over it. A setting whose flag has a cap (``CAPS``, from ``tk.limits``) is held to the same cap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tk.errors import UsageError, first_line
from tk.fileio import atomic_write_bytes
from tk.limits import MAX_THREADS
from tk.manifest import verify_artifact
from tk.runtime.choice import EngineChoice, open_engine
from tk.runtime.inputs import sample_dim
from tk.serve.ingress import check_ingress
from tk.serve.protocol import check_model_name, default_model_name, max_request_bytes
from tk.signing import explicit_policy

DEFAULT_PORT = 8000
MIN_SHARE = 1e-4  # the finest fraction of a CPU or GPU Ray schedules


@dataclass(frozen=True)
class ServeConfig:
    """What ``tk serve`` runs. ``None`` means the default, resolved by ``resolve``."""

    artifact: str
    engine: EngineChoice = field(default_factory=EngineChoice)  # one engine name, device, options, failure policy
    name: str | None = None  # model name in URLs (default: the manifest's model name)
    host: str = "127.0.0.1"  # address the HTTP proxy binds
    port: int = DEFAULT_PORT
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_batch: int | None = None  # samples per engine call (default: the artifact's batch max)
    batching: bool = True  # False: each request runs alone, as soon as the engine is free
    max_delay_ms: float = 0.0  # longest wait past the oldest request for a batch below max_batch to fill
    max_queue: int = 64  # requests waiting for a replica before 503s (-1: unbounded)
    max_ongoing: int | None = None  # requests a replica holds at once (default: 2 x max_batch, at least 8)
    request_timeout_s: float = 20.0  # the proxy answers an error past this (while a replica restarts, say): no hangs
    ingress: str = "proxy"  # or haproxy (tk.serve.ingress)
    max_request_bytes: int | None = None  # larger bodies get 413 unread (default: the largest valid request)
    max_tokens: int | None = None  # a decoder's most new tokens per request (default: its cache's slots less one)


def resolve(config: ServeConfig) -> ServeConfig:
    """Check ``config`` against the artifact and fill in its defaults; raises ``UsageError``."""
    manifest = verify_artifact(config.artifact)
    sig = manifest.signature
    if manifest.generation:  # a decoder: requests are prompts, decoded in one batch of the graph's "batch"
        batch = sig.dims.get("batch")
        _check_max_tokens(config, int(manifest.generation["cache"]["slots"]))
    else:
        require_batch_first_outputs(sig)
        batch = sig.dims.get(sample_dim(sig.inputs))
    limit = batch.max if batch is not None else None
    max_batch = config.max_batch if config.max_batch is not None else (limit or 8)
    _check_numbers(config, max_batch, limit)
    # what a replica's load would refuse (engine missing here, format absent, failed check, a bad option),
    # refused now in one line: constructing the engine runs those checks and loads nothing
    open_engine(config.artifact, config.engine, manifest=manifest)
    if config.max_queue < -1 or config.max_queue == 0:
        raise UsageError(f"--max-queue: expected 1 or more (or -1 for unbounded), got {config.max_queue}")
    if not 0 < config.port < 65536:
        raise UsageError(f"--port: expected 1 to 65535, got {config.port}")
    ingress = check_ingress(config.ingress)
    name = check_model_name(config.name) if config.name is not None else default_model_name(manifest)
    max_ongoing = config.max_ongoing or max(8, 2 * max_batch)
    max_bytes = config.max_request_bytes
    if max_bytes is None and manifest.generation:
        max_bytes = GENERATION_REQUEST_BYTES
    elif max_bytes is None:
        max_bytes = max_request_bytes(sig.inputs, sig.dims, max_batch)
    elif max_bytes < 1:
        raise UsageError(f"--max-request-bytes: expected 1 or more, got {max_bytes}")
    # onnxruntime's idle threads spin by default; in a server they take the cores from the ingress
    # and the event loop between requests (one client, small Transformer at seq 16, haproxy ingress:
    # 6.8 ms served with spinning, 4.2 ms without, engine alone 1.7-2.3 ms)
    engine = config.engine.with_defaults({"spinning": False}, [config.engine.name])
    engine = engine.replace(trust=explicit_policy(engine.trust))  # replicas may not share this process's settings
    return replace(
        config,
        artifact=str(Path(config.artifact).resolve()),
        name=name,
        max_batch=max_batch,
        max_ongoing=max_ongoing,
        max_request_bytes=max_bytes,
        max_tokens=_max_tokens(config, manifest),
        engine=engine,
        ingress=ingress,
    )


def _max_tokens(config: ServeConfig, manifest: Any) -> int | None:
    """A decoder's cap on new tokens per request; None for every other model (which takes no --max-tokens)."""
    if not manifest.generation:
        if config.max_tokens is not None:
            raise UsageError(f"--max-tokens: expected a decoder artifact, found {manifest.model.get('name')!r}, "
                             "which does not generate")  # fmt: skip
        return None
    return config.max_tokens if config.max_tokens is not None else int(manifest.generation["cache"]["slots"]) - 1


GENERATION_REQUEST_BYTES = 1 << 20  # a decoder's request is prompts and options: text, never megabytes


def _check_max_tokens(config: ServeConfig, slots: int) -> None:
    if config.max_tokens is not None and not 1 <= config.max_tokens < slots:
        raise UsageError(
            f"--max-tokens: expected 1 to {slots - 1} (the artifact's cache holds {slots} slots, the prompt's "
            f"included), got {config.max_tokens}"
        )


def _check_numbers(config: ServeConfig, max_batch: int, limit: int | None) -> None:
    """``UsageError`` for a batch, timeout, replica count, delay or share out of range."""
    if max_batch < 1:
        raise UsageError(f"--max-batch: expected 1 or more, got {max_batch}")
    if not (math.isfinite(config.request_timeout_s) and config.request_timeout_s > 0):
        raise UsageError(
            f"--request-timeout: expected a finite number of seconds above 0, got {config.request_timeout_s}"
        )
    if limit is not None and max_batch > limit:
        raise UsageError(f"--max-batch {max_batch}: this artifact's batch max is {limit}; use at most {limit}")
    if config.replicas < 1:
        raise UsageError(f"--replicas: expected 1 or more, got {config.replicas}")
    if not (math.isfinite(config.max_delay_ms) and config.max_delay_ms >= 0):
        raise UsageError(f"--max-delay-ms: expected a finite 0 or more, got {config.max_delay_ms}")
    for flag, share in (
        ("--cpus-per-replica", config.cpus_per_replica),
        ("--gpus-per-replica", config.gpus_per_replica),
    ):
        if not (math.isfinite(share) and (share == 0 or share >= MIN_SHARE)):  # Ray refuses finer fractions
            raise UsageError(f"{flag}: expected 0 or a finite {MIN_SHARE:g} or more, got {share}")


def require_batch_first_outputs(signature: Any) -> None:
    """``UsageError`` unless every output holds the inputs' batch dimension first: a batch's outputs are
    split back into each request's own rows along axis 0."""
    batch = sample_dim(signature.inputs)
    for spec in signature.outputs:
        if not spec.shape or spec.shape[0] != batch:
            raise UsageError(
                f"tk serve: expected every output to hold the batch dimension {batch!r} first (each request gets "
                f"its own rows of it), got output {spec.name!r} of shape {list(spec.shape)}"
            )


def require_room(config: ServeConfig, resources: Mapping[str, float]) -> None:
    """``UsageError`` unless ``config``'s replicas fit ``resources`` (Ray's ``cluster_resources()``)."""
    for flag, share, kind in (
        ("--cpus-per-replica", config.cpus_per_replica, "CPU"),
        ("--gpus-per-replica", config.gpus_per_replica, "GPU"),
    ):
        needed, present = config.replicas * share, float(resources.get(kind, 0.0))
        if needed > present + 1e-9:
            raise UsageError(
                f"--replicas {config.replicas} x {flag} {share:g}: expected at most {present:g} {kind}s in all "
                f"(what this machine's Ray has), got {needed:g}; use fewer replicas or a smaller share"
            )


# the ServeConfig fields a settings file may set, and their types
SETTINGS: dict[str, type] = {
    "replicas": int,
    "cpus_per_replica": float,
    "gpus_per_replica": float,
    "max_batch": int,
    "batching": bool,
    "max_delay_ms": float,
    "max_queue": int,
    "request_timeout_s": float,
    "ingress": str,
    "max_request_bytes": int,
    "engine_threads": int,  # not a ServeConfig field: the engine's threads option (apply_settings)
}
# settings whose flag has a cap: the file is held to the same (tk.limits), checked when it is read
CAPS: dict[str, tuple[str, int, int]] = {"engine_threads": ("--threads", 1, MAX_THREADS)}


def read_settings(path: str | Path) -> dict[str, Any]:
    """A settings file's values by ``ServeConfig`` field; ``UsageError`` for anything else in it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"--config {path}: expected a readable JSON file, got {exc.strerror}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"--config {path}: expected JSON, got an error at line {exc.lineno}: {exc.msg}") from None
    except ValueError as exc:  # not UTF-8 text (a model file, say), or an integer past Python's digit limit
        raise UsageError(f"--config {path}: expected a UTF-8 JSON file of settings, got {first_line(exc)}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a JSON object of settings, got {type(data).__name__}")
    return {key: _setting(path, key, value) for key, value in data.items()}


def _setting(path: Path, key: str, value: Any) -> Any:
    """One setting's value, of its type and within its cap; ``UsageError`` otherwise."""
    kind = SETTINGS.get(key)
    if kind is None:
        raise UsageError(f"--config {path}: unknown setting {key!r}; expected some of {', '.join(SETTINGS)}")
    ok = (
        isinstance(value, bool)
        if kind is bool
        else isinstance(value, kind if kind is not float else (int, float)) and not isinstance(value, bool)
    )
    if ok and kind is float:
        ok = math.isfinite(float(value)) if abs(value) < 1e308 else False  # an int past float's range, NaN, inf
    if not ok:
        shown = (
            json.dumps(value) if not isinstance(value, int) or abs(value) < 10**30 else "an integer of over 30 digits"
        )
        raise UsageError(
            f"--config {path}: {key}: expected {'a finite ' if kind is float else ''}{kind.__name__}, got {shown}"
        )
    if key in CAPS:
        flag, low, high = CAPS[key]
        if not low <= value <= high:
            raise UsageError(f"--config {path}: {key}: expected {low} to {high} (as {flag}), got {value}")
    return kind(value)


def apply_settings(config: ServeConfig, settings: Mapping[str, Any]) -> ServeConfig:
    """``config`` with ``settings`` (keys from ``SETTINGS``); ``engine_threads`` sets the engine's
    ``threads`` option."""
    fields = {k: v for k, v in settings.items() if k != "engine_threads"}
    if "engine_threads" in settings:
        engine = config.engine
        fields["engine"] = engine.replace(options={**engine.options, "threads": settings["engine_threads"]})
    return replace(config, **fields)


def write_settings(path: str | Path, settings: Mapping[str, Any]) -> None:
    """Write ``settings`` (keys from ``SETTINGS``) as the JSON ``read_settings`` reads, atomically."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise UsageError(f"settings: unknown {sorted(unknown)}")
    atomic_write_bytes(Path(path), (json.dumps(dict(settings), indent=2) + "\n").encode())
