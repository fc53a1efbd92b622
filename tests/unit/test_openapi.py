"""``GET /openapi.json`` (gateway.openapi): every route and method the app serves is an
operation (a route left out of ``OPERATIONS`` stops the app from being built), the document
is valid OpenAPI 3.1 and its ``$ref``s all resolve, it is public, and its security follows
the public paths. tests/integration/test_fuzz.py fuzzes the live gateway with it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from gateway.openapi import OPERATIONS, build_document
from gateway.routes import PUBLIC_PATHS, ROUTES
from tests.helpers import assert_openai_error
from tests.unit.conftest import ADMIN, Serve


def _operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


def _served() -> set[tuple[str, str]]:
    served = set()
    for route in ROUTES:
        assert isinstance(route, Route)
        path = route.path.replace("{name:path}", "{name}")
        served |= {(method, path) for method in route.methods or () if method != "HEAD"}
    return served


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_every_route_and_method_is_an_operation_and_nothing_else() -> None:
    document = build_document(ROUTES, PUBLIC_PATHS)
    assert _operations(document) == _served()
    assert set(OPERATIONS) == _served()  # no description of a route that is gone


def test_a_route_without_a_description_stops_the_build() -> None:
    async def handler() -> None: ...

    with pytest.raises(KeyError, match="GET /v1/new"):
        build_document([*ROUTES, Route("/v1/new", handler, methods=["GET"])], PUBLIC_PATHS)


def test_the_document_is_valid_openapi_and_every_ref_resolves() -> None:
    document = build_document(ROUTES, PUBLIC_PATHS)
    validate(document)  # openapi-spec-validator: OpenAPI 3.1, JSON Schema 2020-12
    assert document["openapi"] == "3.1.0"
    schemas = document["components"]["schemas"]
    for ref in _refs(document):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def test_request_bodies_are_the_models_and_errors_are_openai_shaped() -> None:
    document = build_document(ROUTES, PUBLIC_PATHS)
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    request = document["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "tools", "tool_choice", "response_format", "structured_outputs"} <= set(
        request["properties"]
    )
    n = request["properties"]["n"]  # pydantic's constraints, as the handler applies them; null is n=1
    assert n == {"anyOf": [{"default": 1, "minimum": 1, "title": "N", "type": "integer"}, {"type": "null"}]}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    error = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
    for code in ("400", "401", "404", "429"):
        assert chat["responses"][code]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
    by_id = document["paths"]["/v1/responses/{response_id}"]
    assert set(by_id) == {"get", "delete"}
    assert by_id["get"]["parameters"][0]["in"] == "path"


@pytest.mark.parametrize(
    ("path", "schema", "body"),
    [
        ("/v1/completions", "CompletionRequest", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", "ResponsesRequest", {"input": "x"}),
        ("/tokenize", "TokenizeRequest", {"prompt": "x"}),
    ],
)
async def test_the_document_takes_every_null_the_server_takes(
    serve: Serve, path: str, schema: str, body: dict[str, Any]
) -> None:
    """A field whose null the handler reads as its default is nullable in the document: a
    client generated from it, or a validating proxy, took a body the server takes."""
    from gateway import openapi, protocol

    served = await serve()
    model = next(op.body for op in openapi.OPERATIONS.values() if op.body and op.body.__name__ == schema)
    fields = protocol.null_default_fields(model)
    assert fields  # each of these endpoints has some
    components = build_document(ROUTES, PUBLIC_PATHS)["components"]
    properties = components["schemas"][schema]["properties"]
    for field in sorted(fields):
        jsonschema.validate(None, {**properties[field], "components": components})  # its refs resolve
        r = await served.http.post(path, json={"model": "fake-model", **body, field: None})
        assert r.status_code == 200, (field, r.text)


CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
FUNCTION_CALL = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
    {"role": "user", "content": "y"},
]
COMPLETION = {"model": "fake-model", "prompt": "x", "max_tokens": 2}


def _documented(schema: str, body: Any) -> bool:
    components = build_document(ROUTES, PUBLIC_PATHS)["components"]
    try:
        jsonschema.validate(body, {**components["schemas"][schema], "components": components})
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("path", "schema", "body"),
    [
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "response_format": None}),
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "structured_outputs": None}),
        ("/v1/completions", "CompletionRequest", {**COMPLETION, "response_format": None}),
        ("/chat", "HouseChatRequest", {"model": "fake-model", "question": "x", "response_format": None}),
        (
            "/tokenize",
            "TokenizeRequest",
            {"model": "fake-model", "prompt": None, "messages": [{"role": "user", "content": "x"}]},
        ),
        ("/tokenize", "TokenizeRequest", {"model": "fake-model", "prompt": "x", "messages": None}),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {**CHAT, "structured_outputs": {"regex": "a", "choice": None}},
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {**CHAT, "structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {}},
                    "schema": None,
                },
            },
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {
                **CHAT,
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                    {"role": "user", "content": "y"},
                ],
            },
        ),
    ],
)
async def test_bodies_the_server_takes_are_documented(
    serve: Serve, path: str, schema: str, body: Any
) -> None:
    # The extra fields' null, unset siblings and refusal parts were answered but undocumented.
    served = await serve()
    r = await served.http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert _documented(schema, body)


@pytest.mark.parametrize(
    ("path", "schema", "body"),
    [
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {**CHAT, "response_format": {"type": "text", "schema": {}}},
        ),
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "logit_bias": {"abc": 1}}),
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "logit_bias": {"5": 150}}),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}},
        ),
        ("/v1/completions", "CompletionRequest", {**COMPLETION, "prompt": ["a"] * 257}),
        ("/v1/completions", "CompletionRequest", {**COMPLETION, "prompt": [[1]] * 257}),
        ("/tokenize", "TokenizeRequest", {"model": "fake-model"}),
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "tools": []}),
        ("/v1/chat/completions", "ChatCompletionRequest", {**CHAT, "messages": FUNCTION_CALL}),
        ("/tokenize", "TokenizeRequest", {"model": "fake-model", "messages": FUNCTION_CALL}),
    ],
)
async def test_bodies_the_server_refuses_for_fixed_rules_are_not_documented(
    serve: Serve, path: str, schema: str, body: Any
) -> None:
    served = await serve()
    assert (await served.http.post(path, json=body)).status_code == 400
    assert not _documented(schema, body)


@pytest.mark.parametrize(
    ("method", "path", "template"),
    [
        ("GET", "/v1/responses/resp_1", "/v1/responses/{response_id}"),
        ("DELETE", "/v1/responses/resp_1", "/v1/responses/{response_id}"),
        ("GET", "/v1/responses/resp_1/input_items", "/v1/responses/{response_id}/input_items"),
        ("POST", "/v1/responses/resp_1/cancel", "/v1/responses/{response_id}/cancel"),
    ],
)
async def test_a_store_failure_is_documented(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, method: str, path: str, template: str
) -> None:
    served = await serve()

    def locked(*args: Any) -> Any:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(served.gw.responses, "get_now", locked)
    monkeypatch.setattr(served.gw.responses, "delete_now", locked)
    r = await served.http.request(method, path)
    assert_openai_error(r, 500)
    assert "500" in build_document(ROUTES, PUBLIC_PATHS)["paths"][template][method.lower()]["responses"]


def test_security_is_a_key_except_on_public_paths() -> None:
    document = build_document(ROUTES, PUBLIC_PATHS)
    for path, item in document["paths"].items():
        for operation in item.values():
            assert (operation["security"] == []) == (path in PUBLIC_PATHS), path
    public_metrics = build_document(ROUTES, PUBLIC_PATHS | {"/metrics"})
    assert public_metrics["paths"]["/metrics"]["get"]["security"] == []


async def test_served_without_a_key_built_once(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    served = await serve()
    built: list[object] = []
    monkeypatch.setattr("gateway.openapi.build_document", lambda *args: built.append(args) or {})
    r = await served.http.get("/openapi.json", headers={"Authorization": ""})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    monkeypatch.undo()
    assert r.json() == build_document(ROUTES, PUBLIC_PATHS)
    assert (await served.http.get("/openapi.json")).content == r.content
    assert built == []  # rendered by create_app, not per request


async def test_the_served_document_has_the_apps_public_paths(serve: Serve) -> None:
    served = await serve(auth__public_metrics=True)
    document = (await served.http.get("/openapi.json")).json()
    assert document["paths"]["/metrics"]["get"]["security"] == []


# GET and DELETE were two routes: a 405 there (OPTIONS, found by schemathesis) allowed GET only.
async def test_a_405_on_a_response_id_allows_both_get_and_delete(serve: Serve) -> None:
    served = await serve()
    r = await served.http.request("OPTIONS", "/v1/responses/resp_1")
    assert_openai_error(r, 405)
    assert set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}


def assert_documented(document: dict[str, Any], method: str, path: str, r: httpx.Response) -> None:
    """``r``'s status is documented for the operation and its body valid against that schema."""
    responses = document["paths"][path][method]["responses"]
    assert str(r.status_code) in responses, (method, path, r.status_code)
    ref = responses[str(r.status_code)]["content"]["application/json"]["schema"]["$ref"]
    schema = {
        **document["components"]["schemas"][ref.rsplit("/", 1)[1]],
        "components": document["components"],
    }
    jsonschema.validate(r.json(), schema)


