"""The handlers through the whole app in-process with a FakeEngine: /health and /ready in
every state, the inference endpoints and their wire formats, the error statuses, and the
admin reload."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock

import httpx
import pytest

from gateway import state
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.types import LoraSpec
from gateway.watcher import CatalogWatcher
from tests.helpers import (
    assert_openai_error,
    chat_body,
    completion_body,
    eventually_async,
    still_serves_async,
)
from tests.unit.conftest import ADMIN, BASE, CATALOG, Serve, Served, make_adapter
from tests.unit.fakes import FakeEngine


def sse_data(text: str) -> list[str]:
    """The data of each SSE event, in order."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


# -- /health and /ready ------------------------------------------------------------------
async def test_starting_health_200_ready_503_and_requests_503_with_retry_after(serve: Serve) -> None:
    start_gate = asyncio.Event()
    served = await serve(FakeEngine(start_gate=start_gate), wait_ready=False)
    assert (await served.http.get("/health")).json() == {"status": "ok"}
    ready = await served.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "starting"})
    for path, body in [
        ("/v1/chat/completions", chat_body("base")),
        ("/chat", {"question": "hi"}),
        ("/v1/completions", completion_body("base")),
    ]:
        r = await served.http.post(path, json=body)
        err = assert_openai_error(r, 503, "engine_unavailable")
        assert err["type"] == "service_unavailable" and r.headers["retry-after"] == "5"
    assert_openai_error(await served.http.get("/v1/models"), 503)
    assert_openai_error(await served.http.get("/admin/adapters", headers=ADMIN), 503)
    assert served.gw.admission.inflight == 0
    start_gate.set()
    await served.ready()
    assert (await served.http.get("/ready")).json() == {"status": "ready", "model": BASE}
    await still_serves_async(served.http)


