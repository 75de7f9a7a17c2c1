"""The ``aoti`` format: an AOTInductor package, ``model.aoti.pt2``, and where it can run.

A package holds native code compiled for one device, one CPU vector instruction set and one torch
minor version; the writer records them and the engine refuses a package compiled for elsewhere.
"""

from __future__ import annotations

FILE = "model.aoti.pt2"


def cpu_vector_isa() -> str | None:
    """The vector instruction set Inductor compiles CPU code for here (``avx512``, ``avx2``…), if it says."""
    try:
        from torch._inductor import cpu_vec_isa

        return str(cpu_vec_isa.pick_vec_isa()) or None
    except (ImportError, AttributeError, RuntimeError):  # a private API: no answer is not an error
        return None


def supported_vector_isas() -> list[str] | None:
    """Every vector instruction set this CPU runs, as Inductor names them; None when it cannot tell."""
    try:
        from torch._inductor import cpu_vec_isa

        return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    except (ImportError, AttributeError, RuntimeError):
        return None


def torch_minor(version: str) -> tuple[str, ...]:
    """``(major, minor)`` of a torch version string: packages load only under the minor that built them."""
    return tuple(version.split("+")[0].split(".")[:2])
