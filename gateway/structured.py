"""Structured outputs: what a request (or its route) asks of the output's shape.

A request asks with OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``json_object``, ``regex``,
``choice``, ``grammar``); a route may declare a default ``response_format`` and enforce
it. Both become one ``Constraint`` that the engine turns into grammar-constrained
decoding. Everything is checked here, before a stream starts, so a bad schema is a 400
and never an error event after the 200: JSON schemas against their meta-schema here, and
against the engine's grammar backend in ``engine.prepare``.

No vllm here, and no field is silently ignored: a key this gateway does not implement
is a 400 naming it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

from gateway.errors import ConfigError, InvalidRequest
from gateway.types import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# structured_outputs keys, by what this gateway does with them.
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_NOT_IMPLEMENTED = (
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


def request_constraint(extra: Mapping[str, Any]) -> tuple[Constraint | None, str]:
    """The constraint a request body asks for, and the field it came from (the ``param``
    of any later error about it)."""
    for name in _LEGACY:
        if extra.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported; use 'structured_outputs'", param=name)
    fmt = parse_response_format(extra.get("response_format"))
    so = parse_structured_outputs(extra.get("structured_outputs"))
    if fmt is not None and so is not None:
        raise InvalidRequest(
            "give either 'response_format' or 'structured_outputs', not both", param="structured_outputs"
        )
    if so is not None:
        return so, "structured_outputs"
    return fmt, "response_format"


def parse_response_format(value: Any, param: str = "response_format") -> Constraint | None:
    """OpenAI's ``response_format`` -> a constraint; ``text`` (or none) -> None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param)
    kind = value.get("type")
    unknown = set(value) - {"type", "json_schema", "schema"}
    if unknown:
        raise InvalidRequest(f"unknown field in '{param}': {', '.join(sorted(unknown))}", param=param)
    if kind == "text":
        return None
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
        if not isinstance(name, str) or not _NAME.match(name):
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
        if key in _NOT_IMPLEMENTED and item not in (None, False):
            raise InvalidRequest(f"'{param}.{key}' is not supported by this gateway", param=param)
        if key not in _KINDS and key not in _NOT_IMPLEMENTED:
            raise InvalidRequest(f"unknown field '{param}.{key}'", param=param)
    given = [k for k in _KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise InvalidRequest(
            f"'{param}' needs exactly one of {', '.join(_KINDS)} (got {len(given)})", param=param
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
        return Constraint("choice", tuple(item))
    # Regexes and grammars are the grammar backend's dialect (not Python's ``re``): the
    # engine checks them in ``prepare``.
    if not isinstance(item, str) or not item.strip():
        raise InvalidRequest(f"'{param}.{kind}' must be a non-empty string", param=param)
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
    rest of the request's preparation. RecursionError for absurdly deep nesting."""
    text = json.dumps(schema, sort_keys=True)
    return _cached_problem(text) if len(text) <= _CACHED_SCHEMA_CHARS else _meta_check(schema)


_CACHED_SCHEMA_CHARS = 64 * 1024


@functools.lru_cache(maxsize=256)
def _cached_problem(text: str) -> tuple[str, str] | None:
    return _meta_check(json.loads(text))


def _meta_check(schema: dict[str, Any]) -> tuple[str, str] | None:
    """Where and why the meta-schema refuses ``schema``; None if it accepts it."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return "/".join(str(p) for p in exc.path), exc.message
    return None


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
        if value.get("type") in ("text", "json_object", "json_schema"):
            return parse_response_format(value)
        return Constraint("json", check_schema(value, "response_format"))
    except InvalidRequest as exc:
        raise ConfigError(exc.message) from None


def _schema_file(value: str, configs_dir: Path) -> dict[str, Any]:
    if not value.startswith("file:"):
        raise ConfigError("response_format: a string must be 'file:<path under the catalog folder>'")
    try:
        root = configs_dir.resolve()
        path = (root / value.removeprefix("file:").strip()).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        raise ConfigError(f"response_format: {value}: {exc}") from None
    if not path.is_relative_to(root):
        raise ConfigError(f"response_format: {value} is outside {root}")
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
    An enforcing route admits a request that asks for nothing, for any JSON object
    (its schema is one), or for its own schema (annotations aside); anything else is a 400."""
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
