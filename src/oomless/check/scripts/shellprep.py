"""What bashlex does not parse, made parseable without moving a character.

bashlex (the shell parser oomless reads launch scripts with) refuses arithmetic
expansion ``$((...))``, array assignments ``NAME=(a b c)``, ``[[ ... ]]`` tests
and ``case ... esac``. Each is replaced by a placeholder word of the same length
(so every offset and line number of the script stays true) and remembered, to
be evaluated by oomless.check.scripts.shell when the evaluation reaches it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PLACEHOLDER = re.compile(r"@@(\d+)@*")
_NAME_ARRAY = re.compile(r"([A-Za-z_]\w*)\+?=\(")
_STATEMENT_WORDS = {"do", "then", "else", "elif", "if", "while", "until", "!", "&&", "||", "export", "local", "declare", "readonly",
                    "typeset", "-a", "-ga", "-g"}


@dataclass
class Special:
    """One construct replaced by a placeholder."""

    kind: str  # arith | array | case | cmdsub
    start: int
    end: int
    body: str  # the arithmetic expression, the array's items, or the whole case statement
    name: str = ""  # the array's name


@dataclass
class Prepared:
    text: str  # same length as the script, placeholders in place
    specials: list[Special] = field(default_factory=list)


def _closing(text: str, i: int, depth: int = 1) -> int:
    """Offset just after the bracket closing the ``depth`` opened before ``i`` (quotes
    skipped)."""
    quote = ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _at_statement_start(text: str, i: int) -> bool:
    before = text[text.rfind("\n", 0, i) + 1:i].strip()
    if not before or before[-1] in ";&|({":
        return True
    return before.split()[-1] in _STATEMENT_WORDS


def _case_end(text: str, i: int) -> int:
    """Offset after the ``esac`` closing the ``case`` at ``i`` (nested cases counted)."""
    depth = 0
    for m in re.finditer(r"(?<![\w$-])(case|esac)(?![\w-])", text[i:]):
        depth += 1 if m.group(1) == "case" else -1
        if depth == 0:
            return i + m.end()
    return -1


class _Preparer:
    def __init__(self, text: str) -> None:
        self.text, self.out = text, list(text)
        self.specials: list[Special] = []

    def put(self, kind: str, start: int, end: int, body: str, name: str = "",
            keep: str = "") -> int:
        """Replace text[start:end] by a placeholder; the offset after it."""
        self.specials.append(Special(kind, start, end, body, name))
        core = keep + f"@@{len(self.specials) - 1}"
        broken = False  # after a line break: blanks, the break kept (lines stay true)
        for k in range(start, end):
            broken = broken or self.text[k] == "\n"
            at = k - start
            self.out[k] = "\n" if self.text[k] == "\n" else (
                core[at] if at < len(core) else (" " if broken else "@"))
        return end

    def statement(self, i: int) -> int | None:
        """At the start of a statement: an array, a case or a ``[[``; the offset after a
        replaced construct, else None."""
        text = self.text
        m = _NAME_ARRAY.match(text, i)
        end = _closing(text, m.end()) if m else -1
        if m and end > 0:
            return self.put("array", i, end, text[m.end():end - 1], m.group(1),
                            keep=m.group(0)[:-1])
        if re.match(r"case\s", text[i:i + 5]):
            end = _case_end(text, i)
            if end > 0:
                return self.put("case", i, end, text[i:end], keep=": ")
        if text.startswith("[[", i) and (i + 2 == len(text) or text[i + 2].isspace()):
            self.out[i + 1] = " "
        return None


def prepare(text: str) -> Prepared:
    """The script with the constructs bashlex refuses replaced by same-length words."""
    p = _Preparer(text)
    i, quote, comment = 0, "", False
    while i < len(text):
        c = text[i]
        jump = None
        if comment:
            comment = c != "\n"
        elif quote == "'":
            quote = "" if c == "'" else quote
        elif c == "\\":
            if text.startswith("\n", i + 1):  # a line continuation: bashlex would drop it
                p.out[i] = p.out[i + 1] = " "    # and shift every later offset
            i += 1
        elif c == "'" and not quote:
            quote = "'"
        elif c == '"':
            quote = "" if quote else '"'
        elif c == "#" and not quote and (i == 0 or text[i - 1].isspace()):
            comment = True
        elif text.startswith("$((", i):
            end = _closing(text, i + 3, depth=2)
            if end > 0 and text[end - 2:end] == "))":
                jump = p.put("arith", i, end, text[i + 3:end - 2])
        elif text.startswith("$(", i):  # a command's output: known only when it runs
            end = _closing(text, i + 2)
            if end > 0:
                jump = p.put("cmdsub", i, end, text[i:end])
        elif not quote and _at_statement_start(text, i):
            jump = p.statement(i)
        if jump is not None:
            i = jump
            continue
        if not quote and not comment and text.startswith("]]", i) and (
                i + 2 == len(text) or text[i + 2] in " \t\n;&|)") and text[i - 1].isspace():
            p.out[i] = " "
        i += 1
    return Prepared("".join(p.out), p.specials)
