"""``GET /openapi.json``: an OpenAPI 3.1 document of every endpoint the gateway serves.

Request bodies are the request models' own JSON schemas (pydantic's validation mode, so the
document says what the handlers accept), gathered under ``components/schemas`` with their
``$ref``s pointing there. ``response_format`` and ``structured_outputs`` are read from a
body's extra fields (``structured``), so their schemas are written here, as are the response
bodies (small: the keys clients rely on) and OpenAI's error object, which every 4xx and 5xx
carries.

``create_app`` builds the document once, from the app's own route list: an operation is
listed for each route and method, and a route missing from ``OPERATIONS`` stops the app
from being built, so no endpoint goes undocumented. The path is public, like
``/playground`` and like vLLM's server: the document holds nothing of the deployment (no
model names, no keys), only what this README says too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, get_origin

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway import __version__
from gateway.protocol import (
    MAX_LOGIT_BIAS,
    ChatCompletionRequest,
    CompletionRequest,
    HouseChatRequest,
    null_default_fields,
)
from gateway.responses_api import ResponsesRequest
from gateway.structured import STRUCTURED_KINDS, STRUCTURED_UNSUPPORTED
from gateway.tokenize_api import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
JSON, SSE, TEXT, HTML = "application/json", "text/event-stream", "text/plain", "text/html"

# Errors every keyed operation can answer: bad key (401), request head too large (431).
_KEYED = (401, 431)
# ... plus, for a body: not JSON / invalid (400), not received within limits.body_timeout_s
# (408), too large (413), not JSON declared (415).
_BODY = (400, 408, 413, 415)
# ... plus, for generation: routing (404), admission (429), engine not ready or draining
# (503), the engine failing mid-request (500).
_GENERATE = (404, 429, 500, 503)
_STORED = (400, 404, 500)  # 500: the response store failed (store_error)
_DESCRIPTIONS = {
    200: "OK",
    400: "Invalid request",
    401: "Missing or invalid API key",
    403: "The key may not use this endpoint",
    404: "No such model, route or object (for this key)",
    408: "The request body did not arrive within limits.body_timeout_s",
    413: "Request body too large",
    415: "The body is declared as something other than JSON",
    422: "The reload failed (code catalog_invalid); the previous catalog keeps serving",
    429: "Too many requests in flight (Retry-After)",
    431: "Request headers too large",
    500: "The engine failed during the request",
    503: "The engine is starting, stopped, or the gateway is draining (Retry-After)",
}


@dataclass(frozen=True)
class Operation:
    summary: str
    ok: dict[str, str]  # media type -> schema name ("" for a plain string)
    body: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    tag: str = "inference"
    headers: tuple[dict[str, Any], ...] = ()


_STREAM_FORMAT = {
    "name": "X-Stream-Format",
    "in": "header",
    "required": False,
    "description": "'house' streams the team's house SSE events instead of OpenAI's (one choice, no tools); "
    "'openai' (the default) OpenAI's. Any other value is a 400 naming the header.",
    "schema": {"type": "string", "enum": ["openai", "house"]},
}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion (OpenAI)",
        {JSON: "ChatCompletion", SSE: "Event"},
        ChatCompletionRequest,
        _KEYED + _BODY + _GENERATE,
        headers=(_STREAM_FORMAT,),
    ),
    ("POST", "/v1/completions"): Operation(
        "Create a completion (OpenAI)",
        {JSON: "Completion", SSE: "Event"},
        CompletionRequest,
        _KEYED + _BODY + _GENERATE,
    ),
    ("POST", "/chat"): Operation(
        "The house chat stream (any Content-Type; the body is read as JSON)",
        {SSE: "Event"},
        HouseChatRequest,
        (400, 401, 408, 413, 431) + _GENERATE,
    ),
    ("POST", "/v1/responses"): Operation(
        "Create a response (OpenAI Responses API)",
        {JSON: "Response", SSE: "Event"},
        ResponsesRequest,
        _KEYED + _BODY + _GENERATE,
    ),
    ("GET", "/v1/responses/{response_id}"): Operation(
        "Retrieve a stored response of this key", {JSON: "Response"}, None, _KEYED + _STORED
    ),
    ("DELETE", "/v1/responses/{response_id}"): Operation(
        "Delete a stored response of this key", {JSON: "DeletedResponse"}, None, _KEYED + (404, 500)
    ),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        "List a stored response's input items (query: after, before, limit, order)",
        {JSON: "ResponseItemList"},
        None,
        _KEYED + _STORED,
    ),
    ("POST", "/v1/responses/{response_id}/cancel"): Operation(
        "Cancel a background response: this gateway runs none, so a stored one is a 400",
        {JSON: "Response"},
        None,
        _KEYED + _STORED,
    ),
    ("POST", "/tokenize"): Operation(
        "Tokenize a prompt or chat messages (vLLM)",
        {JSON: "TokenizeResponse"},
        TokenizeRequest,
        _KEYED + _BODY + (404, 503),
    ),
    ("POST", "/detokenize"): Operation(
        "Detokenize token ids (vLLM)",
        {JSON: "DetokenizeResponse"},
        DetokenizeRequest,
        _KEYED + _BODY + (404, 503),
    ),
    ("GET", "/v1/models"): Operation(
        "List the models this key may use", {JSON: "ModelList"}, None, _KEYED + (503,), "models"
    ),
    ("GET", "/v1/models/{name}"): Operation(
        "Retrieve a model", {JSON: "Model"}, None, _KEYED + (404, 503), "models"
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics", {TEXT: ""}, None, _KEYED + (403,), "operations"),
    ("GET", "/health"): Operation("Liveness", {JSON: "Status"}, None, (431, 503), "operations"),
    ("GET", "/ready"): Operation(
        "Readiness: the engine is up, not draining", {JSON: "Status"}, None, (431, 503), "operations"
    ),
    ("GET", "/playground"): Operation(
        "A page to try the routes in a browser", {HTML: ""}, None, (431,), "operations"
    ),
    ("GET", "/openapi.json"): Operation("This document", {JSON: "Object"}, None, (431,), "operations"),
    ("GET", "/admin/adapters"): Operation(
        "The catalog's routes and adapters", {JSON: "Object"}, None, _KEYED + (403, 503), "admin"
    ),
    ("POST", "/admin/adapters/reload"): Operation(
        "Reload the catalog now", {JSON: "Object"}, None, _KEYED + (403, 422, 503), "admin"
    ),
    ("GET", "/admin/status"): Operation(
        "Requests in flight, draining, the engine's queue", {JSON: "Object"}, None, _KEYED + (403,), "admin"
    ),
}

_STRING: dict[str, Any] = {"type": "string"}
_OBJECT: dict[str, Any] = {"type": "object"}
_NULLABLE_STRING: dict[str, Any] = {"type": ["string", "null"]}


def _obj(required: Iterable[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": properties}


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "additionalProperties": False}


def _only(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return _closed(_obj((name,), **{name: schema}))


def _const(value: str) -> dict[str, Any]:
    return {"type": "string", "const": value}


_CACHED = _obj(
    ("cached_tokens",),
    cached_tokens={"type": "integer", "description": "Prompt tokens read from the engine's prefix cache"},
)
_USAGE = _obj(
    ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"),
    prompt_tokens={"type": "integer"},
    completion_tokens={"type": "integer"},
    total_tokens={"type": "integer"},
    prompt_tokens_details=_CACHED,
)
_RESPONSE_USAGE = _obj(
    ("input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"),
    input_tokens={"type": "integer"},
    input_tokens_details=_CACHED,
    output_tokens={"type": "integer"},
    output_tokens_details=_obj(("reasoning_tokens",), reasoning_tokens={"type": "integer"}),
    total_tokens={"type": "integer"},
)
_FINISH = {"type": ["string", "null"]}
# Written by hand: the handlers build these as dicts (protocol, sse, responses_events).
_ERROR = _closed(
    _obj(
        ("message", "type", "param", "code"),
        message=_STRING,
        type=_STRING,
        param=_NULLABLE_STRING,
        code=_NULLABLE_STRING,
    )
)
_RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": _only("error", _ERROR),
    # A failed reload: OpenAI's error (code catalog_invalid) and the report, the routes serving.
    "ReloadError": _closed(
        _obj(
            ("error", "reloaded", "routes"),
            error=_ERROR,
            reloaded={"type": "boolean", "const": False},
            routes={"type": "array", "items": _STRING},
        )
    ),
    "ChatCompletion": _obj(
        ("id", "object", "created", "model", "choices", "usage"),
        id=_STRING,
        object=_const("chat.completion"),
        created={"type": "integer"},
        model=_STRING,
        choices={
            "type": "array",
            "items": _obj(
                ("index", "message", "finish_reason"),
                index={"type": "integer"},
                message=_obj(("role",), role=_const("assistant"), content=_NULLABLE_STRING),
                finish_reason=_FINISH,
            ),
        },
        usage=_USAGE,
    ),
    "Completion": _obj(
        ("id", "object", "created", "model", "choices", "usage"),
        id=_STRING,
        object=_const("text_completion"),
        created={"type": "integer"},
        model=_STRING,
        choices={
            "type": "array",
            "items": _obj(
                ("index", "text", "finish_reason"),
                index={"type": "integer"},
                text=_STRING,
                finish_reason=_FINISH,
            ),
        },
        usage=_USAGE,
    ),
    "Response": _obj(
        ("id", "object", "created_at", "status", "model", "output"),
        id=_STRING,
        object=_const("response"),
        created_at={"type": "number"},
        status=_STRING,
        model=_STRING,
        output={"type": "array", "items": _OBJECT},
        usage={"anyOf": [_RESPONSE_USAGE, {"type": "null"}]},  # null while in progress
    ),
    "DeletedResponse": _obj(
        ("id", "object", "deleted"),
        id=_STRING,
        object=_const("response.deleted"),
        deleted={"type": "boolean"},
    ),
    "ResponseItemList": _obj(
        ("object", "data", "first_id", "last_id", "has_more"),
        object=_const("list"),
        data={"type": "array", "items": _OBJECT},
        first_id=_NULLABLE_STRING,
        last_id=_NULLABLE_STRING,
        has_more={"type": "boolean"},
    ),
    "Model": _obj(
        ("id", "object", "created", "owned_by"),
        id=_STRING,
        object=_const("model"),
        created={"type": "integer"},
        owned_by=_STRING,
        root=_STRING,
        parent=_NULLABLE_STRING,
    ),
    "ModelList": _obj(
        ("object", "data"),
        object=_const("list"),
        data={"type": "array", "items": {"$ref": REF.format(model="Model")}},
    ),
    "TokenizeResponse": _obj(
        ("count", "max_model_len", "tokens"),
        count={"type": "integer"},
        max_model_len={"type": "integer"},
        tokens={"type": "array", "items": {"type": "integer"}},
        token_strs={"anyOf": [{"type": "array", "items": _STRING}, {"type": "null"}]},  # null: not asked
    ),
    "DetokenizeResponse": _obj(("prompt",), prompt=_STRING),
    "Status": _obj(("status",), status=_STRING),
    "Object": _OBJECT,
    # One Server-Sent Event, as OpenAPI 3.1 describes a stream: each event by this schema.
    # ``data`` is a JSON object (OpenAI's chunks, the house events, Responses events) or
    # ``[DONE]``.
    "Event": _obj(("data",), event=_STRING, data=_STRING, id=_STRING),
}

# Extra body fields read by ``structured`` (not declared on the models, which keep extras).
_SCHEMA = {"type": "object", "description": "a JSON schema of an object"}
_JSON_SCHEMA_SPEC = _closed(  # unknown fields are refused (so below)
    _obj(
        ("name", "schema"),
        name={"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        description=_NULLABLE_STRING,
        schema=_SCHEMA,
        strict={"type": ["boolean", "null"]},
    )
)
_NULL = {"type": "null"}
_UNSET = {"enum": [None, False]}  # a field left at its default, as clients that dump vLLM's dataclass send


def _format(kind: str, required: Iterable[str] = (), **fields: dict[str, Any]) -> dict[str, Any]:
    """One ``response_format`` form: its ``type``, its own fields, the others' null."""
    others = {name: _NULL for name in ("json_schema", "schema") if name not in fields}
    return _closed(_obj(("type", *required), type=_const(kind), **fields, **others))


