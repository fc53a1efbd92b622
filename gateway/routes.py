"""The HTTP handlers, one module-level function per endpoint, and the route list.

Each handler reads the typed ``Gateway`` from ``request.app.state.gateway`` and the
caller (``Principal``, set by ``AuthMiddleware``) from the request's state. Errors are
raised as ``GatewayError``s and rendered in one place (``responses.render_error``).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, get_args

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from gateway.adapter_slots import PIN_COMING, PIN_REFUSED, PIN_WAITING, AdapterSlots, Residency
from gateway.catalog import Catalog, Lease, Route
from gateway.errors import (
    CatalogInvalid,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PermissionDenied,
)
from gateway.metrics import RequestRecord
from gateway.middleware import Place, Principal
from gateway.openapi import openapi_json
from gateway.playground import playground
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest, model_card
from gateway.responses import SSEResponse, collect_unless_gone, read_json, route_headers
from gateway.responses_api import (
    ResponsesRequest,
    chat_request,
    constraint,
    input_messages,
    items_page,
    rename_param,
)
from gateway.responses_events import (
    ResponseDraft,
    ResponseEventEncoder,
    assistant_turn,
    input_items,
    stream_events,
)
from gateway.responses_tools import ResponseToolEncoder
from gateway.service import Collected, Generation
from gateway.sse import (
    HouseEncoder,
    OpenAIChatEncoder,
    OpenAICompletionEncoder,
    StreamEncoder,
    chat_response,
    completion_response,
    encode_stream,
)
from gateway.sse_tools import ToolChatEncoder, tool_chat_response
from gateway.state import Gateway
from gateway.store import Stored
from gateway.structured import as_response_format
from gateway.tokenize_api import detokenize, tokenize


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _principal(request: Request) -> Principal | None:
    principal: Principal | None = request.scope.get("state", {}).get("principal")
    return principal


# -- inference ----------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    gw = _gateway(request)
    house = _stream_format(request, ("openai", "house")) == "house"
    body = await read_json(request, ChatCompletionRequest, gw.settings.limits)
    gen = await _generate(
        request,
        body.model,
        body.task,
        lambda lease: gw.service.chat(body, lease),
        body.stream or house,
        n=body.n,
    )
    if house:
        _house_can_carry(body, gen)

    def prompt() -> Any:
        return [m.model_dump(exclude_none=True) for m in body.messages]

    if house:
        return _stream(request, gen, HouseEncoder(gen), prompt)
    tools = gen.tools.mode != "none"
    if body.stream:
        encoder = ToolChatEncoder if tools else OpenAIChatEncoder
        return _stream(request, gen, encoder(gen, body.include_usage), prompt)
    return await _whole(request, gen, tool_chat_response if tools else chat_response, prompt)


_STREAM_FORMATS = ("openai", "house")


def _stream_format(request: Request, served: tuple[str, ...]) -> str:
    """The ``X-Stream-Format`` header (absent or empty: ``served[0]``, the endpoint's own).
    It would change the answer, so a value that is unknown, or one this endpoint cannot
    answer in, is a 400 naming the header, not ignored."""
    value = request.headers.get("x-stream-format", "").strip().lower() or served[0]
    if value in served:
        return value
    if value not in _STREAM_FORMATS:
        message = f"X-Stream-Format: unknown format '{value[:40]}'; use 'house' or 'openai'"
    elif value == "house":
        message = "X-Stream-Format: house is served on /v1/chat/completions and POST /chat only"
    else:
        message = "X-Stream-Format: POST /chat streams the house format only; use /v1/chat/completions"
    raise InvalidRequest(message, param="X-Stream-Format")


def _house_can_carry(body: ChatCompletionRequest, gen: Generation, endpoint: str | None = None) -> None:
    """The house stream carries one choice's text: a request for more is a 400, not dropped.
    ``endpoint``: ``POST /chat``, whose 400s point to /v1/chat/completions; else the header's."""
    refused: tuple[str, str, str | None] | None = None  # the field, why, what to send instead
    if body.stream is False and "stream" in body.model_fields_set:  # as POST /chat refuses it
        refused = ("stream", "X-Stream-Format: house streams", "use /v1/chat/completions for one JSON answer")
    elif gen.sampling.n > 1:
        refused = ("n", "the house stream format carries one choice", "use n=1")
    elif gen.tools.mode != "none":
        refused = ("tools", "the house stream format carries no tool calls", None)
    elif body.logprobs:
        refused = ("logprobs", "the house stream format carries no logprobs", None)
    elif body.include_usage:
        refused = ("stream_options.include_usage", "the house stream format carries no usage chunk", None)
    if refused is None:
        return
    gen.close()
    param, why, instead = refused
    if endpoint is not None:
        message = f"'{param}' is not supported by {endpoint} ({why}); use /v1/chat/completions"
    else:
        message = f"{why}; {instead}" if instead else why
    raise InvalidRequest(message, param=param)


async def completions(request: Request) -> Response:
    gw = _gateway(request)
    _stream_format(request, ("openai",))
    body = await read_json(request, CompletionRequest, gw.settings.limits)
    gen = await _generate(
        request,
        body.model,
        body.task,
        lambda lease: gw.service.complete(body, lease),
        body.stream,
        prompts=len(body.prompts),
        n=body.n,
    )
    if body.stream:
        return _stream(request, gen, OpenAICompletionEncoder(gen, body.include_usage), lambda: body.prompt)
    return await _whole(request, gen, completion_response, lambda: body.prompt)


async def house_chat(request: Request) -> Response:
    gw = _gateway(request)
    _stream_format(request, ("house",))
    body = await read_json(request, HouseChatRequest, gw.settings.limits, any_type=True)
    chat = body.chat_request()
    gen = await _generate(request, body.model, body.task, lambda lease: gw.service.house(chat, lease), True)
    _house_can_carry(chat, gen, "POST /chat")
    return _stream(request, gen, HouseEncoder(gen), lambda: body.question)


async def create_response(request: Request) -> Response:
    """``POST /v1/responses`` on the chat path; ``store`` keeps it for its key only."""
    gw = _gateway(request)
    _stream_format(request, ("openai",))
    body = await read_json(request, ResponsesRequest, gw.settings.limits)
    owner = _owner(request)
    turn, history = input_messages(body.input), []
    if body.previous_response_id is not None:
        history = (await _previous(request, body.previous_response_id)).history
    chat = chat_request(body, history, turn)
    limit = await gw.service.check_schemas(
        lambda: constraint(body.text.format), body.text.format.type != "text"
    )
    try:
        gen = await _generate(
            request,
            body.model,
            body.task,
            lambda lease: gw.service.chat(chat, lease, limit, "max_output_tokens"),
            body.stream,
        )
    except InvalidRequest as exc:
        raise rename_param(exc) from None
    draft = ResponseDraft(body, gen)

    async def save(response: dict[str, Any]) -> None:
        await gw.responses.put(owner, response, [*history, *turn, assistant_turn(response)])

    def prompt() -> Any:
        return [m.model_dump(exclude_none=True) for m in chat.messages]

    if body.stream:
        record = _track(request, gen, True, prompt)
        if record is not None:
            record.response_id = draft.id
        encoder = ResponseEventEncoder(draft) if gen.tools.mode == "none" else ResponseToolEncoder(draft)
        events = stream_events(gen, encoder, save if body.store else None)
        return _sse(request, gen, events, record, encoder)
    record = _track(request, gen, False, prompt)
    if record is not None:
        record.response_id = draft.id
    result = await collect_unless_gone(request, gen, gw.stopping())
    if result is None:
        if record is not None:
            record.disconnected = True
        return Response(status_code=499)
    response = draft.whole(result)
    if body.store:
        await save(response)
    return JSONResponse(response, headers=route_headers(gen))


async def response_by_id(request: Request) -> Response:
    """GET or DELETE a stored response: one route, so that a 405 there allows both."""
    if request.method == "DELETE":
        return await delete_response(request)
    return await get_response(request)


async def get_response(request: Request) -> Response:
    query = request.query_params
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequest(
            "streaming a stored response again is not supported by this gateway", param="stream"
        )
    for name in ("starting_after", "include", "include[]"):
        if query.get(name):
            raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name.removesuffix("[]"))
    stored = await _stored(request, request.path_params["response_id"])
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await _gateway(request).responses.delete(_owner(request), response_id):
        raise NotFound(f"Response with id '{response_id[:80]}' not found.", param="response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """``client.responses.cancel``: only a background response can be cancelled (OpenAI's
    rule), and this gateway runs none, so a stored one is vLLM's and OpenAI's 400."""
    await _stored(request, request.path_params["response_id"])
    raise InvalidRequest("Cannot cancel a synchronous response.")  # no param, as vLLM


async def response_input_items(request: Request) -> Response:
    """The input items of a stored response (the conversation it answered), a page at a time."""
    response_id = request.path_params["response_id"]
    stored = await _stored(request, response_id)
    items = input_items(response_id, stored.history[:-1])  # the last turn is the response's own
    return JSONResponse(items_page(items, dict(request.query_params)))


def _owner(request: Request) -> str:
    principal = _principal(request)
    return principal.name if principal is not None else ""


async def _stored(request: Request, response_id: str) -> Stored:
    """A stored response of this caller's key; another key's looks like none (404)."""
    stored = await _gateway(request).responses.get(_owner(request), response_id)
    if stored is None:
        raise NotFound(f"Response with id '{response_id[:80]}' not found.", param="response_id")
    return stored


async def _previous(request: Request, response_id: str) -> Stored:
    """The response that ``previous_response_id`` continues: one that is not stored for this
    key (unknown, ``store: false``, expired, deleted, another key's) is OpenAI's 400."""
    stored = await _gateway(request).responses.get(_owner(request), response_id)
    if stored is None:
        raise InvalidRequest(
            f"Previous response with id '{response_id[:80]}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored


def require_model(model: str | None, task: str | None) -> None:
    """OpenAI requires ``model`` on /v1/*; here a ``task`` may pick the route instead."""
    if not model and not task:
        raise InvalidRequest("you must provide a model parameter", param="model")


async def _generate(
    request: Request,
    model: str | None,
    task: str | None,
    start: Callable[[Lease], Awaitable[Generation]],
    stream: bool,
    *,
    prompts: int = 1,
    n: int = 1,
) -> Generation:
    """Route the request (a lease on the route's current version) and start it; the lease
    is released if the start fails. ``stream``: whether it asked for a stream (its label in
    the metrics, a refusal's too). ``prompts`` x ``n`` more sequences than the key may ever
    have in flight are refused before any prompt is tokenized."""
    if request.scope["path"].startswith("/v1/"):
        require_model(model, task)
    principal = _principal(request)
    lease = _gateway(request).lease(principal, model, task)
    record: RequestRecord | None = request.scope.get("state", {}).get("record")
    if record is not None:  # a request refused from here on (400) counts under its route
        record.route, record.digest, record.stream = lease.route.name, lease.route.digest, stream
    try:
        _refuse_too_large(request, prompts, n)
        gen = await start(lease)
    except BaseException:
        lease.release()
        raise
    _hold_sequences(request, gen)
    gen.caller = principal  # its share and priority when LoRA requests queue
    return gen


def _refuse_too_large(request: Request, prompts: int, n: int) -> None:
    place: Place | None = request.scope.get("state", {}).get("place")
    if place is None:
        return
    gw = _gateway(request)
    refused = gw.admission.too_large(place, prompts * n, _what(prompts, n))
    if refused is not None:
        gw.metrics.rejected.inc()
        raise refused


def _hold_sequences(request: Request, gen: Generation) -> None:
    """The request's place in admission grows to the sequences the engine will run (its
    prompts x ``n``), or the request is refused (429) before any of them starts."""
    place: Place | None = request.scope.get("state", {}).get("place")
    if place is None:
        return
    n, size = gen.sampling.n, gen.num_choices
    gw = _gateway(request)
    refused = gw.admission.grow(place, size, _what(size // n, n))
    if refused is not None:
        gen.close()
        gw.metrics.rejected.inc()
        raise refused


def _what(prompts: int, n: int) -> str:
    """How a request's sequences add up, for a refusal's message."""
    return f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"


def _track(
    request: Request, gen: Generation, stream: bool, prompt: Callable[[], Any]
) -> RequestRecord | None:
    """Tie the generation to the access-log record and the inter-token metric."""
    gw = _gateway(request)
    record: RequestRecord | None = request.scope.get("state", {}).get("record")
    if record is not None:
        record.attach(gen, stream)
        if gen.route.lora is not None:

            def adapter_state() -> None:  # as it is when the request reaches the engine
                assert record is not None
                record.adapter_state = gw.adapters.start_state(gen.route)

            gen.on_engine = adapter_state
        if gw.settings.server.log_prompts:
            record.prompt = prompt()
    gen.on_gap = gw.metrics.itl.labels(gw.metrics.route_label(gen.route.name)).observe
    return record


def _stream(request: Request, gen: Generation, encoder: StreamEncoder, prompt: Callable[[], Any]) -> Response:
    record = _track(request, gen, True, prompt)
    return _sse(request, gen, encode_stream(gen, encoder), record, encoder)


def _sse(
    request: Request,
    gen: Generation,
    events: AsyncIterator[bytes],
    record: RequestRecord | None,
    encoder: StreamEncoder | ResponseEventEncoder,
) -> SSEResponse:
    """A stream's response: it watches its client (gone, stalled) and the drain's stop."""
    gw = _gateway(request)
    return SSEResponse(
        events,
        route_headers(gen),
        record,
        gen.close,
        send_timeout_s=gw.settings.limits.send_timeout_s,
        stop=gw.stopping(),
        on_stop=_error_event(gen, encoder),
    )


def _error_event(
    gen: Generation, encoder: StreamEncoder | ResponseEventEncoder
) -> Callable[[GatewayError], bytes]:
    """What a stream the gateway stops ends with: its format's error event, the error booked
    on the generation (the access log and metrics count it as that error)."""

    def render(exc: GatewayError) -> bytes:
        gen.error = exc
        return encoder.error(exc)

    return render


async def _whole(
    request: Request,
    gen: Generation,
    render: Callable[[Generation, Collected], dict[str, Any]],
    prompt: Callable[[], Any],
) -> Response:
    record = _track(request, gen, False, prompt)
    result = await collect_unless_gone(request, gen, _gateway(request).stopping())
    if result is None:  # the client left; nobody reads this (499 is nginx's word for it)
        if record is not None:
            record.disconnected = True
        return Response(status_code=499)
    return JSONResponse(render(gen, result), headers=route_headers(gen))


# -- models ---------------------------------------------------------------------------------
def model_cards(catalog: Catalog, created: int, slots: AdapterSlots | None = None) -> list[dict[str, Any]]:
    table = catalog.table
    cards = []
    for route in table.all_routes():
        parent = None if route.kind == "base" else table.base.name
        extra: dict[str, Any] = {
            "kind": route.kind,
            "digest": route.digest,
            "rank": route.rank,
            "status": "ready",
            "aliases": list(route.aliases),
            "tasks": list(route.tasks),
            "response_format": as_response_format(route.response_format, route.name),
            "response_format_enforced": route.enforce,
            **(adapter_fields(route, slots) if route.lora is not None else {}),
        }
        cards.append(model_card(route.name, "gateway", created, parent, **extra))
        for alias in route.aliases:
            root = parent or route.name  # an alias of the base model names it, not itself
            cards.append(model_card(alias, "gateway", created, parent, root, alias_of=route.name, **extra))
    return cards


def adapter_fields(route: Route, slots: AdapterSlots | None) -> dict[str, Any]:
    """Residency ("gpu", "cpu" or "not loaded"; "loaded" where the engine's workers cannot
    say which slot: ``AdapterSlots.residency``) and registration warnings."""
    return {
        "residency": slots.residency(route) if slots is not None else None,
        "pinned": route.pinned,
        "preload": route.preload,
        "warnings": [*route.warnings, *_pin_warnings(route, slots)],
    }


def _pin_warnings(route: Route, slots: AdapterSlots | None) -> list[str]:
    if not route.pinned or slots is None or route.lora is None:
        return []
    if not slots.may_pin:
        return [PIN_REFUSED]
    if route.lora.lora_id in slots.pinning:
        return [PIN_COMING]
    if (refused := slots.pins_failed.get(route.lora.lora_id)) is not None:
        return [f"not pinned: the engine refused the pin ({refused}); a reload tries again"]
    return [PIN_WAITING] if route.lora.lora_id in slots.pins_waiting else []


def _visible_cards(request: Request) -> list[dict[str, Any]]:
    gw = _gateway(request)
    principal = _principal(request)
    cards = model_cards(gw.catalog_or_503(), int(gw.started), gw.adapters)
    if principal is None:
        return cards
    # a key may name a route by an alias: the route's cards, aliases and all, are its
    return [c for c in cards if any(map(principal.may_use, (c.get("alias_of") or c["id"], *c["aliases"])))]


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _visible_cards(request)})


async def get_model(request: Request) -> Response:
    name = request.path_params["name"]
    for card in _visible_cards(request):
        if card["id"] == name:
            return JSONResponse(card)
    raise ModelNotFound(name)


# -- operations -----------------------------------------------------------------------------
async def metrics(request: Request) -> Response:
    principal = _principal(request)  # None when auth.public_metrics makes the path public
    if principal is not None and not principal.may_read_metrics():
        raise PermissionDenied("a key limited to some routes may not read /metrics", code="scoped_key")
    gw = _gateway(request)
    m = gw.metrics
    m.engine_up.set(1 if gw.engine.ready else 0)
    m.queued.set(gw.engine.unfinished_requests() or 0)
    m.inflight.set(gw.admission.requests)
    m.inflight_sequences.set(gw.admission.inflight)
    stored, stored_bytes = gw.responses.usage()
    m.responses_stored.set(stored)
    m.responses_stored_bytes.set(stored_bytes)
    routes = gw.catalog.table.routes.values() if gw.catalog is not None else ()  # None while starting
    residencies = [gw.adapters.residency(route) for route in routes]
    for where in get_args(Residency):
        m.adapters.labels(where).set(residencies.count(where))
    # The router view even with scheduling off (nothing queued here then): a router pointed
    # at it (deploy/README.md) must not lose its metrics when the scheduler is switched off.
    queued = gw.scheduler.queued_routes() if gw.scheduler is not None else None
    pinned = [r.name for r in routes if r.lora is not None and r.lora.lora_id in gw.adapters.pinned]
    return Response(m.render(queued, pinned), media_type="text/plain; version=0.0.4; charset=utf-8")


async def health(request: Request) -> Response:
    gw = _gateway(request)
    if gw.engine.errored or gw.startup_error:
        return JSONResponse({"status": "error", "detail": gw.startup_error or "engine stopped"}, 503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    gw = _gateway(request)
    if gw.admission.draining:
        return JSONResponse({"status": "draining"}, 503)
    if gw.is_ready:
        return JSONResponse({"status": "ready", "model": gw.engine.served_model_name})
    failed = gw.startup_error or gw.engine.errored
    return JSONResponse({"status": "error" if failed else "starting"}, 503)


async def admin_adapters(request: Request) -> Response:
    gw = _gateway(request)
    catalog = gw.catalog_or_503()
    await gw.adapters.refresh()
    return JSONResponse(
        {
            "routes": model_cards(catalog, int(gw.started), gw.adapters),
            "rejected": catalog.table.errors,
            "last_error": catalog.last_error,
            "reloads": catalog.reloads,
            "loaded_at": catalog.table.loaded_at,
            # the engine's adapter capacity: GPU slots (max_loras), its CPU cache (max_cpu_loras)
            "slots": {"gpu": gw.settings.engine.gpu_slots, "cpu": gw.settings.engine.max_cpu_loras},
            "engine_loras": sorted(gw.adapters.resident),
            "live_loras": sorted({r.lora.lora_id for r in catalog.table.all_routes() if r.lora}),
            "in_use": {str(k): v for k, v in catalog.in_use().items()},
        }
    )


async def admin_status(request: Request) -> Response:
    gw = _gateway(request)
    stored, stored_bytes = gw.responses.usage()
    return JSONResponse(
        {
            "inflight_requests": gw.admission.requests,
            "inflight_sequences": gw.admission.inflight,  # what limits.max_inflight bounds
            "inflight": gw.admission.inflight,  # deprecated: inflight_sequences
            "rejected": gw.admission.rejected,
            "draining": gw.admission.draining,
            "engine_ready": gw.engine.ready,
            "engine_unfinished_requests": gw.engine.unfinished_requests(),
            "lora_scheduler": gw.scheduler.snapshot() if gw.scheduler is not None else None,
            "gc_frozen_objects": gc.get_freeze_count(),
            "responses_stored": {"count": stored, "bytes": stored_bytes},  # responses.max_bytes bounds
        }
    )


async def admin_reload(request: Request) -> Response:
    gw = _gateway(request)
    if gw.admission.draining:  # adapters loaded into an engine about to stop, which the drain
        # does not wait for: uvicorn would cancel the reload, or the engine stop under it
        raise gw.admission.shutting_down()
    ok = await gw.reload_catalog()
    if not ok and gw.admission.draining:  # the drain began while it waited for another reload
        raise gw.admission.shutting_down()
    catalog = gw.catalog_or_503()
    routes = sorted(catalog.table.routes)
    if ok:  # ``error``: the entries rejected, on one line, or null
        return JSONResponse({"reloaded": True, "error": catalog.last_error, "routes": routes})
    failed = CatalogInvalid(catalog.last_error or "the catalog could not be read")
    return JSONResponse({**failed.to_dict(), "reloaded": False, "routes": routes}, failed.status_code)


ROUTES = [
    HttpRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    HttpRoute("/v1/completions", completions, methods=["POST"]),
    HttpRoute("/chat", house_chat, methods=["POST"]),
    HttpRoute("/v1/responses", create_response, methods=["POST"]),
    HttpRoute("/v1/responses/{response_id}", response_by_id, methods=["GET", "DELETE"]),
    HttpRoute("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
    HttpRoute("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    HttpRoute("/tokenize", tokenize, methods=["POST"]),
    HttpRoute("/detokenize", detokenize, methods=["POST"]),
    HttpRoute("/v1/models", list_models, methods=["GET"]),
    HttpRoute("/v1/models/{name:path}", get_model, methods=["GET"]),
    HttpRoute("/metrics", metrics, methods=["GET"]),
    HttpRoute("/health", health, methods=["GET"]),
    HttpRoute("/ready", ready, methods=["GET"]),
    HttpRoute("/playground", playground, methods=["GET"]),
    HttpRoute("/openapi.json", openapi_json, methods=["GET"]),
    HttpRoute("/admin/adapters", admin_adapters, methods=["GET"]),
    HttpRoute("/admin/adapters/reload", admin_reload, methods=["POST"]),
    HttpRoute("/admin/status", admin_status, methods=["GET"]),
]
# Paths that need no key (``/metrics`` joins them with ``auth.public_metrics``). The
# playground and the OpenAPI document hold nothing of the deployment (``gateway.openapi``).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/playground", "/openapi.json"})
