"""PyTorch engines: ``eager`` (the reference, rebuilt from the manifest) and ``compile``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tk.errors import BackendUnavailableError
from tk.manifest import verify_file
from tk.runtime.base import Engine


def module_from_manifest(root: Any, manifest: Any) -> nn.Module:
    """The float32 PyTorch model the artifact was exported from, with its weights, in eval mode."""
    from tk.models import build_model
    from tk.models.checkpoint import load_weights

    model = manifest.model
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


class EagerEngine(Engine):
    """The PyTorch model itself: the reference every other engine is compared with."""

    name = "eager"

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        return cuda_reason(device)

    def _load(self) -> None:
        self.module = module_from_manifest(self.root, self.manifest).to(self.device)
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
    """The same model under ``torch.compile``; options: ``mode``, ``dynamic``, ``freezing``, ``precision``.

    ``freezing`` (Inductor's constant folding of weights, default on for inference) is what
    makes compile faster on the CPU; ``precision="bf16"`` runs under bfloat16 autocast.
    """

    name = "compile"

    def _load(self) -> None:
        super()._load()
        import torch._inductor.config as inductor_config

        mode = self.options.get("mode") or None
        dynamic = self.options.get("dynamic", True)
        self._freezing = bool(self.options.get("freezing", True))
        artifact_precision = self.manifest.precision if self.manifest.precision in ("bf16", "fp16") else "fp32"
        self._precision = self.options.get("precision") or artifact_precision
        if self._precision not in ("fp32", "bf16", "fp16"):
            raise BackendUnavailableError(
                f"engine 'compile': expected precision fp32, bf16 or fp16, got {self._precision!r}"
            )
        with inductor_config.patch(freezing=self._freezing):
            self.compiled = torch.compile(self.module, mode=None if mode == "default" else mode, dynamic=dynamic)

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if self._loaded:
            out.update(mode=self.options.get("mode") or "default", freezing=self._freezing, precision=self._precision)
        return out

    def _call(self, *args: torch.Tensor) -> Any:
        import torch._inductor.config as inductor_config

        with inductor_config.patch(freezing=self._freezing):
            if self._precision == "fp32":
                return self.compiled(*args)
            dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
            with torch.autocast(device_type=self.device, dtype=dtype):
                out = self.compiled(*args)
            values = list(out) if isinstance(out, (tuple, list)) else [out]
            return [v.float() if v.is_floating_point() else v for v in values]
