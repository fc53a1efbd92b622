"""The app in-process, for tests of auth, limits, status codes and readiness without an
engine: ``create_app`` on a small catalog with a ``FakeEngine``, served over httpx's ASGI
transport with the lifespan running (``serve``). Same keys as the integration suite."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest
import pytest_asyncio
from safetensors.numpy import save_file
from starlette.applications import Starlette

from gateway.app import create_app
from gateway.settings import GatewaySettings, load_settings
from gateway.state import Gateway
from tests.helpers import eventually_async
from tests.unit.fakes import FakeEngine

USER_KEY = "sk-test-user-0001"
ADMIN_KEY = "sk-test-admin-0001"
SHOUT_ONLY_KEY = "sk-test-shout-only"
SINGLE_KEY = "sk-test-one-at-a-time"
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BASE = "fake-model"  # FakeEngine's served_model_name

SETTINGS = f"""
auth:
  keys:
    - {{name: user, key: {USER_KEY}}}
    - {{name: admin, key: {ADMIN_KEY}, admin: true}}
    - {{name: shout-only, key: {SHOUT_ONLY_KEY}, routes: [shout]}}
    - {{name: single, key: {SINGLE_KEY}, max_concurrency: 1}}
catalog_poll_s: 60  # the watcher stays quiet; tests reload through the admin endpoint
"""

CATALOG = """
base:
  aliases: [base]
  tasks: [general]
routes:
  - name: shout
    adapter: shout
    aliases: [loud]
    tasks: [shouting]
  - name: json
    adapter: json
    tasks: [extract]
  - name: concise
    system_prompt: Answer in one sentence.
    tasks: [summary]
"""


def make_adapter(root: Path, name: str) -> None:
    """An adapter directory the catalog accepts (the fake engine never reads the weights)."""
    path = root / name
    path.mkdir(parents=True)
    config = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": BASE,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    # Real safetensors headers (registration reads them), rank 8; the fake model has no
    # weight files, so no shape is checked against it.
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {}
    for module in ("q_proj", "v_proj"):
        tensors[f"{prefix}.{module}.lora_A.weight"] = numpy.zeros((8, 16), dtype=numpy.float32)
        tensors[f"{prefix}.{module}.lora_B.weight"] = numpy.zeros((16, 8), dtype=numpy.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"name": name})


@pytest.fixture
def make_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., GatewaySettings]:
    """Settings on a catalog of its own (tmp_path/adapters.yaml: shout, json, concise).
    Keyword overrides are ``--set`` keys with ``__`` for the dot: ``limits__max_inflight=2``."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    root = tmp_path / "adapters"
    for name in ("shout", "json"):
        make_adapter(root, name)
    (tmp_path / "adapters.yaml").write_text(CATALOG)
    (tmp_path / "gateway.yaml").write_text(SETTINGS)

    def make(**overrides: Any) -> GatewaySettings:
        dotted = {key.replace("__", "."): value for key, value in overrides.items()}
        base = {"config": str(tmp_path / "gateway.yaml"), "catalog": str(tmp_path / "adapters.yaml")}
        # cache_dir: the adapter copies and the response store stay in the test's folder
        base |= {"adapters_root": str(root), "cache_dir": str(tmp_path / "cache")}
        return load_settings({**base, **dotted})

    return make


@dataclass
class Served:
    app: Starlette
    gw: Gateway
    engine: FakeEngine
    http: httpx.AsyncClient  # sends the user's key unless a request says otherwise

    async def ready(self) -> None:
        async def is_ready() -> bool:
            return (await self.http.get("/ready")).status_code == 200

        await eventually_async(is_ready, 5, "/ready is 200", interval=0.01)


Serve = Callable[..., Awaitable[Served]]


@pytest_asyncio.fixture(loop_scope="function")
async def serve(make_settings: Callable[..., GatewaySettings]) -> AsyncIterator[Serve]:
    """``await serve(engine=None, wait_ready=True, **settings)``: the app with its lifespan
    entered (the engine starts in the background, as in production) and a client; both
    are closed after the test."""
    async with AsyncExitStack() as stack:

        async def start(
            engine: FakeEngine | None = None, wait_ready: bool = True, **overrides: Any
        ) -> Served:
            engine = engine or FakeEngine()
            app = create_app(make_settings(**overrides), engine)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
            http = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://gateway.test", headers=USER)
            )
            if engine.gate is not None:  # first on the way out: a failed test leaves no request held
                stack.callback(engine.gate.set)
            served = Served(app, app.state.gateway, engine, http)
            if wait_ready:
                await served.ready()
            return served

        yield start


def http_scope(path: str, headers: dict[str, str], method: str = "POST") -> dict[str, Any]:
    """An ASGI HTTP scope, for tests that drive the app's ``receive`` and ``send`` by hand."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("gateway.test", 80),
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }


def body_then_disconnect(
    body: bytes, gone: asyncio.Event | None = None
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive``: the whole body, then a disconnect (once ``gone`` is set, if given)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if gone is not None:
            await gone.wait()
        return {"type": "http.disconnect"}

    return receive
