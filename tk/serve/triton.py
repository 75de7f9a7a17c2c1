"""``tk deploy triton``: a Triton Inference Server model repository from an artifact.

``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/model.onnx`` (onnxruntime backend, with its external
data file when there is one) or ``REPO/NAME/1/model.plan`` (TensorRT backend). The config is built
as Triton's own ``ModelConfig`` protobuf message (``tritonclient.grpc.model_config_pb2``) and
written with ``google.protobuf.text_format``, so a field Triton does not know cannot slip in.

From the manifest: ``max_batch_size`` is the batch dimension's max (0 when the batch is static:
Triton then sends whole fixed-size tensors and its batcher stays off); dims leave out the batch
dimension and are -1 where a dimension is dynamic. For a TensorRT plan the dims come from the
engine's optimization profile (``formats["trt"]["profile"]``): -1 where min != max, the fixed size
otherwise, and ``max_batch_size`` from the profile's max; a profile whose batch min is above 1 is
refused, since Triton's batcher sends batches from 1. ``dynamic_batching.preferred_batch_size``
is the batch opt size; ``model_warmup`` sends one valid sample at the opt sizes (written as raw
files under ``warmup/``, since zero or random data is not a valid attention mask or token id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import UntrustedArtifactError, UsageError, first_line
from tk.fileio import atomic_write_bytes
from tk.manifest import Manifest, verify_artifact
from tk.outdir import refuse_inside, require_empty
from tk.runtime.inputs import sample_dim
from tk.serve.protocol import check_model_name, default_model_name
from tk.signing import NATIVE_CODE_FORMATS, TrustPolicy, check_signature, how_to_trust, untrusted_reason
from tk.spec import Dim, Signature, TensorSpec, random_feeds

log = logging.getLogger("tk.serve.triton")

# tk dtype -> Triton's DataType enum name
TRITON_TYPES: dict[str, str] = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "float64": "TYPE_FP64",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "bool": "TYPE_BOOL",
}


def backends() -> dict[str, Any]:
    """Format -> the engine class whose Triton backend serves its file (``Engine.triton``), in the order of
    the backends' preference (deploy's default is the first the artifact holds)."""
    from tk.registries import ENGINE_FILE_ROLE, ENGINES
    from tk.runtime import engine_class

    found = {ENGINE_FILE_ROLE[name]: engine_class(name) for name in ENGINES}
    served = {fmt: cls for fmt, cls in found.items() if cls.triton is not None}
    return dict(sorted(served.items(), key=lambda item: item[1].triton.preference))


def _backend(fmt: str) -> Any:
    """The Triton backend of format ``fmt`` (``UsageError`` naming those Triton loads, for another)."""
    served = backends()
    if fmt not in served:
        known = ", ".join(f"{f} ({cls.triton.platform})" for f, cls in served.items())
        raise UsageError(f"--format {fmt}: Triton loads {known}")
    return served[fmt].triton


@dataclass
class TritonModel:
    root: Path  # REPO/NAME
    config: Any  # the ModelConfig message written to config.pbtxt
    files: list[Path]  # what was written, relative to the repository


def model_config_pb2() -> Any:
    try:
        from tritonclient.grpc import model_config_pb2 as pb
    except ImportError as exc:
        raise UsageError(f"tk deploy triton needs tritonclient: pip install 'tk[serve]' ({first_line(exc)})") from exc
    return pb


def triton_config(
    manifest: Manifest,
    fmt: str,
    *,
    name: str,
    instances: int = 1,
    kind: str | None = None,
    max_queue_delay_us: int = 1000,
    require_file: bool = True,
) -> Any:
    """The ``ModelConfig`` message for the artifact's ``fmt`` (onnx or trt) file (``require_file=False``:
    the same message for an artifact without that file, as ``tk serve`` describes another engine)."""
    pb = model_config_pb2()
    backend = _backend(fmt)
    if require_file and fmt not in manifest.formats:
        raise UsageError(f"the artifact has no {fmt} file (it holds: {', '.join(manifest.formats) or 'none'})")
    sig = manifest.signature
    batch_name = sample_dim(sig.inputs)
    batch = sig.dims.get(batch_name)
    profile, batch_min, batch_max = _profile_and_batch(manifest, fmt, backend.profile_key, batch)
    batching = batch is not None and not batch.static
    if batching and profile and batch_min > 1:
        raise UsageError(
            f"the {fmt} file's optimization profile has a batch min of {batch_min}; Triton's batcher sends batches "
            "from 1: re-export with a batch range starting at 1"
        )
    config = pb.ModelConfig(name=name, platform=backend.platform, default_model_filename=backend.model_file)
    config.max_batch_size = batch_max if batching else 0
    for spec in sig.inputs:
        config.input.add(
            name=spec.name,
            data_type=pb.DataType.Value(TRITON_TYPES[spec.dtype]),
            dims=_config_dims(spec, profile[spec.name] if profile else None, sig.dims, batching),
        )
    for spec in sig.outputs:
        out_profile = _output_profile(spec, sig.dims, profile, sig.inputs) if profile else None
        config.output.add(
            name=spec.name,
            data_type=pb.DataType.Value(TRITON_TYPES[spec.dtype]),
            dims=_config_dims(spec, out_profile, sig.dims, batching),
        )
    if batching:
        assert batch is not None
        config.dynamic_batching.preferred_batch_size.append(min(batch.opt, batch_max))
        config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    group_kind = kind or ("KIND_GPU" if backend.gpu or manifest.device == "cuda" else "KIND_CPU")
    config.instance_group.add(count=instances, kind=pb.ModelInstanceGroup.Kind.Value(group_kind))
    _add_warmup(config, sig, profile, batch_name, batching)
    return config


def _profile_and_batch(
    manifest: Manifest, fmt: str, profile_key: str | None, batch: Dim | None
) -> tuple[dict[str, Any] | None, int, int]:
    """The ``fmt`` file's optimization profile (where its backend needs one; none recorded is one
    ``UsageError`` line) and the batch sizes it allows: the profile's, else the batch dimension's."""
    if not profile_key:
        low, high = (batch.min, batch.max) if batch else (1, 1)
        return None, low, high
    profile = manifest.formats.get(fmt, {}).get(profile_key)
    if not profile:
        raise UsageError(f"the artifact's {fmt} settings hold no optimization profile; re-export --format {fmt}")
    first = manifest.signature.inputs[0].name
    return profile, profile[first]["min"][0], profile[first]["max"][0]


def _config_dims(
    spec: TensorSpec, io_profile: dict[str, list[int]] | None, dims: dict[str, Dim], batching: bool
) -> list[int]:
    """A tensor's dims as Triton's config states them: without the batch axis when Triton batches, -1
    where the size varies (by the engine's profile where it has one)."""
    out = []
    for axis, dim in enumerate(spec.shape):
        if batching and axis == 0:
            continue
        if io_profile is not None:  # the engine's profile decides
            low, high = io_profile["min"][axis], io_profile["max"][axis]
            out.append(low if low == high else -1)
        elif isinstance(dim, int):
            out.append(dim)
        else:
            limits = dims.get(dim)
            out.append(limits.min if limits is not None and limits.static else -1)
    return out


def _add_warmup(config: Any, sig: Signature, profile: Any, batch_name: str, batching: bool) -> None:
    """One warmup sample at the opt sizes and batch 1, read from a file per input (``deploy_triton`` writes them)."""
    warmup = config.model_warmup.add(name="tk_opt_sample", batch_size=1)
    for spec, entry in zip(sig.inputs, config.input, strict=True):
        sizes = _warmup_sizes(sig.dims, profile, spec, batch_name)
        warm = warmup.inputs[spec.name]
        warm.data_type = entry.data_type
        warm.dims.extend([size for axis, size in enumerate(spec.concrete_shape(sizes)) if not (batching and axis == 0)])
        warm.input_data_file = spec.name


def _warmup_sizes(dims: dict[str, Any], profile: Any, spec: TensorSpec, batch_name: str) -> dict[str, int]:
    """Opt sizes, at batch 1 when Triton batches (a static batch keeps its one size)."""
    sizes = {n: d.opt for n, d in dims.items()}
    batch = dims.get(batch_name)
    if batch is None or not batch.static:
        sizes[batch_name] = 1
    if profile:  # the profile's opt shape, at batch 1
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, str) and dim != batch_name:
                sizes[dim] = profile[spec.name]["opt"][axis]
    return sizes


