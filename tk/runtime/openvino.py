"""The ``openvino`` engine: OpenVINO's CPU plugin on the artifact's IR (``model.xml`` + ``model.bin``).

The IR is read from the verified bytes (never from the path again), its inputs bounded by the
manifest's dimension ranges, and compiled for the CPU with ``INFERENCE_PRECISION_HINT`` taken
from the artifact's precision: f32 for fp32 and int8 (OpenVINO's own default on a CPU with
AVX512-BF16 or AMX is bf16, which would run a float32 artifact at bfloat16 accuracy), bf16 for
bf16. An artifact whose precision the CPU cannot run (bf16 without bfloat16 dot products, where
OpenVINO silently falls back to f32) is refused: what runs must be what the manifest says.

A decoder's IR may keep its KV cache itself (the manifest's ``formats.openvino.cache: state``,
``tk.export.openvino.stateful``): then ``kept_cache`` runs it on tokens, positions and the mask alone
(``tk.runtime.generation``, ``tk serve``'s batch), its cache float32 inside OpenVINO for fp32 and int8
artifacts and float16 for bf16 ones (``KV_CACHE_PRECISION``), and ``run`` of the artifact's static-cache
step sets the cache's slots as the request's state and reads the step's keys and values back. An int8 IR
whose writer ran its float part in bf16 runs at the bf16 hint where the CPU has bfloat16 products.

Options (``OpenVINOOptions``): ``threads`` (``INFERENCE_NUM_THREADS``; default: OpenVINO's, every
core), ``performance_hint`` (LATENCY or THROUGHPUT; default: OpenVINO's, LATENCY), ``streams``
(``NUM_STREAMS``: a batch runs as that many requests at once, each on its share of the rows and of the
cores, its outputs joined; default: one call). A call with fewer rows than streams would leave cores idle
(a single row on one stream of two runs on half the cores), so it runs as one request of a second compile
at OpenVINO's defaults, made at the first such call. Each calling thread gets its own infer request (or
set of them, one per stream) of each compiled model.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tk.errors import BackendUnavailableError, IntegrityError, UsageError, load_failure
from tk.formats.aoti import runs_natively
from tk.formats.openvino import (
    CACHE_IN_STATE,
    KV_CACHE_PRECISIONS,
    PRECISION_HINTS,
    ROLE,
    STATE_INPUTS,
    STATE_OUTPUTS,
    WEIGHTS_ROLE,
    bounded_shapes,
    missing_reason,
    precision_name,
)
from tk.manifest import read_verified
from tk.runtime.base import Engine, EngineOptions, rebuild_command

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")


@dataclass(frozen=True)
class OpenVINOOptions(EngineOptions):
    performance_hint: str | None = None  # LATENCY or THROUGHPUT; default: OpenVINO's (LATENCY)
    # a batch split into this many requests run at once on as many streams (NUM_STREAMS), each on its share
    # of the cores: MiniLM's bf16 IR at 8 x 128 on 2 cores ran 1.05-1.06x one call (benchmarks/history.md)
    streams: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.streams is not None and (not isinstance(self.streams, int) or self.streams < 1):
            raise UsageError(f"engine 'openvino': streams must be a positive integer, got {self.streams!r}")
        if self.performance_hint is not None and self.performance_hint not in PERFORMANCE_HINTS:
            raise UsageError(
                f"engine 'openvino': performance_hint must be one of {', '.join(PERFORMANCE_HINTS)}, "
                f"got {self.performance_hint!r}"
            )


class OpenVINOEngine(Engine):
    name = "openvino"
    native = "numpy"
    Options = OpenVINOOptions

    @classmethod
    def probe_call(cls, model: Any, feeds: dict[str, Any], like: Engine,
                   options: Mapping[str, Any] | None = None) -> Callable[[], object]:  # fmt: skip
        import openvino as ov

        copy = model.clone()  # the writer goes on with ``model`` (an openvino.Model): its shapes stay its own
        copy.reshape(bounded_shapes(like.manifest.signature, like.dims))
        hint = "bf16" if runs_natively("bf16") else "f32"  # an int8 IR's float part, as its writer runs it
        chosen = OpenVINOOptions(**(options or {}))
        compiled = ov.Core().compile_model(copy, "CPU", compile_config(chosen, hint))
        rows = len(next(iter(feeds.values()))) if feeds else 0
        parts = chosen.streams or 1
        if 1 < parts <= rows:  # as ``run`` splits a batch
            requests, ports = [compiled.create_infer_request() for _ in range(parts)], list(compiled.outputs)
            return lambda: run_in_parts(requests, ports, feeds)
        request = compiled.create_infer_request()
        return lambda: request.infer(feeds, share_inputs=True)  # as ``run`` calls it

    @classmethod
    def tuned_options(cls, batch: int, cores: int) -> list[dict[str, Any]]:
        """Two streams, and one per core where there are more: each request then has a share of the rows
        and of the cores (a batch of one, or one core, has nothing to split)."""
        most = min(batch, cores)
        return [{"streams": n} for n in sorted({2, most}) if 2 <= n <= most]

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        if device != "cpu":
            return f"tk runs OpenVINO on the CPU only, and {device!r} was requested"
        return missing_reason()

    def _load(self) -> None:
        import openvino as ov

        hint = PRECISION_HINTS.get(self.manifest.precision)
        if hint is None:
            raise BackendUnavailableError(
                f"engine 'openvino': the artifact's precision is {self.manifest.precision}; OpenVINO artifacts are "
                f"{', '.join(PRECISION_HINTS)}"
            )
        recorded = self.manifest.formats.get(ROLE, {}).get("inference_precision_hint")
        if self.manifest.precision == "int8" and recorded == "bf16":
            # what NNCF left float runs in bf16 where the CPU has it; elsewhere in float32, which is closer
            hint = "bf16" if runs_natively("bf16") else "f32"
        xml_entry = self.manifest.file(ROLE)
        weights_entry = self.manifest.file(WEIGHTS_ROLE)
        xml = read_verified(self.root, xml_entry)
        weights = np.frombuffer(read_verified(self.root, weights_entry), dtype=np.uint8)
        core = ov.Core()
        try:
            model = core.read_model(xml, ov.Tensor(weights) if weights.size else None)
        except Exception as exc:  # OpenVINO raises RuntimeError for a damaged or foreign IR
            fix = f"re-export it with `{rebuild_command(self.manifest, 'openvino', self.device)}`"
            raise load_failure(exc, f"{self.root / xml_entry.path} (OpenVINO)", fix) from exc
        self._in_names = [s.name for s in self.inputs]
        self._out_names = [s.name for s in self.outputs]
        self._keeps_cache = self.manifest.formats.get(ROLE, {}).get("cache") == CACHE_IN_STATE
        ir_in, ir_out = (STATE_INPUTS, STATE_OUTPUTS) if self._keeps_cache else (self._in_names, self._out_names)
        if not (_names_match(model.inputs, list(ir_in)) and _names_match(model.outputs, list(ir_out))):
            got_in = [sorted(p.get_names()) for p in model.inputs]
            got_out = [sorted(p.get_names()) for p in model.outputs]
            raise IntegrityError(
                f"{self.root / xml_entry.path}: the IR has inputs {got_in} and outputs {got_out}; "
                f"the manifest expects {list(ir_in)} and {list(ir_out)}"
            )
        config = compile_config(self.options, hint)
        if self._keeps_cache:
            config["KV_CACHE_PRECISION"] = KV_CACHE_PRECISIONS[hint]
        else:
            model.reshape(bounded_shapes(self.manifest.signature, self.dims))
        try:
            self._compiled = core.compile_model(model, "CPU", config)
        except Exception as exc:
            raise load_failure(exc, f"{self.root / xml_entry.path} (OpenVINO CPU compile)", "re-export it") from exc
        actual = precision_name(self._compiled.get_property("INFERENCE_PRECISION_HINT"))
        if actual != hint and self.manifest.precision != "int8":
            del self._compiled
            raise BackendUnavailableError(
                f"engine 'openvino': the artifact is {self.manifest.precision}, and OpenVINO's CPU plugin compiled it "
                f"for {actual} (this CPU has no bfloat16 dot products: avx512_bf16 or amx_bf16); run it on such a CPU, "
                f"or re-export --precision fp32"
            )
        self._ports = [self._compiled.output(name) for name in ir_out]
        self._local = threading.local()
        # rows split across requests only where every input and output holds one row per sample
        batch_first = all(s.shape and s.shape[0] == "batch" for s in (*self.inputs, *self.outputs))
        self._streams = self.options.streams if batch_first and not self._keeps_cache else None
        self._whole: Any = None  # the compile at OpenVINO's defaults for calls with fewer rows than streams
        if self._streams is not None and self._streams > 1:
            self._few_rows = (core, model, {k: v for k, v in config.items() if k != "NUM_STREAMS"})
            self._whole_lock = threading.Lock()

    @property
    def compiled_model(self) -> Any:
        """The ``openvino.CompiledModel``, compiled on first use (to time or inspect it directly)."""
        return self.load()._compiled

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        settings.pop("torch_threads", None)
        if self._loaded:
            compiled = self._compiled
            settings["inference_precision"] = precision_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
            settings["inference_num_threads"] = int(compiled.get_property("INFERENCE_NUM_THREADS"))
            settings["performance_hint"] = str(compiled.get_property("PERFORMANCE_HINT")).rpartition(".")[2]
            settings["num_streams"] = int(compiled.get_property("NUM_STREAMS"))
            if self._whole is not None:
                settings["num_streams_few_rows"] = int(self._whole.get_property("NUM_STREAMS"))
        return settings

    def _request(self) -> Any:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        return request

    @property
    def keeps_cache(self) -> bool:
        """Whether the IR keeps a decoder's KV cache itself (OpenVINO's stateful form): ``kept_cache`` runs it."""
        return self.load()._keeps_cache

    @property
    def kept_cache_itemsize(self) -> int:
        return ov_itemsize(self.load()._compiled.get_property("KV_CACHE_PRECISION"))

    def kept_cache(self, own_request: bool = False) -> OpenVINOKeptCache:
        """The cache an IR that keeps one holds, in this thread's infer request (``own_request``: in a request of
        its own, for a caller that may call from different threads, one at a time)."""
        self.load()
        return OpenVINOKeptCache(
            self._compiled.create_infer_request() if own_request else self._request(), self._ports[0]
        )

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        request = self._request()
        if self._keeps_cache:
            return self._run_static_cache(OpenVINOKeptCache(request, self._ports[0]), feeds)
        inputs = {name: np.ascontiguousarray(feeds[name]) for name in self._in_names}
        rows = len(next(iter(inputs.values()))) if inputs else 0
        ports = self._ports
        if self._streams is not None and self._streams > 1:
            if rows >= self._streams:
                return self._run_split(inputs, self._streams)
            request, ports = self._few_rows_request()
        # OpenVINO reads the feeds where they lie (they live until infer returns; a copy of a decoder's cache cost
        # ~10% of its decode step); outputs are copied out of the request (share_outputs=False)
        result = request.infer(inputs, share_inputs=True)
        return {name: result[port] for name, port in zip(self._out_names, ports, strict=True)}

    def _few_rows_request(self) -> tuple[Any, list[Any]]:
        """This thread's request of the compile at OpenVINO's defaults (compiled at the first call that needs
        it), and that compile's output ports."""
        request = getattr(self._local, "few_rows", None)
        if request is None:
            with self._whole_lock:
                if self._whole is None:
                    core, model, config = self._few_rows
                    whole = core.compile_model(model, "CPU", config)
                    self._whole_ports = [whole.output(name) for name in self._out_names]
                    self._whole = whole
            request = self._local.few_rows = self._whole.create_infer_request()
        return request, self._whole_ports

    def _run_split(self, inputs: dict[str, np.ndarray], parts: int) -> dict[str, Any]:
        """``inputs`` as ``parts`` requests of consecutive rows, run at once (this thread's requests), their
        outputs joined in order."""
        requests = getattr(self._local, "split_requests", None)
        if requests is None:
            requests = self._local.split_requests = [self._compiled.create_infer_request() for _ in range(parts)]
        return dict(zip(self._out_names, run_in_parts(requests, self._ports, inputs), strict=True))

    @staticmethod
    def _run_static_cache(cache: OpenVINOKeptCache, feeds: dict[str, Any]) -> dict[str, Any]:
        """One step of the artifact's signature (the static cache in, the new keys and values out) on an IR that
        keeps the cache: the cache's slots before the step's become the request's state, and the step's keys and
        values are read back from it. The loop (``tk.runtime.generation``) runs ``kept_cache`` instead; the export
        check's step parity, ``tk infer`` and ``tk serve``'s newcomers' prefill run this."""
        slots = np.asarray(feeds["cache_position"]).reshape(-1)
        first, width = int(slots[0]), len(slots)
        if not np.array_equal(slots, np.arange(first, first + width)):
            raise UsageError(f"cache_position: expected consecutive slots, got {slots.tolist()}")
        keys, values = np.asarray(feeds["past_keys"]), np.asarray(feeds["past_values"])
        cache.write(keys, values, first)
        mask = np.asarray(feeds["attention_mask"])[:, : first + width]
        logits = cache.step(
            {"input_ids": feeds["input_ids"], "position_ids": feeds["position_ids"], "attention_mask": mask}
        )
        present_keys, present_values = cache.read(first, first + width)
        return {"logits": logits, "present_keys": present_keys.astype(keys.dtype, copy=False),
                "present_values": present_values.astype(values.dtype, copy=False)}  # fmt: skip

    def _close(self) -> None:
        del self._compiled, self._ports, self._local
        self._whole = self._few_rows = None  # the second compile and the model it was made from, where made


