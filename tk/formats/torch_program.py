"""The ``torch`` format: a ``torch.export`` program saved as ``program.pt2``, and loaded without pickle.

``torch.export.load`` unpickles with ``weights_only=False`` in several places: weights and
constants marked ``use_pickle``, custom and opaque objects, archives of older formats, and, when
the restricted unpickler refuses the sample inputs, as a fallback. A crafted archive can run code
through any of them. So ``tk`` reads the archive itself first and refuses every entry that would
reach a pickle path; only an archive whose weights are raw tensor bytes and whose sample inputs
load with ``weights_only=True`` (or are empty, as ``tk`` writes them) is handed to
``torch.export.load``, from the verified bytes. ``torch.export.load`` also extracts and dlopens any
AOTInductor model the archive holds (``data/aotinductor/``): such members are refused, or left out
of what it sees (see ``load_exported_program``).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import torch

from tk.archives import compiled_members_of_bytes
from tk.errors import IntegrityError, first_line
from tk.limits import require_within_budget
from tk.manifest import Manifest, read_verified
from tk.signing import TrustPolicy, require_trusted_code

log = logging.getLogger("tk.runtime")

FILE = "program.pt2"

_WEIGHTS_DIR = "data/weights/"
_CONSTANTS_DIR = "data/constants/"
_SAMPLE_INPUTS_DIR = "data/sample_inputs/"
_REFUSED_PREFIXES = ("custom_obj_", "opaque_obj_")  # constants loaded through a pickler


def save_exported_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """Save ``program`` without its example inputs, so the archive holds nothing that needs unpickling."""
    bare = copy.copy(program)
    bare.example_inputs = None
    torch.export.save(bare, str(path))


def pickled_entries(data: bytes, source: str = FILE) -> list[str]:
    """The entries of a ``.pt2`` archive that ``torch.export.load`` would unpickle (empty when none)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise IntegrityError(f"{source}: not a torch.export archive ({first_line(exc)})") from exc
    with archive:
        infos = archive.infolist()
        require_within_budget(sum(i.file_size for i in infos), "the program archive's unpacked contents")
        by_name = {i.filename.split("/", 1)[1] if "/" in i.filename else i.filename: i.filename for i in infos}
        if "archive_format" not in by_name:
            return ["(an archive of an older torch.export format, which loads through pickle)"]
        found = []
        for name, full in by_name.items():
            base = name.rsplit("/", 1)[-1]
            if name.startswith((_WEIGHTS_DIR, _CONSTANTS_DIR)) and name.endswith(".pt"):
                found.append(name)  # legacy weights/constants files
            elif name.startswith(_CONSTANTS_DIR) and base.startswith(_REFUSED_PREFIXES):
                found.append(name)
            elif name.startswith((_WEIGHTS_DIR, _CONSTANTS_DIR)) and name.endswith("_config.json"):
                found += [f"{name}:{key}" for key in _pickled_payloads(archive.read(full), name)]
            elif name.startswith(_SAMPLE_INPUTS_DIR) and not _loads_without_code(archive.read(full)):
                found.append(name)
        return found


def _pickled_payloads(config_bytes: bytes, name: str) -> list[str]:
    try:
        config = json.loads(config_bytes).get("config", {})
    except (ValueError, AttributeError, RecursionError) as exc:
        raise IntegrityError(f"damaged payload config {name} ({first_line(exc)})") from exc
    if not isinstance(config, dict):
        raise IntegrityError(f"damaged payload config {name}: expected an object")
    return [
        key
        for key, meta in config.items()
        if not isinstance(meta, dict)
        or meta.get("use_pickle")
        or str(meta.get("path_name", "")).startswith(_REFUSED_PREFIXES)
    ]


def _loads_without_code(payload: bytes) -> bool:
    if not payload:
        return True
    try:
        torch.load(io.BytesIO(payload), weights_only=True)
    except Exception:  # the restricted unpickler refuses in several types; any refusal is a no
        return False
    return True


def load_exported_program(
    data: bytes, source: str = FILE, *, drop_compiled: bool = False
) -> torch.export.ExportedProgram:
    """The program in ``data`` (the verified bytes of a ``.pt2``), refusing any archive that carries pickles.

    An archive holding compiled code (``tk.archives.compiled_members``: torch.export.load would dlopen
    it) is refused too, unless ``drop_compiled``: the caller has checked that the user trusts the
    artifact, and the program is then loaded from a copy of the archive without those members, since
    running the program never needs them (tk's torch format writes none).
    """
    refused = pickled_entries(data, source)
    if refused:
        raise IntegrityError(
            f"{source}: the archive holds entries that torch.export.load would unpickle ({', '.join(refused[:3])}); "
            "tk never unpickles an artifact: re-export it with tk"
        )
    compiled = compiled_members_of_bytes(data, source)
    if compiled and not drop_compiled:
        raise IntegrityError(
            f"{source}: the archive holds compiled code ({', '.join(compiled[:3])}), which torch.export.load would "
            "load and run; a torch program holds none: re-export it with tk"
        )
    program = torch.export.load(io.BytesIO(without_members(data, compiled) if compiled else data))
    refuse_unsafe_operators(program, source)
    return program


