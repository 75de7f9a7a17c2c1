"""A throwaway format, ``toy``, in one module: its writer and its engine. Registered by a test with one
entry per registry (``tk.registries``), it must go through ``tk export``, ``tk check``, ``tk optimize``
and ``tk inspect`` with no other edit (issue #46: a format is known only where it lives).

The file is the captured program saved again under its own name, and the engine runs it as a module:
what a new format's writer and engine minimally are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tk.export.base import Writer, option
from tk.export.context import ExportContext
from tk.formats.torch_program import load_exported_program, save_exported_program
from tk.manifest import read_verified
from tk.runtime.torch_engine import TorchEngine

FILE = "model.toy.pt2"
ROLE = "toy"


@dataclass(frozen=True)
class ToyOptions:
    """The toy writer's one setting, so that ``tk optimize`` has a variant of it to try."""

    note: str | None = option("--toy-note")  # recorded in the manifest; default none


class ToyWriter(Writer):
    name = "toy"
    Options = ToyOptions
    precisions = ("fp32",)

    def variants(self, precision: str) -> list[ToyOptions]:
        return [ToyOptions(), ToyOptions(note="second")]

    def variant_words(self, options: ToyOptions, precision: str) -> list[str]:
        return [options.note] if options.note else []

    def write(self, ctx: ExportContext) -> None:
        assert ctx.program is not None
        options: ToyOptions = ctx.settings[self.name]
        save_exported_program(ctx.program, ctx.add_file(FILE, ROLE))
        ctx.formats[self.name] = {"file": FILE, **({"note": options.note} if options.note else {})}


WRITER = ToyWriter()


class ToyEngine(TorchEngine):
    name = "toy"

    def _load_model(self) -> None:
        entry = self.manifest.file(ROLE)
        program = load_exported_program(read_verified(self.root, entry), str(self.root / entry.path))
        self.module = program.module().to(self.device)

    def _forward(self, *args: torch.Tensor) -> Any:
        return self.module(*args)

    def _close(self) -> None:
        del self.module
