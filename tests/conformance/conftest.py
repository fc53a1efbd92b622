"""vLLM's OpenAI-server tests, ported: one live gateway for this whole directory.

Each test here ports one case of vLLM's ``tests/entrypoints/openai/`` (its docstring names
the vLLM file and function). Only the fixture (this live gateway instead of vLLM's
``RemoteOpenAIServer``), the model names and the token counts change. Where the gateway
differs from vLLM on purpose, the test asserts the gateway's documented behaviour and the
README's "Differences from OpenAI and from vLLM" names it.

The gateway starts once for the directory (package scope: it stops before the integration
tests start theirs) through ``tests/integration/conftest.start_gateway``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.integration.conftest import USER_KEY, LiveGateway, start_gateway, stop_gateway

BASE = "gemma-3-270m"  # the embedded base model's served name (README: Routes and adapters)
LORA = "shout"  # a shipped LoRA adapter (configs/adapters.yaml)
MODELS = [BASE, LORA]  # vLLM's tests run "first the base model, then the LoRA"


@pytest.fixture(scope="package")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    gw = start_gateway(tmp_path_factory.mktemp("conformance"))
    try:
        assert httpx.get(gw.url + "/ready").json()["model"] == BASE
        yield gw
    finally:
        stop_gateway(gw)


@pytest_asyncio.fixture(loop_scope="function")
async def client(gateway: LiveGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0, timeout=120) as c:
        yield c


def prompt_tokens(gateway: LiveGateway, model: str, **body: Any) -> int:
    """What the gateway's ``POST /tokenize`` counts for ``body`` (a prompt or messages): the
    prompt_tokens a request with the same input reports. vLLM's tests hard-code these
    counts for their model; here they come from the tokenizer of ours."""
    r = httpx.post(gateway.url + "/tokenize", json={"model": model, **body}, headers=gateway.headers)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


async def refused(call: Any, param: str | None = None) -> openai.BadRequestError:
    """``await call`` is a 400 (naming ``param`` when given)."""
    with pytest.raises(openai.BadRequestError) as info:
        await call
    if param is not None:
        assert info.value.param == param, info.value
    return info.value


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything here is marked ``conformance`` and, since it starts a gateway with a real
    engine, ``integration`` too."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.conformance)
            item.add_marker(pytest.mark.integration)
