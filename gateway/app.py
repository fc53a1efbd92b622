"""The Starlette app: routes, error rendering, lifespan. ``create_app(settings)`` wires
settings -> engine manager -> catalog -> service -> routes.

The engine starts in the background during the lifespan, so ``/health`` answers at once
and ``/ready`` turns 200 when the engine is up. Requests that arrive before then get 503.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute
from starlette.types import Receive, Scope, Send

from gateway.catalog import Catalog, Lease, LoraIds, RoutingTable, load_table, model_module_names
from gateway.engine import EngineManager
from gateway.errors import (
    ConfigError,
    EngineUnavailable,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.middleware import (
    AccessLogMiddleware,
    Admission,
    AdmissionMiddleware,
    AuthMiddleware,
    HeaderLimitMiddleware,
    Principal,
    RequestIdMiddleware,
)
from gateway.playground import playground
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest, model_card
from gateway.service import ChatService, Generation
from gateway.settings import GatewaySettings
from gateway.sse import (
    HouseEncoder,
    OpenAIChatEncoder,
    OpenAICompletionEncoder,
    StreamEncoder,
    chat_response,
    completion_response,
    encode_stream,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Gateway:
    """What the routes need, built once per app: engine, catalog, service."""

    def __init__(self, settings: GatewaySettings, engine: EngineManager | None = None) -> None:
        self.settings = settings
        self.engine = engine or EngineManager(settings.engine, settings.cache_dir)
        self.service = ChatService(self.engine, settings.limits)
        self.catalog: Catalog | None = None
        self.started = time.time()
        self.startup_error: str | None = None
        bound = settings.limits.max_inflight or 4 * settings.engine.max_num_seqs
        self.admission = Admission(bound, settings.limits.retry_after_s)
        self.metrics = GatewayMetrics()
        self.exit_code = 0
        # Set by whoever runs the server (the CLI): ask it to stop. The app calls it when
        # the engine dies, so a supervisor restarts the process.
        self.request_exit: Callable[[], None] = lambda: None

    # -- catalog ----------------------------------------------------------------------
    def build_table(self, ids: LoraIds) -> RoutingTable:
        s = self.settings
        return load_table(
            s.catalog,
            base_name=self.engine.served_model_name,
            adapters_root=s.adapters_root,
            max_lora_rank=s.engine.max_lora_rank,
            model_modules=self._modules,
            lora_ids=ids,
        )

    async def start(self) -> None:
        try:
            await self.engine.start()
            self._modules = model_module_names(self.engine.model_path or "")
            self.catalog = Catalog(self.build_table, self.engine.remove_lora)
            self.metrics.set_routes(route_names(self.catalog.table))
            for route in self.catalog.table.routes.values():
                if route.lora is not None:
                    await self.engine.add_lora(route.lora)  # load now: fail at registration, not first use
            freeze_startup_heap()
        except (ConfigError, GatewayError) as exc:
            self.startup_error = str(exc)
            log.error("startup failed: %s", exc)
            raise

    def catalog_or_503(self) -> Catalog:
        if self.catalog is None or not self.engine.ready:
            raise EngineUnavailable("the engine is not ready", headers={"Retry-After": "5"})
        return self.catalog

    def lease(self, request: Request, model: str | None, task: str | None) -> Lease:
        """The route for this caller. A route the key may not use looks like no route."""
        principal: Principal | None = request.scope.get("state", {}).get("principal")
        allowed = principal.may_use if principal is not None else None
        return self.catalog_or_503().acquire(model, task, allowed)

    async def watch_engine(self, interval: float = 0.5) -> None:
        """Engine death ends the process (non-zero), after open streams got their error event."""
        while not self.engine.errored:
            await asyncio.sleep(interval)
        log.error("the engine has died; failing open requests and exiting")
        self.exit_code = 3
        self.admission.draining = True
        await asyncio.sleep(2.0)  # let open streams send their error event; /health says 503
        self.request_exit()

    def adapter_files_signature(self) -> tuple[Any, ...]:
        """Cheap change detector: stat of the catalog file and of every adapter file."""
        paths = [self.settings.catalog]
        if self.catalog is not None:
            for route in self.catalog.table.routes.values():
                if route.lora is not None:
                    paths += sorted(Path(route.lora.path).iterdir())
        sig = []
        for path in paths:
            try:
                st = path.stat()
                sig.append((str(path), st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append((str(path), None, None))
        return tuple(sig)

    async def reload_catalog(self) -> bool:
        catalog = self.catalog_or_503()
        ok = catalog.reload()
        self.metrics.reloads.labels("ok" if ok else "error").inc()
        if ok:
            self.metrics.set_routes(route_names(catalog.table))
            for route in catalog.table.routes.values():
                if route.lora is not None:
                    try:
                        await self.engine.add_lora(route.lora)
                    except GatewayError as exc:
                        log.error("adapter %s failed to load: %s", route.name, exc.message)
        return ok

    async def watch_catalog(self, interval: float, reload_now: asyncio.Event) -> None:
        last = self.adapter_files_signature()
        while True:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reload_now.wait(), timeout=interval)
            asked = reload_now.is_set()  # SIGHUP reloads even when no file changed
            reload_now.clear()
            current = self.adapter_files_signature()
            if asked or current != last:
                current = await settled(self.adapter_files_signature, current, quiet=min(0.1, interval))
                await self.reload_catalog()
                # Files the reload read keep the stat seen before it: one changed while the
                # reload ran (it awaits the engine) differs at the next poll, not never.
                before = {path: (mtime, size) for path, mtime, size in current}
                last = tuple((p, *before.get(p, (m, s))) for p, m, s in self.adapter_files_signature())
            if self.catalog is not None:
                await self.catalog.remove_drained()


async def settled(signature: Callable[[], T], seen: T, *, quiet: float, max_wait: float = 2.0) -> T:
    """Wait until ``signature()`` stays the same for ``quiet`` seconds (a save or a copy in
    progress), at most ``max_wait``: a reload should read whole files, not half of an edit."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet)
        now = signature()
        if now == seen:
            break
        seen = now
    return seen


