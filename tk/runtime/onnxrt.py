"""The ``onnx`` engine: onnxruntime on the artifact's ONNX file.

Options (``OnnxSessionOptions``): ``provider`` (cpu, cuda, tensorrt, or an onnxruntime provider name;
default: the best one installed for the device), ``threads`` (intra-op threads; default: every
core this process may use), ``optimization`` (all, extended, basic or disable; default all),
``spinning`` (whether idle worker threads spin for the next run: lower latency, but they keep the
cores from anything else in the process, torch or another session; default True, onnxruntime's
own). One session serves
every thread (onnxruntime's ``run`` is thread-safe). On CUDA, inputs and outputs are bound to
device memory, so torch CUDA tensors go in and come out without a trip through the host.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tk.errors import BackendUnavailableError, IntegrityError, UsageError, first_line, load_failure
from tk.manifest import read_verified
from tk.runtime.base import Engine, EngineOptions, TritonBackend
from tk.runtime.dtypes import torch_dtype
from tk.runtime.torch_engine import cuda_reason
from tk.safefiles import private_copy

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
}
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
OPTIMIZATION_LEVELS = {
    "all": "ORT_ENABLE_ALL",
    "extended": "ORT_ENABLE_EXTENDED",
    "basic": "ORT_ENABLE_BASIC",
    "disable": "ORT_DISABLE_ALL",
}
TRT_CACHE = Path("~/.cache/tk/ort-tensorrt")

_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class OnnxSessionOptions(EngineOptions):
    provider: str | None = None  # cpu, cuda, tensorrt or a provider name; default: the best for the device
    optimization: str = "all"  # graph optimization level: all, extended, basic, disable
    spinning: bool = True  # idle intra-op threads spin (onnxruntime's default); off when interleaving engines

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.optimization not in OPTIMIZATION_LEVELS:
            raise UsageError(
                f"engine 'onnx': optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {self.optimization!r}"
            )
        if not isinstance(self.spinning, bool):
            raise UsageError(f"engine 'onnx': spinning must be True or False, got {self.spinning!r}")


class OnnxRuntimeEngine(Engine):
    name = "onnx"
    native = "numpy"
    Options = OnnxSessionOptions

    triton = TritonBackend("onnxruntime_onnx", "model.onnx", preference=1)

    @classmethod
    def triton_files(cls, root: Path, manifest: Any) -> dict[str, bytes]:
        """The graph as ``model.onnx`` and its external data under its own name: the graph may name no
        external data beyond the artifact's own (``verified_onnx_files``)."""
        model_file = manifest.file("onnx").path
        files = verified_onnx_files(root, manifest)
        return {"model.onnx" if n == model_file else Path(n).name: data for n, data in files.items()}

    @classmethod
    def probe_call(cls, model: Any, feeds: dict[str, Any], like: Engine,
                   options: Mapping[str, Any] | None = None) -> Callable[[], object]:  # fmt: skip
        session = cpu_session(model, OnnxSessionOptions(spinning=False))  # serialized ONNX bytes
        return lambda: session.run(None, feeds)

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        reason = cuda_reason(device)
        if reason:
            return reason
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed (pip install 'tk[cpu]', or 'tk[gpu]' for CUDA)"
        if device == "cuda":
            import onnxruntime as ort

            if "CUDAExecutionProvider" not in ort.get_available_providers():
                return (
                    "this onnxruntime has no CUDAExecutionProvider "
                    "(pip uninstall onnxruntime, then pip install 'tk[gpu]')"
                )
        return None

    @classmethod
    def precision_reason(cls, precision: str, device: str = "cpu") -> str | None:
        if precision not in _PROBED_DTYPES or cls.unavailable_reason(device) is not None:
            return None
        return _matmul_probe(precision, PROVIDERS[device])

    def _load(self) -> None:
        import onnxruntime as ort

        path = self.root / self.manifest.file("onnx").path
        files = self._verified_files()
        providers = self._providers(ort)
        options = self._session_options(ort)
        try:
            if len(files) == 1:  # weights inside the graph: load the verified bytes themselves
                self._session = ort.InferenceSession(files[path.name], sess_options=options, providers=providers)
            else:  # external data is read relative to the model's path: a private copy of the verified bytes
                with private_copy(files) as copy:
                    self._session = ort.InferenceSession(
                        str(copy / path.name), sess_options=options, providers=providers
                    )
        except Exception as exc:  # onnxruntime raises its own pybind types
            first = first_line(exc)
            if "NOT_IMPLEMENTED" in first:  # a valid graph with an op or dtype these providers lack
                names = ", ".join(p[0] for p in providers)
                hint = ""
                if self.manifest.precision == "bf16":
                    hint = "; onnxruntime's CPU kernels lack bfloat16: export --precision fp16, or use the aoti engine"
                raise BackendUnavailableError(f"onnxruntime ({names}) cannot run {path.name}: {first}{hint}") from exc
            raise load_failure(exc, f"{path} (onnxruntime)", "re-export the artifact") from exc
        wanted = providers[0][0]
        if wanted not in self._session.get_providers():
            raise BackendUnavailableError(
                f"engine 'onnx': onnxruntime fell back from {wanted} to {self._session.get_providers()} "
                "(are the CUDA/cuDNN or TensorRT libraries on the library path?)"
            )
        self._in_names = [s.name for s in self.inputs]
        self._out_names = [s.name for s in self.outputs]
        got_in = [i.name for i in self._session.get_inputs()]
        got_out = [o.name for o in self._session.get_outputs()]
        if sorted(got_in) != sorted(self._in_names) or sorted(got_out) != sorted(self._out_names):
            raise IntegrityError(
                f"{path}: the ONNX graph has inputs {got_in} and outputs {got_out}; "
                f"the manifest expects {self._in_names} and {self._out_names}"
            )
        self._bind = self.device == "cuda"
        self._device_id = torch.cuda.current_device() if self._bind else 0

    @property
    def session(self) -> Any:
        """The onnxruntime InferenceSession, loaded on first use (to time or inspect it directly)."""
        return self.load()._session

    def _session_options(self, ort: Any) -> Any:
        return session_options(ort, self.options)

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if self._loaded:
            options = self._session.get_session_options()
            out.update(
                providers=self._session.get_providers(),
                intra_op_threads=options.intra_op_num_threads,
                spinning=options.get_session_config_entry("session.intra_op.allow_spinning") == "1",
                graph_optimization_level=str(options.graph_optimization_level).rsplit(".", 1)[-1],
                cpu_memory_arena=options.enable_cpu_mem_arena,
                io_binding=self._bind,
            )
        return out

    def _verified_files(self) -> dict[str, bytes]:
        return verified_onnx_files(self.root, self.manifest)

    def _providers(self, ort: Any) -> list[Any]:
        available = ort.get_available_providers()
        requested = self.options.provider
        if requested:
            name = PROVIDERS.get(str(requested).lower(), str(requested))
            if name not in available:
                raise BackendUnavailableError(
                    f"engine 'onnx': provider {requested!r} is not available; this onnxruntime has {', '.join(available)}"
                )
            if name in GPU_PROVIDERS and self.device != "cuda":
                raise UsageError(f"engine 'onnx': provider {requested!r} runs on the GPU; use --device cuda")
            chain = [name]
        elif self.device == "cuda":
            chain = [p for p in GPU_PROVIDERS if p in available]
            if "TensorrtExecutionProvider" in chain and importlib.util.find_spec("tensorrt") is None:
                chain.remove("TensorrtExecutionProvider")  # listed by onnxruntime-gpu even without TensorRT's libraries
        else:
            chain = []
        if "CPUExecutionProvider" not in chain:
            chain.append("CPUExecutionProvider")
        return [(p, self._provider_options(p)) for p in chain]

    def _provider_options(self, provider: str) -> dict[str, str]:
        if provider == "CUDAExecutionProvider":  # onnxruntime's CUDA provider uses TF32 unless told not to
            tf32 = "1" if self.manifest.precision == "tf32" else "0"
            return {"device_id": str(torch.cuda.current_device()), "use_tf32": tf32}
        if provider != "TensorrtExecutionProvider":
            return {}
        cache = TRT_CACHE.expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        shapes = {}
        for which in ("min", "opt", "max"):
            sizes = {name: getattr(dim, which) for name, dim in self.dims.items()}
            shapes[which] = ",".join(
                f"{s.name}:" + "x".join(str(n) for n in s.concrete_shape(sizes)) for s in self.inputs
            )
        return {
            "device_id": str(torch.cuda.current_device()),
            "trt_profile_min_shapes": shapes["min"],
            "trt_profile_opt_shapes": shapes["opt"],
            "trt_profile_max_shapes": shapes["max"],
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": "True",
        }

    def _to_native(self, value: Any) -> Any:
        if self.device == "cuda":  # keep torch (and CUDA) tensors for I/O binding
            return torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        return super()._to_native(value)

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        if self._bind:
            return self._run_bound(feeds)
        inputs = {name: np.ascontiguousarray(feeds[name]) for name in self._in_names}
        return dict(zip(self._out_names, self._session.run(self._out_names, inputs), strict=True))

    def _run_bound(self, feeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        device = torch.device("cuda", self._device_id)
        binding = self._session.io_binding()
        sizes: dict[str, int] = {}
        keep = []  # the bound tensors must outlive the run
        for spec in self.inputs:
            tensor = feeds[spec.name].to(device).contiguous()
            keep.append(tensor)
            sizes.update({d: n for d, n in zip(spec.shape, tensor.shape, strict=True) if isinstance(d, str)})
            binding.bind_input(
                spec.name, "cuda", self._device_id, _numpy_dtype(tensor.dtype), tuple(tensor.shape), tensor.data_ptr()
            )
        outputs: dict[str, torch.Tensor] = {}
        known = all(all(not isinstance(d, str) or d in sizes for d in s.shape) for s in self.outputs)
        for spec in self.outputs:
            if known:  # preallocate on the device: onnxruntime writes there, nothing is copied back
                out = torch.empty(spec.concrete_shape(sizes), dtype=torch_dtype(spec.dtype), device=device)
                outputs[spec.name] = out
                binding.bind_output(
                    spec.name, "cuda", self._device_id, _numpy_dtype(out.dtype), tuple(out.shape), out.data_ptr()
                )
            else:
                binding.bind_output(spec.name, "cpu")
        torch.cuda.current_stream(device).synchronize()  # onnxruntime reads the inputs on its own stream
        self._session.run_with_iobinding(binding)
        if known:
            return outputs
        return dict(zip(self._out_names, binding.copy_outputs_to_cpu(), strict=True))

    def _close(self) -> None:
        del self._session


def session_options(ort: Any, engine_options: OnnxSessionOptions) -> Any:
    """The ``onnxruntime.SessionOptions`` this engine runs with under ``engine_options``."""
    options = ort.SessionOptions()
    level = OPTIMIZATION_LEVELS[engine_options.optimization]
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.intra_op_num_threads = engine_options.threads or usable_cores()
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if engine_options.spinning else "0")
    options.log_severity_level = 3  # errors only: onnxruntime warns about every initializer it folds away
    return options


