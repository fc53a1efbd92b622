"""``load``: YAML as the gateway reads its own files (settings, catalog): safe, and a key
given twice in one mapping is an error. PyYAML keeps the last one silently, so a second
``engine:`` section dropped the first whole, and a repeated ``adapter:`` in a catalog entry
served whichever came last."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:  # `<<: *base` may be overridden by the keys beside it
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:
                context, problem = "while reading a mapping", f"key '{key}' is given twice"
                raise ConstructorError(context, node.start_mark, problem, key_node.start_mark)
            seen.add(key)
    yield from SafeConstructor.construct_yaml_map(loader, node)


_Loader.add_constructor("tag:yaml.org,2002:map", _mapping)


def load(text: str) -> Any:
    """The document in ``text``; ``yaml.YAMLError`` (with its line) if it is not YAML or
    repeats a key."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def describe(exc: yaml.YAMLError) -> str | None:
    """Where and what, on one line ("line 5, column 1: key 'engine' is given twice"); None
    for an error with no mark. PyYAML's own first line is only the context ("while parsing
    a flow sequence")."""
    if not isinstance(exc, yaml.MarkedYAMLError) or not exc.problem:
        return None
    mark = exc.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{exc.problem}" + (f" ({exc.context})" if exc.context else "")
