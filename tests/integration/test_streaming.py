"""Raw SSE framing over httpx: the house format and OpenAI's, streamed as generated.

"Streamed, not buffered" is judged by order, not by a clock: when the client holds the
first generated event, the engine has not finished the request."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import chat_body
from tests.integration.conftest import LiveGateway

QUESTION = "Tell me about the history of Paris."


def sse_events(response: httpx.Response, on_event: Callable[[int, str], None] | None = None) -> list[str]:
    """Each SSE event, split on the blank line; ``on_event(i, event)`` runs as event ``i``
    arrives, before the client reads on."""
    events: list[str] = []
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            if on_event is not None:
                on_event(len(events), event)
            events.append(event)
    assert buffer == "", f"trailing bytes after the last event: {buffer!r}"
    return events


def unfinished_at(gw: LiveGateway, index: int, seen: list[int]) -> Callable[[int, str], None]:
    """An ``on_event`` that records the engine's unfinished requests when event ``index`` arrives."""

    def look(i: int, event: str) -> None:
        if i == index:
            seen.append(int(gw.status()["engine_unfinished_requests"]))

    return look


def house_texts(events: list[str]) -> str:
    out = []
    for event in events[:-1]:
        kind, data = event.split("\n")
        assert kind == "event: message"
        assert data.startswith("data: {")
        out.append(json.loads(data[6:])["text"])
    return "".join(out)


@pytest.fixture(scope="module")
def http(gateway: LiveGateway) -> httpx.Client:
    return gateway.client()


def test_house_chat_endpoint_streams_as_generated(
    gateway: LiveGateway, http: httpx.Client, base_model: str
) -> None:
    body = {"question": QUESTION, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    unfinished: list[int] = []
    with http.stream("POST", "/chat", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-adapter"] == base_model
        events = sse_events(r, unfinished_at(gateway, 0, unfinished))
    assert events[-1] == "event: done\ndata: [DONE]"
    assert len(events) > 5
    assert house_texts(events)
    # Streamed, not buffered: the first delta was out while the engine was still generating.
    assert unfinished[0] >= 1, (
        "the generation had ended before the first event arrived: the response was buffered"
    )


def test_house_header_on_chat_completions_matches_openai_text(http: httpx.Client, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, max_tokens=24, temperature=0)
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"}) as r:
        assert r.status_code == 200
        raw_events = sse_events(r)
    house = house_texts(raw_events)
    whole = http.post("/v1/chat/completions", json=body).json()
    assert house == whole["choices"][0]["message"]["content"]


def test_house_data_is_utf8_not_escaped(http: httpx.Client, base_model: str) -> None:
    body = chat_body(
        base_model,
        "Écris une phrase en français sur l'été à Orléans.",
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"}) as r:
        raw = r.read()
    assert b"\\u" not in raw  # json.dumps(ensure_ascii=False): non-ASCII goes out as UTF-8 bytes
    raw.decode("utf-8")  # and it is valid UTF-8


def test_openai_sse_framing(gateway: LiveGateway, http: httpx.Client, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, max_tokens=48, temperature=0, stream=True, ignore_eos=True)
    unfinished: list[int] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r, unfinished_at(gateway, 1, unfinished))  # 0 is the role, sent before any token
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"]["content"]  # event 1 carries generated text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # Streamed, not buffered: the first content was out while the engine was still generating.
    assert unfinished[0] >= 1, (
        "the generation had ended before the first content arrived: the response was buffered"
    )


def test_house_rejects_n_above_one(http: httpx.Client, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, n=2)
    r = http.post("/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


def test_house_unknown_model_is_404_before_streaming(http: httpx.Client) -> None:
    r = http.post("/chat", json={"question": "hi", "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
