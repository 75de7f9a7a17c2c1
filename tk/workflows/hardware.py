"""What this CPU runs fast: the instruction-set flags that reduced precision needs.

``torch.backends.cpu.get_cpu_capability()`` says AVX2 or AVX512 but not whether the AVX-512 unit
has bfloat16 dot products (``avx512_bf16``) or int8 ones (``avx512_vnni``), nor AMX; the kernel's
``/proc/cpuinfo`` flags (what ``lscpu`` prints) do. Without them bfloat16 products run in
emulation (0.9 GFLOP/s on an AVX2-only EPYC in our notes) and int8 gains little.
"""

from __future__ import annotations

import torch

from tk.formats.aoti import NATIVE_FLAGS, cpu_flags

NEEDS = NATIVE_FLAGS  # precision -> any one of these flags is enough


def cpu_precision_reason(precision: str, flags: frozenset[str] | None = None) -> str | None:
    """Why this CPU lacks hardware for ``precision`` (bf16, int8), or None when it has it (or needs none)."""
    needs = NEEDS.get(precision)
    if not needs:
        return None
    flags = cpu_flags() if flags is None else flags
    if any(f in flags for f in needs):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return f"this CPU ({capability}) has no {' or '.join(needs)}: {precision} would run emulated"
