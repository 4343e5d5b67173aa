"""A shell reading of a launch script, with a real shell parser (bashlex), never run.

The script is parsed into bashlex's syntax tree and evaluated as bash would with
no arguments given: assignments and ``export``, ``${VAR:-x}`` and the other
default forms, ``$((...))`` arithmetic, arrays, ``if``/``&&`` on tests it can
decide, argument loops (``for a in "$@"``, ``while [[ "$1" != "" ]]``: zero
turns), functions, heredocs (``cat <<EOF > ds.json``, ``read -d '' VAR <<EOF``),
``source`` of a sibling file, line continuations and word splitting. What only
running can tell (``$(python -c '...device_count()')``, a variable from the
environment) stays an :class:`Unknown` that names its text and line, never a
made-up value. Every command met is kept, with the words it would run and where
each literal is written (for editing the same characters later).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bashlex

from ...errors import ConfigError
from . import shellprep
from .shellwords import WordsMixin, shell_test
from .values import Unknown, Var, Word

MAX_DEPTH = 8  # functions and sourced files within each other
MAX_TURNS = 32  # turns of a `for` loop over literal words


@dataclass
class Command:
    argv: list[Word]
    prefix: dict[str, Var]  # NAME=value written before the command
    env: dict[str, Var]  # the variables when it runs
    line: int
    end: int  # offset just after its last word (main file), -1 elsewhere


@dataclass
class ShellScript:
    path: Path
    text: str
    commands: list[Command] = field(default_factory=list)
    variables: dict[str, Var] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # what the reading did not evaluate
    files: dict[str, str] = field(default_factory=dict)  # written by heredocs
    unknowns: list[Unknown] = field(default_factory=list)

    def mark(self, unknown: Unknown) -> str:
        """A value only running can tell, kept inside a string ("--nproc_per_node \0 0\0
        --nnodes 1") so that the known words around it survive word splitting."""
        self.unknowns.append(unknown)
        return f"\0{len(self.unknowns) - 1}\0"

    def resolve(self, value: Any) -> Any:
        """A string with marks is the first unknown it holds; lists and plain strings as is."""
        if isinstance(value, str) and "\0" in value:
            return self.unknowns[int(value.split("\0")[1])]
        return value

    def value(self, name: str, env: dict[str, Var] | None = None) -> Any:
        var = (self.variables if env is None else env).get(name)
        return None if var is None else self.resolve(var.value)


def read_shell(text: str, path: Path) -> ShellScript:
    """The evaluation of a whole script (ConfigError when bashlex cannot parse it)."""
    script = ShellScript(path, text)
    _Evaluator(script, text, path, main=True).run()
    return script


class _Evaluator(WordsMixin):
    def __init__(self, script: ShellScript, text: str, path: Path, main: bool,
                 depth: int = 0) -> None:
        self.script, self.text, self.path, self.main, self.depth = script, text, path, main, depth
        self.env = script.variables
        self.positional: list[str] = []
        self.functions: dict[str, Any] = {}
        self.stopped = False
        self.prep = shellprep.prepare(text)

    # ---- entry --------------------------------------------------------------------------
    def run(self) -> None:
        for node in self._parse(self.prep.text):
            if self.stopped:
                break
            self.node(node)

    def _parse(self, work: str) -> list[Any]:
        try:
            return bashlex.parse(work)
        except (bashlex.errors.ParsingError, NotImplementedError, IndexError, AttributeError,
                TypeError, ValueError) as err:
            where = getattr(err, "position", None)
            line = f" (line {work.count(chr(10), 0, where) + 1})" if where is not None else ""
            raise ConfigError(f"{self.path}: the shell parser cannot read this script{line}: "
                              f"{err}; oomless reads scripts without running them — pass the "
                              "run's settings as a configuration file or with --model / "
                              "--method / --seq-len") from None

    def line(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1

    # ---- nodes -------------------------------------------------------------------------
    def node(self, node: Any) -> bool | None:
        """Evaluate one node; its exit status when known (True: success)."""
        kind = node.kind
        if kind == "command":
            return self.command(node)
        if kind == "list":
            return self.sequence(node.parts)
        if kind == "pipeline":
            status = None
            for part in node.parts:
                if part.kind != "pipe":
                    status = self.node(part)
            return status
        if kind == "compound":
            return self.compound(node)
        if kind == "function":
            self.functions[node.parts[0].word] = node.parts[-1]
            return True
        if kind in ("if", "for", "while", "until"):
            return getattr(self, f"do_{kind}")(node)
        return None

    def sequence(self, parts: list[Any]) -> bool | None:
        status: bool | None = True
        gate = ""
        for part in parts:
            if self.stopped:
                break
            if part.kind == "operator":
                gate = part.op
                continue
            if gate == "&&" and status is False or gate == "||" and status is True:
                continue
            if gate in ("&&", "||") and status is None:
                self.branches([part], [])
                status = None
                continue
            status = self.node(part)
        return status

    def compound(self, node: Any) -> bool | None:
        inner = [p for p in node.list if p.kind != "reservedword"]
        status = None
        for part in inner:
            status = self.node(part)
        return status

    def do_if(self, node: Any) -> bool | None:
        parts = node.parts
        i = 0
        while i < len(parts):
            word = parts[i].word if parts[i].kind == "reservedword" else ""
            if word in ("if", "elif"):
                status = self.node(parts[i + 1])
                body = parts[i + 3]
                rest = parts[i + 4:]
                if status is True:
                    return self.node(body)
                if status is None:
                    self.branches([body], _else_parts(rest), parts[i + 1])
                    return None
                i += 4
                continue
            if word == "else":
                return self.node(parts[i + 1])
            i += 1
        return True

    def branches(self, then: list[Any], otherwise: list[Any], cond: Any = None) -> None:
        """Both ways of a test the reading cannot decide: variables that differ become unknown."""
        before = dict(self.env)
        for part in then:
            self.node(part)
        after_then = dict(self.env)
        self.env.clear()
        self.env.update(before)
        for part in otherwise:
            self.node(part)
        where = self.line(cond.pos[0]) if cond is not None else self.line(then[0].pos[0])
        for name in set(after_then) | set(self.env):
            a, b = after_then.get(name), self.env.get(name)
            if a is None or b is None or a.value != b.value:
                self.env[name] = Var(Unknown(name, where, "is set by a test the reading "
                                     "cannot decide without running"), None, where)

    def do_for(self, node: Any) -> bool | None:
        parts = node.parts
        name = parts[1].word
        words_at = [p for p in parts[3:] if p.kind == "word"] if parts[2].word == "in" else []
        body = next(p for p in parts if p.kind not in ("reservedword", "word"))
        items: list[str | Unknown] = [w.value for p in words_at for w in self.expand(p)]
        if any(isinstance(v, Unknown) for v in items):
            self.script.skipped.append(f"line {self.line(node.pos[0])}: a `for` loop over "
                                       "values known only when the script runs")
            return None
        for value in items[:MAX_TURNS]:
            self.env[name] = Var(value, None, self.line(node.pos[0]))
            self.node(body)
        return True

    def do_while(self, node: Any) -> bool | None:
        status = self.node(node.parts[1])
        if status is not False:  # an argument loop with no arguments: zero turns
            self.script.skipped.append(f"line {self.line(node.pos[0])}: a `while` loop "
                                       "(not run: its condition is known only when it runs)")
        return True

    do_until = do_while

    # ---- simple commands ----------------------------------------------------------------
    def command(self, node: Any) -> bool | None:
        assigns = [p for p in node.parts if p.kind == "assignment"]
        words = [p for p in node.parts if p.kind == "word"]
        redirects = [p for p in node.parts if p.kind == "redirect"]
        if not words:
            for a in assigns:
                self.assign_word(a)
            return True
        prefix = {}
        for a in assigns:
            name, var = self.assignment(a)
            prefix[name] = var
        argv = [w for p in words for w in self.expand(p)]
        name = argv[0].value if argv else ""
        heredoc = next((r.heredoc for r in redirects if getattr(r, "heredoc", None)), None)
        if heredoc is not None:
            self.heredoc(name, argv, redirects, heredoc)
        if name in ("export", "declare", "local", "readonly", "typeset"):
            for p in words[1:]:
                if "=" in p.word and not p.word.startswith("-"):
                    self.assign_word(p)
            return True
        if name in ("source", "."):
            return self.source(argv[1:])
        if name == "shift":
            self.positional = self.positional[1:]
            return True
        if name == "exit":
            self.stopped = True
            return True
        if name in ("[", "test", "[["):
            return shell_test([w.value for w in argv[1:]])
        if name in ("true", ":"):
            return self.special(argv)
        if name == "false":
            return False
        if isinstance(name, str) and name in self.functions:
            return self.call(name, argv[1:])
        self.script.commands.append(Command(
            argv, prefix, dict(self.env), self.line(node.pos[0]),
            node.pos[1] if self.main else -1))
        return True

    def special(self, argv: list[Word]) -> bool:
        """``: @@N``: a case statement the parser did not read (shellprep)."""
        for w in argv[1:]:
            m = shellprep.PLACEHOLDER.fullmatch(str(w.value))
            if m:
                self.case(self.prep.specials[int(m.group(1))])
        return True

    def case(self, special: shellprep.Special) -> None:
        from .shellmath import case_arms

        line = self.line(special.start)
        subject_words = self.expand_text(special.body.split(None, 2)[1], special.start)
        subject = subject_words[0].value if subject_words else ""
        if isinstance(subject, Unknown):
            self.script.skipped.append(f"line {line}: a `case` on {subject.describe()}")
            return
        for patterns, start, end in case_arms(special.body):
            if any(fnmatch.fnmatchcase(subject, p.strip().strip("\"'")) for p in patterns):
                self.nested(_only(self.text, special.start + start, special.start + end))
                return

    def nested(self, text: str) -> None:
        """Evaluate a piece of this script (the rest blanked: offsets stay true)."""
        if not text.strip():
            return
        sub = _Evaluator(self.script, text, self.path, self.main, self.depth)
        sub.env, sub.positional, sub.functions = self.env, self.positional, self.functions
        sub.run()
        self.positional, self.stopped = sub.positional, sub.stopped

    def call(self, name: str, args: list[Word]) -> bool | None:
        if self.depth >= MAX_DEPTH:
            return None
        saved = self.positional
        self.positional = [a.value if isinstance(a.value, str) else "" for a in args]
        self.depth += 1
        try:
            return self.node(self.functions[name])
        finally:
            self.depth -= 1
            self.positional = saved

    def source(self, args: list[Word]) -> bool | None:
        if not args or isinstance(args[0].value, Unknown):
            self.script.skipped.append("a `source` of a file named only when the script runs")
            return None
        target = Path(args[0].value).expanduser()
        for base in (self.path.parent, Path.cwd()):
            found = target if target.is_absolute() else base / target
            if found.is_file() and self.depth < MAX_DEPTH:
                from ...fileio import MAX_CONFIG_BYTES, read_text

                text = read_text(found, "sourced script", ConfigError, MAX_CONFIG_BYTES)
                sub = _Evaluator(self.script, text, found, main=False, depth=self.depth + 1)
                sub.env = self.env
                sub.run()
                return True
        self.script.skipped.append(f"`source {args[0].value}`: no such file next to "
                                   f"{self.path.name} or in the working directory")
        return None

    def heredoc(self, name: Any, argv: list[Word], redirects: list[Any], heredoc: Any) -> None:
        body = heredoc.value.rsplit("\n", 1)[0] + "\n" if "\n" in heredoc.value else ""
        # a body with no expansion, quote or escape is the script's own characters (the
        # preparation blanks line continuations in place): a fix may edit its words
        literal = self.main and not any(c in body for c in "$`\\\"'")
        at = heredoc.pos[0] + len(body) - len(body.lstrip("\n")) if literal else -1
        quoted = any(getattr(r, "output", None) is not None and r.type in ("<<", "<<-") and
                     any(q in r.output.word for q in "'\"") for r in redirects)
        if not quoted:
            body = body.replace("\\\n", "")
            expanded = self.expand_text('"' + body.replace('"', '\\"') + '"', -1)
            if expanded and isinstance(expanded[0].value, str):
                body = expanded[0].value
        if name == "read":
            target = [w.value for w in argv[1:] if isinstance(w.value, str)
                      and re.fullmatch(r"[A-Za-z_]\w*", w.value)]
            if target:
                self.env[target[-1]] = Var(body.strip("\n"), None, self.line(heredoc.pos[0]),
                                           at)
            return
        for r in redirects:
            if r.type in (">", ">|") and getattr(r, "output", None) is not None:
                out = self.expand(r.output)
                if out and isinstance(out[0].value, str):
                    self.script.files[out[0].value] = body

    # ---- assignments --------------------------------------------------------------------
    def assignment(self, node: Any) -> tuple[str, Var]:
        raw = self.prep.text[node.pos[0]:node.pos[1]]
        name = re.match(r"[A-Za-z_]\w*", raw).group(0)
        append = raw[len(name):].startswith("+=")
        value_at = node.pos[0] + len(name) + (2 if append else 1)
        line = self.line(node.pos[0])
        m = shellprep.PLACEHOLDER.fullmatch(raw[value_at - node.pos[0]:])
        if m and self.prep.specials[int(m.group(1))].kind == "array":
            items = self.expand_text(self.prep.specials[int(m.group(1))].body, -1)
            return name, Var([w.value for w in items], None, line)
        words = self.expand(node, value_from=value_at, split=False)
        value = words[0].raw if words else ""
        if append and isinstance(value, str):
            old = self.env.get(name)
            value = (old.value if old and isinstance(old.value, str) else "") + value
        span = words[0].span if words and self.main and not append else None
        return name, Var(value, span, line)

    def assign_word(self, node: Any) -> None:
        name, var = self.assignment(node)
        self.env[name] = var


def _else_parts(rest: list[Any]) -> list[Any]:
    """What runs when the test is false: the elif/else chain as nodes to evaluate."""
    out: list[Any] = []
    for i, p in enumerate(rest):
        if p.kind == "reservedword" and p.word == "else":
            out.append(rest[i + 1])
            break
        if p.kind == "reservedword" and p.word == "elif":
            out.extend(x for x in rest[i + 1:] if x.kind != "reservedword")
            break
    return out


def _only(text: str, start: int, end: int) -> str:
    """``text`` with everything outside [start, end) blanked (line breaks kept)."""
    return "".join(c if start <= i < end or c == "\n" else " " for i, c in enumerate(text))