def _structured(kind: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One ``structured_outputs`` form: ``kind`` given, every other field unset."""
    others = {name: _UNSET for name in (*STRUCTURED_KINDS, *STRUCTURED_UNSUPPORTED) if name != kind}
    return _closed(_obj((kind,), **{kind: schema}, **others))


_EXTRA_FIELDS: dict[str, dict[str, Any]] = {
    "response_format": {
        "description": "OpenAI's response_format; the output is constrained to it.",
        "oneOf": [
            _format("text"),
            _format("json_object", schema={"anyOf": [_SCHEMA, _NULL]}),
            _format("json_schema", ("json_schema",), json_schema=_JSON_SCHEMA_SPEC),
            _NULL,
        ],
    },
    "structured_outputs": {
        "description": "vLLM's structured outputs: exactly one of json, json_object, regex, choice, grammar.",
        "oneOf": [
            _structured("json", {"type": ["object", "string"]}),
            _structured("json_object", {"const": True}),
            _structured("regex", {"type": "string", "minLength": 1}),
            _structured("choice", {"type": "array", "minItems": 1, "items": _STRING}),
            _structured("grammar", {"type": "string", "minLength": 1}),
            _NULL,
        ],
    },
}
_TAKES_EXTRAS = {"ChatCompletionRequest": tuple(_EXTRA_FIELDS), "CompletionRequest": tuple(_EXTRA_FIELDS)}
_TAKES_EXTRAS["HouseChatRequest"] = ("response_format",)


def _request_schemas(models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """The models' JSON schemas, and those they use, keyed by name, refs into components."""
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas: dict[str, Any] = top.get("$defs", {})
    for name, fields in _TAKES_EXTRAS.items():
        schemas[name]["properties"].update({f: _EXTRA_FIELDS[f] for f in fields})
    _refine(schemas)
    for model in _with_nested(models):  # null is taken as the default there: the document too
        properties = schemas[model.__name__]["properties"]
        for field in null_default_fields(model):
            key = model.model_fields[field].alias or field
            if not any(option.get("type") == "null" for option in properties[key].get("anyOf", ())):
                properties[key] = {"anyOf": [properties[key], {"type": "null"}]}
    return schemas


# What validators check beyond the models' types, where a schema can say it.
_LOGIT_BIAS = {
    "anyOf": [
        {
            "type": "object",
            "description": "token id -> bias added to its logit",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "maxProperties": MAX_LOGIT_BIAS,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        _NULL,
    ]
}
_REFUSAL_PART = _closed(_obj(("type", "refusal"), type=_const("refusal"), refusal=_STRING))


def _refine(schemas: dict[str, Any]) -> None:
    for schema in schemas.values():
        if "logit_bias" in schema.get("properties", {}):
            schema["properties"]["logit_bias"] = _LOGIT_BIAS
    if "Message" in schemas:  # an assistant's refusal parts are read as its text (a user's: a 400)
        schemas["RefusalPart"] = {**_REFUSAL_PART, "description": "in assistant messages only"}
        for option in schemas["Message"]["properties"]["content"]["anyOf"]:
            if option.get("type") == "array":
                option["items"] = {"anyOf": [option["items"], {"$ref": REF.format(model="RefusalPart")}]}
        # OpenAI's deprecated form of a call: a 400, send tool_calls
        schemas["Message"]["properties"]["function_call"] = _NULL
    if "TokenizeRequest" in schemas:  # exactly one of them (a null one is not given)
        schemas["TokenizeRequest"]["oneOf"] = [
            {"required": [name], "properties": {name: {"not": _NULL}}} for name in ("prompt", "messages")
        ]
    for option in (
        schemas.get("ChatCompletionRequest", {}).get("properties", {}).get("tools", {}).get("anyOf", ())
    ):
        if option.get("type") == "array":  # as OpenAI and vLLM: leave it out instead
            option["minItems"] = 1


def _with_nested(models: Sequence[type[BaseModel]]) -> list[type[BaseModel]]:
    """``models`` and the models their fields hold directly (``ResponsesRequest.text``)."""
    found: dict[str, type[BaseModel]] = {}
    stack = list(models)
    while stack:
        model = stack.pop()
        if model.__name__ in found:
            continue
        found[model.__name__] = model
        for field in model.model_fields.values():
            kind = field.annotation
            if get_origin(kind) is None and isinstance(kind, type) and issubclass(kind, BaseModel):
                stack.append(kind)
    return list(found.values())


def _content(media: dict[str, str]) -> dict[str, Any]:
    return {
        kind: {"schema": {"$ref": REF.format(model=name)} if name else _STRING}
        for kind, name in media.items()
    }


def _error_schema(path: str, status: int) -> str:
    """OpenAI's error object, except where an answer says why in its own shape."""
    if path in ("/health", "/ready") and status == 503:
        return "Status"  # {"status": "starting" | "draining" | "error", ...}; their 431 is an error
    return "ReloadError" if status == 422 else "Error"  # 422: only the reload's


def _responses(op: Operation, path: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": _content(op.ok)}}
    for status in sorted(op.errors):
        content = _content({JSON: _error_schema(path, status)})
        responses[str(status)] = {"description": _DESCRIPTIONS[status], "content": content}
    return responses


def _operation(method: str, path: str, op: Operation, public: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path).rstrip('_')}",
        "summary": op.summary,
        "tags": [op.tag],
        "responses": _responses(op, path),
        "security": [] if public else [{"bearer": []}, {"apiKey": []}],
    }
    params = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for p in re.findall(r"{(\w+)}", path)
    ]
    if params or op.headers:
        out["parameters"] = [*params, *op.headers]
    if op.body is not None:
        ref = {"$ref": REF.format(model=op.body.__name__)}
        out["requestBody"] = {"required": True, "content": {JSON: {"schema": ref}}}
    return out


