"""Ported from vLLM's tests/entrypoints/openai/completion/: test_completion.py,
test_prompt_validation.py (the cases that need a server; prompt embeddings are not
ported: the gateway takes none) and test_completion_text_offset.py (there a unit test of
vLLM's serving class; here the same property on the live server)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conformance.conftest import BASE, prompt_tokens, refused
from tests.integration.conftest import LiveGateway

PAD5 = [0, 0, 0, 0, 0]  # vLLM's token-id prompt; id 0 is <pad> for Gemma as for OPT


def detokenize(gateway: LiveGateway, tokens: list[int]) -> str:
    r = httpx.post(
        gateway.url + "/detokenize", json={"model": BASE, "tokens": tokens}, headers=gateway.headers
    )
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


async def test_single_completion(client: openai.AsyncOpenAI, gateway: LiveGateway) -> None:
    """vLLM completion/test_completion.py::test_single_completion (prompt_tokens from our
    tokenizer instead of 6; ``prompt_tokens_details`` is left out: vLLM sends it only with
    ``--enable-prompt-tokens-details``, the gateway always, with ``cached_tokens``)."""
    r = await client.completions.create(model=BASE, prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    assert r.id is not None and len(r.choices) == 1
    choice = r.choices[0]
    assert len(choice.text) >= 5
    assert choice.finish_reason == "length"
    expected = prompt_tokens(gateway, BASE, prompt="Hello, my name is")
    assert r.usage is not None
    assert (r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.total_tokens) == (
        5,
        expected,
        expected + 5,
    )

    r = await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0)
    assert len(r.choices[0].text) >= 1
    assert getattr(r.choices[0], "prompt_logprobs", None) is None


async def test_completion_truncation_side_controls_prompt_truncation(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation.
    Difference: ``truncate_prompt_tokens`` (and ``return_token_ids``) are refused (400): a
    prompt is never cut; one too long for the context is a 400."""
    for side in ("right", "left"):
        await refused(
            client.completions.create(
                model=BASE,
                prompt=list(range(8)),
                max_tokens=1,
                temperature=0.0,
                extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side},
            ),
            "truncate_prompt_tokens",
        )


async def test_no_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_no_logprobs"""
    r = await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0, logprobs=None)
    assert r.choices[0].logprobs is None


async def test_zero_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_zero_logprobs (the sampled token is there)"""
    r = await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0, logprobs=0)
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.top_logprobs[0]) == 1


async def test_some_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_some_logprobs"""
    r = await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0, logprobs=5)
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert 5 <= len(logprobs.top_logprobs[0]) <= 6


async def test_too_many_completion_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_too_many_completion_logprobs (max 20, as vLLM)"""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = await client.completions.create(
            model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0, logprobs=30, stream=True
        )
        async for _ in stream:
            pass
    r = await client.completions.create(model=BASE, prompt=PAD5, max_tokens=5, temperature=0.0)
    assert r.choices[0].text is not None


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
async def test_prompt_logprobs_completion(client: openai.AsyncOpenAI, prompt_logprobs: int | None) -> None:
    """vLLM completion/test_completion.py::test_prompt_logprobs_completion. Difference:
    ``prompt_logprobs`` is refused (400) whatever its value; use ``echo`` with ``logprobs``
    for the prompt's logprobs."""
    params: dict[str, Any] = {
        "model": BASE,
        "prompt": ["A robot may not injure another robot", "My name is"],
        "max_tokens": 5,
    }
    if prompt_logprobs is None:
        r = await client.completions.create(**params)
        assert getattr(r.choices[0], "prompt_logprobs", None) is None
        return
    await refused(
        client.completions.create(**params, extra_body={"prompt_logprobs": prompt_logprobs}),
        "prompt_logprobs",
    )


