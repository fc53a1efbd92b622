"""gateway.structured: request fields and catalog entries -> a Constraint, or a 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import ConfigError, InvalidRequest
from gateway.structured import (
    TEXT,
    _cached_problem,
    as_response_format,
    check_schema,
    choose,
    parse_response_format,
    parse_structured_outputs,
    request_constraint,
    route_constraint,
    schema_watch_paths,
    xgrammar_gap,
)
from gateway.types import Constraint

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def _schema_format(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, **extra}}


def test_text_and_absent_mean_no_constraint() -> None:
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) == TEXT  # asked for: it overrides a soft default
    assert request_constraint({}) == (None, "response_format")
    text_and_regex = {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a+"}}
    assert request_constraint(text_and_regex) == (Constraint("regex", "a+"), "structured_outputs")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}, "json_schema"),
        ({"type": "text", "schema": SCHEMA}, "schema"),
        ({"type": "text", "json_schema": {"name": "x", "schema": SCHEMA}}, "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}, "schema": SCHEMA}, "schema"),
    ],
)
def test_a_schema_its_type_does_not_read_is_400_not_dropped(value: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=f"'response_format.{field}' does not go with type"):
        parse_response_format(value)
    parse_response_format({**value, field: None})  # null is left out


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
        ({"type": "json_schema", "json_schema": {"name": "ab\n", "schema": SCHEMA}}, "name' must be"),
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


@pytest.mark.parametrize("target", ["current.json", "/etc/hostname", "v0.json"])
def test_a_schema_link_is_watched_whatever_it_points_to(tmp_path: Path, target: str) -> None:
    """``file:schemas/current.json``, a link: a loop, one out of the catalog's folder (not
    read: a ConfigError) or one to nothing yet. Re-pointing it is the fix, so the link is
    watched in every case; a path that names a place outside the folder is not."""
    (tmp_path / "schemas").mkdir()
    link = tmp_path / "schemas" / "current.json"
    link.symlink_to(target)
    if target != "v0.json":
        with pytest.raises(ConfigError):
            route_constraint("file:schemas/current.json", tmp_path)
    assert link in schema_watch_paths("file:schemas/current.json", tmp_path)
    (tmp_path / "schemas" / "v0.json").write_text(json.dumps(SCHEMA))
    link.unlink()
    link.symlink_to("v0.json")  # the fix
    assert route_constraint("file:schemas/current.json", tmp_path) == Constraint("json", SCHEMA)
    assert schema_watch_paths("file:../outside.json", tmp_path) == ()
    assert schema_watch_paths("file:schemas/../../outside.json", tmp_path) == ()


def test_a_schema_path_with_a_nul_byte_is_rejected_and_not_watched(tmp_path: Path) -> None:
    """It names no file; the file system calls that watch a path raise ValueError for it,
    not OSError, where a missing file's would be handled."""
    with pytest.raises(ConfigError, match="embedded null byte"):
        route_constraint("file:a\0b/c.json", tmp_path)
    assert schema_watch_paths("file:a\0b/c.json", tmp_path) == ()


def test_choose_request_wins_on_a_route_that_does_not_enforce() -> None:
    route = Constraint("json", SCHEMA)
    asked = Constraint("regex", "a+")
    assert choose(None, "response_format", route, False, "r") == route
    assert choose(asked, "response_format", route, False, "r") == asked
    assert choose(asked, "response_format", None, True, "r") == asked
    assert choose(TEXT, "response_format", route, False, "r") is None  # plain text, as asked
    assert choose(TEXT, "response_format", None, False, "r") is None


def test_choose_on_an_enforcing_route() -> None:
    route = Constraint("json", {**SCHEMA, "additionalProperties": False})
    assert choose(None, "response_format", route, True, "json") == route
    assert choose(Constraint("json_object"), "response_format", route, True, "json") == route
    assert choose(TEXT, "response_format", route, True, "json") == route  # OpenAI's default: as left out
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
    for _ in range(3000):  # deeper than the recursion limit, within the size bound
        deep = {"not": deep}
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        check_schema(deep, "response_format")


@pytest.mark.parametrize("dialect", [5, ["x"], {"a": 1}, True, None])
def test_a_dialect_that_is_no_string_is_a_400(dialect: Any) -> None:
    # jsonschema's validator_for parses it as a URI: it raised, and the request was a 500
    with pytest.raises(InvalidRequest, match=r"at \$schema: '\$schema' must be a string") as info:
        check_schema({"$schema": dialect, "type": "object"}, "tools")
    assert info.value.param == "tools"


