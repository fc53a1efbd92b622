"""gateway.structured: request fields and catalog entries -> a Constraint, or a 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import ConfigError, InvalidRequest
from gateway.structured import (
    _cached_problem,
    as_response_format,
    check_schema,
    choose,
    parse_response_format,
    parse_structured_outputs,
    request_constraint,
    route_constraint,
)
from gateway.types import Constraint

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def _schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, **extra}}


def test_text_and_absent_mean_no_constraint() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    assert request_constraint({}) == (None, "response_format")


def test_json_object_and_json_schema() -> None:
    assert parse_response_format({"type": "json_object"}) == Constraint("json_object")
    assert parse_response_format(_schema_format(SCHEMA, strict=True)) == Constraint("json", SCHEMA)


def test_json_object_with_a_schema_beside_it_is_honoured() -> None:
    assert parse_response_format({"type": "json_object", "schema": SCHEMA}) == Constraint("json", SCHEMA)


@pytest.mark.parametrize(
    ("fmt", "words"),
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "'response_format.type' must be one of"),
        ({"type": "json_schema"}, "json_schema' must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "A"}}, "schema' is required"),
        (_schema_format(SCHEMA) | {"json_schema": {"schema": SCHEMA}}, "name' must be"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "name' must be"),
        (_schema_format(SCHEMA, strict="yes"), "strict' must be a boolean"),
        (_schema_format(SCHEMA, strict=0), "strict' must be a boolean"),  # 0 == False, found by fuzzing
        (_schema_format(SCHEMA, description={}), "description' must be a string"),  # found by fuzzing
        (_schema_format(SCHEMA, extra=1), "unknown field"),
        (_schema_format({"type": "objekt"}), "invalid JSON schema"),
        (_schema_format({"properties": {"a": {"minLength": -1}}}), "at properties/a/minLength"),
        (_schema_format([1, 2]), "must be an object"),
        ({"type": "json_object", "extra": 1}, "unknown field"),
    ],
)
def test_bad_response_formats_are_400s_on_response_format(fmt: Any, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        request_constraint({"response_format": fmt})
    assert info.value.param == "response_format"
    assert words in info.value.message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"json": SCHEMA}, Constraint("json", SCHEMA)),
        ({"json": json.dumps(SCHEMA)}, Constraint("json", SCHEMA)),
        ({"json_object": True}, Constraint("json_object")),
        ({"regex": "[a-z]+"}, Constraint("regex", "[a-z]+")),
        ({"choice": ["yes", "no"]}, Constraint("choice", ("yes", "no"))),
        ({"grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
        ({"regex": "a", "disable_any_whitespace": False, "structural_tag": None}, Constraint("regex", "a")),
    ],
)
def test_structured_outputs_kinds(value: dict[str, Any], expected: Constraint) -> None:
    assert parse_structured_outputs(value) == expected
    assert request_constraint({"structured_outputs": value}) == (expected, "structured_outputs")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"structural_tag": "{}"}, "not supported"),
        ({"regex": "a", "whitespace_pattern": " "}, "not supported"),
        ({"regex": "a", "disable_any_whitespace": True}, "not supported"),
        ({"regex": "a", "backend": "outlines"}, "unknown field"),
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"choice": [1]}, "list of strings"),
        ({"grammar": "  "}, "non-empty string"),
        ({"json_object": "yes"}, "must be true"),
        ({"json": {"type": 5}}, "invalid JSON schema"),
        ([1], "must be an object"),
    ],
)
def test_bad_structured_outputs_are_400s(value: Any, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        request_constraint({"structured_outputs": value})
    assert info.value.param == "structured_outputs"
    assert words in info.value.message


def test_both_fields_or_a_legacy_field_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="not both"):
        request_constraint({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
    with pytest.raises(InvalidRequest) as info:
        request_constraint({"guided_json": SCHEMA})
    assert info.value.param == "guided_json"


# -- routes ------------------------------------------------------------------------------
def test_route_formats_inline_openai_and_file(tmp_path: Path) -> None:
    assert route_constraint(None, tmp_path) is None
    assert route_constraint(SCHEMA, tmp_path) == Constraint("json", SCHEMA)
    assert route_constraint({"type": "json_object"}, tmp_path) == Constraint("json_object")
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "a.json").write_text(json.dumps(SCHEMA))
    assert route_constraint("file:schemas/a.json", tmp_path) == Constraint("json", SCHEMA)


@pytest.mark.parametrize(
    "value",
    [{"type": "objekt"}, "schemas/a.json", "file:../outside.json", "file:missing.json", "file:list.json"],
)
def test_bad_route_formats_are_config_errors(tmp_path: Path, value: Any) -> None:
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path.parent / "outside.json").write_text(json.dumps(SCHEMA))
    with pytest.raises(ConfigError):
        route_constraint(value, tmp_path)


def test_choose_request_wins_on_a_route_that_does_not_enforce() -> None:
    route = Constraint("json", SCHEMA)
    asked = Constraint("regex", "a+")
    assert choose(None, "response_format", route, False, "r") == route
    assert choose(asked, "response_format", route, False, "r") == asked
    assert choose(asked, "response_format", None, True, "r") == asked


def test_choose_on_an_enforcing_route() -> None:
    route = Constraint("json", {**SCHEMA, "additionalProperties": False})
    assert choose(None, "response_format", route, True, "json") == route
    assert choose(Constraint("json_object"), "response_format", route, True, "json") == route
    # The SDK's pydantic schema: the same shape, with titles.
    titled = {
        "title": "Answer",
        "type": "object",
        "properties": {"answer": {"title": "Answer", "type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    assert choose(Constraint("json", titled), "response_format", route, True, "json") == route
    with pytest.raises(InvalidRequest) as info:
        choose(Constraint("json", SCHEMA), "structured_outputs", route, True, "json")
    assert info.value.param == "structured_outputs"
    assert "route 'json' enforces" in info.value.message


def test_a_property_named_like_an_annotation_still_counts() -> None:
    route = Constraint("json", {"type": "object", "properties": {"title": {"type": "string"}}})
    other = Constraint("json", {"type": "object", "properties": {"title": {"type": "integer"}}})
    with pytest.raises(InvalidRequest):
        choose(other, "response_format", route, True, "r")


def test_as_response_format() -> None:
    assert as_response_format(None, "x") is None
    assert as_response_format(Constraint("json_object"), "x") == {"type": "json_object"}
    card = as_response_format(Constraint("json", SCHEMA), "my.route")
    spec = {"name": "my_route", "schema": SCHEMA, "strict": True}
    assert card == {"type": "json_schema", "json_schema": spec}


def test_a_schema_is_checked_against_the_meta_schema_once() -> None:
    schema = {"type": "object", "properties": {"once": {"type": "string"}}}
    before = _cached_problem.cache_info()
    for _ in range(3):
        assert request_constraint({"response_format": _schema_format(schema)})[0] == Constraint(
            "json", schema
        )
    after = _cached_problem.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)


@pytest.mark.parametrize("repeat", [1, 2])  # a cached verdict says the same
def test_bad_and_deep_schemas_are_refused_every_time(repeat: int) -> None:
    for schema, words in [
        ({"properties": {"a": {"minLength": -1}}}, "at properties/a/minLength"),
        ({"type": "object", "properties": {"x" * 70_000: {}}, "minProperties": -1}, "minProperties"),
    ]:
        for _ in range(repeat):
            with pytest.raises(InvalidRequest, match=words):
                check_schema(schema, "response_format")
    deep: dict[str, Any] = {}
    for _ in range(5000):
        deep = {"not": deep}
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        check_schema(deep, "response_format")
