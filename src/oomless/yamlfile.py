"""The one YAML reader of oomless: every YAML file (run configurations, the files
``check`` reads, the web page's pastes) goes through :func:`parse_yaml_with_lines`.

Safe types only (``SafeLoader``), the text size-bounded, nesting and the number of
values checked on the event stream before anything is composed, then the node graph
(where every alias is one shared node) checked before the document is built: alias
cycles, alias expansion, keys that are not names, a key given twice (YAML would keep
the last value without a word) and a tab after ``key:``. Every refusal is a
ConfigError naming the file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError


def _key_lines(node: Any, prefix: str = "") -> dict[str, int]:
    """Map dotted keys of a composed YAML mapping to 1-based line numbers."""
    import yaml

    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = key_node.start_mark.line + 1
            out.update(_key_lines(value_node, key + "."))
    return out


# A YAML file is a tree of nodes; anchors and aliases let a short file name the
# same subtree many times. Configuration files hold hundreds of nodes: above
# these bounds, the file is refused before anything builds or walks the
# expanded tree (a 352-byte "billion laughs" expands to 10^9 nodes).
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_yaml_tree(root: Any, path: str | Path, text: str) -> None:
    """Refuse alias cycles, expansion beyond MAX_YAML_NODES, deep nesting and the keys
    :func:`_check_mapping_keys` refuses — on the node graph, where every alias is one
    shared node."""
    import yaml

    expanded: dict[int, int] = {}  # node id -> nodes it stands for, aliases expanded
    depth_of: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    active: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            active.discard(key)
            kids = _yaml_children(node)
            expanded[key] = 1 + sum(expanded[id(k)] for k in kids)
            depth_of[key] = 1 + max((depth_of[id(k)] for k in kids), default=0)
            if expanded[key] > MAX_YAML_NODES:  # the file itself holds fewer (event count)
                raise ConfigError(
                    f"'{path}': its anchors and aliases expand to more than "
                    f"{MAX_YAML_NODES:,} values (line {node.start_mark.line + 1}); a "
                    "configuration file is far smaller: remove the repeated aliases")
            if depth_of[key] > MAX_YAML_DEPTH:
                raise ConfigError(f"'{path}': nested more than {MAX_YAML_DEPTH} levels deep "
                                  f"(line {node.start_mark.line + 1})")
            continue
        if key in expanded:
            continue
        if key in active:
            raise ConfigError(f"'{path}': an alias refers to itself (line "
                              f"{node.start_mark.line + 1}); recursive YAML is not a configuration")
        active.add(key)
        stack.append((node, True))
        if isinstance(node, yaml.MappingNode):
            _check_mapping_keys(node, path, text)
        stack.extend((k, False) for k in _yaml_children(node) if id(k) not in expanded)


def _check_mapping_keys(node: Any, path: str | Path, text: str) -> None:
    """Every key is a name, appears once (YAML would keep the last value without a word)
    and is followed by ``:`` and a space, not a tab (libyaml accepts the tab, PyYAML's own
    scanner does not: the two readers of the same file would disagree)."""
    import yaml

    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not (isinstance(key_node, yaml.ScalarNode)
                and key_node.tag in (_STR_TAG, _MERGE_TAG)):
            raise ConfigError(f"{path}:{line}: a key must be a name; got "
                              f"{key_node.tag.rsplit(':', 1)[-1]} {_short(key_node)} (quote it)")
        if key_node.tag == _STR_TAG:
            if key_node.value in seen:
                raise ConfigError(
                    f"{path}:{line}: key '{key_node.value}' appears twice (first on line "
                    f"{seen[key_node.value]}); YAML would keep only the last value: remove "
                    "one of them")
            seen[key_node.value] = line
        gap = text[key_node.end_mark.index:value_node.start_mark.index]
        if "\t" in gap.split("\n", 1)[0].split("#", 1)[0]:
            raise ConfigError(f"{path}:{line}: a tab after '{key_node.value}:'; YAML separates "
                              "a key from its value with spaces: replace the tab with a space")


def _yaml_children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _short(node: Any) -> str:
    value = node.value if isinstance(node.value, str) else "[...]"
    return repr(value if len(value) <= 40 else value[:37] + "...")


def load_yaml_with_lines(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a YAML configuration file: UTF-8, size-bounded, then as parse_yaml_with_lines."""
    from .fileio import MAX_CONFIG_BYTES, read_text

    text = read_text(path, "configuration", ConfigError, MAX_CONFIG_BYTES)
    return parse_yaml_with_lines(text, path)


def _yaml_loader() -> Any:
    """libyaml's safe loader when PyYAML was built with it (fast), else the Python one."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_yaml_nesting(text: str, path: str | Path) -> None:
    """Refuse nesting deeper than MAX_YAML_DEPTH and more than MAX_YAML_NODES values as
    written (an alias counts once) from the event stream (iterative), before any recursive
    composer runs: deep nesting overflows PyYAML's (and libyaml's) stack."""
    import yaml

    loader = _yaml_loader()(text)
    depth = values = 0
    try:
        while not loader.check_event(yaml.StreamEndEvent):
            event = loader.get_event()
            values += isinstance(event, yaml.NodeEvent)
            if values > MAX_YAML_NODES:
                raise ConfigError(f"'{path}' holds more than {MAX_YAML_NODES:,} values (line "
                                  f"{event.start_mark.line + 1}); a configuration file is far "
                                  "smaller")
            if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise ConfigError(f"{path}:{event.start_mark.line + 1}: nested more than "
                                      f"{MAX_YAML_DEPTH} levels deep; not a configuration")
            elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
                depth -= 1
    finally:
        loader.dispose()


def parse_yaml_with_lines(text: str, path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """A YAML mapping and the line of every dotted key; errors name the file.

    The one YAML entry point of oomless: safe types only (``SafeLoader``), the text
    size-bounded, nesting checked on the event stream, and the node graph checked
    (:func:`_check_yaml_tree`) before the document is built or its keys are walked.
    """
    import yaml

    from .fileio import MAX_CONFIG_BYTES

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"'{path}' is {len(text):,} characters; a configuration file is "
                          f"at most {MAX_CONFIG_BYTES:,}")
    loader = None
    try:
        _check_yaml_nesting(text, path)
        loader = _yaml_loader()(text)
        root = loader.get_single_node()
        if root is None:
            return {}, {}
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise ConfigError(f"'{path}': expected a mapping of keys at the top level, "
                              f"got {kind}")
        _check_yaml_tree(root, path, text)
        data = loader.construct_document(root)
        lines = _key_lines(root)
    except yaml.YAMLError as err:
        raise ConfigError(f"'{path}' is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"'{path}': nested too deeply to be a configuration") from None
    except (ValueError, TypeError, OverflowError) as err:  # int/timestamp constructors
        raise ConfigError(f"'{path}': a value cannot be read ({err})") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines
