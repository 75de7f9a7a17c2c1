"""The ``torch`` format: a ``torch.export`` program saved as ``program.pt2``, and loaded without pickle.

``torch.export.load`` unpickles with ``weights_only=False`` in several places: weights and
constants marked ``use_pickle``, custom and opaque objects, archives of older formats, and, when
the restricted unpickler refuses the sample inputs, as a fallback. A crafted archive can run code
through any of them. So ``tk`` reads the archive itself first and refuses every entry that would
reach a pickle path; only an archive whose weights are raw tensor bytes and whose sample inputs
load with ``weights_only=True`` (or are empty, as ``tk`` writes them) is handed to
``torch.export.load``, from the verified bytes.
"""

from __future__ import annotations

import copy
import io
import json
import zipfile
from pathlib import Path

import torch

from tk.errors import IntegrityError, first_line
from tk.limits import require_within_budget

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


def pickled_entries(data: bytes) -> list[str]:
    """The entries of a ``.pt2`` archive that ``torch.export.load`` would unpickle (empty when none)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise IntegrityError(f"not a torch.export archive ({first_line(exc)})") from exc
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
    except (ValueError, AttributeError) as exc:
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


def load_exported_program(data: bytes, source: str = FILE) -> torch.export.ExportedProgram:
    """The program in ``data`` (the verified bytes of a ``.pt2``), refusing any archive that carries pickles."""
    refused = pickled_entries(data)
    if refused:
        raise IntegrityError(
            f"{source}: the archive holds entries that torch.export.load would unpickle ({', '.join(refused[:3])}); "
            "tk never unpickles an artifact: re-export it with tk"
        )
    return torch.export.load(io.BytesIO(data))