@pytest.mark.parametrize("dialect", [{}, {"$schema": "http://json-schema.org/draft-07/schema#"}])
def test_an_ecma_named_group_passes_the_meta_schema(dialect: dict[str, Any]) -> None:
    # JSON Schema's regexes are ECMA-262: (?<y>...) is a named group there (Python's re
    # spells it (?P<y>...)), and xgrammar enforces it; it was "not a 'regex'".
    schema = {
        **dialect,
        "type": "object",
        "properties": {"year": {"type": "string", "pattern": "^(?<y>[0-9]{4})-(?<m>[0-9]{2})$"}},
        "patternProperties": {"^(?<p>x)-": {"type": "integer"}},
    }
    assert check_schema(schema, "response_format") == schema
    for bad in ("^(?<y[0-9]$", "^(?<1>a)$", "^(?<y>a)(?<y>b)$", "^(?<y>a$"):
        with pytest.raises(InvalidRequest, match="is not a 'regex'"):
            check_schema({**dialect, "type": "string", "pattern": bad}, "response_format")


# -- what xgrammar (the default grammar backend) would take without enforcing -------------
@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "not": {"const": 1}}, "'not' (at not)"),
        ({"type": "object", "properties": {"a": {"not": {}}}}, "'not' (at properties/a/not)"),
        ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 9}}, "'if' (at if)"),
        ({"type": "integer", "else": {"maximum": 0}}, "'else' (at else)"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' (at dependentRequired)"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "'dependentSchemas' (at dependentSchemas)"),
        ({"type": "object", "dependencies": {"a": ["b"]}}, "'dependencies' (at dependencies)"),
        ({"$defs": {"A": {"not": {}}}, "$ref": "#/$defs/A"}, "'not' (at $defs/A/not)"),
        ({"definitions": {"A/B": {"not": {}}}}, "'not' (at definitions/A~1B/not)"),
        ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"not": {}}]}}, "(at items/anyOf/1/not)"),
        ({"allOf": [{"prefixItems": [{"if": {}}]}]}, "(at allOf/0/prefixItems/0/if)"),
    ],
)
def test_keywords_xgrammar_ignores_are_named_with_where(schema: dict[str, Any], where: str) -> None:
    gap = xgrammar_gap(schema)
    assert gap is not None and where in gap and "does not enforce" in gap


_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_B = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
_DEFS = {"A": _A, "N": {"type": "integer"}}


@pytest.mark.parametrize(
    ("schema", "witness", "named"),
    [
        # of several allOf schemas xgrammar enforces none
        ({"allOf": [_A, _B]}, '{"b": 1}', "an 'allOf' of 2 schemas (at allOf)"),
        # beside a $ref, anyOf, oneOf or allOf, the other assertions are left out
        (
            {"$defs": _DEFS, "type": "object", "properties": {"x": {"$ref": "#/$defs/N", "minimum": 5}}},
            '{"x": 1}',
            "'minimum' beside '$ref' (at properties/x)",
        ),
        ({**_A, "anyOf": [_B]}, '{"b": 1}', "'properties' beside 'anyOf' (at the top)"),
        ({**_A, "allOf": [_B]}, '{"b": 1}', "'properties' beside 'allOf'"),
        (
            {"type": "object", "required": ["a"], "oneOf": [_B, {"type": "object", "required": ["c"]}]},
            '{"b": 1}',
            "'required' beside 'oneOf'",
        ),
        # a type beside anyOf is left out too: branches without one of their own take anything
        ({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}, "1", "'type' beside 'anyOf'"),
        ({"type": "integer", "anyOf": [{"type": "string"}, {"type": "integer"}]}, '"a"', "'type' beside"),
        ({"$defs": _DEFS, "$ref": "#/$defs/N", "anyOf": [{"type": "string"}]}, "1", "'anyOf' beside '$ref'"),
        # string and number bounds without a type
        ({"maxLength": 2}, '"abc"', "'maxLength' without a 'type' (at the top)"),
        ({"type": "array", "items": {"minimum": 5}}, "[1]", "'minimum' without a 'type' (at items)"),
        ({"pattern": "^a$"}, '"b"', "'pattern' without a 'type'"),
        # every enum value is offered, also one the keywords beside it refuse
        ({"type": "string", "enum": ["a", 1]}, "1", "'enum' value that the keywords beside it refuse (1"),
        ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, '"bb"', '("bb", at enum)'),
        ({"type": "string", "enum": ["a", "b"], "pattern": "^a$"}, '"b"', '("b", at enum)'),
    ],
)
def test_what_xgrammar_leaves_out_is_named(schema: dict[str, Any], witness: str, named: str) -> None:
    # The witness proves the gap: xgrammar's grammar takes it, and the schema refuses it.
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert _is_grammar_accept_string(grammar, witness)
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(witness))
    gap = xgrammar_gap(schema)
    assert gap is not None and named in gap, gap


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [_A], "description": "one schema: enforced"},
        {"$defs": _DEFS, "$ref": "#/$defs/A", "title": "T", "default": {"a": 1}, "examples": [{"a": 2}]},
        {"$defs": _DEFS, "type": "object", "$ref": "#/$defs/A"},  # the $ref keeps within the type
        {"type": ["object", "null"], "anyOf": [_A, {"type": "null"}]},
        {"type": "number", "anyOf": [{"type": "integer"}, {"type": "number", "minimum": 0.5}]},
        {
            "type": "object",
            "anyOf": [{"properties": {"a": {}}, "required": ["a"]}, {"additionalProperties": False}],
        },
        {"type": "string", "enum": ["a", "bb"], "title": "E"},  # as pydantic writes an Enum
        {"const": "cat", "type": "string"},
        {"properties": {"a": {"type": "integer"}}},  # no type: xgrammar takes it as an object
        {"type": ["string", "integer"], "maxLength": 2, "minimum": 5},
        {"anyOf": [{"type": "string"}, {"type": "null"}], "nullable": True},  # unknown: asserts nothing
    ],
)
def test_what_xgrammar_enforces_beside_a_combinator_passes(schema: dict[str, Any]) -> None:
    assert xgrammar_gap(schema) is None


