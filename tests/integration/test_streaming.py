"""Raw SSE framing over httpx: the house format and OpenAI's, streamed as generated.

"Streamed, not buffered" is judged by order, not by a clock: when the client holds the
first generated event, the engine has not finished the request. The request asks for far
more tokens than a starved CI machine could make while the client looks (a short one lost
that race once), and the client hangs up after a few events, which aborts the rest."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import chat_body, eventually
from tests.integration.conftest import LiveGateway

QUESTION = "Tell me about the history of Paris."


def iter_events(response: httpx.Response) -> Iterator[str]:
    """Each SSE event as it arrives, split on the blank line; no bytes may trail the last."""
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            yield event
    assert buffer == "", f"trailing bytes after the last event: {buffer!r}"


def sse_events(response: httpx.Response) -> list[str]:
    return list(iter_events(response))


def unfinished(gw: LiveGateway) -> int:
    return int(gw.status()["engine_unfinished_requests"])


def unfinished_when_held(gw: LiveGateway, response: httpx.Response, index: int) -> int:
    """The engine's unfinished requests while the client holds event ``index`` of ``response``;
    the client then reads a few events more and hangs up (the caller closes the stream)."""
    events = iter_events(response)
    for _ in range(index + 1):
        next(events)
    seen = unfinished(gw)
    for _ in range(4):
        next(events)  # and the stream goes on
    return seen


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


def test_house_chat_endpoint_framing(http: httpx.Client, base_model: str) -> None:
    body = {"question": QUESTION, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/chat", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-adapter"] == base_model
        events = sse_events(r)
    assert events[-1] == "event: done\ndata: [DONE]"
    assert len(events) > 5
    assert house_texts(events)


def test_house_chat_endpoint_streams_as_generated(gateway: LiveGateway) -> None:
    body = {"question": QUESTION, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with gateway.client() as http, http.stream("POST", "/chat", json=body) as r:
        assert r.status_code == 200
        seen = unfinished_when_held(gateway, r, 0)
    # Streamed, not buffered: the first delta was out while the engine was still generating.
    assert seen >= 1, "the generation had ended before the first event arrived: the response was buffered"
    eventually(lambda: unfinished(gateway) == 0, 30, "engine request aborted after the client hung up")


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


def test_openai_sse_framing(http: httpx.Client, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, max_tokens=48, temperature=0, stream=True, ignore_eos=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[1]["choices"][0]["delta"]["content"]  # event 1 carries generated text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_stream_is_sent_as_generated(gateway: LiveGateway, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, max_tokens=1500, temperature=0, stream=True, ignore_eos=True)
    with gateway.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        seen = unfinished_when_held(gateway, r, 1)  # 0 is the role, sent before any token
    # Streamed, not buffered: the first content was out while the engine was still generating.
    assert seen >= 1, "the generation had ended before the first content arrived: the response was buffered"
    eventually(lambda: unfinished(gateway) == 0, 30, "engine request aborted after the client hung up")


def test_house_rejects_n_above_one(http: httpx.Client, base_model: str) -> None:
    body = chat_body(base_model, QUESTION, n=2)
    r = http.post("/v1/chat/completions", json=body, headers={"X-Stream-Format": "house"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


def test_house_unknown_model_is_404_before_streaming(http: httpx.Client) -> None:
    r = http.post("/chat", json={"question": "hi", "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
