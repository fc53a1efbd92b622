"""Bad input gets an OpenAI-shaped 4xx, and the gateway keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import assert_openai_error, completion_body, still_serves
from tests.integration.conftest import LiveGateway


@pytest.fixture(scope="module")
def http(gateway: LiveGateway) -> httpx.Client:
    return gateway.client()


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"messages": []}', 400, "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
        (b'{"messages": "hello"}', 400, "messages"),
        (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "n": 100}', 400, "n"),
        (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "top_p": -1}', 400, "top_p"),
        # NaN is not JSON: no param, as OpenAI answers a body it cannot parse
        (b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None),
        (
            b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 50}',
            400,
            "top_logprobs",
        ),
        (
            b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e","f","g","h","i"]}',
            400,
            "stop",
        ),
        (
            b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "base", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
            400,
            None,
        ),
    ],
)
def test_bad_chat_bodies(
    http: httpx.Client, base_model: str, content: bytes, status: int, param: str | None
) -> None:
    r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    err = assert_openai_error(r, status)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    still_serves(http, base_model)


def test_body_too_large_is_413(http: httpx.Client, base_model: str) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (3 * 1024 * 1024) + b'"}]}'
    assert_openai_error(http.post("/v1/chat/completions", content=big), 413)
    still_serves(http, base_model)


def test_unknown_path_and_wrong_method(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/chat/completions"), 405)


def test_completion_bad_prompts(http: httpx.Client, base_model: str) -> None:
    for prompt in ("", [], [""], [-1], [10**9], [["a"]]):  # a list of prompts is valid (test_edges)
        r = http.post("/v1/completions", json=completion_body(base_model, prompt, max_tokens=2))
        assert_openai_error(r, 400)
    still_serves(http, base_model)


def test_request_id_is_returned(http: httpx.Client) -> None:
    assert http.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    assert len(http.get("/health").headers["x-request-id"]) == 32
