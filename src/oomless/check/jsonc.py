"""JSON with comments and trailing commas (``.jsonc``, WeClone's settings.json).

Tools that read such files (json5, commentjson) accept ``//`` and ``/* */``
comments and a comma before a closing bracket. :func:`blank` replaces those
by spaces, character for character, so the result is plain JSON whose every
value sits at the same offset as in the original text: positions found in
the blanked text edit the original one.
"""

from __future__ import annotations


def _skip_string(text: str, i: int) -> int:
    """Index just after the JSON string starting at ``text[i] == '"'``."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return i


def _spaces(chunk: str) -> str:
    """The chunk with every character but newlines made a space (offsets kept)."""
    return "".join(c if c == "\n" else " " for c in chunk)


def _drop_comments(text: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _skip_string(text, i)
            out.append(text[i:end])
            i = end
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            out.append(_spaces(text[i:end]))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = len(text) if end < 0 else end + 2
            out.append(_spaces(text[i:end]))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _drop_trailing_commas(text: str) -> str:
    chars = list(text)
    i = 0
    last_comma = None
    while i < len(chars):
        c = chars[i]
        if c == '"':
            i = _skip_string(text, i)
            last_comma = None
            continue
        if c == ",":
            last_comma = i
        elif c in "}]":
            if last_comma is not None:
                chars[last_comma] = " "
            last_comma = None
        elif not c.isspace():
            last_comma = None
        i += 1
    return "".join(chars)


def blank(text: str) -> str:
    """``text`` as plain JSON: comments and trailing commas become spaces."""
    if "/" not in text and "," not in text:
        return text
    return _drop_trailing_commas(_drop_comments(text))


def has_comments(text: str) -> bool:
    return blank(text) != text
