"""The ``torch`` format: the exported program saved as ``program.pt2``."""

from __future__ import annotations

from tk.export.base import Writer
from tk.export.context import ExportContext
from tk.formats.torch_program import FILE, save_exported_program


class TorchWriter(Writer):
    name = "torch"

    def write(self, ctx: ExportContext) -> None:
        assert ctx.program is not None
        save_exported_program(ctx.program, ctx.add_file(FILE, "torch"))
        ctx.formats["torch"] = {"file": FILE}


WRITER = TorchWriter()