def _output_profile(
    spec: TensorSpec, dims: dict[str, Any], profile: dict[str, dict[str, list[int]]], inputs: list[TensorSpec]
) -> dict[str, list[int]]:
    """An output's min/max shape under the profile: each named dim takes its range from an input."""
    ranges: dict[str, tuple[int, int]] = {}
    for source in inputs:
        for axis, dim in enumerate(source.shape):
            if isinstance(dim, str):
                ranges.setdefault(dim, (profile[source.name]["min"][axis], profile[source.name]["max"][axis]))
    shape_min, shape_max = [], []
    for dim in spec.shape:
        if isinstance(dim, int):
            shape_min.append(dim)
            shape_max.append(dim)
        else:
            low, high = ranges.get(dim, (dims[dim].min, dims[dim].max) if dim in dims else (1, 2))
            shape_min.append(low)
            shape_max.append(high)
    return {"min": shape_min, "max": shape_max}


def deploy_triton(
    root: str | Path,
    out: str | Path,
    *,
    fmt: str | None = None,
    name: str | None = None,
    instances: int = 1,
    kind: str | None = None,
    max_queue_delay_us: int = 1000,
    force: bool = False,
    trust: TrustPolicy | None = None,
) -> TritonModel:
    """Write ``out/NAME/config.pbtxt``, ``out/NAME/1/<model file>`` and the warmup sample.

    ``fmt`` defaults to trt when the artifact has a plan, else onnx; ``name`` to the manifest's
    model name made safe (``default_model_name``). Files are verified (sha256) before they are
    copied, and written atomically. A non-empty ``out`` is refused unless ``force`` (then files of
    the same names are replaced, others kept), so an existing repository is never overwritten by
    accident; so is an ``out`` inside the artifact. A format that holds native code (a TensorRT
    plan, which Triton loads) is deployed only from an artifact a key ``trust`` trusts signed, or
    with ``trust.trust_artifact_code``, as every engine that would load it.
    """
    from google.protobuf import text_format

    manifest = verify_artifact(root)
    root = Path(root)
    if fmt is None:
        fmt = default_format(manifest)
    name = check_model_name(name) if name is not None else default_model_name(manifest)
    refuse_inside(Path(out), root, f"--out {out}")
    refuse_inside(Path(out) / name, root, f"--out {out} --name {name}")
    if not 1 <= instances <= 2**31 - 1:
        raise UsageError(f"--instances: expected 1 to {2**31 - 1}, got {instances}")
    if not 0 <= max_queue_delay_us < 2**63:
        raise UsageError(f"--max-queue-delay-us: expected 0 or more microseconds, got {max_queue_delay_us}")
    config = triton_config(
        manifest, fmt, name=name, instances=instances, kind=kind, max_queue_delay_us=max_queue_delay_us
    )
    model_dir = Path(out) / name
    require_empty(Path(out), force)
    require_trusted_file(root, manifest, fmt, trust)
    files = backends()[fmt].triton_files(root, manifest)  # the bytes that were hashed, read once
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, data in files.items():
        target = version_dir / file_name
        atomic_write_bytes(target, data)
        written.append(target)
    written += _write_warmup_samples(model_dir / "warmup", manifest, fmt)
    atomic_write_bytes(model_dir / "config.pbtxt", text_format.MessageToString(config).encode())
    written.append(model_dir / "config.pbtxt")
    return TritonModel(model_dir, config, [p.relative_to(out) for p in written])