@pytest.mark.parametrize("path", ["/health", "/ready"])
async def test_a_431_on_health_and_ready_matches_its_documented_schema(serve: Serve, path: str) -> None:
    """The header limit answers before the route: OpenAI's error object, not a status object."""
    served = await serve()
    r = await served.http.get(path, headers={"x-big": "a" * 20_000})
    assert r.status_code == 431
    assert_documented(build_document(ROUTES, PUBLIC_PATHS), "get", path, r)


async def test_a_503_on_ready_matches_its_documented_schema(serve: Serve) -> None:
    served = await serve()
    served.gw.admission.draining = True
    r = await served.http.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "draining"}
    assert_documented(build_document(ROUTES, PUBLIC_PATHS), "get", "/ready", r)


@pytest.mark.parametrize("query", [{"stream": "true"}, {"include[]": "reasoning"}, {"starting_after": "3"}])
async def test_a_400_on_retrieving_a_response_is_documented(serve: Serve, query: dict[str, str]) -> None:
    served = await serve()
    r = await served.http.get("/v1/responses/resp_1", params=query)
    assert r.status_code == 400
    assert_documented(build_document(ROUTES, PUBLIC_PATHS), "get", "/v1/responses/{response_id}", r)


async def test_a_422_on_a_failed_reload_matches_its_documented_schema(serve: Serve, tmp_path: Path) -> None:
    served = await serve()
    (tmp_path / "adapters.yaml").write_text("routes: [this is not yaml\n")
    r = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert r.status_code == 422
    assert_documented(build_document(ROUTES, PUBLIC_PATHS), "post", "/admin/adapters/reload", r)


def test_every_operation_with_a_body_documents_408() -> None:
    """Every body is read under limits.body_timeout_s (``read_json``): a stalled upload is a 408."""
    document = build_document(ROUTES, PUBLIC_PATHS)
    with_body = [
        (path, method)
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if "requestBody" in operation
    ]
    assert len(with_body) == 6  # chat, completions, /chat, responses, tokenize, detokenize
    for path, method in with_body:
        assert "408" in document["paths"][path][method]["responses"], (method, path)


@pytest.mark.parametrize("path", ["/chat", "/v1/chat/completions"])
async def test_a_408_for_a_stalled_body_matches_its_documented_schema(serve: Serve, path: str) -> None:
    served = await serve(limits__body_timeout_s=0.05)

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"question": '
        await asyncio.sleep(5)
        yield b'"hi"}'

    r = await served.http.post(path, content=stalled(), headers={"content-type": "application/json"})
    assert r.status_code == 408, r.text
    assert_documented(build_document(ROUTES, PUBLIC_PATHS), "post", path, r)