# -- request helpers ----------------------------------------------------------------------
async def read_json(request: Request, model: type[M], max_bytes: int) -> M:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        message = err["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param) from None


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (torch, transformers, the engine client: 650k
    objects on the embedded model) out of the collector's sight. Otherwise every full
    collection walks all of them while streams wait on the event loop (480 ms each on 2 CPU
    cores, measured). vLLM's own server does the same."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    log.info("froze %d start-up objects out of the garbage collector (a full collection took %.0f ms)",
             gc.get_freeze_count(), took * 1000)


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client leaving, whatever the ASGI version,
    so an abandoned request stops in the engine at once rather than at its next token."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str], record: RequestRecord | None) -> None:
        self.record = record
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            # uvicorn answers http.disconnect as soon as a response is complete, so both
            # can be done at once: only a stream cut short (or failing to send) means that
            # the client left.
            left = stream not in done or (gone in done and stream.exception() is not None)
            if left and self.record is not None:
                self.record.disconnected = True
        finally:
            for task in (stream, gone):
                task.cancel()
            with suppress(BaseException):
                await stream
            with suppress(BaseException):
                await gone
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(BaseException):
                    await aclose()


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_unless_gone(request: Request, gen: Generation) -> Any:
    """Collect a whole response, aborting in the engine if the client leaves first."""
    work = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work not in done:
        with suppress(BaseException):
            await work
        return None
    return work.result()


def route_headers(gen: Generation) -> dict[str, str]:
    headers = {"x-adapter": gen.route.name}
    if gen.route.digest:
        headers["x-adapter-digest"] = gen.route.digest
    return headers


