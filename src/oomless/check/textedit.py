"""Minimal edits of YAML, JSON and launch-script files, keeping every other byte
(comments, order, formatting), and the unified diff of an edit.

A value is replaced in place (the text span of its node); a missing key is
inserted after the last entry of its mapping, with that mapping's indentation,
creating missing parent mappings on the way.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from ..errors import ConfigError


def unified_diff(old: str, new: str, name: str) -> str:
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                 fromfile=f"a/{name}", tofile=f"b/{name}")
    # a last line without a newline is marked as GNU diff marks it, so that patch(1)
    # applies the diff to the file as it is
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)


def new_file_diff(text: str, name: str) -> str:
    """The unified diff that creates ``name`` with ``text`` (``patch -p1`` creates it)."""
    lines = text.splitlines(keepends=True)
    body = "".join("+" + line for line in lines)
    return f"--- /dev/null\n+++ b/{name}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


# ---- YAML -----------------------------------------------------------------------
def yaml_scalar(value: Any) -> str:
    """One-line YAML for a value (flow style for lists and mappings)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _yaml_child(node: Any, key: str) -> tuple[Any, Any] | None:
    for k, v in node.value:
        if k.value == key:
            return k, v
    return None


def _line_end(text: str, index: int) -> int:
    """Index just after the line that contains ``index - 1`` (its newline included)."""
    if index > 0 and text[index - 1] == "\n":
        return index
    nl = text.find("\n", index)
    return len(text) if nl < 0 else nl + 1


def _content_end(text: str, index: int) -> int:
    """Just after the last line before ``index`` that holds content: a block
    node's end mark lies past its trailing blank and comment lines."""
    at = _line_end(text, index)
    while at > 0:
        start = text.rfind("\n", 0, at - 1) + 1
        line = text[start:at].strip()
        if line and not line.startswith("#"):
            break
        at = start
    return at


def _nested_yaml(keys: list[str], value: Any, indent: int) -> str:
    lines = []
    for depth, key in enumerate(keys[:-1]):
        lines.append(" " * (indent + 2 * depth) + f"{key}:")
    lines.append(" " * (indent + 2 * (len(keys) - 1)) + f"{keys[-1]}: {yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _yaml_insert(text: str, mapping: Any, keys: list[str], value: Any) -> str:
    if mapping.flow_style:
        raise ConfigError(f"cannot add '{keys[0]}' to a flow-style mapping; edit it by hand")
    if mapping.value:
        indent = mapping.value[0][0].start_mark.column
        at = _content_end(text, mapping.value[-1][1].end_mark.index)
    else:
        indent, at = 0, len(text)
    if at == len(text) and text and not text.endswith("\n"):
        text += "\n"
        at += 1
    return text[:at] + _nested_yaml(keys, value, indent) + text[at:]


def set_yaml(text: str, path: tuple[str, ...], value: Any) -> str:
    """The YAML text with the value at ``path`` set (replaced or inserted)."""
    import yaml

    root = yaml.compose(text) if text.strip() else None
    if root is None:
        return text + _nested_yaml(list(path), value, 0)
    node = root
    for depth, key in enumerate(path):
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"'{'.'.join(path[:depth])}' is not a mapping; cannot set "
                              f"'{'.'.join(path)}'")
        hit = _yaml_child(node, key)
        if hit is None:
            return _yaml_insert(text, node, list(path[depth:]), value)
        node = hit[1]
    start, end = node.start_mark.index, node.end_mark.index
    new = yaml_scalar(value)
    if text[start:end].endswith("\n"):  # block collections end after their newline
        new += "\n"
    return text[:start] + new + text[end:]


# ---- JSON -----------------------------------------------------------------------
class JsonSpans:
    """Positions of every value in a JSON text: path -> (start, end); objects
    also record where their closing brace is and their members' indentation."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values: dict[tuple[str, ...], tuple[int, int]] = {}
        self.objects: dict[tuple[str, ...], dict[str, Any]] = {}
        self.decoder = json.JSONDecoder()
        end = self._value(self._ws(0), ())
        if self._ws(end) != len(text):
            raise ConfigError("trailing text after the JSON value")

    def _ws(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in " \t\r\n":
            i += 1
        return i

    def _value(self, i: int, path: tuple[str, ...]) -> int:
        if i < len(self.text) and self.text[i] == "{":
            end = self._object(i, path)
        elif i < len(self.text) and self.text[i] == "[":
            end = self._array(i, path)
        else:
            _, end = self.decoder.raw_decode(self.text, i)
        self.values[path] = (i, end)
        return end

    def _array(self, i: int, path: tuple[str, ...]) -> int:
        i = self._ws(i + 1)
        n = 0
        while self.text[i] != "]":
            i = self._ws(self._value(i, path + (str(n),)))
            n += 1
            if self.text[i] == ",":
                i = self._ws(i + 1)
        return i + 1

    def _object(self, i: int, path: tuple[str, ...]) -> int:
        info: dict[str, Any] = {"last_end": None, "indent": None, "open": i}
        i = self._ws(i + 1)
        while self.text[i] != "}":
            key, after = self.decoder.raw_decode(self.text, i)
            if info["indent"] is None:
                info["indent"] = i - (self.text.rfind("\n", 0, i) + 1)
            i = self._ws(after)
            if self.text[i] != ":":
                raise ConfigError(f"expected ':' after key \"{key}\"")
            i = self._ws(self._value(self._ws(i + 1), path + (key,)))
            info["last_end"] = self.values[path + (key,)][1]
            if self.text[i] == ",":
                i = self._ws(i + 1)
        info["close"] = i
        self.objects[path] = info
        return i + 1


def _json_member(key: str, value: Any) -> str:
    return f"{json.dumps(key)}: {json.dumps(value)}"


def set_json(text: str, path: tuple[str, ...], value: Any) -> str:
    """The JSON text with the value at ``path`` set (replaced or inserted). Comments and
    trailing commas (JSONC) stay: positions come from the blanked text (check/jsonc.py)."""
    from .jsonc import blank

    spans = JsonSpans(blank(text))
    if path in spans.values:
        start, end = spans.values[path]
        return text[:start] + json.dumps(value) + text[end:]
    depth = len(path) - 1
    while path[:depth] not in spans.objects:
        depth -= 1
    parent = spans.objects[path[:depth]]
    nested: Any = value
    for key in reversed(path[depth + 1:]):
        nested = {key: nested}
    member = _json_member(path[depth], nested)
    if parent["last_end"] is None:
        pad = " " * (2 * (depth + 1))
        at = parent["close"]
        return text[:parent["open"] + 1] + f"\n{pad}{member}\n" + " " * (2 * depth) + text[at:]
    at = parent["last_end"]
    return text[:at] + ",\n" + " " * (parent["indent"] or 0) + member + text[at:]


def set_value(src: Any, text: str, path: tuple[str, ...], value: Any) -> str:
    """``text`` (the current text of ``src``'s file) with ``path`` set to ``value``."""
    if src.fmt == "json":
        return set_json(text, path, value)
    if src.fmt == "sh":
        from .shellargs import parse_launch, set_shell_arg

        return set_shell_arg(text, parse_launch(text, str(src.path)), path[-1], value)
    return set_yaml(text, path, value)
