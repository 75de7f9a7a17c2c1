"""What this machine is and what its CPU runs fast: the one description every measurement carries.

``torch.backends.cpu.get_cpu_capability()`` says AVX2 or AVX512 but not whether the AVX-512 unit
has bfloat16 dot products (``avx512_bf16``) or int8 ones (``avx512_vnni``), nor AMX; the kernel's
``/proc/cpuinfo`` flags (what ``lscpu`` prints) do. Without them bfloat16 products run in
emulation and int8 gains little.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from tk.formats.aoti import NATIVE_FLAGS, cpu_flags
from tk.versions import library_versions

NEEDS = NATIVE_FLAGS  # precision -> any one of these flags is enough
SPEED_FLAGS = ("avx512", "amx", "avx_vnni", "avx2", "fma")  # prefixes of the flags a measurement names


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


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_description(device: str = "cpu") -> dict[str, Any]:
    """CPU model and speed flags, cores, torch threads, GPU, load average, platform and library versions."""
    return {
        "cpu": cpu_model(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(SPEED_FLAGS)),
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": load_average(),  # 1, 5 and 15 minutes; above the cores, other work competes for them
        "platform": platform.platform(),
        "versions": library_versions(device),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
