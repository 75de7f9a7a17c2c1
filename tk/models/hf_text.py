"""A user's own texts as inputs of an ``hf:DIR`` model, tokenized by the directory's own tokenizer.

Random token ids are no stand-in for text: an int8 package judged on them can pass a cosine spec and
miss it on real sentences (docs/optimize.md, "Judge on your own data"). Judging and calibrating on
the texts the model will see is what makes the verdict mean something.

- ``.txt``: one text per line (blank lines skipped).
- ``.jsonl``: one JSON object per line with ``"text"`` and, for a classifier, an integer ``"label"``
  (every line or none), which makes ``top1`` an accuracy against the labels.

Every text is padded to the longest one (at least the model's minimum sequence) and truncated at
the maximum; the arrays come back in the model's input order, as int64.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tk.errors import UsageError, first_line
from tk.limits import require_within_budget
from tk.models.hf import PREFIX, offline
from tk.safefiles import require_regular_file

TEXT_SUFFIXES = (".txt", ".jsonl")
LABEL = "label"


def is_text_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() in TEXT_SUFFIXES


def load_tokenizer(model: str, *, what: str) -> Any:
    """The tokenizer of ``model`` (``hf:DIR``), loaded offline without remote code; ``what`` (the file or flag
    that needs it) starts the one-line error when the directory has none."""
    directory = Path(model[len(PREFIX) :])
    if not (directory / "tokenizer_config.json").is_file():
        raise UsageError(f"{what}: texts need the model's tokenizer; {directory} has no tokenizer_config.json")
    from transformers import AutoTokenizer

    with offline():
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)


def read_text_samples(
    path: str | Path, model: str, input_names: Sequence[str], *, min_seq: int, max_seq: int
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The texts of ``path`` tokenized for ``model`` (``hf:DIR``, as a ModelSpec or a manifest names it)
    into ``input_names``, and their labels if given."""
    path = Path(path)
    if not model.startswith(PREFIX):
        raise UsageError(
            f"{path}: a text file needs an hf:DIR model with a tokenizer; {model} takes arrays "
            "(give a .npz or .npy file)"
        )
    tokenizer = load_tokenizer(model, what=str(path))
    directory = Path(model[len(PREFIX) :])
    texts, labels = _read_texts(path)
    names = list(input_names)
    require_within_budget(len(texts) * max_seq * 8 * len(names), f"{len(texts)} texts at up to {max_seq} tokens")
    tokens = tokenizer(texts, padding="longest", truncation=True, max_length=max_seq, return_tensors="np")
    missing = [n for n in names if n not in tokens]
    if missing:
        raise UsageError(f"{path}: the tokenizer of {directory} gives {sorted(tokens)}, the model needs {missing}")
    arrays = {n: np.asarray(tokens[n], dtype=np.int64) for n in names}
    short = min_seq - arrays[names[0]].shape[1]
    if short > 0:  # every text shorter than the range's minimum: pad on, as padding="max_length" would
        pad = {n: (tokenizer.pad_token_id or 0) if n == "input_ids" else 0 for n in names}
        arrays = {n: np.pad(a, ((0, 0), (0, short)), constant_values=pad[n]) for n, a in arrays.items()}
    return arrays, labels


def _read_texts(path: Path) -> tuple[list[str], np.ndarray | None]:
    require_regular_file(path, 'a .txt file of texts, one per line, or a .jsonl file of {"text": ...} lines')
    require_within_budget(path.stat().st_size, f"{path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: expected UTF-8 text, found bytes that are not ({first_line(exc)})") from exc
    if path.suffix.lower() == ".txt":
        texts = [line for line in lines if line.strip()]
        labels = None
    else:
        texts, found = [], []
        for number, line in enumerate(lines, 1):
            if line.strip():
                text, label = _jsonl_record(path, number, line)
                texts.append(text)
                found.append(label)
        given = [label is not None for label in found]
        if any(given) and not all(given):
            raise UsageError(
                f"{path}: expected a {LABEL!r} on every line or on none, found it on {sum(given)} of {len(given)}"
            )
        labels = np.asarray(found, dtype=np.int64) if found and all(given) else None
    if not texts:
        raise UsageError(f"{path}: expected texts, one per line; found none")
    return texts, labels


def _jsonl_record(path: Path, number: int, line: str) -> tuple[str, int | None]:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{path}:{number}: expected a JSON object per line, found invalid JSON ({exc.msg})") from exc
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UsageError(f'{path}:{number}: expected an object with a "text" string, found {line[:60]!r}')
    label = record.get(LABEL)
    if label is not None and (isinstance(label, bool) or not isinstance(label, int) or label < 0):
        raise UsageError(f"{path}:{number}: expected {LABEL!r} to be a class index (an integer >= 0), found {label!r}")
    return record["text"], label