def test_more_pydantic_shapes_pass() -> None:
    import datetime
    from typing import Annotated, Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field, conint, constr

    class Inner(BaseModel):
        v: Annotated[int, Field(ge=0, le=9)]

    class Outer(BaseModel):
        inner: Inner = Field(description="described model field")
        default_inner: Inner = Inner(v=1)
        maybe: Annotated[str, Field(min_length=1)] | None = None
        nums: list[Annotated[float, Field(gt=0)]] = Field(min_length=1, max_length=3)
        table: dict[str, Inner]
        when: datetime.date
        code: constr(pattern=r"^[A-Z]{3}$")  # type: ignore[valid-type]
        small: conint(multiple_of=2) | None = None  # type: ignore[valid-type]
        kind: Literal["a", "b"] = "a"
        pair: tuple[int, str]

    for schema in (Outer.model_json_schema(), to_strict_json_schema(Outer)):
        assert xgrammar_gap(schema) is None, (xgrammar_gap(schema), schema)


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "integer"}, {"type": "number"}],  # every integer is a number
        [{"type": "string"}, {"type": "string", "maxLength": 3}],
        [{"const": 1}, {"const": 1.0}],
        [{"enum": ["a", "b"]}, {"enum": ["b"]}],
        [{"type": "object"}, {"type": ["object", "null"]}],
        [True, {"type": "string"}],
        # no type: a string matches both
        [{"properties": {"k": {"const": "a"}}, "required": ["k"]}, {"properties": {"k": {"const": "b"}}}],
        # two branches may leave the tag out: {} matches both
        [
            {"type": "object", "properties": {"k": {"const": "a"}}},
            {"type": "object", "properties": {"k": {"const": "b"}}},
        ],
    ],
)
def test_a_one_of_whose_branches_may_overlap_is_named(branches: list[Any]) -> None:
    gap = xgrammar_gap({"type": "object", "properties": {"v": {"oneOf": branches}}})
    assert gap is not None and "'oneOf' (at properties/v/oneOf)" in gap and "use 'anyOf'" in gap


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": ["null", "boolean"]}]},
        {"oneOf": [{"const": 1}, {"const": True}, {"enum": ["1", None]}]},  # true is not 1
        {"oneOf": [{"type": "string"}, False, {"type": "object"}]},
        {"oneOf": [{"type": "string", "maxLength": 3}]},
        {  # the tag's type on the parent, the branches each require it
            "type": "object",
            "oneOf": [
                {"properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]},
                {"properties": {"k": {"const": "d"}}},  # one may leave it out
            ],
        },
        {  # a property named like a keyword is not one
            "type": "object",
            "properties": {"not": {"type": "string"}, "if": {}, "oneOf": {"type": "integer"}},
            "required": ["not"],
        },
        {"type": "array", "items": {"$ref": "#"}},  # recursion ends
    ],
)
def test_what_xgrammar_enforces_passes(schema: dict[str, Any]) -> None:
    assert xgrammar_gap(schema) is None


