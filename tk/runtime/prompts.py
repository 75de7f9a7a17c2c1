"""Prompts for ``tk generate``: token ids from a file, or texts through the artifact's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tk.errors import UsageError
from tk.safefiles import require_regular_file

MAX_PROMPT_FILE = 64 << 20  # bytes: a prompts file is text, never a dataset


def read_prompt_ids(path: Path) -> list[list[int]]:
    """Prompts from ``path``: ``.json`` (a list of lists of token ids, or one list) or text (one prompt a line,
    ids separated by spaces or commas; blank lines skipped). One ``UsageError`` line for anything else."""
    require_regular_file(path, "a prompts file (.json or .txt of token ids)")
    if path.stat().st_size > MAX_PROMPT_FILE:
        raise UsageError(f"{path}: expected a prompts file of at most {MAX_PROMPT_FILE >> 20} MiB, found a larger file")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: expected text (JSON or token ids), found binary data") from exc
    if path.suffix == ".json":
        try:
            data: Any = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise UsageError(f"{path}: expected JSON, a list of lists of token ids ({exc})") from exc
        rows = [data] if isinstance(data, list) and data and all(_is_id(t) for t in data) else data
        if not isinstance(rows, list) or not all(isinstance(r, list) and all(_is_id(t) for t in r) for r in rows):
            raise UsageError(f"{path}: expected a list of lists of token ids (non-negative integers)")
        return [list(r) for r in rows]
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.replace(",", " ").split()
        if not parts:
            continue
        if not all(p.isdigit() for p in parts):
            bad = next(p for p in parts if not p.isdigit())
            raise UsageError(f"{path}:{number}: expected token ids (non-negative integers), found {bad[:20]!r}")
        prompts.append([int(p) for p in parts])
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tokenizer_of(manifest: Any, what: str) -> Any:
    """The Hugging Face tokenizer of an ``hf:DIR`` decoder's directory; one line for a model without one."""
    from tk.models.hf import is_hf_name

    name = str(manifest.model.get("name", ""))
    if not is_hf_name(name):
        raise UsageError(
            f"{what}: expected an hf:DIR model with a tokenizer, found {name!r}, which has none; give --prompt-ids"
        )
    from tk.models.hf_text import load_tokenizer

    return load_tokenizer(name, what=what)
