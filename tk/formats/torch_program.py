"""The ``torch`` format: a ``torch.export`` program saved as ``program.pt2``."""

from __future__ import annotations

from pathlib import Path

import torch

FILE = "program.pt2"


def save_exported_program(program: torch.export.ExportedProgram, path: Path) -> None:
    torch.export.save(program, str(path))


def load_exported_program(path: Path) -> torch.export.ExportedProgram:
    return torch.export.load(str(path))
