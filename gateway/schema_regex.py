"""JSON Schema's regular expressions (ECMA-262) read with Python's ``re``.

A schema's ``pattern``s and ``patternProperties`` keys are ECMA-262 regexes, which
jsonschema compiles with Python's ``re``: in the meta-schema's ``format: regex`` check and
when it validates an instance (a strict function's arguments). ``re`` spells a named group
``(?P<name>...)``, so ECMA's ``(?<name>...)``, which xgrammar enforces, was "not a 'regex'".
The check and the schema copy here read it as ECMA does. The scan of a pattern's groups also
finds what xgrammar's JSON-schema converter drops: a lookahead.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema import FormatChecker


def group_openings(pattern: str) -> Iterator[int]:
    """Where ``pattern`` opens a group: each ``(`` neither escaped nor in a character class."""
    escaped = in_class = False
    for i, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            yield i


def has_lookahead(pattern: str) -> bool:
    """Whether ``pattern`` has a lookahead group, ``(?=`` or ``(?!``."""
    return any(pattern.startswith(("(?=", "(?!"), i) for i in group_openings(pattern))


def python_regex(pattern: str) -> str:
    """``pattern`` as Python's ``re`` spells it: a named group ``(?<name>`` is ``(?P<name>``
    (a look-behind, ``(?<=`` or ``(?<!``, is spelled alike)."""
    named = [
        i
        for i in group_openings(pattern)
        if pattern.startswith("(?<", i) and not pattern.startswith(("(?<=", "(?<!"), i)
    ]
    for i in reversed(named):
        pattern = f"{pattern[: i + 2]}P{pattern[i + 2 :]}"
    return pattern


def _is_regex(instance: object) -> bool:
    if isinstance(instance, str):
        re.compile(python_regex(instance))  # re.error: not a regex
    return True


@functools.cache
def format_checker(base: FormatChecker) -> FormatChecker:
    """``base`` (a draft's checker) with ``format: regex`` read as ECMA-262."""
    checker = FormatChecker(())
    checker.checkers = {**base.checkers, "regex": (_is_regex, re.error)}
    return checker


def check_meta_schema(schema: dict[str, Any]) -> None:
    """The meta-schema's check of ``schema`` (jsonschema.SchemaError), its patterns ECMA-262."""
    cls = jsonschema.validators.validator_for(schema)
    meta = jsonschema.validators.validator_for(cls.META_SCHEMA, default=cls)
    cls.check_schema(schema, format_checker=format_checker(meta.FORMAT_CHECKER))


# Where a schema holds schemas: one, a list of them, or a map to them (the others hold data).
_ONE = frozenset(
    {
        "additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items",
        "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)  # fmt: skip
_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def python_patterns(schema: Any) -> Any:
    """``schema`` with its ``pattern``s and ``patternProperties`` keys as Python's ``re``
    spells them (``python_regex``), for jsonschema to validate instances with: it runs them
    with ``re`` (``pattern``, ``patternProperties``, ``additionalProperties``...)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            out[key] = python_regex(value)
        elif key in _MAPS and isinstance(value, dict):
            rename = python_regex if key == "patternProperties" else str
            out[key] = {rename(str(name)): python_patterns(sub) for name, sub in value.items()}
        elif key in _LISTS and isinstance(value, list):
            out[key] = [python_patterns(sub) for sub in value]
        elif key in _ONE:
            out[key] = python_patterns(value)
    return out