class GatedAdd(FakeEngine):
    """An engine whose ``add_lora`` waits for ``add_gate`` (open until a test clears it)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_gate = asyncio.Event()
        self.add_gate.set()
        self.adds_started = 0

    async def add_lora(self, lora: LoraSpec) -> None:
        self.adds_started += 1
        await self.add_gate.wait()
        await super().add_lora(lora)


def requests_counted(served: Served, route: str) -> float:
    labels = {"route": route, "status": "200", "stream": "false"}
    return served.gw.metrics.registry.get_sample_value("gateway_requests_total", labels) or 0.0


async def test_ready_and_requests_wait_for_the_adapters_to_load(serve: Serve) -> None:
    """The engine is up, an adapter is still loading: not ready, and no request is served yet
    (it would reach an adapter not loaded, pinned or preloaded, and count as route unknown)."""
    engine = GatedAdd()
    engine.add_gate.clear()
    served = await serve(engine, wait_ready=False)
    await eventually_async(lambda: engine.adds_started, 5, "an adapter is loading")
    ready = await served.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "starting"})
    assert_openai_error(await served.http.post("/v1/chat/completions", json=chat_body("shout")), 503)
    engine.add_gate.set()
    await served.ready()
    await still_serves_async(served.http, "shout")
    assert requests_counted(served, "shout") == 1


async def test_a_failed_start_is_reported_by_health_and_ready(serve: Serve, tmp_path: Path) -> None:
    (tmp_path / "adapters.yaml").write_text("routes: [this is not yaml\n")
    engine = FakeEngine()
    served = await serve(engine, wait_ready=False)
    await eventually_async(lambda: served.gw.startup_error is not None, 5, "the start failed")
    health = await served.http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "adapters.yaml" in health.json()["detail"]
    ready = await served.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "error"})
    assert_openai_error(await served.http.post("/v1/chat/completions", json=chat_body("base")), 503)
    assert served.gw.exit_code == 2  # a setting: the process ends with the CLI's config status
    assert not engine.started  # refused before the engine's minutes of start


async def test_a_store_file_that_is_not_a_database_fails_the_start_at_once(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "responses.sqlite3"
    store.write_bytes(b"not a database " * 100)
    engine = FakeEngine()
    served = await serve(engine, wait_ready=False, responses__store_path=str(store))
    await eventually_async(lambda: served.gw.startup_error is not None, 5, "the start failed")
    health = (await served.http.get("/health")).json()
    assert health["status"] == "error" and "responses.store_path" in health["detail"]
    assert "file is not a database" in health["detail"]
    assert not engine.started  # refused before the engine's minutes of start


async def test_a_model_folder_that_is_not_there_fails_the_start_before_the_engine(
    serve: Serve, tmp_path: Path
) -> None:
    engine = FakeEngine()
    served = await serve(engine, wait_ready=False, engine__model=str(tmp_path / "no-model"))
    await eventually_async(lambda: served.gw.startup_error is not None, 5, "the start failed")
    assert served.gw.startup_error == f"engine.model: no such file or directory: {tmp_path / 'no-model'}"
    assert served.gw.exit_code == 2
    assert not engine.started  # vLLM would take it for a Hugging Face repo id


async def test_a_cache_dir_that_cannot_be_written_fails_the_start_before_the_engine(
    serve: Serve, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("where cache_dir's folder would be")
    engine = FakeEngine()
    served = await serve(
        engine, wait_ready=False, cache_dir=str(blocker / "cache"), responses__store_path=":memory:"
    )
    await eventually_async(lambda: served.gw.startup_error is not None, 5, "the start failed")
    assert (served.gw.startup_error or "").startswith(f"cache_dir: cannot write under {blocker / 'cache'}")
    assert served.gw.exit_code == 2  # a setting, not "the engine could not start" (1)
    assert not engine.started


class PausesAfterItsFirstStep(FakeEngine):
    """Its first step goes out; ``more`` is set once the gateway has taken it and asks for the
    next, which waits for ``go``."""

    def __init__(self) -> None:
        super().__init__(words=["Hello", " there", "!"])
        self.more, self.go = asyncio.Event(), asyncio.Event()

    async def generate(  # type: ignore[override]
        self, prompt_ids: list[int], sampling: Any, request_id: str, lora: LoraSpec | None, priority: int = 0
    ) -> AsyncIterator[Any]:
        steps = super().generate(prompt_ids, sampling, request_id, lora, priority)
        yield await anext(steps)
        self.more.set()
        await self.go.wait()
        async for step in steps:
            yield step


async def test_a_response_is_stored_when_it_ends_not_while_it_streams(serve: Serve) -> None:
    engine = PausesAfterItsFirstStep()
    served = await serve(engine)
    body = {"model": BASE, "input": "Hi", "stream": True}
    stream = asyncio.ensure_future(served.http.post("/v1/responses", json=body))
    await asyncio.wait_for(engine.more.wait(), 5)  # its first delta has been encoded
    assert served.gw.responses.count_now() == 0  # README: GET is a 404 until it ends
    engine.go.set()
    last = [e for e in (await stream).text.split("\n\n") if e][-1]
    final = json.loads(last.split("\ndata: ", 1)[1])
    assert final["type"] == "response.completed"
    got = await served.http.get(f"/v1/responses/{final['response']['id']}")
    assert got.status_code == 200 and got.json() == final["response"]


async def test_an_engine_that_fails_to_build_is_an_error_not_starting_forever(serve: Serve) -> None:
    engine = FakeEngine()
    engine.start = AsyncMock(side_effect=ValueError("disable_any_whitespace needs a backend"))  # type: ignore[method-assign]
    served = await serve(engine, wait_ready=False)
    await eventually_async(lambda: served.gw.startup_error is not None, 5, "the start failed")
    ready = await served.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "error"})
    health = (await served.http.get("/health")).json()
    assert "ValueError: disable_any_whitespace needs a backend" in health["detail"]
    assert served.gw.exit_code == 1


async def test_a_failed_start_asks_the_server_to_exit_with_one_log_line(
    make_settings: Callable[..., GatewaySettings], caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine()
    engine.start = AsyncMock(side_effect=ValueError("dtype\n  Input should be 'auto'"))  # type: ignore[method-assign]
    app = create_app(make_settings(), engine)
    exited = asyncio.Event()
    app.state.gateway.request_exit = exited.set
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(exited.wait(), 5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "startup failed: the engine could not start: ValueError: dtype Input should be 'auto'"
    ]
    assert errors[0].exc_info is None  # no traceback for what is mostly a refused setting


async def test_a_nul_in_a_schema_path_at_start_leaves_the_engine_supervised(
    serve: Serve, tmp_path: Path
) -> None:
    """``response_format: "file:a\\0b/c.json"`` rejects its entry; the path (ValueError, not
    OSError) also ended ``Gateway.run`` at the watcher's start: no hot swap, and no
    ``watch_engine``, so an engine death went unnoticed (no drain, no exit)."""
    (tmp_path / "adapters.yaml").write_text(
        CATALOG + '  - {name: odd, system_prompt: x, response_format: "file:a\\0b/c.json"}\n'
    )
    served = await serve()
    assert "odd" in served.gw.catalog_or_503().table.errors
    served.engine.fail()
    await eventually_async(lambda: served.gw.admission.draining, 5, "the supervisor drains after the death")


async def test_a_failed_catalog_watcher_starts_again_and_the_engine_stays_supervised(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher runs beside the engine supervisor in ``Gateway.run``: its failure must end
    neither (it ended both, for good)."""
    made: list[CatalogWatcher] = []

    class FailsFirst(CatalogWatcher):
        def __init__(self, *args: Any) -> None:
            if not made:
                made.append(self)
                raise ValueError("embedded null byte")
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(state, "CatalogWatcher", FailsFirst)
    monkeypatch.setattr(state, "WATCHER_RETRY_S", 0.05, raising=False)
    served = await serve()
    await eventually_async(lambda: len(made) == 2, 5, "the watcher started again")
    served.engine.fail()
    await eventually_async(lambda: served.gw.admission.draining, 5, "the supervisor drains after the death")


