"""PyTorch engines: ``eager`` (the reference, rebuilt from the manifest) and ``compile``."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tk.errors import BackendUnavailableError, EngineError, IntegrityError, first_line
from tk.formats.inductor_freezing import inductor_freezing, register_float_weight_packing
from tk.limits import extrapolated_bytes, module_bytes, require_within_budget
from tk.manifest import read_verified
from tk.runtime.base import GraphOptions
from tk.runtime.torch_engine import TorchEngine
from tk.signing import TrustPolicy, check_signature


def module_from_manifest(
    root: Any, manifest: Any, *, trust_model_code: bool = False, trust: TrustPolicy | None = None
) -> nn.Module:
    """The float32 PyTorch model the artifact was exported from, with its weights, in eval mode.

    A user model (``package.module:callable``) is rebuilt by importing and calling that code, so it
    is refused unless ``trust_model_code`` is set or the artifact's signature verifies against a
    key ``trust`` trusts (the user's own, by default: their own exports rebuild without a flag).
    """
    from tk.models import build_model
    from tk.models.checkpoint import load_weights

    model = manifest.model
    from tk.models.hf import is_hf_name

    name = str(model.get("name", ""))
    user_code = ":" in name and not is_hf_name(name)  # hf:DIR runs transformers' own classes only
    if user_code and not (trust_model_code or check_signature(root, manifest, trust).trusted):
        raise IntegrityError(
            f"{root}: the reference model is user code ({model['name']!r}), rebuilding it runs that code, and the "
            "artifact is not signed by a key you trust; pass --trust-model-code if you trust this artifact, "
            "or --public-key FILE of its signer"
        )

    def build() -> Any:
        return build_model(
            model["name"],
            size=model.get("size"),
            config=model.get("config") or None,
            input_descriptions=tuple(model.get("input_descriptions", ())),
        )

    if ":" not in model["name"]:  # a built-in model's size comes from the manifest's config: measure it first
        require_within_budget(_builtin_bytes(root, model), f"the model {root} describes")
    spec = build()
    entry = manifest.file("weights")
    load_weights(spec.module, read_verified(root, entry), source=str(Path(root) / entry.path))
    return spec.module.eval()


def _builtin_bytes(root: str | Path, model: dict[str, Any]) -> int:
    """The bytes of the built-in model the manifest's config describes, built on the meta device
    (nothing allocated); a config of many layers is measured at 1 and 2 and extrapolated."""
    from tk.models import build_model

    config = dict(model.get("config") or {})

    def meta_bytes(layers: int | None) -> int:
        cfg = config if layers is None else {**config, "layers": layers}
        with torch.device("meta"):
            return module_bytes(build_model(model["name"], size=model.get("size"), config=cfg or None).module)

    try:
        return extrapolated_bytes(meta_bytes, config.get("layers"))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise IntegrityError(
            f"{root}: the manifest's model config cannot build {model['name']!r} ({first_line(exc)})"
        ) from exc


@dataclass(frozen=True)
class EagerOptions(GraphOptions):
    # rebuild a user model (package.module:callable) named in the manifest: runs its code
    trust_model_code: bool = False


@dataclass(frozen=True)
class CompileOptions(EagerOptions):
    mode: str | None = None  # torch.compile mode: default, reduce-overhead, max-autotune; default: default
    dynamic: bool = True  # compile for dynamic shapes (one graph for every batch size)
    freezing: bool = False  # Inductor's weights as constants, packed for oneDNN on the CPU (off, as in torch.compile)
    precision: str | None = None  # fp32, bf16 or fp16 (autocast); default: the artifact's precision


class EagerEngine(TorchEngine):
    """The PyTorch model itself: the reference every other engine is compared with."""

    name = "eager"
    Options = EagerOptions
    _float64 = False  # inside in_float64(): run the float64 copy

    def _load_model(self) -> None:
        trust_code = self.options.trust_model_code
        module = module_from_manifest(self.root, self.manifest, trust_model_code=trust_code, trust=self.trust)
        self.module = module.to(self.device)

    def _forward(self, *args: torch.Tensor) -> Any:
        if self._float64:
            args = tuple(a.double() if a.is_floating_point() else a for a in args)
        return self.module(*args)

    @contextlib.contextmanager
    def in_float64(self) -> Iterator[None]:
        """Within: ``run`` computes a float64 copy of the model (floating weights, buffers and inputs
        cast) and returns float64 outputs: the truth ``tk.parity.measure_noise_floor`` measures float32's
        own rounding against. Not thread-safe: the engine serves nothing else meanwhile.

        Raises ``EngineError`` where the module refuses the copy or the cast, ``ResourceError`` where
        the copy would not fit the memory budget; an op without a float64 kernel fails in ``run``.
        """
        self.load()
        require_within_budget(2 * module_bytes(self.module), "a float64 copy of the model (its noise floor)")
        try:
            float64 = copy.deepcopy(self.module).double()
        except Exception as exc:  # a module may refuse deepcopy or .double() in its own way
            raise EngineError(f"the module refuses a float64 copy ({type(exc).__name__}: {first_line(exc)})") from exc
        float32, self.module, self._float64 = self.module, float64, True
        try:
            yield
        finally:
            self.module, self._float64 = float32, False

    def _close(self) -> None:
        del self.module
        if self.device == "cuda":
            torch.cuda.empty_cache()


class CompiledEngine(EagerEngine):
    """The same model under ``torch.compile`` (options: ``CompileOptions``).

    ``freezing`` (Inductor's weights as constants, folded and, on the CPU, packed for oneDNN) is off
    by default, as in ``torch.compile``: the baseline is what a user's own compile gives, and packed
    float32 linears ran slower on the AVX2 EPYC (benchmarks/history.md). ``precision="bf16"`` runs
    under bfloat16 autocast.
    ``cuda_graph`` means Inductor's own CUDA graphs (mode ``reduce-overhead``); whether they were
    used, or skipped and why, and how often Dynamo recompiled are in ``settings()``.
    """

    name = "compile"
    Options = CompileOptions

    @contextlib.contextmanager
    def in_float64(self) -> Iterator[None]:
        raise EngineError("engine 'compile' runs Inductor's code in its own precision; the floor is eager's")
        yield  # a generator, so the error comes on entering the context

    def _graphs_apply(self) -> bool:
        return False  # Inductor captures its own graphs under reduce-overhead

    def _load_model(self) -> None:
        super()._load_model()
        from torch._inductor import list_mode_options

        mode = self.options.mode or "default"
        if self.options.cuda_graph and mode == "default":
            mode = "reduce-overhead"  # Inductor's CUDA graphs (max-autotune has them too)
        self._mode = mode
        artifact_precision = self.manifest.precision if self.manifest.precision in ("bf16", "fp16") else "fp32"
        self._precision = self.options.precision or artifact_precision
        if self._precision not in ("fp32", "bf16", "fp16"):
            raise BackendUnavailableError(
                f"engine 'compile': expected precision fp32, bf16 or fp16, got {self._precision!r}"
            )
        self._autocast_dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        # torch.compile takes a mode or options, not both: the mode's options plus freezing, compiled in
        options = dict(list_mode_options(mode, self.options.dynamic)) if mode != "default" else {}
        options["freezing"] = self.options.freezing
        self._freezing = inductor_freezing if self.options.freezing else contextlib.nullcontext
        if self.options.freezing and self.device == "cpu":
            register_float_weight_packing()  # not left out by an earlier unpacked frozen compile in this process
        self.compiled = torch.compile(self.module, dynamic=self.options.dynamic, options=options)
        self._counters_at_load = compile_counters()

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if self._loaded:
            now = compile_counters()
            since = {key: now[key] - self._counters_at_load.get(key, 0) for key in now}
            uses_graphs = self._mode == "reduce-overhead" and self.device == "cuda"
            out.update(
                mode=self._mode,
                precision=self._precision,
                frames_compiled=since["frames"],
                recompilations=max(0, since["frames"] - 1),
                cuda_graphs="not asked for" if not uses_graphs
                else "used" if since["cudagraph_skips"] == 0
                else f"skipped {since['cudagraph_skips']} time(s): TORCH_LOGS=cudagraphs prints Inductor's reasons",
            )  # fmt: skip
        return out

    def _forward(self, *args: torch.Tensor) -> Any:
        if self._precision == "fp32":
            with self._freezing():  # any call may trace (a new shape, a guard that fails)
                return self.compiled(*args)
        with torch.autocast(device_type=self.device, dtype=self._autocast_dtype), self._freezing():
            out = self.compiled(*args)
        values = list(out) if isinstance(out, (tuple, list)) else [out]
        return [v.float() if v.is_floating_point() else v for v in values]


def compile_counters() -> dict[str, int]:
    """Dynamo frames compiled and Inductor's CUDA-graph skips so far in this process (process-wide counters)."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]), "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}
