"""The ``openvino`` engine: OpenVINO's CPU plugin on the artifact's IR (``model.xml`` + ``model.bin``).

The IR is read from the verified bytes (never from the path again), its inputs bounded by the
manifest's dimension ranges, and compiled for the CPU with ``INFERENCE_PRECISION_HINT`` taken
from the artifact's precision: f32 for fp32 and int8 (OpenVINO's own default on a CPU with
AVX512-BF16 or AMX is bf16, which would run a float32 artifact at bfloat16 accuracy), bf16 for
bf16. An artifact whose precision the CPU cannot run (bf16 without bfloat16 dot products, where
OpenVINO silently falls back to f32) is refused: what runs must be what the manifest says.

Options (``OpenVINOOptions``): ``threads`` (``INFERENCE_NUM_THREADS``; default: OpenVINO's, every
core), ``performance_hint`` (LATENCY or THROUGHPUT; default: OpenVINO's, LATENCY). Each calling
thread gets its own infer request of the one compiled model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tk.errors import BackendUnavailableError, IntegrityError, UsageError, load_failure
from tk.formats.openvino import PRECISION_HINTS, ROLE, WEIGHTS_ROLE, bounded_shapes, missing_reason, precision_name
from tk.manifest import read_verified
from tk.runtime.base import Engine, EngineOptions, rebuild_command

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")


@dataclass(frozen=True)
class OpenVINOOptions(EngineOptions):
    performance_hint: str | None = None  # LATENCY or THROUGHPUT; default: OpenVINO's (LATENCY)

    def __post_init__(self) -> None:
        super().__post_init__()
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
    def probe_call(cls, model: Any, feeds: dict[str, Any], like: Engine) -> Callable[[], object]:
        import openvino as ov

        copy = model.clone()  # the writer goes on with ``model`` (an openvino.Model): its shapes stay its own
        copy.reshape(bounded_shapes(like.manifest.signature, like.dims))
        request = ov.Core().compile_model(copy, "CPU", compile_config(OpenVINOOptions(), "f32")).create_infer_request()
        return lambda: request.infer(feeds)

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
        if not (_names_match(model.inputs, self._in_names) and _names_match(model.outputs, self._out_names)):
            got_in = [sorted(p.get_names()) for p in model.inputs]
            got_out = [sorted(p.get_names()) for p in model.outputs]
            raise IntegrityError(
                f"{self.root / xml_entry.path}: the IR has inputs {got_in} and outputs {got_out}; "
                f"the manifest expects {self._in_names} and {self._out_names}"
            )
        model.reshape(bounded_shapes(self.manifest.signature, self.dims))
        try:
            self._compiled = core.compile_model(model, "CPU", compile_config(self.options, hint))
        except Exception as exc:
            raise load_failure(exc, f"{self.root / xml_entry.path} (OpenVINO CPU compile)", "re-export it") from exc
        actual = precision_name(self._compiled.get_property("INFERENCE_PRECISION_HINT"))
        if actual != hint:
            del self._compiled
            raise BackendUnavailableError(
                f"engine 'openvino': the artifact is {self.manifest.precision}, and OpenVINO's CPU plugin compiled it "
                f"for {actual} (this CPU has no bfloat16 dot products: avx512_bf16 or amx_bf16); run it on such a CPU, "
                f"or re-export --precision fp32"
            )
        self._ports = [self._compiled.output(name) for name in self._out_names]
        self._local = threading.local()

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
        return settings

    def _run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        inputs = {name: np.ascontiguousarray(feeds[name]) for name in self._in_names}
        # OpenVINO reads the feeds where they lie (they live until infer returns; a copy of a decoder's cache cost
        # ~10% of its decode step); outputs are copied out of the request (share_outputs=False)
        result = request.infer(inputs, share_inputs=True)
        return {name: result[port] for name, port in zip(self._out_names, self._ports, strict=True)}

    def _close(self) -> None:
        del self._compiled, self._ports, self._local


def compile_config(options: OpenVINOOptions, hint: str) -> dict[str, Any]:
    """The CPU plugin's configuration under ``options`` at the precision hint ``hint`` (f32, bf16)."""
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": hint}
    if options.threads is not None:
        config["INFERENCE_NUM_THREADS"] = options.threads
    if options.performance_hint is not None:
        config["PERFORMANCE_HINT"] = options.performance_hint
    return config


def _names_match(ports: list[Any], names: list[str]) -> bool:
    """Whether ``ports`` are as many as ``names`` and each name is one port's tensor name."""
    return len(ports) == len(names) and all(any(n in p.get_names() for p in ports) for n in names)
