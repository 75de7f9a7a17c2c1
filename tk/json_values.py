"""Values read from a JSON file tk did not write (a baseline), checked before use.

Python's json reads NaN, Infinity, integers of any size, lone surrogates and control characters: each
check says whether a value is what a field may hold, and ``shown`` quotes one in an error line without
failing on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def shown(value: Any) -> str:
    """A value of a damaged file as an error line quotes it: short, and never a failure of its own
    (``repr`` of an integer of 5,000 digits raises)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an {type(value).__name__} too large to show"
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(value: Any) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity, which would make every limit pass or fail)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value: Any) -> bool:
    """An integer of 1 or more (a batch size, a sample count); ``True`` is no count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_sizes(value: Any) -> bool:
    """Dimension sizes: an object of names to counts."""
    return isinstance(value, dict) and all(is_name(k) and is_count(v) for k, v in value.items())


def is_name(value: Any) -> bool:
    """A name a baseline may hold (an output, a dimension, a CPU flag, a file): printable text, which
    no control character, escape sequence or lone surrogate is."""
    return isinstance(value, str) and bool(value) and value.isprintable()


def is_choice(value: Any, choices: Sequence[str]) -> bool:
    return isinstance(value, str) and value in choices


def finite(value: float | None) -> float | None:
    """``value``, or None where it is NaN or infinite (what JSON writes as null)."""
    return None if value is None or not math.isfinite(value) else value


def is_sha256(value: Any) -> bool:
    """A sha256 digest as lowercase hex."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
