"""The HTTP handlers, one module-level function per endpoint, and the route list.

Each handler reads the typed ``Gateway`` from ``request.app.state.gateway`` and the
caller (``Principal``, set by ``AuthMiddleware``) from the request's state. Errors are
raised as ``GatewayError``s and rendered in one place (``responses.render_error``).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from gateway.catalog import Catalog, Lease
from gateway.errors import InvalidRequest, NotFound
from gateway.metrics import RequestRecord
from gateway.middleware import Principal
from gateway.playground import playground
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest, model_card
from gateway.responses import SSEResponse, collect_unless_gone, read_json, route_headers
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
from gateway.state import Gateway
from gateway.structured import as_response_format


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _principal(request: Request) -> Principal | None:
    principal: Principal | None = request.scope.get("state", {}).get("principal")
    return principal


# -- inference ----------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request, ChatCompletionRequest, gw.settings.limits.max_body_bytes)
    gen = await _generate(request, body.model, body.task, lambda lease: gw.service.chat(body, lease))
    house = request.headers.get("x-stream-format", "").lower() == "house"
    if house and gen.sampling.n > 1:
        gen.close()
        raise InvalidRequest("the house stream format carries one choice; use n=1", param="n")

    def prompt() -> Any:
        return [m.model_dump(exclude_none=True) for m in body.messages]

    if house:
        return _stream(request, gen, HouseEncoder(gen), prompt)
    if body.stream:
        return _stream(request, gen, OpenAIChatEncoder(gen, body.include_usage), prompt)
    return await _whole(request, gen, chat_response, prompt)


async def completions(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request, CompletionRequest, gw.settings.limits.max_body_bytes)
    gen = await _generate(request, body.model, body.task, lambda lease: gw.service.complete(body, lease))
    if body.stream:
        return _stream(request, gen, OpenAICompletionEncoder(gen, body.include_usage), lambda: body.prompt)
    return await _whole(request, gen, completion_response, lambda: body.prompt)


async def house_chat(request: Request) -> Response:
    gw = _gateway(request)
    body = await read_json(request, HouseChatRequest, gw.settings.limits.max_body_bytes)
    gen = await _generate(request, body.model, body.task, lambda lease: gw.service.house(body, lease))
    return _stream(request, gen, HouseEncoder(gen), lambda: body.question)


async def _generate(
    request: Request, model: str | None, task: str | None, start: Callable[[Lease], Awaitable[Generation]]
) -> Generation:
    """Route the request (a lease on the route's current version) and start it; the lease
    is released if the start fails."""
    lease = _gateway(request).lease(_principal(request), model, task)
    try:
        return await start(lease)
    except BaseException:
        lease.release()
        raise


def _track(
    request: Request, gen: Generation, stream: bool, prompt: Callable[[], Any]
) -> RequestRecord | None:
    """Tie the generation to the access-log record and the inter-token metric."""
    gw = _gateway(request)
    record: RequestRecord | None = request.scope.get("state", {}).get("record")
    if record is not None:
        record.attach(gen, stream)
        if gw.settings.server.log_prompts:
            record.prompt = prompt()
    gen.on_gap = gw.metrics.itl.labels(gw.metrics.route_label(gen.route.name)).observe
    return record


def _stream(request: Request, gen: Generation, encoder: StreamEncoder, prompt: Callable[[], Any]) -> Response:
    record = _track(request, gen, True, prompt)
    return SSEResponse(encode_stream(gen, encoder), route_headers(gen), record)


async def _whole(
    request: Request,
    gen: Generation,
    render: Callable[[Generation, Collected], dict[str, Any]],
    prompt: Callable[[], Any],
) -> Response:
    record = _track(request, gen, False, prompt)
    result = await collect_unless_gone(request, gen)
    if result is None:  # the client left; nobody reads this (499 is nginx's word for it)
        if record is not None:
            record.disconnected = True
        return Response(status_code=499)
    return JSONResponse(render(gen, result), headers=route_headers(gen))


# -- models ---------------------------------------------------------------------------------
def model_cards(catalog: Catalog, created: int) -> list[dict[str, Any]]:
    table = catalog.table
    cards = []
    for route in table.all_routes():
        parent = None if route.kind == "base" else table.base.name
        extra = {
            "kind": route.kind,
            "digest": route.digest,
            "rank": route.rank,
            "status": "ready",
            "aliases": list(route.aliases),
            "tasks": list(route.tasks),
            "response_format": as_response_format(route.response_format, route.name),
            "response_format_enforced": route.enforce,
        }
        cards.append(model_card(route.name, "gateway", created, parent, **extra))
        for alias in route.aliases:
            cards.append(model_card(alias, "gateway", created, parent, alias_of=route.name, **extra))
    return cards


def _visible_cards(request: Request) -> list[dict[str, Any]]:
    gw = _gateway(request)
    principal = _principal(request)
    cards = model_cards(gw.catalog_or_503(), int(gw.started))
    if principal is None:
        return cards
    return [c for c in cards if principal.may_use(c.get("alias_of") or c["id"])]


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _visible_cards(request)})


async def get_model(request: Request) -> Response:
    name = request.path_params["name"]
    for card in _visible_cards(request):
        if card["id"] == name:
            return JSONResponse(card)
    raise NotFound(f"The model '{name[:80]}' does not exist", param="model")


# -- operations -----------------------------------------------------------------------------
async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    m = gw.metrics
    m.engine_up.set(1 if gw.engine.ready else 0)
    m.queued.set(gw.engine.unfinished_requests() or 0)
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


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
    return JSONResponse({"status": "starting" if not gw.startup_error else "error"}, 503)


async def admin_adapters(request: Request) -> Response:
    gw = _gateway(request)
    catalog = gw.catalog_or_503()
    return JSONResponse(
        {
            "routes": model_cards(catalog, int(gw.started)),
            "rejected": catalog.table.errors,
            "last_error": catalog.last_error,
            "reloads": catalog.reloads,
            "loaded_at": catalog.table.loaded_at,
            "engine_loras": sorted(await gw.engine.list_loras()),
            "live_loras": sorted(r.lora.lora_id for r in catalog.table.all_routes() if r.lora),
            "in_use": {str(k): v for k, v in catalog.in_use().items()},
        }
    )


async def admin_status(request: Request) -> Response:
    gw = _gateway(request)
    return JSONResponse(
        {
            "inflight": gw.admission.inflight,
            "rejected": gw.admission.rejected,
            "draining": gw.admission.draining,
            "engine_ready": gw.engine.ready,
            "engine_unfinished_requests": gw.engine.unfinished_requests(),
            "gc_frozen_objects": gc.get_freeze_count(),
        }
    )


async def admin_reload(request: Request) -> Response:
    gw = _gateway(request)
    ok = await gw.reload_catalog()
    catalog = gw.catalog_or_503()
    body = {"reloaded": ok, "error": catalog.last_error, "routes": sorted(catalog.table.routes)}
    return JSONResponse(body, 200 if ok else 422)


ROUTES = [
    HttpRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    HttpRoute("/v1/completions", completions, methods=["POST"]),
    HttpRoute("/chat", house_chat, methods=["POST"]),
    HttpRoute("/v1/models", list_models, methods=["GET"]),
    HttpRoute("/v1/models/{name:path}", get_model, methods=["GET"]),
    HttpRoute("/metrics", metrics, methods=["GET"]),
    HttpRoute("/health", health, methods=["GET"]),
    HttpRoute("/ready", ready, methods=["GET"]),
    HttpRoute("/playground", playground, methods=["GET"]),
    HttpRoute("/admin/adapters", admin_adapters, methods=["GET"]),
    HttpRoute("/admin/adapters/reload", admin_reload, methods=["POST"]),
    HttpRoute("/admin/status", admin_status, methods=["GET"]),
]
# Paths that need no key (``/metrics`` joins them with ``auth.public_metrics``).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/playground"})