async def test_completion_streaming(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_completion_streaming"""
    prompt = "What is an LLM?"
    whole = await client.completions.create(model=BASE, prompt=prompt, max_tokens=5, temperature=0.0)
    stream = await client.completions.create(
        model=BASE, prompt=prompt, max_tokens=5, temperature=0.0, stream=True
    )
    chunks: list[str] = []
    finish_reasons = 0
    async for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reasons += 1
    assert finish_reasons == 1
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text
    assert "".join(chunks) == whole.choices[0].text


async def test_parallel_no_streaming(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_parallel_no_streaming: n unique completions,
    each with its index and finish reason. Not ported: vLLM's check that the samples end at
    different lengths, which needs a model that stops early (OPT-125m there); the 270M base
    model at temperature 1 runs on to max_tokens."""
    n, max_tokens = 3, 20
    r = await client.completions.create(
        model=BASE,
        prompt="What is an LLM?",
        max_tokens=max_tokens,
        n=n,
        temperature=1.0,
        logprobs=0,
        seed=42,
    )
    assert len(r.choices) == n
    for i, choice in enumerate(r.choices):
        assert choice.index == i and choice.finish_reason is not None
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        assert 1 <= len(choice.logprobs.tokens) <= max_tokens
    assert len({c.text for c in r.choices}) == n


async def test_parallel_streaming(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_parallel_streaming: the n samples flattened
    into one stream, told apart by ``index``. Not ported: the check that they end at
    different lengths (model behaviour; see test_parallel_no_streaming)."""
    n, max_tokens = 3, 20
    stream = await client.completions.create(
        model=BASE,
        prompt="What is an LLM?",
        max_tokens=max_tokens,
        n=n,
        temperature=1.0,
        stream=True,
        seed=42,
    )
    chunks: list[list[str]] = [[] for _ in range(n)]
    finish_reasons = 0
    async for chunk in stream:
        chunks[chunk.choices[0].index].append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reasons += 1
    assert finish_reasons == n
    assert all(1 <= len(c) <= max_tokens for c in chunks)
    assert len({"".join(c) for c in chunks}) == n


async def test_completion_stream_options(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_completion_stream_options. Difference:
    ``continuous_usage_stats: true`` is refused (400) instead of usage in every chunk."""
    common: dict[str, Any] = {
        "model": BASE,
        "prompt": "What is the capital of France?",
        "max_tokens": 5,
        "temperature": 0.0,
    }
    for options in ({"include_usage": False, "continuous_usage_stats": False}, {}):
        stream = await client.completions.create(**common, stream=True, stream_options=options)  # type: ignore[arg-type]
        async for chunk in stream:
            assert chunk.usage is None

    await refused(
        client.completions.create(
            **common, stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True}
        ),
        "stream_options.continuous_usage_stats",
    )

    stream = await client.completions.create(
        **common, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}
    )
    usage_chunks = 0
    async for chunk in stream:
        assert chunk.usage is None
        if chunk.choices[0].finish_reason is not None:
            final = await anext(stream)
            assert final.usage is not None
            assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
            assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
            assert final.choices == []
            usage_chunks += 1
    assert usage_chunks == 1  # a finish_reason came, and the usage chunk after it

    await refused(
        client.completions.create(
            **common, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        ),
        "stream_options.continuous_usage_stats",
    )
    for options in (
        {"include_usage": None},
        {"include_usage": True},
        {"continuous_usage_stats": None},
        {"continuous_usage_stats": True},
    ):
        await refused(client.completions.create(**common, stream=False, stream_options=options))  # type: ignore[arg-type]


