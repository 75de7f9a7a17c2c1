"""The ``torch`` engine: a saved ``torch.export`` program, run as a module."""

from __future__ import annotations

from typing import Any

import torch

from tk.errors import TkError, load_failure
from tk.formats.torch_program import load_artifact_program
from tk.runtime.torch_engine import TorchEngine


class ExportedProgramEngine(TorchEngine):
    name = "torch"

    def _load_model(self) -> None:
        path = self.root / self.manifest.file("torch").path
        try:
            program = load_artifact_program(self.root, self.manifest, self.trust, self.name)
        except TkError:
            raise
        except Exception as exc:  # a damaged archive fails in zipfile, deserialization or torch
            raise load_failure(exc, f"{path} (torch.export program)", "re-export it") from exc
        self.module = program.module().to(self.device)

    def _forward(self, *args: torch.Tensor) -> Any:
        return self.module(*args)

    def _close(self) -> None:
        del self.module
