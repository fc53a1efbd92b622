"""Raw SSE framing over httpx: the house format and OpenAI's, streamed as generated."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.integration.conftest import LiveGateway

QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]


def timed_events(response: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, raw event) for each SSE event, split on the blank line."""
    events, buffer = [], ""
    for text in response.iter_text():
        now = time.monotonic()
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            events.append((now, event))
    assert buffer == "", f"trailing bytes after the last event: {buffer!r}"
    return events


def house_texts(events: list[tuple[float, str]]) -> str:
    out = []
    for _, event in events[:-1]:
        kind, data = event.split("\n")
        assert kind == "event: message"
        assert data.startswith("data: {")
        out.append(json.loads(data[6:])["text"])
    return "".join(out)


@pytest.fixture(scope="module")
def http(gateway: LiveGateway) -> httpx.Client:
    return gateway.client()


def test_house_chat_endpoint_streams_as_generated(http: httpx.Client, base_model: str) -> None:
    body = {"question": "Tell me about the history of Paris.", "max_tokens": 48, "temperature": 0}
    with http.stream("POST", "/chat", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-adapter"] == base_model
        events = timed_events(r)
    assert events[-1][1] == "event: done\ndata: [DONE]"
    assert len(events) > 5
    assert house_texts(events)
    # Streamed, not buffered: the first delta arrived well before the stream ended.
    first, last = events[0][0], events[-1][0]
    assert last - first > 0.2, "all events arrived together: the response was buffered"


def test_house_header_on_chat_completions_matches_openai_text(http: httpx.Client, base_model: str) -> None:
    body = {"model": base_model, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"}) as r:
        assert r.status_code == 200
        raw_events = timed_events(r)
    house = house_texts(raw_events)
    whole = http.post("/v1/chat/completions", json=body).json()
    assert house == whole["choices"][0]["message"]["content"]


def test_house_data_is_utf8_not_escaped(http: httpx.Client, base_model: str) -> None:
    body = {"model": base_model, "messages": [{"role": "user", "content": "Écris une phrase en français sur l'été à Orléans."}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"}) as r:
        raw = r.read()
    assert b"\\u" not in raw  # json.dumps(ensure_ascii=False): non-ASCII goes out as UTF-8 bytes
    raw.decode("utf-8")  # and it is valid UTF-8


def test_openai_sse_framing(http: httpx.Client, base_model: str) -> None:
    body = {"model": base_model, "messages": QUESTION, "max_tokens": 48, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = timed_events(r)
    assert events[-1][1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for _, e in events[:-1]]
    assert all(e.startswith("data: {") and "\n" not in e for _, e in events[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1][0] - events[1][0] > 0.2, "all events arrived together: the response was buffered"


def test_house_rejects_n_above_one(http: httpx.Client, base_model: str) -> None:
    body = {"model": base_model, "messages": QUESTION, "n": 2}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


def test_house_unknown_model_is_404_before_streaming(http: httpx.Client) -> None:
    r = http.post("/chat", json={"question": "hi", "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