# -- the app ------------------------------------------------------------------------------
def create_app(settings: GatewaySettings, engine: EngineManager | None = None) -> Starlette:
    gw = Gateway(settings, engine)
    limits = settings.limits
    reload_now = asyncio.Event()

    async def start_generation(
        lease: Lease, start: Callable[[Lease], Awaitable[Generation]]
    ) -> Generation:
        try:
            return await start(lease)
        except BaseException:
            lease.release()
            raise

    def track(request: Request, gen: Generation, stream: bool, prompt: Callable[[], Any]) -> RequestRecord | None:
        record: RequestRecord | None = request.scope.get("state", {}).get("record")
        if record is not None:
            record.attach(gen, stream)
            if settings.server.log_prompts:
                record.prompt = prompt()
        gen.on_gap = gw.metrics.itl.labels(gw.metrics.route_label(gen.route.name)).observe
        return record

    async def respond(
        request: Request,
        gen: Generation,
        stream: bool,
        encoder: type[StreamEncoder] | Any,
        include_usage: bool,
        whole: Callable[[Generation, Any], dict[str, Any]],
        prompt: Callable[[], Any],
    ) -> Response:
        headers = route_headers(gen)
        record = track(request, gen, stream, prompt)
        if stream:
            return SSEResponse(encode_stream(gen, encoder(gen, include_usage)), headers, record)
        result = await collect_unless_gone(request, gen)
        if result is None:  # the client left; nobody reads this (499 is nginx's word for it)
            if record is not None:
                record.disconnected = True
            return Response(status_code=499)
        return JSONResponse(whole(gen, result), headers=headers)

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, limits.max_body_bytes)
        lease = gw.lease(request, body.model, body.task)
        gen = await start_generation(lease, lambda l: gw.service.chat(body, l))
        house = request.headers.get("x-stream-format", "").lower() == "house"
        if house and gen.sampling.n > 1:
            gen.close()
            raise InvalidRequest("the house stream format carries one choice; use n=1", param="n")
        encoder = HouseEncoder if house else OpenAIChatEncoder
        prompt = lambda: [m.model_dump(exclude_none=True) for m in body.messages]  # noqa: E731
        return await respond(request, gen, body.stream or house, encoder, body.include_usage, chat_response, prompt)

    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, limits.max_body_bytes)
        lease = gw.lease(request, body.model, body.task)
        gen = await start_generation(lease, lambda l: gw.service.complete(body, l))
        return await respond(
            request, gen, body.stream, OpenAICompletionEncoder, body.include_usage, completion_response, lambda: body.prompt
        )

    async def house_chat(request: Request) -> Response:
        body = await read_json(request, HouseChatRequest, limits.max_body_bytes)
        lease = gw.lease(request, body.model, body.task)
        gen = await start_generation(lease, lambda l: gw.service.house(body, l))
        record = track(request, gen, True, lambda: body.question)
        return SSEResponse(encode_stream(gen, HouseEncoder(gen)), route_headers(gen), record)

    def visible_cards(request: Request) -> list[dict[str, Any]]:
        principal: Principal | None = request.scope.get("state", {}).get("principal")
        cards = model_cards(gw.catalog_or_503(), int(gw.started))
        if principal is None:
            return cards
        return [c for c in cards if principal.may_use(c.get("alias_of") or c["id"])]

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": visible_cards(request)})

    async def get_model(request: Request) -> Response:
        name = request.path_params["name"]
        for card in visible_cards(request):
            if card["id"] == name:
                return JSONResponse(card)
        raise NotFound(f"The model '{name[:80]}' does not exist", param="model")

    async def metrics(request: Request) -> Response:
        m = gw.metrics
        m.engine_up.set(1 if gw.engine.ready else 0)
        m.queued.set(gw.engine.unfinished_requests() or 0)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(request: Request) -> Response:
        if gw.engine.errored or gw.startup_error:
            return JSONResponse({"status": "error", "detail": gw.startup_error or "engine stopped"}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if gw.admission.draining:
            return JSONResponse({"status": "draining"}, 503)
        if gw.catalog is not None and gw.engine.ready:
            return JSONResponse({"status": "ready", "model": gw.engine.served_model_name})
        return JSONResponse({"status": "starting" if not gw.startup_error else "error"}, 503)

    async def admin_adapters(request: Request) -> Response:
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
        ok = await gw.reload_catalog()
        catalog = gw.catalog_or_503()
        body = {"reloaded": ok, "error": catalog.last_error, "routes": sorted(catalog.table.routes)}
        return JSONResponse(body, 200 if ok else 422)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def boot() -> None:
            with suppress(ConfigError, GatewayError):
                await gw.start()
                watchers = [gw.watch_catalog(settings.catalog_poll_s, reload_now), gw.watch_engine()]
                await asyncio.gather(*watchers)

        task = asyncio.create_task(boot())
        loop = asyncio.get_running_loop()
        with suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread / Windows
            loop.add_signal_handler(signal.SIGHUP, reload_now.set)
        try:
            yield
        finally:
            task.cancel()
            with suppress(BaseException):
                await task
            await gw.engine.shutdown()

    app = Starlette(
        routes=[
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
        ],
        exception_handlers={GatewayError: render_error, HTTPException: render_http_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )
    public = {"/health", "/ready", "/playground"} | ({"/metrics"} if settings.auth.public_metrics else set())
    app.add_middleware(AdmissionMiddleware, admission=gw.admission, metrics=gw.metrics)
    app.add_middleware(AuthMiddleware, keys=settings.auth.keys, public_paths=frozenset(public))
    app.add_middleware(HeaderLimitMiddleware, max_bytes=settings.server.max_header_bytes)
    app.add_middleware(AccessLogMiddleware, metrics=gw.metrics)
    app.add_middleware(RequestIdMiddleware)
    app.state.gateway = gw
    return app


def route_names(table: RoutingTable) -> frozenset[str]:
    return frozenset(r.name for r in table.all_routes())


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
        }
        cards.append(model_card(route.name, "gateway", created, parent, **extra))
        for alias in route.aliases:
            cards.append(model_card(alias, "gateway", created, parent, alias_of=route.name, **extra))
    return cards


async def render_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return JSONResponse(exc.to_dict(), exc.status_code, headers=exc.headers)


async def render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: GatewayError = NotFound(f"no route for {request.method} {request.scope.get('path', '')[:200]}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"method {request.method} is not allowed here")
    else:
        err = InvalidRequest(str(exc.detail))
        err.status_code = exc.status_code
    return JSONResponse(err.to_dict(), err.status_code, headers=dict(exc.headers or {}))
