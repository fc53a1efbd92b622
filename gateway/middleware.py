"""Pure-ASGI middleware (no BaseHTTPMiddleware: it buffers and breaks streaming).

Outermost first:

- ``RequestIdMiddleware``: accepts a sane ``x-request-id`` or makes one, returns it, and
  turns any unexpected exception into an OpenAI-shaped 500 instead of a traceback page.
- ``AccessLogMiddleware``: one JSON line per request (``gateway.access`` logger) and the
  request metrics, from a ``RequestRecord`` the app fills in as the request flows. A client
  that leaves while sending its body is a 499 there, not an error.
- ``HeaderLimitMiddleware``: request heads above a size get 431 (not every uvicorn
  HTTP implementation enforces a limit), a preflight too.
- ``cors``: Starlette's CORS middleware (``server.cors_allow_origins``), so that a browser
  app can call the API from another origin, as it can OpenAI's and vLLM's. It answers
  preflights before auth (a preflight carries no key) and puts its headers on every answer,
  a 401 or 429 too, so the app can read the error; the 431 and the fallback 500, made
  outside it, go through it as well (``cors_wrap``).
- ``AuthMiddleware``: deny by default. Decisions use the raw ASGI ``scope["path"]``, the
  same value the router matches on, never a URL rebuilt from the Host header (vLLM's
  ``--api-key`` was bypassed that way). Keys are compared as SHA-256 digests in constant
  time, all keys every time.
- ``AdmissionMiddleware``: a bound on sequences in flight (running + queued) and per key;
  above it a fast 429 with ``Retry-After``. A request holds one from its headers on and
  its prompts x ``n`` once its body is read. While draining, new work gets 503.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import (
    AuthenticationFailed,
    EngineUnavailable,
    GatewayError,
    HeadersTooLarge,
    PermissionDenied,
    RateLimited,
)
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.settings import ApiKey

log = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/chat", "/v1/responses"})


async def send_error(send: Send, exc: GatewayError) -> None:
    body = json.dumps(exc.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return ""


Wrap = Callable[[ASGIApp], ASGIApp]  # an answer made outside CORS, given its headers (``cors_wrap``)


def _unwrapped(app: ASGIApp) -> ASGIApp:
    return app


async def _refuse(scope: Scope, send: Send, error: GatewayError, wrap: Wrap) -> None:
    """Send ``error``, through ``wrap`` (CORS) unless the request is a preflight: CORS answers
    those itself, and a refused preflight fails in the browser whatever its headers."""

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        await send_error(send, error)

    async def no_body() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    await (answer if scope["method"] == "OPTIONS" else wrap(answer))(scope, no_body, send)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, refusals: Wrap = _unwrapped) -> None:
        self.app = app
        self.refusals = refusals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in request %s", request_id)
            if started:
                raise
            await _refuse(scope, send_with_id, GatewayError("internal error"), self.refusals)


class AccessLogMiddleware:
    quiet_paths = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.quiet_paths:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        record = RequestRecord(state.get("request_id", ""), scope["method"], scope["path"][:200])
        state["record"] = record

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except ClientDisconnect:  # it left while sending its body: no one to answer, no error
            record.disconnected = True
        finally:
            record.finish()
            if record.status == 0:  # nothing was sent: the client left, or we failed
                record.status = 499 if record.disconnected else 500
            access_log.info(json.dumps(record.log_fields(), ensure_ascii=False))
            if scope["path"] in INFERENCE_PATHS and scope["method"] != "OPTIONS":  # not a CORS preflight
                self.metrics.observe(record)


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, refusals: Wrap = _unwrapped) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusals = refusals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.max_bytes:
                error = HeadersTooLarge(f"request headers are larger than {self.max_bytes} bytes")
                await _refuse(scope, send, error, self.refusals)
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Principal:
    """The caller, as far as routes go: its key's name, allowed routes and limits, and its
    share and priority when LoRA requests queue (``lora_scheduler``)."""

    name: str
    routes: frozenset[str] | None
    admin: bool
    max_concurrency: int | None
    weight: float = 1.0
    priority: int = 0

    def may_use(self, route: str) -> bool:
        return self.routes is None or route in self.routes

    def may_read_metrics(self) -> bool:
        """Metrics name every route, so a key limited to some routes would learn of the others
        (``/v1/models`` hides them). A key with no route at all is a scrape key."""
        return self.admin or self.routes is None or not self.routes


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: list[ApiKey], public_paths: frozenset[str]) -> None:
        self.app = app
        self.public_paths = public_paths
        self._keys = [
            (
                bytes.fromhex(k.sha256 or ""),
                Principal(
                    k.name,
                    frozenset(k.routes) if k.routes is not None else None,
                    k.admin,
                    k.max_concurrency,
                    k.weight,
                    k.priority,
                ),
            )
            for k in keys
        ]

    def authenticate(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for stored, principal in self._keys:  # no early exit: timing says nothing about which key
            if hmac.compare_digest(digest, stored):
                found = principal
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in self.public_paths:
            await self.app(scope, receive, send)
            return
        auth = _header(scope, b"authorization")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else _header(scope, b"x-api-key")
        principal = self.authenticate(token) if token else None
        if principal is None:
            error = AuthenticationFailed(
                "Missing or invalid API key. Send it as 'Authorization: Bearer <key>'.",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await send_error(send, error)
            return
        if _is_admin_path(path) and not principal.admin:
            await send_error(
                send, PermissionDenied("this key may not use admin endpoints", code="admin_only")
            )
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


# Response headers a browser app may read besides the CORS-safelisted ones: the OpenAI SDKs
# read x-request-id, and retry-after to pace their retries of a 429 or 503.
CORS_EXPOSED_HEADERS = ("x-request-id", "x-adapter", "x-adapter-digest", "retry-after", "x-should-retry")


def cors(origins: list[str]) -> list[Middleware]:
    """CORS as vLLM's server sets it up: any method and request header, no credentials (keys
    travel in a header, not in cookies). No middleware at all for no origins."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=CORS_EXPOSED_HEADERS,
        )
    ]