def test_pydantic_and_openai_sdk_schemas_pass() -> None:
    from enum import StrEnum
    from typing import Annotated, Literal

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"] = "dog"  # not required in the schema
        barks: float

    class Lizard(BaseModel):
        pet_type: Literal["lizard", "gecko"]

    class Color(StrEnum):
        red = "red"
        blue = "blue"

    class Owner(BaseModel):
        pet: Cat | Dog | Lizard = Field(discriminator="pet_type")
        pets: list[Annotated[Cat | Dog, Field(discriminator="pet_type")]]
        maybe: Cat | None = None
        color: Color
        n: int | str
        friend: Owner | None = None

    schema = Owner.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    assert xgrammar_gap(schema) is None
    assert xgrammar_gap(to_strict_json_schema(Owner)) is None


def _pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def _optional(count: int, required: int = 0) -> dict[str, Any]:
    properties = {f"p{i}": {"type": "string", "maxLength": 5} for i in range(count + required)}
    return {"type": "object", "properties": properties, "required": [f"p{i}" for i in range(required)]}


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        # 20,000 optional properties: 14 minutes of the engine's only compile thread, then 9.5 GB
        (_optional(20_000), "an object has 20000 properties that may be left out"),
        (_optional(129), "an object has 129 properties that may be left out"),
        ({"type": "object", "properties": {"a": _optional(100), "b": _optional(100)}}, "too costly"),
        (
            {
                "type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
                "required": [],
            },
            "too costly",
        ),
        ({"type": "array", "items": [{"type": "integer"}] * 5001}, "more than 5000 schema objects"),
        # A 1.5 MB alternation held the event loop for 5 to 9 s in Python's re.compile alone
        (_pattern("|".join(f"w{i}" for i in range(200_000))), "more than 16384 characters together"),
        (
            {"type": "object", "properties": {f"p{i}": _pattern("a" * 6000) for i in range(3)}},
            "regular expressions ('pattern', 'patternProperties') are too long",
        ),
        ({"type": "object", "patternProperties": {"b" * 16385: {}}}, "too long"),
        # 64,000 eight-letter values: 19 s of the engine's compile thread
        ({"type": "string", "enum": [f"{i:08d}" for i in range(64_000)]}, "'enum' and 'const' values"),
        (
            {"type": "object", "properties": {f"p{i}": {"const": "c" * 7000} for i in range(10)}},
            "more than 65536 characters together",
        ),
    ],
)
def test_schemas_too_costly_to_check_or_compile_are_400s(schema: dict[str, Any], words: str) -> None:
    for fmt in ({"response_format": _schema_format(schema)}, {"structured_outputs": {"json": schema}}):
        with pytest.raises(InvalidRequest) as info:
            request_constraint(fmt)
        assert info.value.param == next(iter(fmt))
        assert words in info.value.message


def test_large_schemas_within_the_bounds_pass() -> None:
    for schema in (
        _optional(128),
        _optional(90, required=3000),
        {"type": "object", "properties": {"a": _optional(90)}},
        {"type": "object", "properties": {"a": _pattern("a" * 8000), "b": _pattern("b" * 8000)}},
        {"type": "object", "properties": {"pattern": {"type": "object"}}},  # a property named so
        {"type": "string", "enum": [f"{i:08d}" for i in range(6000)]},  # 60,000 characters
        {"type": "object", "properties": {"const": {"type": "string", "description": "d" * 70_000}}},
    ):
        assert check_schema(schema, "response_format") is schema


def test_regex_constraints_are_bounded_in_length() -> None:
    # Compiled by xgrammar on the event loop, then by the engine in time that grows with the
    # square of its size; vLLM's 5 s compile timeout keeps the loop waiting all that time.
    long = "|".join(f"w{i}" for i in range(5000))
    with pytest.raises(InvalidRequest) as info:
        request_constraint({"structured_outputs": {"regex": long}})
    assert info.value.param == "structured_outputs"
    assert "at most 16384 characters" in info.value.message
    fits = "a" * 16384
    assert request_constraint({"structured_outputs": {"regex": fits}}) == (
        Constraint("regex", fits),
        "structured_outputs",
    )