async def test_batch_completions(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_batch_completions. Differences: beam search
    (``use_beam_search``) is refused (400); ``n > 1`` at temperature 0 (a 400 on vLLM's server)
    is answered as OpenAI answers it, each choice the same greedy text; sampled ``n=2`` checks
    the indices (the two prompts are the same text, so which prompt a choice continues, the
    ``prompt * n + choice`` layout, is checked in tests/integration/test_edges.py)."""
    for prompts in (["Hello, my name is"] * 2, [PAD5] * 2):
        batch = await client.completions.create(model=BASE, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2
        assert batch.choices[0].text == batch.choices[1].text

        await refused(
            client.completions.create(
                model=BASE,
                prompt=prompts,
                n=2,
                max_tokens=5,
                temperature=0.0,
                extra_body={"use_beam_search": True},
            ),
            "use_beam_search",
        )
        greedy = await client.completions.create(
            model=BASE, prompt=prompts, n=2, max_tokens=5, temperature=0.0
        )
        assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
        assert {c.text for c in greedy.choices} == {batch.choices[0].text}  # one prompt twice, greedy
        batch = await client.completions.create(
            model=BASE, prompt=prompts, n=2, max_tokens=5, temperature=1.0
        )
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert all(c.finish_reason in ("stop", "length") for c in batch.choices)

        stream = await client.completions.create(
            model=BASE, prompt=prompts, max_tokens=5, temperature=0.0, stream=True
        )
        texts = ["", ""]
        async for chunk in stream:
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])
async def test_echo_logprob_completion(
    client: openai.AsyncOpenAI, gateway: LiveGateway, logprobs_arg: int
) -> None:
    """vLLM completion/test_completion.py::test_echo_logprob_completion"""
    for prompt in ("Hello, my name is", PAD5):
        r = await client.completions.create(
            model=BASE, prompt=prompt, max_tokens=5, temperature=0.0, echo=True, logprobs=logprobs_arg
        )
        prompt_text = detokenize(gateway, prompt) if isinstance(prompt, list) else prompt
        assert r.choices[0].text.startswith(prompt_text)
        logprobs = r.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.text_offset is not None and len(logprobs.text_offset) > 5
        assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) > 5
        assert logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) > 5
        assert logprobs.top_logprobs[0] is None
        for top in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1
        assert logprobs.tokens is not None and len(logprobs.tokens) > 5


async def test_invalid_json_schema(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_invalid_json_schema"""
    schema = {
        "$defs": {
            "CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}
        },
        "properties": {
            "brand": {"title": "Brand", "type": "string"},
            "model": {"title": "Model", "type": "string"},
            "car_type": {"$ref": "#/$defs/CarType"},
            "foo": "bar",
        },
        "required": ["brand", "model", "car_type"],
        "title": "CarDescription",
        "type": "object",
    }
    await refused(
        client.completions.create(
            model=BASE,
            prompt="Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
            max_tokens=5,
            extra_body={"structured_outputs": {"json": schema}},
        )
    )


async def test_invalid_regex(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_invalid_regex"""
    await refused(
        client.completions.create(
            model=BASE,
            prompt="Generate an email address for Alan Turing, who works in Enigma. Example result:",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]},
        )
    )


async def test_invalid_grammar(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion.py::test_invalid_grammar"""
    grammar = """
        root ::= select_statementinvalidsyntax
        select_statement ::= "SELECT " column " from " table " where " condition
        column ::= "col_1 " | "col_2 "
        table ::= "table_1 " | "table_2 "
        condition ::= column "= " number
        number ::= "1 " | "2 "
    """
    await refused(
        client.completions.create(
            model=BASE,
            prompt="Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
            max_tokens=5,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
    )


async def test_empty_prompt(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_prompt_validation.py::test_empty_prompt: no prompt (and empty
    ``prompt_embeds``) is a 400. The gateway names ``prompt``."""
    await refused(
        client.completions.create(
            model=BASE,
            prompt=None,  # type: ignore[arg-type]
            max_tokens=5,
            temperature=0.0,
            extra_body={"prompt_embeds": []},
        ),
        "prompt",
    )


async def test_out_of_vocab_token_ids(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_prompt_validation.py::test_out_of_vocab_token_ids"""
    error = await refused(
        client.completions.create(model=BASE, prompt=[999999], max_tokens=5, temperature=0.0), "prompt"
    )
    assert "out of vocabulary" in error.message


async def test_stream_text_offset_matches_non_stream_with_stop_holdback(client: openai.AsyncOpenAI) -> None:
    """vLLM completion/test_completion_text_offset.py::
    test_stream_text_offset_matches_non_stream_with_stop_holdback: with ``stop`` (which
    makes the detokenizer hold text back), the streamed ``text_offset`` values equal the
    non-streamed ones, and each is where its token starts in the text."""
    body: dict[str, Any] = {
        "model": BASE,
        "prompt": "Hi",
        "max_tokens": 8,
        "logprobs": 0,
        "stop": ["\n\n"],
        "temperature": 0.0,
    }
    whole = await client.completions.create(**body)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.text_offset is not None and logprobs.tokens is not None
    starts, at = [], 0
    for token in logprobs.tokens:
        starts.append(at)
        at += len(token)
    assert logprobs.text_offset == starts

    streamed: list[int] = []
    stream = await client.completions.create(**body, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.text_offset:
                streamed += choice.logprobs.text_offset
    assert streamed == logprobs.text_offset