def _write_warmup_samples(warmup_dir: Path, manifest: Manifest, fmt: str) -> list[Path]:
    """The warmup sample ``config.pbtxt`` names (``_add_warmup``): one file of raw values per input."""
    warmup_dir.mkdir(exist_ok=True)
    sig = manifest.signature
    profile_key = _backend(fmt).profile_key
    profile = manifest.formats[fmt].get(profile_key) if profile_key else None
    batch_name = sample_dim(sig.inputs)
    written = []
    for spec in sig.inputs:
        sizes = _warmup_sizes(sig.dims, profile, spec, batch_name)
        array = random_feeds([spec], sizes, seed=0)[spec.name]
        atomic_write_bytes(warmup_dir / spec.name, np.ascontiguousarray(array).tobytes())
        written.append(warmup_dir / spec.name)
    return written


def default_format(manifest: Manifest, engine: str | None = None) -> str:
    """The format Triton serves: ``engine``'s own where a backend serves it and the artifact holds it; with no
    engine, the first backend (by preference) the artifact holds; else the first that needs no profile
    (``tk serve`` describes an engine Triton has no backend for as that model's)."""
    from tk.registries import ENGINE_FILE_ROLE

    served = backends()
    own = ENGINE_FILE_ROLE.get(engine or "")
    if own in served and own in manifest.formats:
        return own
    held = [fmt for fmt in served if fmt in manifest.formats]
    if engine is None and held:
        return held[0]
    return next((fmt for fmt, cls in served.items() if cls.triton.profile_key is None), next(iter(served)))


