"""The ``trt`` engine: a serialized TensorRT engine run through ``execute_async_v3`` on torch CUDA memory.

Each thread gets its own execution context, CUDA stream and I/O buffers (allocated once at the
profile's largest shapes, then reused through views); every context shares one deserialized
engine. With ``cuda_graph=True`` each input shape is captured once into a CUDA graph and
replayed afterwards. Outputs come back on the GPU for CUDA inputs and on the host otherwise.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from tk.errors import BackendUnavailableError, InputError, IntegrityError
from tk.formats.tensorrt import trt_logger, unavailable_reason
from tk.manifest import read_verified
from tk.runtime.base import Engine, EngineOptions, TritonBackend, rebuild_command
from tk.signing import require_trusted_code

log = logging.getLogger("tk.runtime")

_TRT_DTYPES = {  # trt.DataType member name -> torch dtype
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class _ThreadState:
    """What one thread needs to run the engine without touching another thread's memory."""

    context: Any  # trt.IExecutionContext
    stream: torch.cuda.Stream
    buffers: dict[str, torch.Tensor]  # flat, sized for the profile's max shapes
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input shapes last set on the context
    graphs: dict[tuple[tuple[int, ...], ...], torch.cuda.CUDAGraph | None] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorRTOptions(EngineOptions):
    cuda_graph: bool = False  # capture each input shape into a CUDA graph, then replay it