def cpu_session(model: bytes, engine_options: OnnxSessionOptions) -> Any:
    """A CPU session of a serialized ONNX model (one not yet in an artifact: ``tk optimize`` times an int8
    graph before its exclusion search) with the options this engine's sessions get."""
    import onnxruntime as ort

    return ort.InferenceSession(model, sess_options=session_options(ort, engine_options),
                                providers=["CPUExecutionProvider"])  # fmt: skip


def _numpy_dtype(dtype: torch.dtype) -> Any:
    if dtype not in _NUMPY_DTYPES:
        raise UsageError(f"engine 'onnx': I/O binding does not support {dtype}")
    return _NUMPY_DTYPES[dtype]


def verified_onnx_files(root: Path, manifest: Any) -> dict[str, bytes]:
    """An artifact's ONNX file and its external data (if any), by name, read once and checked against
    the manifest (``tk.manifest.Manifest``). The graph may name only external data files the manifest
    lists, beside the model file: any other is refused before onnxruntime (or Triton) reads it."""
    model = manifest.file("onnx")
    if "/" in model.path:
        raise IntegrityError(f"{root}: expected the ONNX file at the artifact's top level, found {model.path!r}")
    files = {model.path: read_verified(root, model)}
    data_files = {e.path: e for e in manifest.files if e.role == "onnx-data"}
    external = manifest.formats.get("onnx", {}).get("external_data")
    if external and (not isinstance(external, str) or external not in data_files):
        raise IntegrityError(
            f"{root}: the ONNX model keeps its weights in {external}, and the manifest lists no such "
            "onnx-data file; the artifact is incomplete, re-export it"
        )
    named = _external_locations(files[model.path])
    unknown = sorted(named - set(data_files))
    if unknown:
        raise IntegrityError(
            f"{root / model.path}: the graph reads external data from {unknown[:3]}, which the manifest does "
            "not list; refusing to load it"
        )
    for name, entry in data_files.items():
        files[name] = read_verified(root, entry)
    return files


