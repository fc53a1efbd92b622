"""The end of a drain (``DrainingServer``): requests still in flight when
``limits.drain_timeout_s`` runs out end with a 503, or their format's error event once the
stream has started, and are aborted in the engine; none is left to be cut by uvicorn."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import uvicorn
from starlette.types import Message

from gateway.errors import EngineUnavailable, GatewayError
from gateway.metrics import RequestRecord
from gateway.responses import SSEResponse
from gateway.server import DrainingServer
from tests.helpers import assert_openai_error, chat_body, eventually_async
from tests.unit.conftest import ADMIN, Serve, make_adapter
from tests.unit.fakes import FakeEngine
from tests.unit.test_routes import sse_data


async def test_the_drain_timeout_stops_what_is_still_in_flight() -> None:
    stopped: list[bool] = []
    admission = SimpleNamespace(requests=1, inflight=1, draining=True)
    gw: Any = SimpleNamespace(
        admission=admission,
        settings=SimpleNamespace(limits=SimpleNamespace(drain_timeout_s=0.1)),
        stop_requests=lambda: stopped.append(True),
    )
    server = DrainingServer(uvicorn.Config(lambda *_: None), gw)
    await server._drain()
    assert stopped == [True] and server.should_exit


async def test_a_second_signal_stops_what_is_in_flight_at_once() -> None:
    stopped: list[bool] = []
    gw: Any = SimpleNamespace(
        admission=SimpleNamespace(requests=1, inflight=1, draining=False),
        settings=SimpleNamespace(limits=SimpleNamespace(drain_timeout_s=60)),
        stop_requests=lambda: stopped.append(True),
    )
    server = DrainingServer(uvicorn.Config(lambda *_: None), gw)
    server._loop = asyncio.get_running_loop()
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.sleep(0.01)
    assert gw.admission.draining and not server.should_exit and stopped == []
    server.handle_exit(signal.SIGINT, None)
    await asyncio.sleep(0.01)
    assert server.should_exit and not server.force_exit and stopped == [True]
    if server._drain_task is not None:
        server._drain_task.cancel()


async def test_stopped_streams_end_with_an_error_event_and_are_aborted(serve: Serve) -> None:
    served = await serve(FakeEngine(gate=asyncio.Event()))
    chat = asyncio.ensure_future(
        served.http.post("/v1/chat/completions", json=chat_body("base", stream=True))
    )
    house = asyncio.ensure_future(served.http.post("/chat", json={"question": "Hi", "stream": True}))
    responses = asyncio.ensure_future(
        served.http.post(
            "/v1/responses", json={"model": "base", "input": "Hi", "stream": True, "store": True}
        )
    )
    await eventually_async(lambda: served.engine.running == 3, 5, "three streams in the engine")
    served.gw.stop_requests()
    chat_events = sse_data((await asyncio.wait_for(chat, 5)).text)
    assert json.loads(chat_events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert chat_events[-1] == "[DONE]"  # after the error event, as vLLM's server
    error = json.loads(chat_events[-2])["error"]
    assert (error["type"], error["message"]) == ("service_unavailable", "the gateway is shutting down")
    assert (await asyncio.wait_for(house, 5)).text.endswith(
        'event: error\ndata: {"error": "the gateway is shutting down"}\n\n'
    )
    events = [e for e in (await asyncio.wait_for(responses, 5)).text.split("\n\n") if e]
    last = json.loads(events[-1].split("\ndata: ", 1)[1])
    assert last["type"] == "response.failed"
    assert last["response"]["error"]["message"] == "the gateway is shutting down"
    await eventually_async(lambda: len(served.engine.aborted) == 3, 5, "all three aborted")
    assert served.gw.admission.inflight == 0
    stored = await served.http.get(f"/v1/responses/{last['response']['id']}")
    assert stored.status_code == 404  # a failed stream is not stored, as any that fails


async def test_stopped_whole_answers_and_queued_lora_requests_get_a_503(serve: Serve) -> None:
    served = await serve(FakeEngine(gate=asyncio.Event()), engine__max_loras=1)
    base = asyncio.ensure_future(served.http.post("/v1/chat/completions", json=chat_body("base")))
    shout = asyncio.ensure_future(served.http.post("/v1/chat/completions", json=chat_body("shout")))
    await eventually_async(lambda: served.engine.running == 2, 5, "base and shout in the engine")
    queued = asyncio.ensure_future(
        served.http.post("/v1/chat/completions", json=chat_body("json", stream=True))
    )

    async def json_queued() -> bool:
        status = (await served.http.get("/admin/status", headers=ADMIN)).json()
        return bool(status["lora_scheduler"]["queued"])

    await eventually_async(json_queued, 5, "json waits for shout's slot")
    served.gw.stop_requests()
    for r in await asyncio.wait_for(asyncio.gather(base, shout), 5):
        assert assert_openai_error(r, 503)["message"] == "the gateway is shutting down"
        assert r.headers["retry-after"] == "1"
    events = sse_data((await asyncio.wait_for(queued, 5)).text)
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable" and events[-1] == "[DONE]"
    assert served.engine.running == 0 and len(served.engine.calls) == 2  # json never reached it
    assert served.gw.admission.inflight == 0
    assert served.gw.scheduler is not None and served.gw.scheduler.queued == 0


async def test_a_stopped_stream_whose_client_does_not_read_ends_before_uvicorn_cancels_it() -> None:
    """A client that stopped reading blocks every send: the error event cannot go out, and the
    stream must still end within uvicorn's 2 s (else it is cancelled: a traceback at exit)."""
    sent: list[Message] = []
    unblock = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        if message.get("body"):
            await unblock.wait()  # a full TCP window

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError

    async def tokens() -> AsyncIterator[bytes]:
        while True:
            yield b"data: {}\n\n"

    stop: asyncio.Future[GatewayError] = asyncio.get_running_loop().create_future()
    record = RequestRecord("id", "POST", "/v1/chat/completions")
    response = SSEResponse(
        tokens(), {}, record, send_timeout_s=60, stop=stop, on_stop=lambda exc: b"event: error\n\n"
    )
    call = asyncio.ensure_future(response({"type": "http"}, receive, send))
    await eventually_async(lambda: len(sent) == 2, 5, "the stream blocked on its first event")
    stop.set_result(EngineUnavailable("the gateway is shutting down"))
    await asyncio.wait_for(call, 1.8)
    assert record.disconnected  # it took nothing more: a client gone, not a 200
    unblock.set()