class OpenVINOKeptCache:
    """A decoder's KV cache kept in one infer request's state (``tk.runtime.generation.KeptCache``): one
    variable per layer and kind (batch, kv heads, filled slots, head dim), which each ``step`` extends."""

    def __init__(self, request: Any, logits: Any) -> None:
        self._request = request
        self._logits = logits

    def empty(self) -> None:
        self._request.reset_state()

    def step(self, feeds: Mapping[str, Any]) -> np.ndarray:
        """The next-token logits of ``input_ids``, ``position_ids`` and ``attention_mask`` (batch, filled + new
        slots); the step's keys and values join the cache. Feeds are not checked."""
        inputs = {name: np.ascontiguousarray(feeds[name]) for name in STATE_INPUTS[:3]}
        inputs[STATE_INPUTS[3]] = np.arange(inputs["input_ids"].shape[0], dtype=np.int32)
        return self._request.infer(inputs, share_inputs=True)[self._logits]

    def write(self, keys: Any, values: Any, stop: int) -> None:
        """The cache set to slots ``[0, stop)`` of ``keys`` and ``values`` (batch, layers, kv heads, slots, head dim)."""
        import openvino as ov

        self._request.reset_state()  # an empty cache of the next step's rows
        if stop:
            for state in self._request.query_state():
                kind, layer = _state_of(state.name)
                cached = np.asarray(keys if kind == "key" else values)[:, layer, :, :stop]
                state.state = ov.Tensor(np.ascontiguousarray(cached, dtype=np.float32))

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots ``[start, stop)`` of the cache as keys and values (batch, layers, kv heads, slots, head dim)."""
        present: dict[str, dict[int, np.ndarray]] = {"key": {}, "value": {}}
        for state in self._request.query_state():
            kind, layer = _state_of(state.name)
            present[kind][layer] = np.array(state.state.data[:, :, start:stop])
        return tuple(np.stack([by[i] for i in sorted(by)], axis=1) for by in (present["key"], present["value"]))  # type: ignore[return-value]


def run_in_parts(requests: Sequence[Any], ports: list[Any], inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``inputs`` as one request of consecutive rows per ``requests`` (infer requests of one compile with
    several streams), started at once and waited on from this thread, the outputs at ``ports`` joined in order.

    Not an ``AsyncInferQueue``: its Python callback runs on OpenVINO's threads, and a process that had run one
    aborted at exit about one time in seven ("terminate called ... Resource deadlock avoided", openvino
    2026.4.1: benchmarks/history.md, 2026-12-06); plain requests run no Python outside this thread."""
    pieces = {name: np.array_split(array, len(requests)) for name, array in inputs.items()}  # views, no copies
    started: list[Any] = []
    failed: BaseException | None = None
    for index, request in enumerate(requests):
        try:
            request.start_async({name: piece[index] for name, piece in pieces.items()}, share_inputs=True)
        except BaseException as exc:
            failed = exc
            break
        started.append(request)
    for request in started:  # every started one waited on, whatever failed: none left busy for the next call
        try:
            request.wait()
        except BaseException as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
    # one copy out of the requests' buffers, which serve their next run
    return [np.concatenate([r.get_tensor(port).data for r in requests]) for port in ports]


