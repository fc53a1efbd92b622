"""What the grammar backend (xgrammar) takes and does not enforce, checked against xgrammar
itself: each witness is an instance its grammar accepts and the schema refuses (or, for a
shape that must pass, one both refuse). Also the checks' own costs and failures, the auto +
format grammar's messages, and the lowest repetition_penalty the sampler survives. Found by
a review of the first version of these checks."""

from __future__ import annotations

import contextlib
import json
import time
import tracemalloc
from typing import Any

import jsonschema
import pytest

from gateway.errors import InvalidRequest
from gateway.structured import xgrammar_gap

# vLLM's own checks import torch pieces that warn on import
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


def _xgr_accepts(schema: dict[str, Any], value: Any) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, json.dumps(value))


# -- 1. false refusal: pydantic's dict with bounded keys ------------------------------------
def test_pydantic_dict_with_bounded_keys_is_not_refused() -> None:
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Tags(BaseModel):
        counts: dict[Annotated[str, Field(max_length=3)], int]

    schema = Tags.model_json_schema()
    assert schema["properties"]["counts"]["propertyNames"] == {"maxLength": 3}  # no type: keys are strings
    # xgrammar does enforce it: a 4-letter key is refused, as the schema refuses it
    assert not _xgr_accepts(schema, {"counts": {"abcd": 1}})
    assert _xgr_accepts(schema, {"counts": {"abc": 1}})
    assert xgrammar_gap(schema) is None


# -- 2. a type beside anyOf "kept" by branches whose keywords xgrammar does not type ---------
@pytest.mark.parametrize(
    ("schema", "witness"),
    [
        ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, 1),
        ({"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {}),
        # asserted to pass in test_structured.py::test_what_xgrammar_enforces_beside_a_combinator_passes
        ({"type": "object", "anyOf": [{"required": ["a"]}, {"properties": {"b": {"const": 1}}}]}, "s"),
        ({"type": "object", "anyOf": [{"minProperties": 1}]}, {}),
        ({"type": "object", "anyOf": [{"patternProperties": {"^a": {"type": "integer"}}}]}, 1),
        ({"type": "array", "anyOf": [{"minItems": 2}, {"maxItems": 0}]}, [1]),
        ({"type": "array", "anyOf": [{"contains": {"type": "string"}}]}, 1),
        ({"type": "array", "anyOf": [{"uniqueItems": True}]}, 1),
    ],
)
def test_type_beside_anyof_of_untyped_branches_is_a_gap(schema: dict[str, Any], witness: Any) -> None:
    assert _xgr_accepts(schema, witness)
    assert not jsonschema.Draft202012Validator(schema).is_valid(witness)
    assert xgrammar_gap(schema) is not None


# -- 3. object / array bounds without a type ---------------------------------------------------
@pytest.mark.parametrize(
    ("schema", "witness"),
    [
        ({"minItems": 2}, [1]),
        ({"required": ["a"]}, {}),
        ({"minProperties": 1}, {}),
        ({"additionalProperties": {"type": "integer"}, "required": ["a"]}, {}),
    ],
)
def test_object_and_array_bounds_without_a_type_are_a_gap(schema: dict[str, Any], witness: Any) -> None:
    assert _xgr_accepts(schema, witness)
    assert not jsonschema.Draft202012Validator(schema).is_valid(witness)
    assert xgrammar_gap(schema) is not None


# -- 4. keyword combinations xgrammar drops (it logs "ignoring ...") --------------------------
@pytest.mark.parametrize(
    ("schema", "witness"),
    [
        # pydantic constr(min_length=2, pattern=...): "pattern combined with minLength/maxLength"
        ({"type": "string", "minLength": 2, "pattern": "^a+$"}, "a"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa"),
        # pydantic Annotated[EmailStr, Field(max_length=5)]
        ({"type": "string", "format": "email", "maxLength": 5}, "abcd@x.com"),
        ({"type": "string", "format": "email", "pattern": "^a+$"}, "x@y.com"),
        # pydantic confloat(multiple_of=0.5): "multipleOf is not supported for type:number"
        ({"type": "number", "multipleOf": 0.5}, 0.3),
        # pydantic conint(gt=0, multiple_of=5): "range + multipleOf combination not yet supported"
        ({"type": "integer", "exclusiveMinimum": 0, "multipleOf": 5}, 3),
        # pydantic set[str]
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, ["a", "a"]),
        # required names a property that 'properties' does not declare
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {"a": 1}),
    ],
)
async def test_keyword_combinations_xgrammar_ignores_are_a_400(schema: dict[str, Any], witness: Any) -> None:
    # vLLM's own check (has_xgrammar_unsupported_json_features) finds most; ours the rest
    assert _xgr_accepts(schema, witness)
    assert not jsonschema.Draft202012Validator(schema).is_valid(witness)
    with pytest.raises(InvalidRequest):
        await _chat({"response_format": _fmt({"type": "object", "properties": {"v": schema}})})