def require_trusted_file(root: Path, manifest: Manifest, fmt: str, trust: TrustPolicy | None) -> None:
    """Refuse (one line) to deploy ``fmt`` when it holds native code (``NATIVE_CODE_FORMATS``: a TensorRT plan)
    and no key ``trust`` trusts signed the artifact, unless ``trust.trust_artifact_code`` (then a warning)."""
    if fmt not in NATIVE_CODE_FORMATS:
        return
    policy = trust or TrustPolicy()
    found = check_signature(root, manifest, policy)
    if found.trusted:
        return
    if not policy.trust_artifact_code:
        raise UntrustedArtifactError(
            f"{root}: refusing to deploy its {fmt} file, native code that Triton would load, because "
            f"{untrusted_reason(found)}; {how_to_trust(root)}"
        )
    log.warning("warning: --trust-artifact-code: deploying the %s file of %s although %s", fmt, root,
                untrusted_reason(found))  # fmt: skip


def read_config(path: str | Path) -> Any:
    """Parse a ``config.pbtxt`` into ``ModelConfig`` (raises ``UsageError`` naming the bad line)."""
    from google.protobuf import text_format

    pb = model_config_pb2()
    try:
        return text_format.Parse(Path(path).read_text(), pb.ModelConfig())
    except text_format.ParseError as exc:
        raise UsageError(f"{path}: not a valid Triton model config ({exc})") from exc


def served_config(
    manifest: Manifest,
    *,
    name: str,
    engine: str,
    replicas: int,
    max_batch: int,
    batching: bool,
    max_delay_ms: float,
) -> Any:
    """The ``ModelConfig`` that ``tk serve`` reports for what it serves: the one ``tk deploy triton``
    writes (the plan for the trt engine, else the ONNX model's), with the server's own batch
    limit, batch delay and replica count, and ``platform`` naming tk's engine when that is neither."""
    fmt = default_format(manifest, engine)
    config = triton_config(
        manifest,
        fmt,
        name=name,
        instances=replicas,
        max_queue_delay_us=int(max_delay_ms * 1000),
        require_file=False,
    )
    from tk.runtime import engine_class

    if engine_class(engine).triton is None:  # an engine Triton has no backend for: named as tk's
        config.platform = f"tk_{engine}"
        config.ClearField("default_model_filename")
    if config.max_batch_size > 0:
        config.max_batch_size = min(config.max_batch_size, max_batch)
        if config.HasField("dynamic_batching"):
            preferred = [min(size, max_batch) for size in config.dynamic_batching.preferred_batch_size]
            del config.dynamic_batching.preferred_batch_size[:]
            config.dynamic_batching.preferred_batch_size.extend(preferred)
        if not batching:
            config.ClearField("dynamic_batching")
    return config


def config_json(config: Any) -> dict[str, Any]:
    """``config`` in the JSON form Triton's ``GET /v2/models/NAME/config`` answers: protobuf field
    names, enums by name, every scalar field present (defaults too), and 64-bit integers as JSON
    numbers (protobuf's JSON mapping writes them as strings, which Triton's clients do not read)."""
    from google.protobuf import json_format
    from google.protobuf.descriptor import FieldDescriptor

    data = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    wide = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}  # fmt: skip

    def numbers(message_descriptor: Any, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        for key, item in value.items():
            field = message_descriptor.fields_by_name.get(key)
            if field is None:
                continue
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                target = field.message_type
                if target.GetOptions().map_entry:  # a map: its values' type
                    value_field = target.fields_by_name["value"]
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        value[key] = {k: numbers(value_field.message_type, v) for k, v in item.items()}
                    elif value_field.type in wide:
                        value[key] = {k: int(v) for k, v in item.items()}
                elif isinstance(item, list):
                    value[key] = [numbers(target, v) for v in item]
                else:
                    value[key] = numbers(target, item)
            elif field.type in wide:
                value[key] = [int(v) for v in item] if isinstance(item, list) else int(item)
        return value

    return numbers(config.DESCRIPTOR, data)