def cors_wrap(origins: list[str]) -> Wrap:
    """An app wrapped in the CORS middleware of ``cors``: for the answers made outside it (the
    header limit's 431, the fallback 500), so a browser app can read those too."""

    def wrap(app: ASGIApp) -> ASGIApp:
        for cls, args, kwargs in reversed(cors(origins)):
            app = cls(app, *args, **kwargs)
        return app

    return wrap


def _is_admin_path(path: str) -> bool:
    # Collapse '//' so '//admin/x' is judged like '/admin/x', whatever the router makes of it.
    return re.sub(r"/+", "/", path).lower().startswith("/admin")


@dataclass(slots=True)
class Place:
    """What one admitted request holds of the in-flight bounds, in sequences: one from its
    headers on, all of them (its prompts x ``n``) once its body is read (``Admission.grow``)."""

    principal: Principal | None
    size: int = 1


@dataclass
class Admission:
    """Sequences in flight (running + queued), in total and per key; shared with the app for
    drain and status. A sequence is what the engine runs: a request counts its prompts x
    ``n``, so a batch of 256 prompts with ``n=8`` cannot pass the bounds as one request.
    ``requests`` counts the requests holding them (``/metrics``, ``/admin/status``)."""

    max_inflight: int
    retry_after_s: int
    inflight: int = 0  # sequences
    requests: int = 0
    per_key: dict[str, int] = field(default_factory=dict)
    draining: bool = False
    rejected: int = 0

    def shutting_down(self) -> EngineUnavailable:
        """The 503 of whatever the drain refuses or ends."""
        return EngineUnavailable(
            "the gateway is shutting down", headers={"Retry-After": str(self.retry_after_s)}
        )

    def admit(self, principal: Principal | None) -> GatewayError | None:
        """One sequence for a new request, before its body is read."""
        if self.draining:
            return self.shutting_down()
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.inflight >= self.max_inflight:
            self.rejected += 1
            return RateLimited(
                f"the gateway is at capacity ({self.max_inflight} sequences in flight)", headers=retry
            )
        limit = principal.max_concurrency if principal is not None else None
        if principal is not None and limit is not None and self.per_key.get(principal.name, 0) >= limit:
            self.rejected += 1
            return RateLimited(f"this key has {limit} sequences in flight already", headers=retry)
        self._add(principal, 1)
        self.requests += 1
        return None

    def grow(self, place: Place, size: int, what: str) -> GatewayError | None:
        """Hold ``size`` sequences for an admitted request (``what``: how they add up, for the
        message). A request larger than the gateway's bound holds all of it: it runs when
        nothing else does (a batch of 256 prompts stays possible with the defaults). One larger
        than its key's limit by itself is OpenAI's "Request too large": a 429 with no
        ``Retry-After``, as waiting would not help; one that would fit later, a 429 with it.
        Refused, the request keeps what it held (the middleware releases it)."""
        refused = self.too_large(place, size, what)
        if refused is not None:
            return refused
        wanted, size = size, min(size, self.max_inflight)
        more = size - place.size
        if more <= 0:
            return None
        principal = place.principal
        limit = principal.max_concurrency if principal is not None else None
        retry = {"Retry-After": str(self.retry_after_s)}
        used = self.per_key.get(principal.name, 0) if principal is not None else 0
        if self.inflight + more > self.max_inflight:
            needs = f"{size} sequences ({what})"
            if wanted > size:
                needs = f"all {size} sequences the gateway runs or queues at once ({what})"
            refused = RateLimited(
                f"the gateway is at capacity: this request needs {needs}, "
                f"{self.max_inflight - self.inflight + place.size} are free",
                headers=retry,
            )
        elif limit is not None and used + more > limit:
            refused = RateLimited(
                f"this key may have {limit} sequences in flight and has {used - place.size}; "
                f"this request needs {size} ({what})",
                headers=retry,
            )
        if refused is not None:
            self.rejected += 1
            return refused
        self._add(principal, more)
        place.size = size
        return None

    def too_large(self, place: Place, size: int, what: str) -> GatewayError | None:
        """OpenAI's "Request too large" if ``size`` sequences are more than the key may ever
        have in flight: checked again in ``grow``, and before a request's prompts are
        tokenized. ``x-should-retry: false`` keeps the OpenAI SDKs from sending it again."""
        principal = place.principal
        limit = principal.max_concurrency if principal is not None else None
        if limit is None or size <= limit:
            return None
        self.rejected += 1
        return RateLimited(
            f"Request too large for this key: {size} sequences ({what}), more than its limit of "
            f"{limit} in flight. Send fewer prompts or a lower n.",
            headers={"x-should-retry": "false"},
        )

    def _add(self, principal: Principal | None, count: int) -> None:
        self.inflight += count
        if principal is not None:
            self.per_key[principal.name] = self.per_key.get(principal.name, 0) + count

    def release(self, principal: Principal | None, size: int = 1) -> None:
        """An admitted request has ended: it and the ``size`` sequences it held."""
        self.requests -= 1
        self.inflight -= size
        if principal is not None:
            left = self.per_key[principal.name] - size
            if left:
                self.per_key[principal.name] = left
            else:
                del self.per_key[principal.name]


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, admission: Admission, metrics: GatewayMetrics) -> None:
        self.app = app
        self.admission = admission
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        principal = state.get("principal")
        refused = self.admission.admit(principal)
        if refused is not None:
            if refused.status_code == 429:
                self.metrics.rejected.inc()
            await send_error(send, refused)
            return
        place = state["place"] = Place(principal)  # the route grows it to the request's sequences
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.release(principal, place.size)