async def test_engine_death_health_503_requests_503_and_open_streams_get_an_error_event(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate))
    stream = asyncio.ensure_future(
        served.http.post("/v1/chat/completions", json=chat_body("base", stream=True))
    )
    await eventually_async(lambda: served.engine.running == 1, 5, "the stream reached the engine")
    served.engine.fail()
    gate.set()
    events = sse_data((await stream).text)
    assert (await stream).status_code == 200  # the status line went out before the engine died
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable" and events[-1] == "[DONE]"
    health = await served.http.get("/health")
    assert (health.status_code, health.json()["status"]) == (503, "error")
    r = await served.http.post("/v1/chat/completions", json=chat_body("base"))
    assert_openai_error(r, 503)
    ready = await served.http.get("/ready")
    assert ready.status_code == 503
    assert ready.json()["status"] in ("error", "draining")  # never "starting" once it has died
    await eventually_async(lambda: served.gw.admission.draining, 5, "the supervisor drains after the death")
    assert (await served.http.get("/ready")).json() == {"status": "draining"}


async def test_the_lifespan_starts_the_engine_and_shuts_it_down(
    make_settings: Callable[..., GatewaySettings],
) -> None:
    engine = FakeEngine()
    app = create_app(make_settings(), engine)
    async with app.router.lifespan_context(app):
        await eventually_async(lambda: app.state.gateway.is_ready, 5, "the gateway started")
        assert engine.started and not engine.shut_down
    assert engine.shut_down and not engine.ready


