"""What a format's writer is: the interface the orchestrator (``tk.export``) loops over.

A format is one module under ``tk.export`` holding one writer object (a ``Writer`` subclass
instance) and one line in ``tk.registries.FORMATS`` naming it (``"module:OBJECT"``). The writer
says what it needs (``unavailable_reason``), what it accepts (``Options``, its own dataclass,
checked by ``validate``) and writes its files (``write``), precision steps included. A writer
that needs another's output asks the context for it by name (``ctx.require("onnx-plain")``);
the writer listing that name in ``provides`` makes it, once.

Each field of an ``Options`` dataclass defaults to ``None`` (or ``()``), meaning "the default";
its ``metadata["flag"]`` is the ``tk export`` option that sets it, so a value the user gave can
be named when it cannot apply. ``metadata["shapes"]`` names a product of the writer that the
field changes (``--opset`` shapes ``onnx-plain``): such a value also applies when only a writer
requiring that product is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from tk.export.context import ExportContext, ExportOptions

REDUCED = ("fp32", "tf32", "fp16", "bf16")  # the precisions every writer takes; int8 is opt-in


def option(flag: str, *, default: Any = None, shapes: str | None = None) -> Any:
    """A field of a writer's options dataclass, set by ``flag``; ``shapes``: a product it changes."""
    return field(default=default, metadata={"flag": flag, "shapes": shapes})


@dataclass(frozen=True)
class NoOptions:
    """The options of a writer that takes none."""


class Writer:
    """One export format. Subclasses set ``name`` and override what they need.

    What ``tk optimize`` needs to know of a format is declared here too, never by comparing its name
    elsewhere: the settings worth trying per precision (``variants``, the writer's own ``Options``
    objects) and the words they add to a candidate's name, and, for int8, the order its exclusion
    search runs in, whether the speed gate's probe of its all-int8 model costs a compile, whether its
    manifest names the modules left out of int8 by module path, and what precision those run in.
    """

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    precisions: ClassVar[tuple[str, ...]] = REDUCED  # the --precision values it writes
    provides: ClassVar[tuple[str, ...]] = ()  # products other writers may ``ctx.require``
    requires: ClassVar[tuple[str, ...]] = ()  # products it asks for
    # int8 under tk optimize: the order exclusion searches run in (lowest first: the likeliest winner, so the
    # speed gate can skip a later search that cannot beat it), whether timing the all-int8 model costs a
    # compile (the gate skips that probe where the precision race already says int8 leads), and whether the
    # manifest's ``quantization.excluded`` lists module paths (then the share of linears kept int8 is known)
    device_free: ClassVar[bool] = False  # its file runs on any device (ONNX): checked on the CPU where need be
    int8_rank: ClassVar[int] = 9
    int8_probe_compiles: ClassVar[bool] = False
    int8_excludes_modules: ClassVar[bool] = False

    def variants(self, precision: str) -> list[Any]:
        """The settings ``tk optimize`` tries for this format at ``precision``, as this writer's ``Options``
        objects; the first is the default, which shares one capture with the other formats' defaults."""
        return [self.Options()]

    def variant_words(self, options: Any, precision: str) -> list[str]:
        """The words ``options`` add to a candidate's name (``onnx int8 dynamic``, ``aoti fp32 frozen``)."""
        return ["static"] if precision == "int8" else []

    def int8_float_part(self) -> str:
        """The precision the layers this format's int8 model leaves out run in (float32 unless overridden)."""
        return "fp32"

    def unavailable_reason(self, device: str, precision: str) -> str | None:
        """Why this machine cannot write the format at ``precision`` for ``device``; None when it can."""
        return None

    def validate(self, options: Any, export: ExportOptions) -> None:
        """Refuse (``UsageError``, one line naming the option) settings that cannot apply, before any work."""

    def write(self, ctx: ExportContext) -> None:
        """Write the format's files into ``ctx.staging`` and its record into ``ctx.formats[name]``."""
        raise NotImplementedError

    def provide(self, product: str, ctx: ExportContext) -> Any:
        """Make ``product`` (one of ``provides``) for another writer; its files go under ``ctx.scratch``."""
        raise NotImplementedError(f"{self.name} provides no {product!r}")


def given(options: Any) -> dict[str, str]:
    """The fields of a writer's options that were set (not None, not empty), as field name -> flag."""
    if not dataclasses.is_dataclass(options):
        return {}
    return {
        f.name: f.metadata.get("flag", f.name)
        for f in dataclasses.fields(options)
        if getattr(options, f.name) not in (None, ())
    }


def shapes(options_type: type, name: str) -> str | None:
    """The product a field of ``options_type`` changes, if any."""
    for f in dataclasses.fields(options_type):
        if f.name == name:
            return f.metadata.get("shapes")
    return None