def compile_config(options: OpenVINOOptions, hint: str) -> dict[str, Any]:
    """The CPU plugin's configuration under ``options`` at the precision hint ``hint`` (f32, bf16)."""
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": hint}
    if options.threads is not None:
        config["INFERENCE_NUM_THREADS"] = options.threads
    if options.performance_hint is not None:
        config["PERFORMANCE_HINT"] = options.performance_hint
    if options.streams is not None:
        config["NUM_STREAMS"] = options.streams
    return config


def ov_itemsize(element_type: Any) -> int:
    """Bytes of one value of an OpenVINO element type (``<Type: 'float16'>``: 2)."""
    return max(1, int(element_type.bitwidth) // 8)


def _state_of(variable: str) -> tuple[str, int]:
    """("key" or "value", layer) of a stateful IR's variable, named after its input (``past_key_3...``)."""
    match = re.search(r"past_(key|value)_(\d+)", variable)
    if match is None:
        raise IntegrityError(f"the OpenVINO IR has a state {variable!r}; expected past_key_N or past_value_N")
    return match.group(1), int(match.group(2))


def _names_match(ports: list[Any], names: list[str]) -> bool:
    """Whether ``ports`` are as many as ``names`` and each name is one port's tensor name."""
    return len(ports) == len(names) and all(any(n in p.get_names() for p in ports) for n in names)
