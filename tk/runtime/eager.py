"""PyTorch engines: ``eager`` (the reference, rebuilt from the manifest) and ``compile``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tk.errors import BackendUnavailableError, IntegrityError
from tk.manifest import verify_file
from tk.runtime.base import Engine, EngineOptions


def module_from_manifest(root: Any, manifest: Any, *, trust_model_code: bool = False) -> nn.Module:
    """The float32 PyTorch model the artifact was exported from, with its weights, in eval mode.

    A user model (``package.module:callable``) is rebuilt by importing and calling that code, so it
    is refused unless ``trust_model_code`` is set or the manifest's signature was verified.
    """
    from tk.manifest import SIGNING_ENV
    from tk.models import build_model
    from tk.models.checkpoint import load_weights

    model = manifest.model
    from tk.models.hf import is_hf_name

    name = str(model.get("name", ""))
    user_code = ":" in name and not is_hf_name(name)  # hf:DIR runs transformers' own classes only
    if user_code and not (trust_model_code or os.environ.get(SIGNING_ENV)):
        raise IntegrityError(
            f"{root}: the reference model is user code ({model['name']!r}) and rebuilding it runs that code; "
            f"pass --trust-model-code if you trust this artifact, or sign artifacts with {SIGNING_ENV}"
        )
    spec = build_model(
        model["name"],
        size=model.get("size"),
        config=model.get("config") or None,
        input_descriptions=tuple(model.get("input_descriptions", ())),
    )
    load_weights(spec.module, verify_file(root, manifest.file("weights")))
    return spec.module.eval()


def cuda_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU found (torch.cuda.is_available() is False)"
    if device not in ("cpu", "cuda"):
        return f"unknown device {device!r} (expected cpu or cuda)"
    return None


def outputs_by_name(out: Any, names: list[str]) -> dict[str, torch.Tensor]:
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    return dict(zip(names, values, strict=True))


@dataclass(frozen=True)
class EagerOptions(EngineOptions):
    # rebuild a user model (package.module:callable) named in the manifest: runs its code
    trust_model_code: bool = False


@dataclass(frozen=True)
class CompileOptions(EagerOptions):
    mode: str | None = None  # torch.compile mode: default, reduce-overhead, max-autotune; default: default
    dynamic: bool = True  # compile for dynamic shapes (one graph for every batch size)
    freezing: bool = True  # Inductor's constant folding of weights: what makes compile fast on the CPU
    precision: str | None = None  # fp32, bf16 or fp16 (autocast); default: the artifact's precision


class EagerEngine(Engine):
    """The PyTorch model itself: the reference every other engine is compared with."""

    name = "eager"
    Options = EagerOptions

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        return cuda_reason(device)

    def _load(self) -> None:
        trust = self.options.trust_model_code
        self.module = module_from_manifest(self.root, self.manifest, trust_model_code=trust).to(self.device)
        self._order = [s.name for s in self.inputs]
        self._out_names = [s.name for s in self.outputs]

    def _call(self, *args: torch.Tensor) -> Any:
        return self.module(*args)

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        args = [feeds[n].to(self.device) for n in self._order]
        with torch.inference_mode():
            out = self._call(*args)
        return outputs_by_name(out, self._out_names)

    def _close(self) -> None:
        del self.module
        if self.device == "cuda":
            torch.cuda.empty_cache()


class CompiledEngine(EagerEngine):
    """The same model under ``torch.compile`` (options: ``CompileOptions``).

    ``freezing`` (Inductor's constant folding of weights, default on for inference) is what
    makes compile faster on the CPU; ``precision="bf16"`` runs under bfloat16 autocast.
    """

    name = "compile"
    Options = CompileOptions

    def _load(self) -> None:
        super()._load()
        from torch._inductor import list_mode_options

        mode = self.options.mode or "default"
        dynamic = self.options.dynamic
        self._freezing = self.options.freezing
        artifact_precision = self.manifest.precision if self.manifest.precision in ("bf16", "fp16") else "fp32"
        self._precision = self.options.precision or artifact_precision
        if self._precision not in ("fp32", "bf16", "fp16"):
            raise BackendUnavailableError(
                f"engine 'compile': expected precision fp32, bf16 or fp16, got {self._precision!r}"
            )
        self._autocast_dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        # torch.compile takes a mode or options, not both: the mode's options plus freezing, compiled in
        options = dict(list_mode_options(mode, dynamic)) if mode != "default" else {}
        options["freezing"] = self._freezing
        self.compiled = torch.compile(self.module, dynamic=dynamic, options=options)

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if self._loaded:
            out.update(mode=self.options.mode or "default", precision=self._precision)
        return out

    def _call(self, *args: torch.Tensor) -> Any:
        if self._precision == "fp32":
            return self.compiled(*args)
        with torch.autocast(device_type=self.device, dtype=self._autocast_dtype):
            out = self.compiled(*args)
        values = list(out) if isinstance(out, (tuple, list)) else [out]
        return [v.float() if v.is_floating_point() else v for v in values]