class TensorRTEngine(Engine):
    """A TensorRT plan on the GPU (options: ``TensorRTOptions``)."""

    name = "trt"
    Options = TensorRTOptions
    # a plan's dims come from its optimization profile (manifest formats.trt.profile); preferred where present
    triton = TritonBackend("tensorrt_plan", "model.plan", gpu=True, profile_key="profile", preference=0)

    @classmethod
    def unavailable_reason(cls, device: str = "cuda") -> str | None:
        return unavailable_reason(device)

    def _load(self) -> None:
        require_trusted_code(self.root, self.manifest, self.trust, self.name)  # plans can carry plugins: native code
        import tensorrt as trt

        self._refuse_foreign_engine(trt)
        entry = self.manifest.file("trt")
        path = self.root / entry.path
        plan = read_verified(self.root, entry)
        self._device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self._device):
            self._runtime = trt.Runtime(trt_logger())
            self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise IntegrityError(
                f"{path}: TensorRT {trt.__version__} cannot deserialize it (see its log); rebuild it with "
                f"`{rebuild_command(self.manifest, 'trt', 'cuda')}`"
            )
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._in_names = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._out_names = [n for n in names if n not in self._in_names]
        want_in, want_out = [s.name for s in self.inputs], [s.name for s in self.outputs]
        if sorted(self._in_names) != sorted(want_in) or sorted(self._out_names) != sorted(want_out):
            raise IntegrityError(
                f"{path}: the engine has inputs {self._in_names} and outputs {self._out_names}; "
                f"the manifest expects {want_in} and {want_out}"
            )
        self._out_names = want_out
        self._profile = {n: self._engine.get_tensor_profile_shape(n, 0) for n in self._in_names}  # (min, opt, max)
        self._dtypes = {n: _torch_dtype(trt, self._engine.get_tensor_dtype(n)) for n in names}
        self._cuda_graph = self.options.cuda_graph
        self._local = threading.local()
        self._states: list[_ThreadState] = []
        self._states_lock = threading.Lock()

    def _refuse_foreign_engine(self, trt: Any) -> None:
        """TensorRT plans load only in the TensorRT version, and on the GPUs, they were built for."""
        settings = self.manifest.formats.get("trt", {})
        rebuild = rebuild_command(self.manifest, "trt", "cuda")
        built = settings.get("tensorrt") or self.manifest.versions.get("tensorrt")
        if built != trt.__version__:
            raise IntegrityError(
                f"{self.root}: the TensorRT engine was built with TensorRT {built}, this machine has "
                f"{trt.__version__}; an engine loads only in the version that built it: rebuild it with `{rebuild}`"
            )
        level = settings.get("hardware_compatibility", "none")
        built_cc = settings.get("compute_capability")
        major, minor = torch.cuda.get_device_capability()
        here = f"{major}.{minor}"
        if level == "ampere+":
            ok = (major, minor) >= (8, 0)
        else:  # "none" and "same-compute-capability" engines run only on the compute capability that built them
            ok = built_cc is None or built_cc == here
        if not ok:
            raise BackendUnavailableError(
                f"{self.root}: the TensorRT engine was built for compute capability {built_cc} "
                f"(hardware compatibility {level}) and this GPU has {here}; rebuild it here with `{rebuild}`"
            )

    # -- per-thread state ------------------------------------------------------------------------
    def _state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._new_state()
            self._local.state = state
            with self._states_lock:
                self._states.append(state)
        return state

    def _new_state(self) -> _ThreadState:
        with torch.cuda.device(self._device):
            context = self._engine.create_execution_context()
            if context is None:
                raise BackendUnavailableError(
                    "TensorRT could not create an execution context (is the GPU out of memory?)"
                )
            for name in self._in_names:  # the largest shapes size every buffer
                context.set_input_shape(name, tuple(self._profile[name][2]))
            buffers = {}
            for name in self._in_names + self._out_names:
                shape = tuple(context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise IntegrityError(
                        f"TensorRT output {name!r} has a data-dependent shape {shape}; tk cannot run it"
                    )
                buffers[name] = torch.empty(math.prod(shape), dtype=self._dtypes[name], device=self._device)
                context.set_tensor_address(name, buffers[name].data_ptr())
            return _ThreadState(context, torch.cuda.Stream(self._device), buffers)

    # -- running -----------------------------------------------------------------------------------
    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = self._state()
        shapes = {name: tuple(feeds[name].shape) for name in self._in_names}
        on_host = not any(t.is_cuda for t in feeds.values())
        with torch.cuda.device(self._device):
            stream = state.stream
            stream.wait_stream(torch.cuda.current_stream())  # inputs on the GPU were written on the caller's stream
            with torch.cuda.stream(stream):
                for name in self._in_names:
                    _view(state.buffers[name], shapes[name]).copy_(feeds[name], non_blocking=True)
                if shapes != state.shapes:
                    self._set_shapes(state, shapes)
                self._execute(state, tuple(shapes[n] for n in self._in_names))
                outputs = {}
                for name in self._out_names:
                    view = _view(state.buffers[name], tuple(state.context.get_tensor_shape(name)))
                    outputs[name] = view.to("cpu") if on_host else view.clone()
            stream.synchronize()
        return outputs

    def _set_shapes(self, state: _ThreadState, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, shape in shapes.items():
            if not state.context.set_input_shape(name, shape):
                low, _, high = self._profile[name]
                raise InputError(
                    f"input {name!r}: TensorRT refused shape {shape}; the engine's profile allows "
                    f"{tuple(low)} to {tuple(high)}"
                )
        state.shapes = dict(shapes)

    def _execute(self, state: _ThreadState, key: tuple[tuple[int, ...], ...]) -> None:
        if self._cuda_graph:
            if key not in state.graphs:
                self._enqueue(state)  # TensorRT finishes shape-dependent setup on the first run at a shape
                state.graphs[key] = self._capture(state)
                return
            graph = state.graphs[key]
            if graph is not None:
                graph.replay()
                return
        self._enqueue(state)

    def _enqueue(self, state: _ThreadState) -> None:
        if not state.context.execute_async_v3(state.stream.cuda_stream):
            raise BackendUnavailableError("TensorRT execute_async_v3 failed (its log says why)")

    def _capture(self, state: _ThreadState) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=state.stream, capture_error_mode="thread_local"):
                self._enqueue(state)
        except Exception as exc:  # some layers cannot be captured; run this shape without a graph
            log.warning("trt: CUDA graph capture failed at shapes %s (%s); running without a graph", state.shapes, exc)
            return None
        return graph

    def _close(self) -> None:
        with self._states_lock:
            states, self._states = self._states, []
        for state in states:
            state.stream.synchronize()
            state.graphs.clear()
            del state.context
            state.buffers.clear()
        self._local = threading.local()  # drops every thread's reference to its state
        del self._engine, self._runtime
        torch.cuda.empty_cache()


def _view(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return flat[: math.prod(shape)].view(shape)


def _torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    for name, torch_dtype in _TRT_DTYPES.items():
        if getattr(trt.DataType, name, None) == dtype:
            return torch_dtype
    raise IntegrityError(f"the TensorRT engine uses dtype {dtype}, which tk cannot feed")