def load_artifact_program(root: str | Path, manifest: Manifest, trust: TrustPolicy | None, what: str = "torch"
                          ) -> torch.export.ExportedProgram:  # fmt: skip
    """The artifact's torch program, from its verified bytes. An archive that holds compiled code loads only
    when the user trusts the artifact (``require_trusted_code``, before anything is extracted), and even
    then without that code."""
    entry = manifest.file("torch")
    source = str(Path(root) / entry.path)
    data = read_verified(root, entry)
    compiled = compiled_members_of_bytes(data, source)
    if compiled:
        require_trusted_code(root, manifest, trust, what)
        log.warning("note: %s holds compiled code (%s); it is left out: the program runs without it",
                    source, ", ".join(compiled[:3]))  # fmt: skip
    return load_exported_program(data, source, drop_compiled=bool(compiled))


def without_members(data: bytes, names: list[str]) -> bytes:
    """The zip archive ``data`` with the members ``names`` left out (read member by member, never extracted)."""
    leave_out = set(names)
    kept = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as archive, zipfile.ZipFile(kept, "w") as out:
        for info in archive.infolist():
            if info.filename not in leave_out:
                out.writestr(info, archive.read(info))
    return kept.getvalue()


# Operators a loaded program may call: the core ATen and prims sets and the quantize/dequantize ops of
# PT2E; control flow by name (its bodies are graphs checked like the main one). Nothing else: an operator
# from another namespace runs whatever code registered it, and other higher-order operators take code
# or formats of their own (``print`` formats its string over its arguments' attributes: a program
# calling it printed os.environ).
SAFE_NAMESPACES = ("aten", "prims", "quantized_decomposed")
SAFE_HIGHER_ORDER = ("cond", "while_loop", "map_impl", "scan", "wrap_with_set_grad_enabled", "wrap_with_autocast")
# ATen operators that reach outside the process's tensors: from_file maps any file into a tensor (a
# program rewritten to call it read /etc/passwd into its output), _print writes to stdout
UNSAFE_ATEN = ("from_file", "_print")
# Python-level targets torch.export writes for symbolic sizes, tuple outputs and grad regions
SAFE_FUNCTION_MODULES = ("_operator", "operator", "math")
SAFE_FUNCTIONS = (round, torch._C._set_grad_enabled, torch.autograd.grad_mode.set_grad_enabled)


def refuse_unsafe_operators(program: torch.export.ExportedProgram, source: str = FILE) -> None:
    """Refuse (``IntegrityError``, one line) a program that calls, or hands to another operator, an
    operator outside ``SAFE_NAMESPACES`` and ``SAFE_HIGHER_ORDER``, one of ``UNSAFE_ATEN``, or a Python
    function other than ``SAFE_FUNCTIONS``, ``SAFE_FUNCTION_MODULES``' and torch's ``sym_*``. The
    program's graph is data until it runs: this reads every node of it and of its subgraphs first."""
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            why = _unsafe(node.target) if node.op == "call_function" else f"a {node.op} node ({node.target})"
            for value in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
                if why is None and callable(value) and not isinstance(value, (torch.fx.Node, torch.Tensor)):
                    why = _unsafe(value)  # an operator handed to another (with_effects, auto_functionalized)
            if why:
                raise IntegrityError(
                    f"{source}: the program calls {why}, which tk does not run from an artifact; "
                    "expected only ATen, prims and quantize operators: re-export it with tk"
                )


def _unsafe(target: Any) -> str | None:
    """Why ``target`` may not run, or None."""
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.namespace, target._schema.name.split("::")[-1]
        if namespace not in SAFE_NAMESPACES or (namespace == "aten" and name in UNSAFE_ATEN):
            return f"{namespace}::{name}"
        return None
    if isinstance(target, torch._ops.HigherOrderOperator):
        return None if target.name() in SAFE_HIGHER_ORDER else f"the higher-order operator {target.name()}"
    if any(target is safe for safe in SAFE_FUNCTIONS):
        return None
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", repr(target))
    if module in SAFE_FUNCTION_MODULES or (module == "torch" and name.startswith("sym_")):
        return None
    return f"the Python function {module}.{name}"
