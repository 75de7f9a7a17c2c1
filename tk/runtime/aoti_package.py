"""An AOTInductor package opened for the CPU with its constants on cache-line boundaries.

AOTInductor copies a package's constants (the weights, oneDNN's packed ones included) into one block from
``std::malloc``, which glibc aligns to 16 bytes, at offsets that are multiples of 64: so in three loads of
four every weight starts 16, 32 or 48 bytes off a cache line, and each of its rows that oneDNN's AMX and
AVX-512 kernels read spans two lines. MiniLM's bf16 package at 8 x 128 ran 29.7-30.8 ms a call that way
and 23.6-25.1 ms with the same bytes aligned (benchmarks/history.md, 2026-12-06 evening); which of the two
a loaded package got was luck of the heap, so one process's package ran 20% faster than the next one's.

``open_package`` runs the package's model library in torch's own runner (what
``torch._inductor.aoti_load_package`` builds), copies each constant once into torch's own allocations
(64-byte aligned), hands those to the runner as its constants and frees the runner's block: the same
bytes, aligned, and no more memory once loaded (twice the constants while it copies). A package other
than what tk's writer makes (one model library, its constants inside it) opens with torch's loader as is.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from tk.archives import AOTI_DIR
from tk.formats.aoti import FILE
from tk.safefiles import private_copy

log = logging.getLogger("tk.runtime")

ALIGNMENT = 64  # bytes: a cache line, and what torch's CPU allocator gives every tensor
LIBRARY = "model.so"
EXTERN_NODES = "model.json"  # beside LIBRARY: torch's runner reads it for the ops its proxy executor calls


class AlignedCpuPackage:
    """A CPU package's model, called like ``torch._inductor.aoti_load_package``'s: positional tensors in, its
    outputs as exported out."""

    def __init__(self, runner: Any, constants: dict[str, torch.Tensor]) -> None:
        self._runner = runner
        self._constants = constants  # user-managed by the runner: must live as long as it
        self._out_spec = pytree.treespec_loads(runner.get_call_spec()[1])

    def __call__(self, *args: torch.Tensor) -> Any:
        return pytree.tree_unflatten(self._runner.run(list(args)), self._out_spec)


def open_package(data: bytes, device: str) -> Callable[..., Any]:
    """The package in ``data`` (a ``.pt2`` archive's verified bytes) ready to call on ``device``: on the CPU, where
    it is one model library with its constants inside, with its constants aligned; else as torch's loader opens it
    (which takes a path: the verified bytes written to a private directory)."""
    files = _model_library(data) if device == "cpu" else None
    if files is None:
        with private_copy({FILE: data}) as copy:
            return torch._inductor.aoti_load_package(str(copy / FILE))
    with private_copy(files) as copy:  # dlopen takes a path; the mapping outlives the file
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(copy / LIBRARY), 1)
    return AlignedCpuPackage(runner, realigned_constants(runner))


def realigned_constants(runner: Any) -> dict[str, torch.Tensor]:
    """``runner``'s constants moved into torch's allocations (aligned to ``ALIGNMENT``) and its own block
    freed; the copies returned must outlive the runner. Left where they are (``{}``) when already aligned,
    or when torch's runner cannot hand every constant back: it names them by their original names, which
    Inductor's int8 lowering repeats (nine ``x_scale``) in packages tk wrote before
    ``tk.export.aoti.constant_names``, and one left out would point into the freed block."""
    original = runner.get_constant_names_to_original_fqns()  # the runner's own name -> the original one
    constants = runner.extract_constants_map(False)  # by original name
    if not constants:
        return {}
    if len(constants) != len(original) or len(set(original.values())) != len(original):
        log.debug("tk: AOTInductor constants left where the loader put them (names repeat or are folded)")
        return {}
    dense = [t for t in constants.values() if t.layout == torch.strided and t.numel()]  # oneDNN's have no pointer
    if dense and all(t.data_ptr() % ALIGNMENT == 0 for t in dense):  # all in one block: aligned alike
        return {}
    own_name = {fqn: name for name, fqn in original.items()}
    copies = {own_name[fqn]: t.clone() for fqn, t in constants.items()}  # oneDNN's packed ones too
    del constants
    runner.update_constant_buffer(copies, True, True, True)  # the inactive set, user-managed, every constant
    runner.swap_constant_buffer()
    runner.free_inactive_constant_buffer()  # the block std::malloc gave
    log.debug("tk: %d AOTInductor constants moved to %d-byte boundaries", len(copies), ALIGNMENT)
    return copies


def _model_library(data: bytes) -> dict[str, bytes] | None:
    """The archive's one compiled model library (``LIBRARY``), where it holds exactly one and no constants
    beside it, with the description of the ops it calls through torch's proxy executor where it has one
    (``EXTERN_NODES``: the ``.json`` of the library's name; an int8 ResNet's max pooling under a dynamic
    batch is ``quantized::max_pool2d``, which the runner cannot call without it)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        libraries = [n for n in names if n.endswith(".so") and f"/{AOTI_DIR}" in n]
        beside = [n for n in names if "/data/weights/" in n or "/data/constants/" in n]
        if len(libraries) != 1 or beside:
            return None
        files = {LIBRARY: archive.read(libraries[0])}
        extern_nodes = libraries[0].removesuffix(".so") + ".json"
        if extern_nodes in names:
            files[EXTERN_NODES] = archive.read(extern_nodes)
        return files
