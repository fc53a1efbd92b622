"""Structured outputs: what a request (or its route) asks of the output's shape.

A request asks with OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``,
``choice``, ``grammar``); a route may declare a default ``response_format`` and enforce
it. Both become one ``Constraint`` that the engine turns into grammar-constrained
decoding. Everything is checked here, before a stream starts, so a bad schema is a 400
and never an error event after the 200: JSON schemas against their meta-schema here, and
against the engine's grammar backend in ``engine.prepare`` (which, under xgrammar, also
refuses what ``xgrammar_gap`` finds: keywords xgrammar would take and not enforce).

No vllm here, and no field is silently ignored: a key this gateway does not implement
is a 400 naming it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import jsonschema

from gateway.errors import ConfigError, InvalidRequest
from gateway.schema_regex import bounded_validator, check_meta_schema, has_lookahead, regex_budget
from gateway.types import Constraint

FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's, for a format's name (fullmatch)
# structured_outputs keys, by what this gateway does with them.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
STRUCTURED_UNSUPPORTED = (
    "structural_tag",
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_additional_properties",
    "disable_fallback",
)
# vLLM's older top-level spellings; refused rather than ignored.
_LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object")
# Keywords that describe a schema without changing what it accepts.
_ANNOTATIONS = frozenset({"title", "description", "examples", "$comment", "default"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


# The field beside ``type`` that each response_format type reads (``text``: none).
_FORMAT_FIELDS = {"json_schema": "json_schema", "json_object": "schema"}
TEXT = Constraint("text")  # plain text, asked for by name (``response_format: {"type": "text"}``)


def request_constraint(extra: Mapping[str, Any]) -> tuple[Constraint | None, str]:
    """The constraint a request body asks for, and the field it came from (the ``param``
    of any later error about it)."""
    for name in _LEGACY:
        if extra.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported; use 'structured_outputs'", param=name)
    fmt = parse_response_format(extra.get("response_format"))
    so = parse_structured_outputs(extra.get("structured_outputs"))
    if fmt not in (None, TEXT) and so is not None:
        raise InvalidRequest(
            "give either 'response_format' or 'structured_outputs', not both", param="structured_outputs"
        )
    if so is not None:
        return so, "structured_outputs"
    return fmt, "response_format"


def parse_response_format(value: Any, param: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` -> a constraint: ``text`` -> ``TEXT``, none -> None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    kind = value.get("type")
    unknown = set(value) - {"type", "json_schema", "schema"}
    if unknown:
        raise InvalidRequest(f"unknown field in '{param}': {', '.join(sorted(unknown))}", param=param)
    read = _FORMAT_FIELDS.get(kind) if isinstance(kind, str) else None
    unread = sorted(k for k in ("json_schema", "schema") if k != read and value.get(k) is not None)
    if kind in ("text", "json_object", "json_schema") and unread:  # else dropped without a word
        raise InvalidRequest(f"'{param}.{unread[0]}' does not go with type '{kind}'", param=param)
    if kind == "text":
        return TEXT
    if kind == "json_object":
        # Some clients (instructor's older JSON_SCHEMA mode, Together, Anyscale) put a
        # schema beside json_object; honour it rather than ignore it.
        if value.get("schema") is not None:
            return Constraint("json", check_schema(value["schema"], param))
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(f"'{param}.json_schema' must be an object", param=param)
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise InvalidRequest(
                f"unknown field in '{param}.json_schema': {', '.join(sorted(unknown))}", param=param
            )
        name = spec.get("name")
        if not isinstance(name, str) or not FORMAT_NAME.fullmatch(name):
            raise InvalidRequest(
                f"'{param}.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'", param=param
            )
        if not isinstance(spec.get("strict"), bool | None):  # not `in (True, False)`: 0 == False
            raise InvalidRequest(f"'{param}.json_schema.strict' must be a boolean", param=param)
        if not isinstance(spec.get("description"), str | None):
            raise InvalidRequest(f"'{param}.json_schema.description' must be a string", param=param)
        if "schema" not in spec:
            raise InvalidRequest(f"'{param}.json_schema.schema' is required", param=param)
        return Constraint("json", check_schema(spec["schema"], param))
    raise InvalidRequest(f"'{param}.type' must be one of 'text', 'json_object', 'json_schema'", param=param)


def parse_structured_outputs(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs`` -> a constraint; exactly one kind, nothing unknown."""
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    for key, item in value.items():
        if key in STRUCTURED_UNSUPPORTED and item not in (None, False):
            raise InvalidRequest(f"'{param}.{key}' is not supported by this gateway", param=param)
        if key not in STRUCTURED_KINDS and key not in STRUCTURED_UNSUPPORTED:
            raise InvalidRequest(f"unknown field '{param}.{key}'", param=param)
    given = [k for k in STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise InvalidRequest(
            f"'{param}' needs exactly one of {', '.join(STRUCTURED_KINDS)} (got {len(given)})", param=param
        )
    kind = given[0]
    item = value[kind]
    if kind == "json":
        schema = json.loads(item) if isinstance(item, str) and _is_json(item) else item
        return Constraint("json", check_schema(schema, param))
    if kind == "json_object":
        if item is not True:
            raise InvalidRequest(f"'{param}.json_object' must be true", param=param)
        return Constraint("json_object")
    if kind == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            raise InvalidRequest(f"'{param}.choice' must be a non-empty list of strings", param=param)
        if sum(len(c) for c in item) > MAX_LITERAL_CHARS:
            raise InvalidRequest(
                f"'{param}.choice' is too long: at most {MAX_LITERAL_CHARS} characters together",
                param=param,
            )
        return Constraint("choice", tuple(item))
    # Regexes and grammars are the grammar backend's dialect (not Python's ``re``): the
    # engine checks them in ``prepare``.
    if not isinstance(item, str) or not item.strip():
        raise InvalidRequest(f"'{param}.{kind}' must be a non-empty string", param=param)
    if len(item) > MAX_PATTERN_CHARS:
        raise InvalidRequest(
            f"'{param}.{kind}' is too long: at most {MAX_PATTERN_CHARS} characters", param=param
        )
    return Constraint("regex" if kind == "regex" else "grammar", item)


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema that its own meta-schema accepts; an object schema, as OpenAI requires."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"the JSON schema in '{param}' must be an object", param=param)
    try:
        problem = schema_problem(schema)
    except RecursionError:
        raise InvalidRequest(f"the JSON schema in '{param}' is nested too deeply", param=param) from None
    if problem is not None:
        where, message = problem
        raise InvalidRequest(
            f"invalid JSON schema in '{param}'{f' at {where}' if where else ''}: {message}", param=param
        )
    return schema


def schema_problem(schema: dict[str, Any]) -> tuple[str, str] | None:
    """Where and why its meta-schema refuses ``schema``; None if it accepts it. Cached by
    the schema's text: an app sends the same schema (or tools) with every request, and the
    meta-schema check costs more front-end CPU (about 1 ms for a 5-field object) than the
    rest of the request's preparation. RecursionError for absurdly deep nesting. A schema
    too costly to check or compile (``schema_size_problem``) is refused before either."""
    text = json.dumps(schema, sort_keys=True)
    return _cached_problem(text) if len(text) <= _CACHED_SCHEMA_CHARS else _meta_check(schema)


_CACHED_SCHEMA_CHARS = 64 * 1024

# What a schema may cost. The meta-schema check costs about 0.2 to 0.5 ms a sub-schema
# (2 CPU cores; 1 s for 5,000), in a thread beside the event loop (``service``), and the
# engine compiles each new grammar on a thread of its own (one per two cores, shared by
# every structured request; a compile cannot be stopped, not even by an abort), where
# xgrammar's time and memory grow with the square of the properties one object may leave
# out: 200 optional properties took 0.76 s, 400 took 2.6 s, and a 0.9 MB schema of 20,000
# held the engine's only compile thread for 14 minutes (every other structured request
# waited) until, at 9.5 GB, the OOM killer ended the engine. Legitimate schemas (pydantic
# models, tools) stay far below both bounds.
MAX_SCHEMA_NODES = 5000
MAX_OPTIONAL_PROPERTIES = 128  # in one object; more objects share the square of it
# Regexes (a schema's ``pattern``s and ``patternProperties`` keys, together; or a
# ``structured_outputs.regex``) are compiled three times: by Python's ``re`` in the
# meta-schema check (``format: regex``) and by xgrammar's converter, both in threads beside
# the event loop (``service``), then by the engine's grammar compiler. None of them is
# bounded in time: a 1.5 MB alternation held the event loop for 5 to 9 s (every stream
# stalled), and the engine's compile time grows with the square of its size (80,000
# alternatives: 4.7 s). 16 KiB costs 10 to 30 ms; patterns a schema or a regex constraint
# needs are far shorter.
MAX_PATTERN_CHARS = 16 * 1024
# A ``structured_outputs.grammar`` is bounded as a regex; a ``choice`` list and a schema's
# ``enum`` / ``const`` values become one alternation each, which xgrammar compiles in time
# that grows faster than its size: 64,000 eight-letter values took 7 s as a choice and 19 s
# as an enum, 150,000 choices (a 2 MB body) 34 s, and a 590 KB grammar 49 s, each on the
# engine's compile thread. 64 KiB of values compile in about 0.2 s.
MAX_LITERAL_CHARS = 64 * 1024


def schema_size_problem(schema: Any, *, compiled: bool = True) -> str | None:
    """Why ``schema`` (or a list of schemas, checked together) is too costly to check and
    compile, or None: more than ``MAX_SCHEMA_NODES`` schema objects, or (with ``compiled``:
    the schemas are compiled together) optional properties whose squares sum to more than
    ``MAX_OPTIONAL_PROPERTIES`` squared, or regular expressions longer than
    ``MAX_PATTERN_CHARS`` together, or ``enum`` / ``const`` values longer than
    ``MAX_LITERAL_CHARS`` together (as JSON). Iterative, so any nesting is fine."""
    nodes = cost = worst = patterns = literals = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema is too large: more than {MAX_SCHEMA_NODES} schema objects"
        pattern, keyed = node.get("pattern"), node.get("patternProperties")
        patterns += len(pattern) if isinstance(pattern, str) else 0
        patterns += sum(len(str(key)) for key in keyed) if isinstance(keyed, dict) else 0
        if patterns > MAX_PATTERN_CHARS:
            return (
                f"the schema's regular expressions ('pattern', 'patternProperties') are too long: "
                f"more than {MAX_PATTERN_CHARS} characters together"
            )
        enum, const = node.get("enum"), node.get("const")
        literals += sum(len(json.dumps(v)) for v in enum) if isinstance(enum, list) else 0
        # (a dict may be a property's schema, where ``const`` is the property's name)
        literals += len(json.dumps(const)) if const is not None and not isinstance(const, dict) else 0
        if literals > MAX_LITERAL_CHARS:
            return (
                f"the schema's 'enum' and 'const' values are too long: more than {MAX_LITERAL_CHARS} "
                "characters together"
            )
        properties, required = node.get("properties"), node.get("required")
        if compiled and isinstance(properties, dict):
            named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
            optional = sum(1 for name in properties if name not in named)
            cost, worst = cost + optional * optional, max(worst, optional)
            if cost > MAX_OPTIONAL_PROPERTIES**2:
                return (
                    f"the schema is too costly to compile: an object has {worst} properties that may be "
                    f"left out (at most {MAX_OPTIONAL_PROPERTIES} in one object, fewer over several; "
                    "list the others in 'required')"
                )
        stack.extend(node.values())
    return None


@functools.lru_cache(maxsize=256)
def _cached_problem(text: str) -> tuple[str, str] | None:
    return _meta_check(json.loads(text))


def _meta_check(schema: dict[str, Any]) -> tuple[str, str] | None:
    """Where and why the meta-schema refuses ``schema``, or why it is too costly to check
    (first, as the check is what costs); None if it accepts it."""
    too_big = schema_size_problem(schema)
    if too_big is not None:
        return "", too_big
    if not isinstance(schema.get("$schema", ""), str):  # validator_for would fail parsing it as a URI
        return "$schema", "'$schema' must be a string (the dialect's URI)"
    try:
        check_meta_schema(schema)  # its patterns ECMA-262, as JSON Schema has them
    except jsonschema.SchemaError as exc:
        return "/".join(str(p) for p in exc.path), exc.message
    return _endless(schema)


# -- values without end ---------------------------------------------------------------------
# A grammar is built from the schema as it is written: a sub-schema that every value of must
# hold itself again (``{"$ref": "#"}``, an object that requires a property of its own type)
# becomes a rule that no finite text completes. Where decoding can enter it, the engine is left
# with no token to allow (vLLM ends the request with an error: a 500) or with whitespace alone
# until ``max_tokens``. JSON Schema itself reads a bare ``$ref`` cycle as "any value": the
# grammar backends cannot, so such a schema is refused up front, naming the place.
_OBJECT, _ARRAY = frozenset({"object"}), frozenset({"array"})
# Where a value holds the values of sub-schemas, so decoding can enter them (not ``$defs``,
# nor what is only judged: ``not``, ``if``, ``contains``...).
_GENERATED = frozenset(
    {
        "properties",
        "patternProperties",
        "allOf",
        "anyOf",
        "oneOf",
        "prefixItems",
        "items",
        "additionalProperties",
    }
)
_ENDLESS = (
    "no finite JSON value can be generated for it: every value it allows holds itself again "
    "(a '$ref' cycle with no way out); give the recursion an end (an optional property, an "
    "array that may be empty, a null branch)"
)


def _endless(schema: dict[str, Any]) -> tuple[str, str] | None:
    """The first place (root first) in ``schema`` whose values could only be infinite, as a
    grammar reads it, with the message; None when every reachable sub-schema can end. A
    fixpoint: a sub-schema can end once what it needs can (``_needs``), as for the
    productive rules of a grammar."""
    nodes: dict[int, str] = {}  # where each is
    needs: dict[int, tuple[bool, list[Any]]] = {}  # (any of them will do, the sub-schemas)
    for node, where in _reachable(schema, _GENERATED):
        nodes[id(node)] = where
        needs[id(node)] = _needs(node, schema)
    # Which can end: those that need nothing, then, step by step, those whose needs have
    # (a worklist over who needs what, so a long chain costs no more than a short one).
    waiting: dict[int, int] = {}  # of the sub-schemas a node needs, how many cannot end yet
    needed_by: dict[int, list[int]] = {}
    ready = []
    for key, (any_of, subs) in needs.items():
        open_ = [id(sub) for sub in subs if isinstance(sub, dict) and id(sub) in nodes]
        if (any_of and len(open_) < len(subs)) or not open_:  # a branch that ends, or no needs
            ready.append(key)
            continue
        waiting[key] = 1 if any_of else len(open_)
        for sub in open_:
            needed_by.setdefault(sub, []).append(key)
    ends: set[int] = set()
    while ready:  # each node comes here once: when it needs nothing, or when its count hits 0
        key = ready.pop()
        ends.add(key)
        for parent in needed_by.get(key, ()):
            waiting[parent] -= 1
            if waiting[parent] == 0:
                ready.append(parent)
    for key, where in nodes.items():
        if key not in ends:
            return where, _ENDLESS
    return None


def _needs(node: dict[str, Any], root: Any) -> tuple[bool, list[Any]]:
    """What a value of ``node`` needs generated first: ``(True, subs)`` one of ``subs``,
    ``(False, subs)`` all of them (none: it ends as it is). A ``$ref`` is read as its
    target, a union as its branches, as xgrammar builds them. What is not an object there
    (a boolean, a ``$ref`` out of the schema) counts as one that ends: ``false`` is the
    backend's to refuse, with its own message."""
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _local_ref(root, ref)
        return False, [target if isinstance(target, dict) else True]
    for kind in ("anyOf", "oneOf"):
        branches = node.get(kind)
        if isinstance(branches, list) and branches:
            return True, [b if isinstance(b, dict) else True for b in branches]
    parts = node.get("allOf")
    subs: list[Any] = list(parts) if isinstance(parts, list) else []
    types = _grammar_types(node, root, {})
    if types not in (_OBJECT, _ARRAY):
        return False, subs  # it may be a scalar (or anything): that ends
    if types == _OBJECT:
        properties = node.get("properties")
        required = node.get("required")
        if isinstance(properties, dict) and isinstance(required, list):
            subs += [properties[name] for name in required if isinstance(name, str) and name in properties]
    else:
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        first = node.get("prefixItems")
        first = first if isinstance(first, list) else []
        subs += first[:least]
        items = node.get("items")
        if least > len(first) and isinstance(items, dict):
            subs.append(items)
    return False, subs


# -- what the grammar backend enforces ----------------------------------------------------
# Keywords xgrammar (the default grammar backend) takes and ignores: decoded without them, an
# answer can break the schema. ``dependencies`` is the older spelling of the two after ``else``.
_XGRAMMAR_IGNORES = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies")
_XGRAMMAR = "the grammar backend (xgrammar)"
# Where a schema holds schemas (the others hold data: enum, const, default...).
_SUBSCHEMA = frozenset(
    {
        "additionalItems",
        "additionalProperties",
        "contains",
        "contentSchema",
        "items",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
    }
)
_SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_REF_HOPS = 16


def xgrammar_gap(schema: Any) -> str | None:
    """What in ``schema`` xgrammar would decode without enforcing (a keyword it ignores, or
    a ``oneOf`` whose branches may overlap, which it decodes as ``anyOf``), as the end of
    a message naming the keyword and where; None when it enforces all of it. Sub-schemas
    anywhere count ($defs, properties, items, anyOf...), and what a local $ref points to."""
    for node, where in _reachable(schema):
        for keyword in _XGRAMMAR_IGNORES:
            if keyword in node:
                return (
                    f"uses '{keyword}' (at {_at(where, keyword)}), which {_XGRAMMAR} does not enforce: "
                    "answers could break the schema"
                )
        problem = _siblings_gap(node, where, schema) or _lookahead_gap(node, where)
        if problem is not None:
            return problem
        branches = node.get("oneOf")
        if isinstance(branches, list) and not _disjoint(branches, node, schema):
            return (
                f"has a 'oneOf' (at {_at(where, 'oneOf')}) whose branches may overlap, which {_XGRAMMAR} "
                "decodes as 'anyOf': use 'anyOf', or give every branch a required property with a "
                "'const' of its own"
            )
    return None


# JSON Schema's assertions: what an instance must meet. Other keywords (title, description,
# default, examples, discriminator, unknown ones) assert nothing, so ignoring them is harmless.
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_ASSERTIONS = frozenset(
    {
        *_COMBINATORS,
        "type", "enum", "const",
        "properties", "patternProperties", "additionalProperties", "required", "propertyNames",
        "minProperties", "maxProperties", "unevaluatedProperties",
        "items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains",
        "minItems", "maxItems", "uniqueItems", "unevaluatedItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    }
)  # fmt: skip
# Keywords that xgrammar reads only under a "type" of theirs (with none, any value passes).
_TYPED_ONLY = {
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
    "exclusiveMaximum": "number", "multipleOf": "number",
}  # fmt: skip
# Without a "type", xgrammar reads a schema as an object only from these keywords, and as an
# array only from the next; then it enforces that type's bounds too (with any other, none).
_OBJECT_WORDS = frozenset({"properties", "additionalProperties"})
_ARRAY_WORDS = frozenset({"items", "prefixItems"})
_OBJECT_BOUNDS = ("minProperties", "maxProperties", "propertyNames", "patternProperties")
_ARRAY_BOUNDS = ("minItems", "maxItems", "contains", "uniqueItems")


def _siblings_gap(node: dict[str, Any], where: str, root: Any) -> str | None:
    """What xgrammar leaves out of one schema object: it decodes a ``$ref``, ``allOf``,
    ``anyOf`` or ``oneOf`` alone, without the assertions beside it (a ``type`` beside it is
    harmless when every branch keeps within it); of an ``allOf`` of several schemas it
    enforces none; string and number bounds without a ``type`` it ignores; and it offers
    every ``enum`` / ``const`` value, also one that the keywords beside it refuse."""
    combinators = [k for k in _COMBINATORS if k in node]
    if len(combinators) > 1:
        first, second = combinators[:2]
        return (
            f"has '{second}' beside '{first}' (at {where or 'the top'}), and {_XGRAMMAR} enforces only "
            f"one of them: wrap them in an 'allOf' of one schema each, or keep one"
        )
    if combinators:
        kind = combinators[0]
        parts = node["allOf"] if kind == "allOf" else None
        if isinstance(parts, list) and len(parts) > 1:
            return (
                f"has an 'allOf' of {len(parts)} schemas (at {_at(where, 'allOf')}), which {_XGRAMMAR} "
                "does not enforce: merge them into one schema"
            )
        for keyword in node:
            if keyword == kind or keyword not in _ASSERTIONS:
                continue
            if keyword == "type" and _within_type(node, kind, root):
                continue
            return (
                f"has '{keyword}' beside '{kind}' (at {where or 'the top'}), which {_XGRAMMAR} does not "
                f"enforce there: move it into the schema{'s' if kind != '$ref' else ''} of '{kind}'"
            )
        return None
    if "type" not in node and "enum" not in node and "const" not in node:
        untyped = [] if where.endswith("propertyNames") else list(_TYPED_ONLY.items())  # keys: strings
        if not any(k in node for k in _OBJECT_WORDS):
            untyped += [(k, "object") for k in _OBJECT_BOUNDS]
        if not any(k in node for k in _ARRAY_WORDS):
            untyped += [(k, "array") for k in _ARRAY_BOUNDS]
        for keyword, kind in untyped:
            if keyword in node:
                return (
                    f"has '{keyword}' without a 'type' (at {where or 'the top'}), which {_XGRAMMAR} then "
                    f'does not enforce: add "type": "{kind}"'
                )
    if "format" in node and "pattern" in node:
        return (
            f"has both 'format' and 'pattern' (at {where or 'the top'}), and {_XGRAMMAR} enforces only "
            "the format: keep one"
        )
    required, declared = node.get("required"), node.get("properties")
    if isinstance(required, list):
        names = declared if isinstance(declared, dict) else {}
        missing = next((r for r in required if isinstance(r, str) and r not in names), None)
        if missing is not None:
            return (
                f"requires '{missing}' (at {_at(where, 'required')}), which its 'properties' do not declare, "
                f"and {_XGRAMMAR} enforces 'required' only for declared properties: declare it"
            )
    return _refused_value(node, where)


def _lookahead_gap(node: dict[str, Any], where: str) -> str | None:
    """A lookahead in a ``pattern`` or a ``patternProperties`` key: xgrammar's JSON-schema
    converter drops it (it logs that it is ignored), so answers need not match the pattern.
    (A look-behind it refuses itself.)"""
    pattern, keyed = node.get("pattern"), node.get("patternProperties")
    found = [_at(where, "pattern")] if isinstance(pattern, str) and has_lookahead(pattern) else []
    if isinstance(keyed, dict):
        found += [
            f"{_at(where, 'patternProperties')}/{key.replace('~', '~0').replace('/', '~1')}"
            for key in map(str, keyed)
            if has_lookahead(key)
        ]
    if not found:
        return None
    return (
        f"has a lookahead ('(?=' or '(?!') in a regular expression (at {found[0]}), which {_XGRAMMAR} "
        "does not enforce: answers could break the schema; write the pattern without it"
    )


def _within_type(node: dict[str, Any], kind: str, root: Any) -> bool:
    """Whether every schema of ``node``'s combinator keeps within ``node``'s own ``type``."""
    allowed = _type_names(node.get("type"))
    if allowed is None:
        return False
    if kind == "$ref":
        ref = node["$ref"]
        targets = [_local_ref(root, ref) if isinstance(ref, str) else None]
    else:
        targets = node[kind] if isinstance(node[kind], list) else [None]
    memo: dict[int, frozenset[str] | None] = {}
    for target in targets:
        types = _grammar_types(_resolved(target, root), root, memo)
        if types is None or not all(t in allowed or (t == "integer" and "number" in allowed) for t in types):
            return False
    return True


def _type_names(kind: Any) -> frozenset[str] | None:
    kinds = [kind] if isinstance(kind, str) else kind
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return None
    return frozenset(kinds)


def _grammar_types(
    schema: dict[str, Any] | None, root: Any, memo: dict[int, frozenset[str] | None], depth: int = 0
) -> frozenset[str] | None:
    """The JSON types xgrammar lets ``schema`` produce; None when it may be any. ``memo``
    holds what each branch gave (by identity), so shared branches are read once."""
    if schema is None or depth > _REF_HOPS:
        return None
    if "type" in schema:
        return _type_names(schema["type"])
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return frozenset(_json_type(v) for v in values)
    if any(k in schema for k in _OBJECT_WORDS):
        return frozenset({"object"})
    if any(k in schema for k in _ARRAY_WORDS):
        return frozenset({"array"})
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list) and branches:
        found: set[str] = set()
        for branch in branches:
            key = id(branch)
            if key not in memo:
                memo[key] = None  # a cycle back here may be anything
                memo[key] = _grammar_types(_resolved(branch, root), root, memo, depth + 1)
            types = memo[key]
            if types is None:
                return None
            found |= types
        return frozenset(found)
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "string"


def _refused_value(node: dict[str, Any], where: str) -> str | None:
    """An ``enum`` / ``const`` value that the assertions beside it refuse (xgrammar offers it)."""
    keyword = "const" if "const" in node else "enum" if isinstance(node.get("enum"), list) else None
    if keyword is None:
        return None
    others = {k: v for k, v in node.items() if k in _ASSERTIONS and k not in ("enum", "const")}
    if not others or "$ref" in json.dumps(others):  # a $ref needs the whole schema: not checked
        return None
    try:
        # Its regexes (``pattern``, nested ones under ``properties``...) under a time bound:
        # one past it (a client's "^(a+)+$") leaves the values not judged.
        validator = bounded_validator(others, jsonschema.Draft202012Validator)
        values = [node["const"]] if keyword == "const" else node["enum"]
        with regex_budget():
            refused = next((v for v in values if not validator.is_valid(v)), _NONE)
    except Exception:  # keywords another draft let through (multipleOf 0...): not judged here
        return None
    if refused is _NONE:
        return None
    shown = json.dumps(refused)[:80]
    return (
        f"has an '{keyword}' value that the keywords beside it refuse ({shown}, at {_at(where, keyword)}), "
        f"which {_XGRAMMAR} would still offer: drop the value or the keyword"
    )


_NONE = object()


def _at(where: str, keyword: str) -> str:
    return f"{where}/{keyword}" if where else keyword


def _reachable(schema: Any, keys: frozenset[str] | None = None) -> Iterator[tuple[dict[str, Any], str]]:
    """Each sub-schema (an object) of ``schema`` once, root first, depth first, with where it
    is: under the keywords ``keys`` (all that hold schemas when None), and what a local
    ``$ref`` points to."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, where
        children = list(_subschemas(node, where, keys))
        ref = node.get("$ref")
        if isinstance(ref, str) and (target := _local_ref(schema, ref)) is not None:
            children.append((target, ref.removeprefix("#").removeprefix("/")))
        stack.extend(reversed(children))


def _subschemas(
    node: dict[str, Any], where: str, keys: frozenset[str] | None = None
) -> Iterator[tuple[Any, str]]:
    for key, value in node.items():
        if keys is not None and key not in keys:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield sub, f"{_at(where, key)}/{str(name).replace('~', '~0').replace('/', '~1')}"
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield sub, f"{_at(where, key)}/{i}"
        elif key in _SUBSCHEMA:
            yield value, _at(where, key)


def _local_ref(root: Any, ref: str) -> Any:
    """What a $ref within the schema (``#``, ``#/$defs/A``) points to; None for any other."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _disjoint(branches: list[Any], parent: dict[str, Any], root: Any) -> bool:
    """Whether no instance can match two of ``branches`` (so anyOf decodes as oneOf): by
    their types, their const / enum values, or a property that each branch gives a value
    of its own (pydantic's discriminated unions; at most one branch may leave it out, as
    pydantic does for a tag with a default). Only what is provable counts."""
    resolved = [_resolved(b, root) for b in branches if b is not False]  # false matches nothing
    if len(resolved) <= 1:
        return True
    merged = [b for b in resolved if b is not None]
    if len(merged) < len(resolved):
        return False
    types = [_types(b, parent) for b in merged]
    if all(t is not None for t in types) and _apart(types):
        return True
    values = [_values(b) for b in merged]
    if all(v is not None for v in values) and _apart(values):
        return True
    if any(t != frozenset({"object"}) for t in types):
        return False
    properties: list[dict[str, Any]] = [
        b["properties"] if isinstance(b.get("properties"), dict) else {} for b in merged
    ]
    for name in sorted(set.intersection(*(set(p) for p in properties))):
        tags = [_values(_resolved(p[name], root)) for p in properties]
        left_out = sum(name not in _required(b, parent) for b in merged)
        if left_out <= 1 and all(t is not None for t in tags) and _apart(tags):
            return True
    return False


def _resolved(schema: Any, root: Any) -> dict[str, Any] | None:
    """``schema`` merged with what its local $ref chain points to (an instance meets every
    keyword of both, so each one found here holds); None for a schema that is not an object."""
    merged: dict[str, Any] = {}
    for _ in range(_REF_HOPS):
        if not isinstance(schema, dict):
            return None
        merged = {**schema, **merged}
        ref = schema.get("$ref")
        schema = _local_ref(root, ref) if isinstance(ref, str) else None
        if schema is None:
            break
    return merged


def _types(schema: dict[str, Any], parent: dict[str, Any]) -> frozenset[str] | None:
    kinds = _type_names(schema.get("type", parent.get("type")))
    return None if kinds is None else frozenset("number" if k == "integer" else k for k in kinds)


def _values(schema: dict[str, Any] | None) -> frozenset[Any] | None:
    if schema is None:
        return None
    if "const" in schema:
        return frozenset([_canonical(schema["const"])])
    if isinstance(schema.get("enum"), list):
        return frozenset(_canonical(v) for v in schema["enum"])
    return None


def _canonical(value: Any) -> Any:
    """A hashable form of a JSON value under JSON Schema's equality (1 == 1.0, true != 1)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | float):
        number = float(value)
        return ("number", number) if number == number else ("number", "nan")
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("object", tuple(sorted((str(k), _canonical(v)) for k, v in value.items())))
    return ("other", repr(value))


def _required(schema: dict[str, Any], parent: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for given in (schema.get("required"), parent.get("required")):
        if isinstance(given, list):
            names.update(n for n in given if isinstance(n, str))
    return names


def _apart(sets: list[Any]) -> bool:
    """Whether the sets are pairwise disjoint."""
    return sum(len(s) for s in sets) == len(frozenset().union(*sets))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting (then a 400)
        return False
    return True


# -- routes ------------------------------------------------------------------------------
def route_constraint(value: dict[str, Any] | str | None, configs_dir: Path) -> Constraint | None:
    """A catalog entry's ``response_format``: an OpenAI ``response_format`` object, a bare
    JSON schema, or ``file:<path>`` (a JSON file under the catalog's folder). ConfigError
    if it is not a valid one."""
    if value is None:
        return None
    try:
        if isinstance(value, str):
            value = _schema_file(value, configs_dir)
        try:  # YAML's .inf / .nan, a file's Infinity: kept, no card showing it would be JSON
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ConfigError("response_format: holds a number that is not finite (NaN, Infinity)") from None
        if value.get("type") in ("text", "json_object", "json_schema"):
            parsed = parse_response_format(value)
            return None if parsed == TEXT else parsed
        return Constraint("json", check_schema(value, "response_format"))
    except InvalidRequest as exc:
        raise ConfigError(exc.message) from None


def schema_file_path(value: str, configs_dir: Path) -> Path:
    """The file a ``file:<path>`` response format names, resolved (ConfigError if it is
    not such a value, or not under the catalog's folder)."""
    if not value.startswith("file:"):
        raise ConfigError("response_format: a string must be 'file:<path under the catalog folder>'")
    try:
        root = configs_dir.resolve()
        path = (root / _named(value)).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop (3.11); a NUL byte
        raise ConfigError(f"response_format: {value}: {exc}") from None
    if not path.is_relative_to(root):
        raise ConfigError(f"response_format: {value} is outside {root}")
    return path


def schema_watch_paths(value: str, configs_dir: Path) -> tuple[Path, ...]:
    """What a reload must follow for a ``file:<path>`` value: the file it reads and, where it
    differs, the path as named (a link there, re-pointed, changes what is read). The path as
    named is followed when nothing is read too (a link in a loop or out of the catalog's
    folder: re-pointing it is the fix), as long as it names a place in the folder. Watching
    reads no file: the rule on reads stays ``schema_file_path``'s."""
    if not value.startswith("file:") or "\0" in value:  # a NUL byte names no file
        return ()
    root = configs_dir.absolute()
    named = Path(os.path.normpath(root / _named(value)))
    paths = [named] if named.is_relative_to(root) else []
    with suppress(ConfigError):
        read = schema_file_path(value, configs_dir)
        if read != named:
            paths.insert(0, read)
    return tuple(paths)


def _named(value: str) -> str:
    return value.removeprefix("file:").strip()


def _schema_file(value: str, configs_dir: Path) -> dict[str, Any]:
    path = schema_file_path(value, configs_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"response_format: {value}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"response_format: {value} must hold a JSON object")
    return data


def choose(
    asked: Constraint | None, param: str, default: Constraint | None, enforce: bool, route: str
) -> Constraint | None:
    """The constraint a request runs with: the request's own, else the route's default.
    An enforcing route admits a request that asks for nothing (or for text, as OpenAI's
    default), for any JSON object (its schema is one), or for its own schema (annotations
    aside); anything else is a 400. Plain text asked for by name (``TEXT``) wins over a
    default the route does not enforce."""
    if asked == TEXT:
        return default if enforce else None
    if asked is None:
        return default
    if not enforce or default is None:
        return asked
    if asked.kind == "json_object" and default.kind in ("json", "json_object"):
        return default
    if asked.kind == default.kind and _bare(asked.value) == _bare(default.value):
        return default
    raise InvalidRequest(
        f"route '{route}' enforces its own response format ({describe(default)}); "
        f"leave '{param}' out or send that schema",
        param=param,
    )


def _bare(schema: Any) -> Any:
    """``schema`` without annotation keywords (title, description...), for comparing."""
    if isinstance(schema, list):
        return [_bare(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _bare(s) for name, s in value.items()}
        else:
            out[key] = value if key in ("enum", "const") else _bare(value)
    return out


_SHAPES_AN_OBJECT = frozenset(
    {"properties", "patternProperties", "additionalProperties", "$ref", "anyOf", "oneOf", "allOf"}
)


def open_object(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: true`` where it is an object that says nothing
    of its properties: what JSON Schema means by it, and what xgrammar's strict mode reads it
    as only inline (reached through a ``$ref``, ``{"type": "object"}`` admitted ``{}`` alone)."""
    if isinstance(schema, dict) and schema.get("type") == "object" and not _SHAPES_AN_OBJECT & schema.keys():
        return {**schema, "additionalProperties": True}
    return schema


def opened(constraint: Constraint | None) -> Constraint | None:
    """``constraint`` as the engine decodes it: a JSON schema with its root and each schema
    of its ``$defs`` and ``definitions`` (where a ``$ref`` leads) opened (``open_object``),
    as the tools' grammars have them; the constraint itself when nothing changes."""
    if constraint is None or constraint.kind != "json" or not isinstance(constraint.value, dict):
        return constraint
    schema = constraint.value
    out = open_object(schema)
    for where in ("$defs", "definitions"):
        found = schema.get(where)
        if isinstance(found, dict) and any(open_object(sub) is not sub for sub in found.values()):
            out = {**out, where: {key: open_object(sub) for key, sub in found.items()}}
    return constraint if out is schema else Constraint("json", out)


def describe(constraint: Constraint) -> str:
    if constraint.kind == "json":
        return "JSON schema " + json.dumps(constraint.value, separators=(",", ":"))[:200]
    return constraint.kind.replace("_", " ")


def as_response_format(constraint: Constraint | None, name: str) -> dict[str, Any] | None:
    """A route's constraint as OpenAI's ``response_format`` object, for ``/v1/models``."""
    if constraint is None:
        return None
    if constraint.kind == "json_object":
        return {"type": "json_object"}
    if constraint.kind == "json":
        schema_name = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]
        spec = {"name": schema_name, "schema": constraint.value, "strict": True}
        return {"type": "json_schema", "json_schema": spec}
    value = list(constraint.value) if constraint.kind == "choice" else constraint.value
    return {"type": "structured_outputs", "structured_outputs": {constraint.kind: value}}