# -- 5. CPU: _grammar_types walks every branch path (k ** depth) ----------------------------------
def test_type_beside_anyof_check_is_not_exponential(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.structured as structured

    calls = 0
    real = structured._grammar_types

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(structured, "_grammar_types", counting)
    n, k = 10, 3  # ~1 KB of schema; k=4, n=16 (~2 KB) would run for days on the event loop
    defs: dict[str, Any] = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}] * k} for i in range(n)}
    defs[f"D{n}"] = {"type": "string"}
    schema = {"type": "string", "anyOf": [{"$ref": "#/$defs/D0"}], "$defs": defs}
    xgrammar_gap(schema)
    assert calls < 1000, calls  # 3**10 + ... = 88573 now


# -- 6. CPU: the enum check runs the client's pattern with Python's backtracking re ------------
def test_enum_beside_a_pattern_is_no_redos() -> None:
    schema = {"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 25 + "!"]}  # ~70 bytes
    start = time.perf_counter()
    xgrammar_gap(schema)
    assert time.perf_counter() - start < 0.5  # ~2 s at 25 letters, doubling per letter


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|aa)+$"])  # the second is slow in the regex module too
@pytest.mark.parametrize(
    "where",
    [
        lambda p: {"properties": {"x": {"type": "string", "pattern": p}}, "required": ["x"]},
        lambda p: {"patternProperties": {p: {"type": "string"}}, "additionalProperties": False},
        lambda p: {"propertyNames": {"pattern": p}},
    ],
)
def test_enum_beside_a_nested_pattern_is_no_redos(pattern: str, where: Any) -> None:
    """Only a ``pattern`` beside the ``enum`` was left out: one under ``properties`` (or a
    ``patternProperties`` key, a ``propertyNames`` pattern) ran under ``re`` against the
    client's value, holding the GIL, so the check's thread stalled every stream too."""
    text = "a" * 27 + "!"
    schema = {"type": "object", **where(pattern), "enum": [{"x": text, text: "y"}]}
    start = time.perf_counter()
    xgrammar_gap(schema)
    assert time.perf_counter() - start < 1  # ~6 s at 27 letters under re, doubling per letter


def test_enum_values_share_one_regex_budget() -> None:
    """An object value of 200 keys, each a few ms under a ``patternProperties`` regex: a
    second together, each within the per-regex bound. The values share one budget: past it
    they are not judged (the refused one after them is not named), within about that budget."""
    from tests.unit.test_tools import SLOW, slow_key_length

    n = slow_key_length(0.005)
    slow = {"a" * n + f"!{i}": 1 for i in range(200)}
    schema = {
        "type": "object",
        "patternProperties": {SLOW: {}},
        "enum": [slow, {"refused": 1}],
        "minProperties": 2,
    }
    start = time.perf_counter()
    gap = xgrammar_gap(schema)
    assert time.perf_counter() - start < 0.5
    assert "refuse" not in (gap or "")


@pytest.mark.parametrize("where", ["^x{200000}$", "^(?:ab){100000}$", "^(a{1000}){200}$"])
def test_enum_beside_a_large_repeat_count_is_no_memory_bomb(where: str) -> None:
    """The regex module writes a repeat's minimum count out, copy by copy, as it compiles:
    ``a{200000}`` took 50 MB and ``a{4294967294}`` (14 bytes of schema) every byte the
    machine had, where Python's re (and xgrammar) keep one copy and a count."""
    schema = {"type": "string", "pattern": where, "enum": ["a"]}
    tracemalloc.start()
    try:
        xgrammar_gap(schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20, peak
    judged = {"type": "string", "pattern": "^a{4000}$", "enum": ["a" * 4000, "b"]}  # a count used as such
    assert xgrammar_gap(judged) is not None and '("b", at enum)' in (xgrammar_gap(judged) or "")


# -- 7. crash: the enum check's validator raising on keywords its own draft has not checked ------
@pytest.mark.parametrize("multiple_of", [0, "x"])
async def test_an_enum_beside_an_unchecked_multiple_of_is_no_500(multiple_of: Any) -> None:
    # draft-03 has no multipleOf, so its meta-schema lets 0 or "x" through; _refused_value then
    # validates with Draft 2020-12: ZeroDivisionError / TypeError escape as a 500.
    schema = {
        "$schema": "http://json-schema.org/draft-03/schema#",
        "type": "object",
        "properties": {"a": {"type": "number", "enum": [1, 2], "multipleOf": multiple_of}},
    }
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    with contextlib.suppress(InvalidRequest):  # a 400, or accepted: fine; any other error is a 500
        await _chat(body)


# -- 8/9. tool_choice auto + a JSON-schema format: the gap check reads the combined grammar -------
async def _chat(body: dict[str, Any]) -> Any:
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.protocol import ChatCompletionRequest
    from gateway.service import ChatService
    from gateway.settings import LimitSettings
    from tests.unit.fakes import FakeTokenizer
    from tests.unit.test_engine_params import _manager_on, _vllm_engine

    engine = _manager_on(_vllm_engine())
    engine._tokenizer, engine._max_model_len = FakeTokenizer(), 1000
    table = RoutingTable(base=Route(name="b", kind="base"), routes={}, errors={})
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    return await ChatService(engine, LimitSettings()).chat(request, Catalog(lambda ids: table).acquire(None))


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


async def test_a_format_gap_under_auto_tools_names_the_place_in_the_format() -> None:
    answer = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}
    with pytest.raises(InvalidRequest) as alone:
        await _chat({"response_format": _fmt(answer)})
    assert "(at properties/a/not)" in alone.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidRequest) as beside_tools:
        await _chat({"response_format": _fmt(answer), "tools": [tool]})
    # it was "(at $defs/answer.schema/properties/a/not)", a place not in the client's schema
    assert "(at properties/a/not)" in beside_tools.value.message, beside_tools.value.message


