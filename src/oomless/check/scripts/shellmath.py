"""Word expansion, arithmetic and ``case`` arms for oomless.check.scripts.shell.

A word is expanded as bash does: quotes removed, ``$VAR`` / ``${...}`` /
``$(...)`` / ``$((...))`` replaced, unquoted expansions split on blanks. A word
that is a literal (or a single variable whose literal value is written in the
script) keeps the span of those characters, so that a fix edits them in place.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from . import shellprep

_VAR_IN_MATH = re.compile(r"\$\{?([A-Za-z_]\w*|\d+)\}?")


class _Field:
    def __init__(self) -> None:
        self.chars: list[str] = []
        self.present = False

    def add(self, text: str) -> None:
        self.chars.append(text)
        self.present = self.present or bool(text)


def expand_word(ev: Any, node: Any, value_from: int | None, split: bool) -> list[Any]:
    from .values import Unknown, Word

    start, end = node.pos
    start = value_from if value_from is not None else start
    text = ev.prep.text
    if text[start:end] in ('"$@"', '"${@}"', "$@", "${@}") and not ev.positional:
        return []  # "$@" with no arguments is no word at all
    parts = sorted((p for p in (getattr(node, "parts", None) or []) if p.pos[0] >= start),
                   key=lambda p: p.pos[0])
    fields = [_Field()]
    quote = ""
    single_var = None
    i = start
    while i < end:
        part = next((p for p in parts if p.pos[0] == i), None)
        c = text[i]
        if part is not None and quote != "'":
            value, var = _part_value(ev, part)
            single_var = var if len(parts) == 1 else None
            _put(fields, value, split and not quote, ev.script)
            i = part.pos[1]
            continue
        m = shellprep.PLACEHOLDER.match(text, i) if c == "@" and quote != "'" else None
        special = ev.prep.specials[int(m.group(1))] if m else None
        if special is not None and special.kind in ("arith", "cmdsub"):
            value = ev.arithmetic(special.body, i) if special.kind == "arith" else \
                command_output(special.body, ev.line(i))
            _put(fields, value, split and not quote, ev.script)
            i = m.end()
            continue
        i, quote = _literal_char(text, i, end, quote, fields[-1])
    line = ev.line(node.pos[0])
    out = []
    for f in fields:
        if not f.present:
            continue
        raw = "".join(f.chars)
        out.append(Word(ev.script.resolve(raw), None, line, raw,
                        node.pos[1] if ev.main else -1))
    if len(out) == 1 and not isinstance(out[0].value, Unknown):
        out[0].span = _literal_span(text, start, end, parts, single_var)
    elif single_var is not None and single_var.at >= 0 and re.fullmatch(
            r"\$\{?[A-Za-z_]\w*\}?", text[start:end]):
        _body_spans(out, single_var)
    return out


def _body_spans(words: list[Any], var: Any) -> None:
    """Spans of the words an unquoted ``$VAR`` splits into, where VAR holds a literal
    heredoc body (``read -d '' CMD <<EOF``): each word is where the body writes it."""
    pos = 0
    for w in words:
        found = var.value.find(w.raw, pos) if isinstance(w.value, str) else -1
        if found < 0:
            return
        w.span = (var.at + found, var.at + found + len(w.raw))
        pos = found + len(w.raw)


def _literal_char(text: str, i: int, end: int, quote: str, field: _Field) -> tuple[int, str]:
    """One character of a word outside expansions: quotes opened or closed, backslash
    escapes as bash reads them (a line continuation disappears); the next offset and
    the quote state."""
    c = text[i]
    if quote == "'":
        if c == "'":
            return i + 1, ""
        field.add(c)
    elif c == "\\" and i + 1 < end:
        nxt = text[i + 1]
        if nxt != "\n":
            field.add(nxt if not quote or nxt in '$`"\\' else c + nxt)
        return i + 2, quote
    elif c == "'" and not quote:
        field.present = True
        return i + 1, "'"
    elif c == '"':
        field.present = True
        return i + 1, "" if quote else '"'
    else:
        field.add(c)
    return i + 1, quote


def _put(fields: list[_Field], value: Any, split: bool, script: Any) -> None:
    from .values import Unknown

    if isinstance(value, Unknown):
        fields[-1].add(script.mark(value))
        return
    if not split:
        fields[-1].add(value)
        return
    pieces = re.split(r"[ \t\n]+", value)
    for k, piece in enumerate(pieces):
        if k > 0 and fields[-1].present:
            fields.append(_Field())
        fields[-1].add(piece)


def _part_value(ev: Any, part: Any) -> tuple[Any, Any]:

    if part.kind == "parameter":
        return ev.parameter(part.value, part.pos[0])
    if part.kind == "tilde":
        return part.value, None
    raw = ev.text[part.pos[0]:part.pos[1]] if ev.text else "$(...)"
    return command_output(raw, ev.line(part.pos[0])), None


def command_output(raw: str, line: int) -> Any:
    """The unknown output of ``$(...)`` / backticks."""
    from .values import Unknown

    unknown = Unknown(raw, line, "is the output of a command, known only when the script runs")
    if unknown.gpu_count:
        unknown = Unknown(raw, line, "counts the GPUs when the script runs")
    return unknown


def _literal_span(text: str, start: int, end: int, parts: list[Any],
                  var: Any) -> tuple[int, int] | None:
    raw = text[start:end]
    if "@@" in raw:
        return None
    if not parts:
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" and raw[0] not in raw[1:-1]:
            return (start + 1, end - 1)
        if not any(q in raw for q in "'\"\\"):
            return (start, end)
        return None
    if var is not None and len(parts) == 1 and re.fullmatch(  # $N, ${N}, ${N:-4}
            r"\"?\$\{?[A-Za-z_]\w*(?::?[-=][\w.+-]+)?\}?\"?", raw):
        return var.span
    return None


def arithmetic(expr: str, ev: Any, line: int, depth: int = 0) -> Any:
    """The value of ``$((expr))`` as a decimal string, or an Unknown."""
    from .values import Unknown

    for m in re.finditer(r"\$\{([^}]*)\}", expr):
        got, _var = ev.parameter(m.group(1), 0)
        got = ev.script.resolve(got)
        if isinstance(got, Unknown):
            return got
        expr = expr.replace(m.group(0), str(got), 1)
    plain = _VAR_IN_MATH.sub(lambda m: "_p" + m.group(1) if m.group(1).isdigit()
                             else m.group(1), expr)
    try:
        tree = ast.parse(plain.strip(), mode="eval")
    except SyntaxError:
        return Unknown(f"$(({expr}))", line, "is arithmetic the reading does not evaluate")

    def value_of(name: str) -> Any:
        key = name[2:] if name.startswith("_p") and name[2:].isdigit() else name
        got, _var = ev.parameter(key, 0)
        if isinstance(got, Unknown):
            return Unknown(got.text, got.line, f"{got.why} (used in $(({expr.strip()})) at "
                           f"line {line})")
        got = ev.script.resolve(str(got).strip())
        if isinstance(got, Unknown):
            return Unknown(got.text, got.line, f"{got.why} (used in $(({expr.strip()})) at "
                           f"line {line})")
        if re.fullmatch(r"-?\d+", got):
            return int(got)
        if got and depth < 4:
            inner = arithmetic(got, ev, line, depth + 1)
            return int(inner) if isinstance(inner, str) else inner
        return 0

    try:
        result = _eval(tree.body, value_of)
    except (TypeError, ZeroDivisionError, ValueError):
        return Unknown(f"$(({expr}))", line, "is arithmetic the reading does not evaluate")
    return result if isinstance(result, Unknown) else str(result)


def _eval(node: ast.AST, value_of: Any) -> Any:
    from .values import Unknown

    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return value_of(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand, value_of)
        return v if isinstance(v, Unknown) else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, value_of), _eval(node.right, value_of)
        for v in (a, b):
            if isinstance(v, Unknown):
                return v
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
               ast.Div: lambda: int(a / b) if b else 1 // b, ast.FloorDiv: lambda: a // b,
               ast.Mod: lambda: a % b, ast.Pow: lambda: a ** b}
        if type(node.op) in ops:
            return ops[type(node.op)]()
    raise ValueError("not bash arithmetic")


def case_arms(body: str) -> list[tuple[list[str], int, int]]:
    """(patterns, start, end) of each arm of ``case WORD in ... esac`` (offsets in body)."""
    m = re.match(r"case\s+.+?\s+in\b", body, re.S)
    if not m:
        return []
    arms = []
    i = m.end()
    while i < len(body):
        while i < len(body) and (body[i].isspace() or body[i] == "#"):
            if body[i] == "#":
                i = body.find("\n", i) if "\n" in body[i:] else len(body)
            else:
                i += 1
        if body.startswith("esac", i) or i >= len(body):
            break
        close = body.find(")", i)
        if close < 0:
            break
        patterns = body[i:close].lstrip("(").split("|")
        end = _arm_end(body, close + 1)
        arms.append((patterns, close + 1, end))
        i = end + 2
    return arms


def _arm_end(body: str, i: int) -> int:
    quote = ""
    while i < len(body):
        c = body[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif body.startswith(";;", i) or body.startswith("esac", i) and body[i - 1].isspace():
            return i
        i += 1
    return len(body)