# -- inference through the fake ----------------------------------------------------------
async def test_chat_completion(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post("/v1/chat/completions", json=chat_body("base", max_tokens=5))
    assert r.status_code == 200
    assert r.headers["x-adapter"] == BASE and "x-adapter-digest" not in r.headers
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == BASE
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world!"}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_a_lora_route_reaches_the_engine_with_its_adapter(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post("/v1/chat/completions", json=chat_body("loud", max_tokens=5))
    assert r.status_code == 200 and r.json()["model"] == "shout"
    assert r.headers["x-adapter"] == "shout" and len(r.headers["x-adapter-digest"]) == 64
    lora = served.engine.calls[-1][3]
    assert lora is not None and lora.name == "shout" and lora.lora_id in served.engine.loras
    by_task = await served.http.post("/v1/chat/completions", json=chat_body(BASE, task="shouting"))
    assert by_task.headers["x-adapter"] == "shout"


async def test_stream_options_given_as_null_are_the_defaults(serve: Serve) -> None:
    """vLLM takes ``include_usage: null`` as false; it was a 400 'Input should be a valid boolean'."""
    served = await serve()
    options = {"include_usage": None, "continuous_usage_stats": None}
    r = await served.http.post(
        "/v1/chat/completions", json=chat_body("shout", stream=True, stream_options=options)
    )
    assert r.status_code == 200, r.text
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert all(c["choices"] and c.get("usage") is None for c in chunks)


async def test_chat_stream_is_openai_chunks_then_done(serve: Serve) -> None:
    served = await serve()
    body = chat_body("shout", stream=True, stream_options={"include_usage": True})
    r = await served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-adapter"] == "shout" and r.headers["cache-control"] == "no-cache"
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "shout" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!"
    assert (
        len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) == 3
    )  # one per step
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_house_stream_on_chat_and_on_chat_completions(serve: Serve) -> None:
    served = await serve()
    expected = (
        'event: message\ndata: {"text": "Hello"}\n\n'
        'event: message\ndata: {"text": " world"}\n\n'
        'event: message\ndata: {"text": "!"}\n\n'
        "event: done\ndata: [DONE]\n\n"
    )
    house = await served.http.post("/chat", json={"question": "hi", "task": "shouting"})
    assert house.status_code == 200 and house.headers["x-adapter"] == "shout"
    assert house.text == expected
    header = await served.http.post(
        "/v1/chat/completions", json=chat_body("base"), headers={"X-Stream-Format": "house"}
    )
    assert header.status_code == 200 and header.text == expected
    two = await served.http.post(
        "/v1/chat/completions", json=chat_body("base", n=2), headers={"X-Stream-Format": "house"}
    )
    assert assert_openai_error(two, 400)["param"] == "n"
    whole = await served.http.post(  # an explicit stream: false is refused, as on POST /chat
        "/v1/chat/completions", json=chat_body("base", stream=False), headers={"X-Stream-Format": "house"}
    )
    assert assert_openai_error(whole, 400)["param"] == "stream"
    assert (
        served.gw.catalog is not None and served.gw.catalog.in_use() == {}
    )  # the refused ones let go of their route


async def test_completion(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post("/v1/completions", json=completion_body("base", [5, 6, 7], max_tokens=2))
    assert r.status_code == 200
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == "Hello world"
    assert served.engine.calls[-1][0] == [5, 6, 7]
    stream = await served.http.post("/v1/completions", json=completion_body("base", "hi", stream=True))
    data = sse_data(stream.text)
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == "Hello world!"


async def test_a_completion_on_a_route_with_a_system_prompt_is_refused_not_stripped(serve: Serve) -> None:
    """A completion's raw prompt has no system turn: the preset's prompt was silently left out
    and the base model answered as if no route had been asked for."""
    served = await serve()
    for body, param in (
        (completion_body("concise", "hi"), "model"),
        ({"prompt": "hi", "task": "summary", "stream": True}, "task"),  # the field that chose it
    ):
        r = await served.http.post("/v1/completions", json=body)
        err = assert_openai_error(r, 400)
        assert err["param"] == param and "/v1/chat/completions" in err["message"]
    assert served.engine.calls == []
    chat = await served.http.post("/v1/chat/completions", json=chat_body("concise", max_tokens=2))
    assert chat.status_code == 200 and chat.json()["model"] == "concise"


async def test_models_list_and_card(serve: Serve) -> None:
    served = await serve()
    cards = {m["id"]: m for m in (await served.http.get("/v1/models")).json()["data"]}
    assert cards[BASE]["parent"] is None and cards["shout"]["parent"] == BASE
    assert (
        cards["shout"]["kind"] == "lora"
        and len(cards["shout"]["digest"]) == 64
        and cards["shout"]["rank"] == 8
    )
    assert cards["loud"]["alias_of"] == "shout" and cards["loud"]["digest"] == cards["shout"]["digest"]
    assert cards["concise"]["kind"] == "preset" and cards["concise"]["digest"] is None
    assert (await served.http.get("/v1/models/concise")).json()["id"] == "concise"
    assert_openai_error(await served.http.get("/v1/models/nope"), 404)


# -- errors ------------------------------------------------------------------------------
async def test_unknown_path_is_404_and_wrong_method_405(serve: Serve) -> None:
    served = await serve()
    assert_openai_error(await served.http.get("/v1/nothing"), 404, "not_found")
    assert_openai_error(await served.http.post("/v1/nothing"), 404, "not_found")
    assert_openai_error(await served.http.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_openai_error(await served.http.delete("/v1/models"), 405, "method_not_allowed")
    assert_openai_error(await served.http.get("/admin/adapters/reload", headers=ADMIN), 405)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"[1, 2]", None),
        (b'"text"', None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (b'{"messages": "hello"}', "messages"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 100}', "n"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_p": -1}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),  # not JSON
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
        (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}',
            "max_tokens",
        ),
    ],
)
async def test_bad_bodies_are_400_with_param(serve: Serve, content: bytes, param: str | None) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert served.engine.calls == [] and served.gw.admission.inflight == 0
    await still_serves_async(served.http)