async def test_an_admin_reload_while_draining_is_a_503(serve: Serve) -> None:
    served = await serve()
    reloads = served.gw.catalog.reloads if served.gw.catalog is not None else None
    served.gw.admission.draining = True
    r = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert assert_openai_error(r, 503)["message"] == "the gateway is shutting down"
    assert r.headers["retry-after"] == "1"
    assert served.gw.catalog is not None and served.gw.catalog.reloads == reloads
    assert (await served.http.get("/admin/status", headers=ADMIN)).json()["draining"] is True


async def test_sighup_or_a_file_change_does_not_reload_while_draining(serve: Serve, tmp_path: Any) -> None:
    """As the admin endpoint: no adapter loaded or warmed in an engine about to stop, which
    the drain does not wait for (the watcher's reloads, SIGHUP's too, go through here)."""
    served = await serve()
    gw = served.gw
    assert gw.catalog is not None
    make_adapter(tmp_path / "adapters", "fresh")
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(catalog.read_text() + "  - {name: fresh, adapter: fresh, preload: true}\n")
    reloads = gw.catalog.reloads
    gw.admission.draining = True
    assert await gw.reload_catalog() is False
    assert gw.catalog.reloads == reloads and "fresh" not in gw.catalog.table.routes
    assert not any(request_id.startswith("preload-") for _, _, request_id, _ in served.engine.calls)
    gw.admission.draining = False  # (never so in production) the same file reloads otherwise
    assert await gw.reload_catalog() is True and "fresh" in gw.catalog.table.routes


class _GatedAddEngine(FakeEngine):
    """Adding an adapter waits for ``add_gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.add_gate = asyncio.Event()
        self.waiting_in_add = 0
        self.added: list[str] = []

    async def add_lora(self, lora: Any) -> None:
        self.waiting_in_add += 1
        await self.add_gate.wait()
        self.added.append(lora.name)
        await super().add_lora(lora)


async def test_a_reload_waiting_for_another_is_skipped_once_the_drain_begins(
    serve: Serve, tmp_path: Any
) -> None:
    """Checked when its turn comes too: a SIGHUP reload queued behind a watcher's reload that
    is still loading adapters found the gateway not draining yet, and ran during the drain."""
    engine = _GatedAddEngine()
    engine.add_gate.set()
    served = await serve(engine)
    gw = served.gw
    engine.add_gate.clear()
    for name in ("extra", "extra2"):
        make_adapter(tmp_path / "adapters", name)
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(catalog.read_text() + "  - {name: extra, adapter: extra}\n")
    engine.waiting_in_add = 0
    first = asyncio.create_task(gw.reload_catalog())
    await eventually_async(lambda: engine.waiting_in_add == 1, 5, "the first reload loading extra")
    catalog.write_text(catalog.read_text() + "  - {name: extra2, adapter: extra2}\n")
    second = asyncio.create_task(gw.reload_catalog())
    await asyncio.sleep(0.05)  # past the first check, waiting for the first reload
    gw.admission.draining = True
    engine.add_gate.set()
    assert await asyncio.wait_for(first, 5) is True
    assert await asyncio.wait_for(second, 5) is False
    assert "extra2" not in engine.added
