"""Words of a shell reading: parameter expansion (``${VAR:-x}``, ``${#A[@]}``, positional
arguments as with none given), arithmetic, and ``[ ... ]`` tests (oomless.check.scripts.shell).
"""

from __future__ import annotations

import re
from typing import Any

import bashlex

from . import shellprep
from .shellmath import arithmetic
from .values import Unknown, Value, Var, Word

_PARAM = re.compile(r"^(#?)([A-Za-z_]\w*|\d+|[@*#?$!])(\[[^\]]*\])?(.*)$", re.S)
_DEFAULT_OPS = (":-", ":=", ":+", ":?", "-", "=", "+", "?")


class WordsMixin:
    """Expansion methods of the shell evaluator (it holds script, env, positional, prep)."""

    script: Any
    env: dict[str, Var]
    positional: list[str]
    prep: shellprep.Prepared
    path: Any
    depth: int

    def line(self, pos: int) -> int:
        raise NotImplementedError

    def expand_text(self, text: str, at: int) -> list[Word]:
        """Words of a piece of shell text (``at``: its offset in the script, -1 if none)."""
        sub = type(self)(self.script, "", self.path, main=False, depth=self.depth)
        sub.env, sub.positional, sub.prep = self.env, self.positional, shellprep.prepare(
            ": " + text)
        sub.text = ": " + text
        try:
            nodes = bashlex.parse(sub.prep.text)
        except Exception:  # noqa: BLE001 - any parser failure: the text stays unknown
            return [Word(Unknown(text.strip(), self.line(max(at, 0)), "cannot be parsed"),
                         None, self.line(max(at, 0)))]
        words = [p for p in nodes[0].parts if p.kind == "word"][1:] if nodes else []
        out = [w for p in words for w in sub.expand(p)]
        for w in out:
            w.span, w.line, w.end = None, self.line(max(at, 0)), -1
        if at < 0:
            self.script.unknowns = sub.script.unknowns
        return out

    def expand(self, node: Any, value_from: int | None = None, split: bool = True) -> list[Word]:
        from .shellmath import expand_word

        return expand_word(self, node, value_from, split)

    def parameter(self, body: str, pos: int) -> tuple[Value, Var | None]:
        """The value of ``${body}`` / ``$body``, and the variable read when it is one."""
        line = self.line(pos)
        m = _PARAM.match(body)
        if not m:
            return Unknown("${" + body + "}", line, "is a parameter form the reading does not "
                           "evaluate"), None
        length, name, index, rest = m.groups()
        var = self._lookup(name, line)
        value = var.value if var else None
        if index and isinstance(value, list):
            key = index[1:-1]
            value = " ".join(value) if key in ("@", "*") else (
                value[int(key)] if key.isdigit() and int(key) < len(value) else "")
        elif isinstance(value, list):
            value = value[0] if value else ""
        if length:
            count = len(var.value) if var and isinstance(var.value, list) and index else (
                len(value) if isinstance(value, str) else None)
            return (str(count) if count is not None else Unknown(
                "${" + body + "}", line, "is known only when the script runs")), None
        if rest:
            got = self._operator(name, value, rest, body, line)
            return got, self._default_var(got, var, value, rest, body, pos, line)
        if value is None:
            return Unknown("$" + name, line, "is not set in the script (it comes from the "
                           "environment)"), None
        return value, var

    def _lookup(self, name: str, line: int) -> Var | None:
        if name.isdigit():
            n = int(name)
            if n == 0:
                return Var(str(self.script.path))
            return Var(self.positional[n - 1] if n <= len(self.positional) else "")
        if name in ("@", "*"):
            return Var(" ".join(self.positional))
        if name == "#":
            return Var(str(len(self.positional)))
        if name in ("?", "$", "!"):
            return Var(Unknown("$" + name, line, "is known only when the script runs"))
        return self.env.get(name)

    def _operator(self, name: str, value: Value, rest: str, body: str, line: int) -> Value:
        op = next((o for o in _DEFAULT_OPS if rest.startswith(o)), None)
        if op is None:
            return Unknown("${" + body + "}", line, "is a parameter operation the reading "
                           "does not evaluate")
        word = rest[len(op):]
        unset = value is None or (op.startswith(":") and value == "")
        if op in (":+", "+"):
            return self._word(word, line) if not unset else ""
        if not unset:
            return value
        if op in (":?", "?"):
            return Unknown("${" + body + "}", line, "stops the script when unset")
        default = self._word(word, line)
        if op in (":=", "="):
            self.env[name] = Var(default, None, line)
        return default

    def _default_var(self, got: Value, var: Var | None, value: Value, rest: str, body: str,
                     pos: int, line: int) -> Var | None:
        """The variable a default operator's value comes from: N's own when N is set, else
        one standing for the default that is used (``4`` of ``${N:-4}``) with where that
        literal is written in the main script, so that a fix edits it; None otherwise."""
        op = next((o for o in _DEFAULT_OPS if rest.startswith(o)), "")
        word = rest[len(op):]
        unset = value is None or (op.startswith(":") and value == "")
        if op in (":-", "-", ":=", "=") and not unset and got == value:
            return var
        if op not in (":-", "-", ":=", "=") or not unset or got != word or not getattr(
                self, "main", False) or not re.fullmatch(r"[\w.+-]+", word):
            return None
        start = pos + 2 + len(body) - len(rest) + len(op)
        text = self.prep.text
        if text[pos:pos + 2] != "${" or text[start:start + len(word)] != word:
            return None
        var = Var(word, (start, start + len(word)), line)
        if op in (":=", "="):
            self.env[body[:len(body) - len(rest)]] = var
        return var

    def _word(self, text: str, line: int) -> Value:
        if not text:
            return ""
        words = self.expand_text(text, -1)
        return " ".join(w.raw for w in words)

    def arithmetic(self, expr: str, pos: int) -> Value:
        return arithmetic(expr, self, self.line(pos))


def shell_test(args: list[Any]) -> bool | None:
    """``[ ... ]`` / ``test ...`` when every operand is known; None otherwise."""
    if args and args[-1] in ("]", "]]"):
        args = args[:-1]
    if any(isinstance(a, Unknown) for a in args):
        return None
    negate = bool(args) and args[0] == "!"
    args = args[1:] if negate else args
    result: bool | None = None
    if len(args) == 1:
        result = args[0] != ""
    elif len(args) == 2 and args[0] in ("-z", "-n"):
        result = (args[1] == "") == (args[0] == "-z")
    elif len(args) == 3:
        a, op, b = args
        ints = {"-eq": lambda x, y: x == y, "-ne": lambda x, y: x != y,
                "-gt": lambda x, y: x > y, "-ge": lambda x, y: x >= y,
                "-lt": lambda x, y: x < y, "-le": lambda x, y: x <= y}
        if op in ("=", "=="):
            result = a == b
        elif op == "!=":
            result = a != b
        elif op in ints and a.lstrip("-").isdigit() and b.lstrip("-").isdigit():
            result = ints[op](int(a), int(b))
    if result is None:
        return None
    return result != negate