async def test_unknown_model_is_404_model_not_found(serve: Serve) -> None:
    served = await serve()
    for name in ("no-such-adapter", "../shout", "SHOUT"):
        err = assert_openai_error(
            await served.http.post("/v1/chat/completions", json=chat_body(name)), 404, "model_not_found"
        )
        assert err["param"] == "model"
    assert_openai_error(
        await served.http.post("/chat", json={"question": "hi", "model": "nope"}), 404, "model_not_found"
    )


async def test_context_length_exceeded(serve: Serve) -> None:
    served = await serve(FakeEngine(max_model_len=50))
    r = await served.http.post("/v1/chat/completions", json=chat_body("base", "x" * 100))
    assert_openai_error(r, 400, "context_length_exceeded")


async def test_body_too_large_is_413_by_content_length(serve: Serve) -> None:
    served = await serve(limits__max_body_bytes=1024)
    big = json.dumps(chat_body("base", "x" * 2000)).encode()
    r = await served.http.post(
        "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.request.headers["content-length"] == str(len(big))
    assert_openai_error(r, 413, "payload_too_large")
    assert served.engine.calls == []
    await still_serves_async(served.http)


async def test_body_too_large_is_413_when_streamed_without_a_length(serve: Serve) -> None:
    served = await serve(limits__max_body_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "base", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}]}'

    r = await served.http.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, "payload_too_large")
    await still_serves_async(served.http)