def _external_locations(model_bytes: bytes) -> set[str]:
    """The external data files an ONNX model's tensors name (read without loading them): initializers,
    and the tensors inside nodes' attributes (a ``Constant``'s value, a subgraph's initializers: a crafted
    graph read a file from the working directory through a ``Constant`` whose value was external data)."""
    import onnx

    try:
        model = onnx.ModelProto.FromString(model_bytes)
    except Exception as exc:  # protobuf raises DecodeError and others for damaged bytes
        raise IntegrityError(
            f"damaged ONNX file ({type(exc).__name__}: {first_line(exc)}); re-export the artifact"
        ) from exc
    locations = set()
    for tensor in _tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {item.key: item.value for item in tensor.external_data}
            locations.add(info.get("location", ""))
    return locations


def _tensors(model: Any) -> Iterator[Any]:
    """Every ``TensorProto`` of ``model``: its graphs' initializers (sparse ones too) and every tensor held
    by an attribute: of a node, in the main graph, in subgraphs (``If``, ``Loop``, ``Scan``), in functions,
    and a function's attribute defaults (which a ``Constant`` inside it can take by reference); the
    training graphs too."""
    graphs = [model.graph]
    for info in model.training_info:
        graphs += [info.initialization, info.algorithm]
    attributes = [a for f in model.functions for a in f.attribute_proto]
    node_lists = [f.node for f in model.functions]
    while graphs or node_lists or attributes:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
            node_lists.append(graph.node)
        elif node_lists:
            attributes.extend(a for node in node_lists.pop() for a in node.attribute)
        else:
            attr = attributes.pop()
            yield from ([attr.t] if attr.HasField("t") else [])
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
            for sparse in attr.sparse_tensors:
                yield from (sparse.values, sparse.indices)
            graphs.extend([attr.g] if attr.HasField("g") else [])
            graphs.extend(attr.graphs)


_PROBED_DTYPES = {"bf16": "BFLOAT16", "fp16": "FLOAT16"}


@functools.cache
def _matmul_probe(precision: str, provider: str) -> str | None:
    """Whether ``provider`` has a MatMul kernel for ``precision``: one 2x2 MatMul, opened in a session.

    onnxruntime's CPU provider has no bfloat16 MatMul, so a bf16 graph fails at session creation
    (NOT_IMPLEMENTED); asked once per process, so that ``tk optimize`` skips such a candidate
    instead of exporting it first. A probe, not a version table: the kernels come and go by release."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    dtype = getattr(TensorProto, _PROBED_DTYPES[precision])
    a, b, y = (helper.make_tensor_value_info(n, dtype, [2, 2]) for n in "aby")
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "probe", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    try:
        ort.InferenceSession(model.SerializeToString(), providers=[provider])
    except Exception as exc:  # onnxruntime raises its own pybind types
        if "NOT_IMPLEMENTED" not in str(exc):
            return None  # not the answer the probe asks for: the candidate is exported and says its own error
        return f"onnxruntime {ort.__version__} has no {onnx.TensorProto.DataType.Name(dtype).lower()} MatMul for {provider}"
    return None
