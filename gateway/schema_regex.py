"""JSON Schema's regular expressions (ECMA-262) read with Python's ``re``.

A schema's ``pattern``s and ``patternProperties`` keys are ECMA-262 regexes, which
jsonschema compiles with Python's ``re``: in the meta-schema's ``format: regex`` check and
when it validates an instance (a strict function's arguments). ``re`` spells a named group
``(?P<name>...)``, so ECMA's ``(?<name>...)``, which xgrammar enforces, was "not a 'regex'".
The check and the schema copy here read it as ECMA does. The scan of a pattern's groups also
finds what xgrammar's JSON-schema converter drops: a lookahead.

A client's regex run against text it chose (a strict function's arguments, an ``enum``
value) must not run under ``re``: it backtracks without bound (``^(a+)+$`` against 30 a's
and a ``!`` takes minutes) and holds the GIL meanwhile, so every stream stalls, even when
the check runs in a thread. ``bounded`` validators run them with the ``regex`` module,
which stops at a time limit and lets go of the GIL while it matches. It compiles a repeat by
writing its minimum count out, copy by copy, where ``re`` keeps one copy and the count:
``a{4294967294}``, 14 bytes of schema, would take all the machine's memory. A regex whose
counts write out more than ``MAX_REPEAT_COPIES`` is not run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import re._constants as _sre
import re._parser as _parser
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import regex
from jsonschema import FormatChecker, ValidationError
from referencing import Registry


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


_Errors = Iterator[ValidationError]  # what a keyword's check yields


class RegexTooSlow(ValueError):
    """A schema's regexes took longer than their budget on an instance (``regex_budget``),
    or one cannot be run here: the instance cannot be shown valid."""


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("regex_deadline", default=None)
REGEX_BUDGET_S = 0.1  # all of one check's regexes: a schema's own take microseconds


@contextlib.contextmanager
def regex_budget(seconds: float = REGEX_BUDGET_S) -> Iterator[None]:
    """The time the ``bounded`` validators' regexes may take together within the block."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


MAX_REPEAT_COPIES = 5000  # about 3 MB compiled; a schema's own counts are far lower
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def repeat_copies(pattern: str) -> int:
    """How many more nodes than it spells ``pattern`` has once each repeat's minimum count
    is written out (``(ab){3}`` as ``ababab``: 4; nested counts multiply), read by ``re``'s
    parser, as the meta-schema check reads it (``re.error``: not a regex)."""
    tree = _parser.parse(python_regex(pattern))
    return _written(tree, unrolled=True) - _written(tree, unrolled=False)


def _written(items: Any, unrolled: bool) -> int:
    size = 0
    for op, arg in items:
        if op in _REPEATS:
            least, _, item = arg
            size += _written(item, unrolled) * (max(least, 1) if unrolled else 1)
        else:  # a node, and the patterns in it (a group's, an alternation's branches...)
            size += 1 + sum(_written(sub, unrolled) for sub in _inner(arg))
    return size


def _inner(arg: Any) -> Iterator[Any]:
    if isinstance(arg, _parser.SubPattern):
        yield arg
    elif isinstance(arg, tuple | list):
        for part in arg:
            yield from _inner(part)


@functools.lru_cache(maxsize=32)  # at most ~100 MB, where the module's own cache keeps 500
def _compiled(pattern: str) -> Any:
    """``pattern`` compiled by the regex module; one that repeats too much, or that ``re``
    cannot read, is not (``RegexTooSlow``)."""
    try:
        copies = repeat_copies(pattern)
    except (re.error, RecursionError) as exc:
        raise RegexTooSlow(f"a regex of the schema cannot be run: {exc}") from None
    if copies > MAX_REPEAT_COPIES:
        raise RegexTooSlow(f"a regex of the schema repeats more than {MAX_REPEAT_COPIES} times in all")
    return regex.compile(pattern, cache_pattern=False)


def _search(pattern: str, text: str) -> bool:
    deadline = _DEADLINE.get()
    left = (deadline - time.monotonic()) if deadline is not None else REGEX_BUDGET_S
    if left <= 0:
        raise RegexTooSlow(f"the schema's regexes took longer than {REGEX_BUDGET_S:g} s")
    try:
        return _compiled(pattern).search(text, timeout=left) is not None
    except TimeoutError:
        raise RegexTooSlow(f"the schema's regexes took longer than {REGEX_BUDGET_S:g} s") from None
    except regex.error as exc:
        raise RegexTooSlow(f"a regex of the schema cannot be run: {exc}") from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> _Errors:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _matched(schema: Any, name: str) -> bool:
    patterns = schema.get("patternProperties", {})
    return isinstance(patterns, dict) and any(_search(p, name) for p in patterns)


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> _Errors:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> _Errors:
    if not validator.is_type(instance, "object"):
        return
    declared = schema.get("properties", {})
    extras = [k for k in instance if k not in declared and not _matched(schema, k)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        yield ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, extras))})")


def _unevaluated_properties(validator: Any, value: Any, instance: Any, schema: Any) -> _Errors:
    # jsonschema finds the keys that ``patternProperties`` evaluated with ``re``, through every
    # subschema: where a schema has both, an object is not judged.
    if validator.is_type(instance, "object"):
        raise RegexTooSlow("unevaluatedProperties beside patternProperties is not checked here")
    yield from ()


@functools.cache
def _bounded(cls: Any, unevaluated: bool) -> type[Any]:
    keywords = {
        "pattern": _pattern,
        "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
    }
    if unevaluated:
        keywords["unevaluatedProperties"] = _unevaluated_properties
    extended: type[Any] = jsonschema.validators.extend(cls, keywords)
    return extended


def bounded_validator(schema: dict[str, Any], cls: type[Any] | None = None) -> Any:
    """A validator of ``schema`` (``cls``, else the draft its ``$schema`` names) that runs its
    regexes with a time bound: within a ``regex_budget``, more time than it gives raises
    ``RegexTooSlow`` (a ``ValueError``). An empty registry: a remote ``$ref`` is never fetched."""
    draft: Any = cls or jsonschema.validators.validator_for(schema)
    text = json.dumps(schema)
    unevaluated = "unevaluatedProperties" in text and "patternProperties" in text
    return _bounded(draft, unevaluated)(schema, registry=Registry())
