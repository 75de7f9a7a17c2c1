"""The ``torch`` engine: a saved ``torch.export`` program, run as a module."""

from __future__ import annotations

import torch

from tk.errors import TkError, load_failure
from tk.formats.torch_program import load_exported_program
from tk.manifest import read_verified
from tk.runtime.base import Engine
from tk.runtime.eager import cuda_reason, outputs_by_name


class ExportedProgramEngine(Engine):
    name = "torch"

    @classmethod
    def unavailable_reason(cls, device: str = "cpu") -> str | None:
        return cuda_reason(device)

    def _load(self) -> None:
        entry = self.manifest.file("torch")
        path = self.root / entry.path
        data = read_verified(self.root, entry)
        try:
            program = load_exported_program(data, str(path))
        except TkError:
            raise
        except Exception as exc:  # a damaged archive fails in zipfile, deserialization or torch
            raise load_failure(exc, f"{path} (torch.export program)", "re-export it") from exc
        self.module = program.module().to(self.device)
        self._order = [s.name for s in self.inputs]
        self._out_names = [s.name for s in self.outputs]

    def _run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            out = self.module(*[feeds[n].to(self.device) for n in self._order])
        return outputs_by_name(out, self._out_names)

    def _close(self) -> None:
        del self.module