@pytest.mark.parametrize("kind", ["grammar", "choice"])
def test_grammar_and_choice_constraints_are_bounded_in_length(kind: str) -> None:
    # Unbounded, each held the engine's compile thread (every structured request waited):
    # 150,000 choices (a 2 MB body) 34 s, a 590 KB grammar 49 s.
    choices = [f"{i:08d}" for i in range(150_000)]
    long: Any = choices if kind == "choice" else "root ::= " + " | ".join(f'"{c}"' for c in choices)
    with pytest.raises(InvalidRequest) as info:
        request_constraint({"structured_outputs": {kind: long}})
    assert info.value.param == "structured_outputs"
    assert f"'structured_outputs.{kind}' is too long" in info.value.message
    fits: Any = choices[:8192] if kind == "choice" else 'root ::= "' + "a" * (16384 - 12) + '"'
    assert request_constraint({"structured_outputs": {kind: fits}})[0] is not None


# -- values without end (a $ref cycle with no way out) ----------------------------------------
_LOOP_D = {"type": "object", "properties": {"d": {"$ref": "#/$defs/D"}}, "required": ["d"]}


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"$ref": "#"}, ""),  # the engine had no token to allow: a 500
        ({"$defs": {"T": {"$ref": "#/$defs/T"}}, "$ref": "#/$defs/T"}, ""),
        # found by a fuzz run: the inner T is not the one "#/$defs/T" names
        (
            {"$defs": {"T": {"$defs": {"T": {"type": "number"}}, "$ref": "#/$defs/T"}}, "$ref": "#/$defs/T"},
            "",
        ),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, ""),
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, ""),  # an object by its words
        # optional, but once its key is written only whitespace may follow
        ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "properties/a"),
        ({"$defs": {"D": _LOOP_D}, "anyOf": [{"$ref": "#/$defs/D"}, {"type": "string"}]}, "anyOf/0"),
        (
            {
                "$defs": {
                    "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                    "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
                },
                "$ref": "#/$defs/A",
            },
            "",
        ),
        (  # a tree whose every node needs a child
            {
                "$defs": {
                    "N": {
                        "type": "object",
                        "properties": {"c": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/N"}}},
                        "required": ["c"],
                    }
                },
                "$ref": "#/$defs/N",
            },
            "",
        ),
        (
            {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2},
            "",
        ),
        ({"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/properties/x"}]}}}, "properties/x"),
    ],
)
def test_a_schema_whose_values_could_only_be_infinite_is_a_400_naming_where(
    schema: dict[str, Any], where: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_response_format(_schema_format(schema))
    message = info.value.message
    assert info.value.param == "response_format"
    assert "no finite JSON value can be generated" in message
    assert (f" at {where}:" in message) if where else ("' at " not in message), message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
        {
            "type": "object",
            "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["n"],
        },
        {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {
            "$defs": {
                "N": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}}},
                    "required": ["c"],
                }
            },
            "$ref": "#/$defs/N",
        },
        {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1},
        {"$defs": {"Unused": {"$ref": "#/$defs/Unused"}}, "type": "object"},  # nothing refers to it
        {"type": "object", "properties": {"a": False}, "required": ["a"]},  # the backend's to refuse
        {"$ref": "https://example.com/elsewhere.json"},  # not the schema's own: the engine judges
    ],
)
def test_recursive_schemas_with_a_way_out_pass(schema: dict[str, Any]) -> None:
    assert parse_response_format(_schema_format(schema)) == Constraint("json", schema)


def test_pydantic_recursive_models_pass() -> None:
    from pydantic import BaseModel

    class Node(BaseModel):
        value: int
        children: list[Node]
        parent: Node | None = None

    assert parse_response_format(_schema_format(Node.model_json_schema())) is not None


def test_a_long_chain_of_refs_is_followed_to_its_end() -> None:
    n = 1500
    defs: dict[str, Any] = {
        f"N{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/N{i + 1}"}}, "required": ["n"]}
        for i in range(n)
    }
    defs[f"N{n}"] = {"type": "string"}
    assert parse_response_format(_schema_format({"$defs": defs, "$ref": "#/$defs/N0"})) is not None
    defs[f"N{n}"] = {"$ref": "#/$defs/N0"}  # no end now
    with pytest.raises(InvalidRequest, match="no finite JSON value"):
        parse_response_format(_schema_format({"$defs": defs, "$ref": "#/$defs/N0"}))
