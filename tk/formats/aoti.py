"""The ``aoti`` format: an AOTInductor package, ``model.aoti.pt2``, and where it can run.

A package holds native code compiled for one device, one CPU vector instruction set and one torch
minor version; the writer records them and the engine refuses a package compiled for elsewhere.
"""

from __future__ import annotations

import functools
from pathlib import Path

FILE = "model.aoti.pt2"

# CPU features that decide how oneDNN packs a frozen package's weights (and which kernels it picks)
PACKING_FEATURES = frozenset(
    {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}
)


# precision -> CPU flags of which any one runs it natively (bfloat16 or int8 dot products), not emulated
NATIVE_FLAGS: dict[str, tuple[str, ...]] = {
    "bf16": ("avx512_bf16", "amx_bf16"),
    "int8": ("avx512_vnni", "avx_vnni", "amx_int8"),
}


def runs_natively(precision: str) -> bool:
    """Whether this CPU has ``precision``'s dot products (any flag of ``NATIVE_FLAGS[precision]``)."""
    return any(f in cpu_flags() for f in NATIVE_FLAGS[precision])


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def packing_features() -> list[str] | None:
    """The ``PACKING_FEATURES`` this CPU has, sorted; None where the flags cannot be read."""
    flags = cpu_flags()
    return sorted(flags & PACKING_FEATURES) if flags else None


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