def build_document(routes: Sequence[BaseRoute], public_paths: frozenset[str]) -> dict[str, Any]:
    """The OpenAPI document of ``routes``; ``KeyError`` for a route that ``OPERATIONS`` lacks."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        path = re.sub(r"{(\w+):\w+}", r"{\1}", route.path)  # {name:path} -> {name}
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op = OPERATIONS.get((method, path))
            if op is None:
                raise KeyError(f"{method} {path} is not described in gateway.openapi.OPERATIONS")
            paths.setdefault(path, {})[method.lower()] = _operation(method, path, op, path in public_paths)
    models = [op.body for op in OPERATIONS.values() if op.body is not None]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "LoRA gateway",
            "version": __version__,
            "description": "OpenAI-compatible: one vLLM engine, many LoRA adapters routed per request.",
        },
        "paths": paths,
        "components": {
            "schemas": {**_request_schemas(models), **_RESPONSE_SCHEMAS},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
            },
        },
    }


def render(routes: Sequence[BaseRoute], public_paths: frozenset[str]) -> bytes:
    return json.dumps(build_document(routes, public_paths), separators=(",", ":")).encode()


async def openapi_json(request: Request) -> Response:
    body: bytes = request.app.state.openapi  # rendered once, by create_app
    return Response(body, media_type=JSON)
