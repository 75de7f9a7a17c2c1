"""What the torch-native engines (eager, compile, torch, aoti) share: inputs on the engine's device,
outputs by name, and CUDA-graph replay per input shape (``--cuda-graph``, see ``tk.runtime.cuda``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from tk.errors import UsageError
from tk.runtime.base import Engine, GraphOptions
from tk.runtime.cuda import GraphCache


def cuda_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA GPU found (torch.cuda.is_available() is False)"
    if device not in ("cpu", "cuda"):
        return f"unknown device {device!r} (expected cpu or cuda)"
    return None


def outputs_by_name(out: Any, names: list[str]) -> dict[str, torch.Tensor]:
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    return dict(zip(names, values, strict=True))


class TorchEngine(Engine):
    """A torch-native engine: subclasses load in ``_load_model`` and call the model in ``_forward``.

    Inputs already on the engine's device stay there (no copy); outputs come back on the device.
    """

    Options = GraphOptions

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        return cuda_reason(device)

    @abstractmethod
    def _load_model(self) -> None: ...

    @abstractmethod
    def _forward(self, *args: torch.Tensor) -> Any: ...

    def _load(self) -> None:
        if getattr(self.options, "cuda_graph", False) and self.device != "cuda":
            raise UsageError(f"--cuda-graph: CUDA graphs need --device cuda; this run is on {self.device}")
        self._load_model()
        self._torch_device = torch.device(self.device)
        self._order = [s.name for s in self.inputs]
        self._out_names = [s.name for s in self.outputs]
        self._graphs: GraphCache | None = None
        if getattr(self.options, "cuda_graph", False) and self._graphs_apply():
            self._graphs = GraphCache(self._forward, max_graphs=self.options.max_graphs)

    def _graphs_apply(self) -> bool:
        """Whether ``--cuda-graph`` is served by ``GraphCache`` (compile uses Inductor's own graphs)."""
        return True

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        args = [feeds[n].to(self._torch_device, non_blocking=True).contiguous() for n in self._order]
        with torch.inference_mode():
            out = self._graphs(*args) if self._graphs is not None else self._forward(*args)
        return outputs_by_name(out, self._out_names)

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if self._loaded and self._graphs is not None:
            out["cuda_graphs"] = self._graphs.stats()
        return out
