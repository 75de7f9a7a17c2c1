"""Strings tk did not write, made safe to show: a manifest's or a baseline's names, a path, an error quoting them.

JSON carries any character, so a manifest can name its model ``ESC ] 52 ; c ; … BEL`` (a terminal
obeying it writes the clipboard), ``ESC [ 2 J`` (clears the screen) or a lone surrogate (no encoder
takes it: printing it is a traceback). ``printable`` shows every character that is not printable
text escaped as Python writes it (``\\x1b``, ``\\u202e``, ``\\ud800``) and leaves the rest alone, so
the name stays recognisable and one line stays one line; the result is also valid XML 1.0 text.
rich reads ``[...]`` in a table cell as markup (``[/]`` raises), so ``table_cell`` also escapes that.
"""

from __future__ import annotations


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``str(text)`` with each non-printable character (controls, format and bidi characters,
    surrogates, unassigned code points, separators other than the space) escaped; with
    ``keep_newlines``, ``\\n`` stays a line break."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(char if char.isprintable() or (keep_newlines and char == "\n") else _escaped(char) for char in value)


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def table_cell(text: object) -> str:
    """``text`` for a rich table cell or a rich-printed line: printable, and its ``[`` not read as markup."""
    from rich.markup import escape

    return escape(printable(text))
