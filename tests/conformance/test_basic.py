"""Ported from vLLM's tests/entrypoints/openai/basic/: test_basic.py (the server-level
cases; ``test_server_load`` needs vLLM's ``--enable-server-load-tracking`` and
``test_health_check_engine_dead_error`` is a unit test with mocks, covered here by
tests/integration/test_faults.py) and test_chat_echo.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.conformance.conftest import BASE, refused
from tests.helpers import eventually
from tests.integration.conftest import USER_KEY, LiveGateway

BEIJING = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Beijing is the capital of which country?"},
]


async def test_show_version(gateway: LiveGateway) -> None:
    """vLLM basic/test_basic.py::test_show_version. Difference: the gateway serves no
    ``GET /version`` (404)."""
    with gateway.client() as http:
        assert http.get("/version").status_code == 404


async def test_check_health(gateway: LiveGateway) -> None:
    """vLLM basic/test_basic.py::test_check_health"""
    assert httpx.get(gateway.url + "/health").status_code == 200


async def test_request_cancellation(gateway: LiveGateway) -> None:
    """vLLM basic/test_basic.py::test_request_cancellation: many long requests whose
    clients give up after 0.5 s are all cancelled in the engine, and the server answers
    afterwards. Token counts fit the 2048-token context; where vLLM infers the abort
    from a fast answer, this checks the engine's unfinished requests (no timing)."""
    messages = [{"role": "user", "content": "Write a long story"}]
    async with openai.AsyncOpenAI(
        base_url=gateway.v1, api_key=USER_KEY, timeout=0.5, max_retries=0
    ) as impatient:
        tasks = [
            asyncio.create_task(
                impatient.chat.completions.create(
                    messages=messages,  # type: ignore[arg-type]
                    model=BASE,
                    max_tokens=1500,
                    extra_body={"min_tokens": 1500},
                )
            )
            for _ in range(20)
        ]
        done, pending = await asyncio.wait(tasks)
    assert not pending
    for task in done:
        with pytest.raises(openai.APITimeoutError):
            task.result()

    # Nothing left in the engine, nor in the gateway on its way there (a request not yet in
    # the engine at the first look must not reach it later).
    def settled() -> bool:
        status = gateway.status()
        return status["engine_unfinished_requests"] == 0 and status["inflight_requests"] == 0

    eventually(settled, 30, "every request aborted", lambda: str(gateway.status()))
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as client:
        r = await client.chat.completions.create(messages=messages, model=BASE, max_tokens=10)  # type: ignore[arg-type]
    assert len(r.choices) == 1


async def test_request_wrong_content_type(client: openai.AsyncOpenAI) -> None:
    """vLLM basic/test_basic.py::test_request_wrong_content_type (the gateway: 415)"""
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(
            messages=[{"role": "user", "content": "Write a long story"}],
            model=BASE,
            max_tokens=10,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
    assert info.value.status_code == 415


@pytest.mark.parametrize("echo", [True, False])
async def test_chat_session_with_echo_and_continue_final_message(
    client: openai.AsyncOpenAI, echo: bool
) -> None:
    """vLLM basic/test_chat_echo.py::test_chat_session_with_echo_and_continue_final_message.
    Difference: chat ``echo``, ``continue_final_message`` and ``add_generation_prompt: false``
    are refused (400); every chat prompt ends with a new assistant turn."""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": saying},
    ]
    flags = {"echo": echo, "continue_final_message": True, "add_generation_prompt": False}
    await refused(
        client.chat.completions.create(model=BASE, messages=messages, max_tokens=5, extra_body=flags),  # type: ignore[arg-type]
        "continue_final_message",
    )
    # Each flag on its own is refused too, naming itself.
    for name, value in [("echo", echo), ("continue_final_message", True), ("add_generation_prompt", False)]:
        if value is False and name == "echo":
            continue  # echo: false asks for nothing
        await refused(
            client.chat.completions.create(
                model=BASE, messages=messages, max_tokens=5, extra_body={name: value}
            ),  # type: ignore[arg-type]
            name,
        )


async def test_prompt_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM basic/test_chat_echo.py::test_prompt_logprobs. Difference: ``prompt_logprobs``
    is refused (400)."""
    await refused(
        client.chat.completions.create(model=BASE, messages=BEIJING, extra_body={"prompt_logprobs": -1}),  # type: ignore[arg-type]
        "prompt_logprobs",
    )


async def test_top_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM basic/test_chat_echo.py::test_top_logprobs. Difference: ``top_logprobs: -1``
    (vLLM: the whole vocabulary) is a 400; at most ``limits.max_logprobs`` (20)."""
    await refused(
        client.chat.completions.create(
            model=BASE,
            messages=BEIJING,  # type: ignore[arg-type]
            max_tokens=5,
            extra_body={"top_logprobs": -1, "logprobs": "true"},
        ),
        "top_logprobs",
    )
