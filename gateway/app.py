"""``create_app(settings, engine)``: the Starlette app, wired. Nothing else lives here.

settings -> ``Gateway`` (engine, catalog, service, admission, metrics) -> routes, behind
the middleware (outermost first, as listed). The lifespan starts the gateway in the
background, so ``/health`` answers at once and ``/ready`` turns 200 when the engine is up;
requests that arrive before then get 503.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from gateway import openapi
from gateway.errors import GatewayError
from gateway.middleware import (
    AccessLogMiddleware,
    AdmissionMiddleware,
    AuthMiddleware,
    HeaderLimitMiddleware,
    RequestIdMiddleware,
    cors,
    cors_wrap,
)
from gateway.responses import render_error, render_http_error
from gateway.routes import PUBLIC_PATHS, ROUTES
from gateway.settings import GatewaySettings
from gateway.state import Gateway
from gateway.types import Engine


def create_app(settings: GatewaySettings, engine: Engine | None = None) -> Starlette:
    gw = Gateway(settings, engine)
    public = PUBLIC_PATHS | ({"/metrics"} if settings.auth.public_metrics else set())
    refusals = cors_wrap(settings.server.cors_allow_origins)  # answers made outside CORS get its headers
    app = Starlette(
        routes=ROUTES,
        middleware=[
            Middleware(RequestIdMiddleware, refusals=refusals),
            Middleware(AccessLogMiddleware, metrics=gw.metrics),
            Middleware(HeaderLimitMiddleware, max_bytes=settings.server.max_header_bytes, refusals=refusals),
            *cors(settings.server.cors_allow_origins),
            Middleware(AuthMiddleware, keys=settings.auth.keys, public_paths=frozenset(public)),
            Middleware(AdmissionMiddleware, admission=gw.admission, metrics=gw.metrics),
        ],
        exception_handlers={GatewayError: render_error, HTTPException: render_http_error},
        lifespan=_lifespan,
    )
    app.state.gateway = gw
    app.state.openapi = openapi.render(ROUTES, frozenset(public))  # served by GET /openapi.json
    return app


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    gw: Gateway = app.state.gateway
    task = asyncio.create_task(gw.run())
    loop = asyncio.get_running_loop()
    with suppress(NotImplementedError, RuntimeError, ValueError):  # not main thread / Windows
        loop.add_signal_handler(signal.SIGHUP, gw.reload_now.set)
    try:
        yield
    finally:
        task.cancel()
        with suppress(BaseException):
            await task
        await gw.engine.shutdown()
        gw.close()