async def test_a_tool_schema_gap_under_auto_is_not_blamed_on_the_format() -> None:
    # An MCP-style "id or name" tool: fine under auto alone (its arguments are parsed, not
    # decoded); beside a JSON-schema format it was a 400 on response_format "at $defs/lookup".
    lookup = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
        "anyOf": [{"required": ["id"]}, {"required": ["name"]}],
    }
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": lookup}}]
    await _chat({"tools": tools})  # accepted
    answer = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await _chat({"tools": tools, "response_format": _fmt(answer)})  # accepted too: not in the grammar


# -- 10. repetition_penalty: the new lower bound still breaks vLLM's float32 sampler -----------
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_lowest_accepted_repetition_penalty_keeps_vllm_sampling_finite() -> None:
    import annotated_types
    import torch
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    from gateway.protocol import SamplingFields

    field = SamplingFields.model_fields["repetition_penalty"]
    lowest = next(m.ge for m in field.metadata if isinstance(m, annotated_types.Ge))
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    logits[0, 0] = float("-inf")  # the grammar's bitmask: token 0 is not allowed
    prompt = torch.tensor([[1]])  # token 1 (allowed, a positive logit) is in the prompt
    out = torch.full((1, 1), 4, dtype=torch.long)  # padding: no output yet
    penalized = apply_penalties(
        logits, prompt, out, torch.zeros(1), torch.zeros(1), torch.tensor([lowest], dtype=torch.float32)
    )
    probs = penalized.softmax(dim=-1, dtype=torch.float32)
    # at 1e-45, 1/1.4e-45 is inf in float32, so token 1's logit is inf, every probability NaN, and the
    # sampler picks token 0, which the grammar refuses: finish_reason "error", a 500 (EngineFailed).
    assert torch.isfinite(probs).all(), (penalized, probs)
    assert random_sample(probs, {}).item() != 0


# -- 11. a lookahead in a pattern: xgrammar's JSON-schema converter drops it, with a warning ------
_DIGIT = "^(?=.*[0-9])[a-z0-9]{3}$"  # three letters or digits, at least one a digit


@pytest.mark.parametrize(
    ("schema", "witness", "at"),
    [
        ({"type": "string", "pattern": _DIGIT}, "abc", "properties/v/pattern"),
        ({"type": "string", "pattern": "^(?!x)[a-z]$"}, "x", "properties/v/pattern"),
        (
            {
                "type": "object",
                "patternProperties": {"^(?!x)[a-z]$": {"type": "integer"}},
                "additionalProperties": False,
            },
            {"x": 1},
            "properties/v/patternProperties/^(?!x)[a-z]$",
        ),
    ],
)
async def test_a_lookahead_in_a_pattern_is_a_400(schema: dict[str, Any], witness: Any, at: str) -> None:
    assert _xgr_accepts(schema, witness)
    assert not jsonschema.Draft202012Validator(schema).is_valid(witness)
    with pytest.raises(InvalidRequest) as info:
        await _chat({"response_format": _fmt({"type": "object", "properties": {"v": schema}})})
    assert f"lookahead ('(?=' or '(?!') in a regular expression (at {at})" in info.value.message
    assert info.value.param == "response_format"


@pytest.mark.parametrize("pattern", [r"^[(?=]+$", r"^\(?=$", r"^[\]](?:a)$", r"^a\\[(?!]$"])
def test_what_only_looks_like_a_lookahead_passes(pattern: str) -> None:
    # in a class, or after an escaped "(": literal characters, which xgrammar enforces
    assert xgrammar_gap({"type": "string", "pattern": pattern}) is None


# -- 12. an ECMA-262 named group: a JSON Schema regex that xgrammar enforces ----------------------
async def test_an_ecma_named_group_is_taken_and_enforced() -> None:
    schema = {"type": "object", "properties": {"year": {"type": "string", "pattern": "^(?<y>[0-9]{4})$"}}}
    assert _xgr_accepts(schema, {"year": "2024"}) and not _xgr_accepts(schema, {"year": "20x4"})
    gen = await _chat({"response_format": _fmt(schema)})  # it was a 400: "is not a 'regex'"
    gen.close()
    assert gen.sampling.constraint.value == schema