# -- admin reload ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content",
    [
        b"routes: [this is not yaml\n",
        "routes:\n  - {name: base, system_prompt: caf\u00e9}\n".encode("latin-1"),
    ],
    ids=["not-yaml", "not-utf8"],
)
async def test_reload_with_a_broken_catalog_is_422_and_the_last_good_table_serves(
    serve: Serve, tmp_path: Path, content: bytes
) -> None:
    served = await serve()
    (tmp_path / "adapters.yaml").write_bytes(content)
    r = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert r.status_code == 422
    body = r.json()  # OpenAI's error object, so a client's error handling shows why, and the report
    assert set(body) == {"error", "reloaded", "routes"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "catalog_invalid"
    assert body["error"]["param"] is None and "adapters.yaml" in body["error"]["message"]
    assert body["reloaded"] is False and body["routes"] == ["concise", "json", "shout"]
    await still_serves_async(served.http, "shout")
    last_error = (await served.http.get("/admin/adapters", headers=ADMIN)).json()["last_error"]
    assert last_error == body["error"]["message"]
    (tmp_path / "adapters.yaml").write_text("")  # an editor's truncate before its write
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 422
    await still_serves_async(served.http, "shout")
    (tmp_path / "adapters.yaml").write_text(CATALOG)
    fixed = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert fixed.status_code == 200  # the 200 keeps its shape: "error", the rejected entries or null
    assert fixed.json() == {"reloaded": True, "error": None, "routes": ["concise", "json", "shout"]}


async def test_reload_adds_a_route_and_loads_its_adapter(serve: Serve, tmp_path: Path) -> None:
    served = await serve()
    (tmp_path / "adapters.yaml").write_text(
        CATALOG + "  - name: hot\n    adapter: shout\n  - name: evil\n    adapter: ../x\n"
    )
    r = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert r.status_code == 200 and r.json()["routes"] == ["concise", "hot", "json", "shout"]
    ok = await served.http.post("/v1/chat/completions", json=chat_body("hot"))
    assert ok.status_code == 200 and ok.headers["x-adapter"] == "hot"
    state = (await served.http.get("/admin/adapters", headers=ADMIN)).json()
    assert "evil" in state["rejected"]
    assert set(state["live_loras"]) <= set(state["engine_loras"])
    assert_openai_error(
        await served.http.post("/v1/chat/completions", json=chat_body("evil")), 404, "model_not_found"
    )


async def _reload_loading_hot(
    serve: Serve, tmp_path: Path
) -> tuple[Served, GatedAdd, asyncio.Task[httpx.Response]]:
    """A reload adding route ``hot``, held while the engine loads hot's adapter."""
    engine = GatedAdd()
    served = await serve(engine)
    make_adapter(tmp_path / "adapters", "hot")
    (tmp_path / "adapters.yaml").write_text(CATALOG + "  - {name: hot, adapter: hot}\n")
    engine.add_gate.clear()
    loads = engine.adds_started
    reloading = asyncio.create_task(served.http.post("/admin/adapters/reload", headers=ADMIN))
    await eventually_async(lambda: engine.adds_started > loads, 5, "hot's adapter is loading")
    return served, engine, reloading


async def test_a_reload_serves_the_old_table_until_the_new_adapters_are_loaded(
    serve: Serve, tmp_path: Path
) -> None:
    served, engine, reloading = await _reload_loading_hot(serve, tmp_path)
    assert_openai_error(
        await served.http.post("/v1/chat/completions", json=chat_body("hot")), 404, "model_not_found"
    )
    await still_serves_async(served.http, "shout")
    engine.add_gate.set()
    r = await reloading
    assert r.status_code == 200 and "hot" in r.json()["routes"]
    await still_serves_async(served.http, "hot")
    assert requests_counted(served, "hot") == 1


def add_symlink_loop_entry(tmp_path: Path) -> None:
    os.symlink("loop", tmp_path / "adapters" / "loop")  # adapters/loop -> adapters/loop
    (tmp_path / "adapters.yaml").write_text(CATALOG + "  - {name: loop, adapter: loop}\n")


async def test_reload_rejects_a_symlink_loop_entry_and_keeps_the_rest(serve: Serve, tmp_path: Path) -> None:
    served = await serve()
    add_symlink_loop_entry(tmp_path)
    r = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert r.status_code == 200 and "loop" in r.json()["error"]
    assert r.json()["routes"] == ["concise", "json", "shout"]
    await still_serves_async(served.http, "shout")


async def test_a_symlink_loop_entry_does_not_stop_the_start(serve: Serve, tmp_path: Path) -> None:
    add_symlink_loop_entry(tmp_path)
    served = await serve()
    state = (await served.http.get("/admin/adapters", headers=ADMIN)).json()
    assert "cannot be resolved" in state["rejected"]["loop"]
    await still_serves_async(served.http, "shout")


async def test_a_reload_waiting_for_another_when_the_drain_starts_is_a_503(
    serve: Serve, tmp_path: Path
) -> None:
    """It passed the handler's drain check, then the drain began while it waited for the
    other reload: skipped, it was answered 422 ``catalog_invalid`` for a catalog that is fine."""
    served, engine, first = await _reload_loading_hot(serve, tmp_path)  # holds the reload lock
    second = asyncio.create_task(served.http.post("/admin/adapters/reload", headers=ADMIN))
    await asyncio.sleep(0.05)
    served.gw.admission.draining = True  # SIGTERM
    engine.add_gate.set()
    assert (await first).status_code == 200
    assert_openai_error(await second, 503)


async def test_live_loras_names_each_engine_adapter_once(serve: Serve, tmp_path: Path) -> None:
    (tmp_path / "adapters.yaml").write_text(
        "routes:\n  - {name: shout, adapter: shout}\n"
        "  - {name: shout-strict, adapter: shout, system_prompt: Be strict.}\n"
        "  - {name: json, adapter: json}\n"
    )
    served = await serve()
    state = (await served.http.get("/admin/adapters", headers=ADMIN)).json()
    assert len(state["live_loras"]) == 2 == len(set(state["live_loras"]))


@pytest.mark.parametrize("number", [".inf", "-.inf", ".nan"])
async def test_a_schema_with_a_number_json_has_not_is_the_entrys_rejection(
    serve: Serve, tmp_path: Path, number: str
) -> None:
    """Accepted, it was on the route's card, which no JSON can carry: /v1/models and
    /admin/adapters answered 500 for every key."""
    (tmp_path / "adapters.yaml").write_text(
        CATALOG + "  - name: scored\n    system_prompt: Rate it.\n    response_format:\n"
        f"      type: object\n      properties:\n        score: {{type: number, maximum: {number}}}\n"
    )
    served = await serve()
    assert "not finite" in served.gw.catalog_or_503().table.errors["scored"]
    assert (await served.http.get("/v1/models")).status_code == 200
    assert (await served.http.get("/admin/adapters", headers=ADMIN)).status_code == 200
