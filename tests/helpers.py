"""Helpers shared by unit and integration tests: one polling loop, a free port, request
bodies, the OpenAI error shape, and "the gateway still serves"."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, overload

import httpx

T = TypeVar("T")


def _timed_out(what: str, timeout: float, detail: Callable[[], str] | None) -> AssertionError:
    extra = f" {detail()}" if detail is not None else ""
    return AssertionError(f"{what}: not within {timeout} s.{extra}")


def eventually(
    check: Callable[[], T],
    timeout: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> T:
    """Call ``check`` until it returns something true, and return that; fail after ``timeout``
    seconds with ``what`` (and ``detail()``, for context) in the message."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, detail)
        time.sleep(interval)
    return result


@overload
async def eventually_async(
    check: Callable[[], Awaitable[T]],
    timeout: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> T: ...


@overload
async def eventually_async(
    check: Callable[[], T],
    timeout: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> T: ...


async def eventually_async(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    detail: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> Any:
    """``eventually`` for a test that runs on the event loop: it sleeps with ``asyncio.sleep``
    so that tasks on the same loop (load, the app under test) keep running. ``check`` may
    be a coroutine function (a request to an app in-process)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, detail)
        await asyncio.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- request bodies -----------------------------------------------------------------------
def messages(content: str = "Hi") -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def chat_body(model: str, content: str = "Hi", **fields: Any) -> dict[str, Any]:
    """A /v1/chat/completions body with one user turn; ``fields`` add or override the rest."""
    return {"model": model, "messages": messages(content), **fields}


def completion_body(model: str, prompt: Any = "Hi", **fields: Any) -> dict[str, Any]:
    """A /v1/completions body; ``prompt`` may be text, token ids, or anything to be refused."""
    return {"model": model, "prompt": prompt, **fields}


# -- responses ------------------------------------------------------------------------------
def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """``r`` is ``status`` with exactly OpenAI's error object; returns the inner ``error``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err  # type: ignore[no-any-return]


class HasClient(Protocol):
    def client(self) -> httpx.Client: ...


def still_serves(target: httpx.Client | HasClient, model: str = "base") -> None:
    """A short chat request to ``model`` is answered 200 (after a fault, the gateway lives).
    ``target`` is a client with the user's key (a starlette ``TestClient`` too), or a live
    gateway whose ``client()`` makes one."""
    if isinstance(target, httpx.Client):
        r = target.post("/v1/chat/completions", json=chat_body(model, max_tokens=2))
    else:
        with target.client() as http:
            r = http.post("/v1/chat/completions", json=chat_body(model, max_tokens=2))
    assert r.status_code == 200, r.text


async def still_serves_async(http: httpx.AsyncClient, model: str = "base") -> None:
    """``still_serves`` for an async client (an app in-process over ``httpx.ASGITransport``)."""
    r = await http.post("/v1/chat/completions", json=chat_body(model, max_tokens=2))
    assert r.status_code == 200, r.text
