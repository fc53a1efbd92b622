"""Edges of the chat, completions, /chat and /tokenize contracts: leases on early
disconnects, lone surrogates, nulls the SDKs send, fields honoured or refused by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.embedded import embedded_model_dir, is_prepared
from tests.unit.conftest import USER_KEY, Serve, body_then_disconnect, http_scope
from tests.unit.fakes import FakeEngine

MSG = [{"role": "user", "content": "Hi"}]
MODEL_DIR = embedded_model_dir(Path.home() / ".cache" / "gateway" / "models")
needs_model = pytest.mark.skipif(not is_prepared(MODEL_DIR), reason="the embedded model is not prepared")


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "base",
        **({"prompt": "Hi"} if path == "/v1/completions" else {"messages": MSG}),
        **fields,
    }


# -- a stream's lease is released however the client leaves --------------------------------
async def asgi_post(served: Any, path: str, body: dict[str, Any], receive_after: list[str]) -> None:
    """POST straight to the ASGI app; after the body, ``receive`` answers a disconnect, and
    every ``send`` of a type in ``receive_after`` waits, as a slow socket does."""
    raw = json.dumps(body).encode()
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer {USER_KEY}",
        "content-length": str(len(raw)),
    }
    scope = http_scope(path, headers)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] in receive_after:
            await asyncio.sleep(0.01)

    await served.app(scope, body_then_disconnect(raw), send)


@pytest.mark.parametrize("slow", ["http.response.start", "http.response.body"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_stream_left_before_its_first_step_releases_its_lease(
    serve: Serve, slow: str, path: str
) -> None:
    served = await serve()
    body = {
        "model": "shout",
        "stream": True,
        **({"input": "Hi"} if path == "/v1/responses" else {"messages": MSG}),
    }
    await asgi_post(served, path, body, [slow])
    await asyncio.sleep(0.05)
    assert served.gw.catalog_or_503().in_use() == {}


# -- lone surrogates are a 400, never a 500 --------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"model":"base","messages":[{"role":"user","content":"\\ud83d"}]}', "messages[0].content"),
        (
            '{"model":"base","messages":[{"role":"user","content":[{"type":"text","text":"x\\udc00"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            '{"model":"base","messages":[{"role":"user","content":"Hi"}],"structured_outputs":{"\\ud800":1}}',
            "structured_outputs",
        ),
        (
            '{"model":"base","messages":[{"role":"tool","content":"x","tool_call_id":"\\ud800"}]}',
            "messages[0].tool_call_id",
        ),
    ],
)
async def test_a_lone_surrogate_is_a_400(serve: Serve, raw: str, param: str) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_a_lone_surrogate_in_raw_bytes_is_a_400(serve: Serve) -> None:
    # json.loads(bytes) decodes with "surrogatepass": these bytes reached the tokenizer (500).
    served = await serve()
    raw = '{"model":"base","messages":[{"role":"user","content":"\ud800"}]}'
    r = await served.http.post(
        "/v1/chat/completions",
        content=raw.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "request body is not valid JSON"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-32-be"])
async def test_a_lone_surrogate_in_a_utf16_or_utf32_body_is_a_400(serve: Serve, encoding: str) -> None:
    """JSON may come in UTF-16 or UTF-32 (``json.detect_encoding``), where the escape is not
    the ASCII bytes ``\\ud8``. Echoed from a schema kept as sent, it failed to encode (500)."""
    served = await serve()
    raw = (
        '{"model": "fake-model", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",'
        ' "schema": {"type": "object", "description": "\\ud800"}}}}'
    )
    r = await served.http.post(
        "/v1/responses", content=raw.encode(encoding), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "text.format.schema.description"


async def test_a_surrogate_pair_is_text(serve: Serve) -> None:
    served = await serve()
    raw = '{"model":"base","messages":[{"role":"user","content":"\\ud83d\\ude00 and \\\\ud800"}]}'
    r = await served.http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


# -- /tokenize counts what chat sends ----------------------------------------------------------
class GemmaTokenizerEngine(FakeEngine):
    _tokenizer_cache: Any = None

    @property
    def tokenizer(self) -> Any:
        if GemmaTokenizerEngine._tokenizer_cache is None:
            from transformers import AutoTokenizer

            GemmaTokenizerEngine._tokenizer_cache = AutoTokenizer.from_pretrained(str(MODEL_DIR))
        return GemmaTokenizerEngine._tokenizer_cache


@needs_model
async def test_tokenize_counts_chats_prompt_with_tool_turns(serve: Serve) -> None:
    engine = GemmaTokenizerEngine(max_model_len=1000)
    assert engine.tokenizer is not None  # loaded now, not within the app's 5 s to be ready
    served = await serve(engine)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    chat = await served.http.post("/v1/chat/completions", json={"model": "base", "messages": history})
    counted = await served.http.post("/tokenize", json={"model": "base", "messages": history})
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    orphan = await served.http.post(
        "/tokenize", json={"model": "base", "messages": history[:1] + history[2:]}
    )
    assert orphan.status_code == 400
    # a conversation ending in the call, before its result: tokenize counts it (nothing is
    # generated), chat refuses it as OpenAI does
    pending = await served.http.post("/tokenize", json={"model": "base", "messages": history[:2]})
    assert pending.status_code == 200 and pending.json()["count"] > 0
    chat = await served.http.post("/v1/chat/completions", json={"model": "base", "messages": history[:2]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


@needs_model
async def test_tokenize_counts_chats_prompt_with_tools_offered(serve: Serve) -> None:
    """vLLM's /tokenize takes ``tools``; here it was a 400, so a client could not count the
    prompt of a chat offering tools (the tools template renders them into it)."""
    engine = GemmaTokenizerEngine(max_model_len=4000)
    assert engine.tokenizer is not None
    served = await serve(engine)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    counts = []
    for offered in (tools, None):
        body = {"model": "base", "messages": messages} | ({"tools": offered} if offered else {})
        chat = await served.http.post("/v1/chat/completions", json=body)
        counted = await served.http.post("/tokenize", json=body)
        assert counted.status_code == 200, counted.text
        assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"]
        counts.append(counted.json()["count"])
    assert counts[0] > counts[1] + 10  # the tools are in the prompt
    # tool_choice none: chat renders the tools all the same (as vLLM), and /tokenize counts them
    body = {"model": "base", "messages": messages, "tools": tools, "tool_choice": "none"}
    counted = await served.http.post("/tokenize", json=body)
    chat = await served.http.post("/v1/chat/completions", json=body)
    assert counted.json()["count"] == chat.json()["usage"]["prompt_tokens"] == counts[0]
    for bad in ({"messages": messages, "tools": []}, {"prompt": "Hi", "tools": tools}):
        r = await served.http.post("/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# -- POST /chat honours chat's sampling fields and refuses what its stream cannot carry ------
async def test_house_chat_passes_sampling_fields_on(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", "stop": ["world"], "top_p": 0.5, "seed": 7})
    assert r.status_code == 200
    sampling = served.engine.calls[-1][1]
    assert (sampling.stop, sampling.top_p, sampling.seed) == (("world",), 0.5, 7)
    r = await served.http.post("/chat", json={"question": "Hi", "structured_outputs": {"regex": "a+"}})
    assert r.status_code == 200 and served.engine.calls[-1][1].constraint is not None


@pytest.mark.parametrize(
    ("name", "value", "param"),
    [
        ("n", 2, "n"),
        ("logprobs", True, "logprobs"),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
        ("messages", MSG, "messages"),
        ("top_p", 5, "top_p"),  # chat's own check, named
        ("bad_words", ["x"], "bad_words"),
        # README: a usage chunk is a 400 on POST /chat too (it always streams, with no usage)
        ("stream_options", {"include_usage": True}, "stream_options.include_usage"),
        ("stream_options", {"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
    ],
)
async def test_house_chat_refuses_by_name(serve: Serve, name: str, value: Any, param: str) -> None:
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", name: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"),
        ("n", 2),
        ("logprobs", True),
        ("logprobs", 1),  # true, as chat reads it (it was taken, and dropped)
    ],
)
async def test_house_chat_points_chat_fields_to_chat_completions(serve: Serve, name: str, value: Any) -> None:
    """What the house stream cannot carry is served by /v1/chat/completions: the 400 says so,
    not that the gateway lacks it (tools are served there)."""
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", name: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and "/v1/chat/completions" in error["message"], error


@pytest.mark.parametrize(
    ("stream", "says"),
    [
        (False, "always streams"),
        (0, "always streams"),
        ("maybe", "valid boolean"),  # chat's own check: not a boolean
        ([True], "valid boolean"),
        (2, "valid boolean"),
    ],
)
async def test_house_chat_refuses_stream_it_cannot_honour(serve: Serve, stream: Any, says: str) -> None:
    """POST /chat always streams: ``stream: false`` is a 400, not a stream anyway, and a value
    that is not a boolean is one, as on chat completions."""
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", "stream": stream})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stream" and says in error["message"], error
    assert served.engine.calls == []


@pytest.mark.parametrize("stream", [True, None])
async def test_house_chat_takes_stream_true_or_null(serve: Serve, stream: Any) -> None:
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", "stream": stream})
    assert r.status_code == 200 and r.text.startswith("event: message"), r.text


async def test_house_chat_errors_name_the_question_not_messages(serve: Serve) -> None:
    """POST /chat has no ``messages``: a prompt too long for the context names ``question``."""
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi " * 200})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "question"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ],
)
async def test_house_stream_format_refuses_what_it_cannot_carry(
    serve: Serve, fields: dict[str, Any], param: str
) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions",
        headers={"x-stream-format": "house"},
        json=body_for("/v1/chat/completions", **fields),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert served.gw.catalog_or_503().in_use() == {}


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("/v1/chat/completions", "houes", "unknown format 'houes'"),
        ("/v1/chat/completions", "ndjson", "unknown format"),
        ("/v1/completions", "house", "/v1/chat/completions and POST /chat only"),
        ("/v1/responses", "house", "/v1/chat/completions and POST /chat only"),
        ("/chat", "openai", "streams the house format only"),
        ("/chat", "houes", "unknown format"),
    ],
)
async def test_a_stream_format_an_endpoint_cannot_answer_in_is_a_400(
    serve: Serve, path: str, value: str, says: str
) -> None:
    """X-Stream-Format would change the answer: an unknown value, or one the endpoint cannot
    produce, is a 400 naming the header, not an answer in another format."""
    served = await serve()
    body = {"question": "Hi"} if path == "/chat" else body_for(path)
    if path == "/v1/responses":
        body = {"model": "base", "input": "Hi"}
    r = await served.http.post(path, json=body, headers={"X-Stream-Format": value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "X-Stream-Format" and says in error["message"], error
    assert served.engine.calls == [] and served.gw.catalog_or_503().in_use() == {}


@pytest.mark.parametrize(
    ("path", "value", "house"),
    [
        ("/v1/chat/completions", "House", True),
        ("/v1/chat/completions", "openai", False),
        ("/v1/chat/completions", "", False),
        ("/v1/completions", "openai", False),
        ("/chat", "house", True),
    ],
)
async def test_a_stream_format_an_endpoint_answers_in_is_served(
    serve: Serve, path: str, value: str, house: bool
) -> None:
    served = await serve()
    body = {"question": "Hi"} if path == "/chat" else body_for(path)
    r = await served.http.post(path, json=body, headers={"X-Stream-Format": value})
    assert r.status_code == 200, r.text
    assert r.text.startswith("event: message") == house, r.text


# -- vLLM's fields: honoured, or refused when they would change the answer -------------------
@pytest.mark.parametrize(
    ("path", "name", "value"),
    [
        ("/v1/completions", "skip_special_tokens", False),
        ("/v1/chat/completions", "skip_special_tokens", False),
        ("/v1/chat/completions", "spaces_between_special_tokens", False),
        ("/v1/chat/completions", "verbosity", "low"),
        ("/v1/chat/completions", "moderation", {"policy": {"output": {"mode": "block"}}}),
        ("/v1/chat/completions", "watermarking", True),
        ("/v1/completions", "vllm_xargs", {"a": 1}),
        ("/v1/completions", "suffix", "x"),
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        # OpenAI refuses a reasoning effort for a model that does not reason; vLLM hands it to
        # the chat template, which ignores it: "low" was answered as if unset
        ("/v1/chat/completions", "reasoning_effort", "low"),
        ("/v1/chat/completions", "reasoning_effort", "minimal"),
        # chat's fields sent to completions were ignored (vLLM's unknown fields)
        ("/v1/completions", "max_completion_tokens", 2),
        ("/v1/completions", "messages", MSG),
        ("/v1/completions", "top_logprobs", 3),
        ("/v1/completions", "reasoning_effort", "high"),
        ("/v1/completions", "verbosity", "low"),
        ("/v1/completions", "modalities", ["audio"]),
        ("/v1/completions", "audio", {"voice": "alloy", "format": "mp3"}),
        ("/v1/completions", "web_search_options", {}),
        ("/v1/completions", "moderation", {"model": "omni-moderation-latest"}),
    ],
)
async def test_answer_changing_fields_are_refused_by_name(
    serve: Serve, path: str, name: str, value: Any
) -> None:
    served = await serve()
    r = await served.http.post(path, json=body_for(path, **{name: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


async def test_defaults_of_refused_fields_are_accepted(serve: Serve) -> None:
    served = await serve()
    fields = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "verbosity": "medium",
        "reasoning_effort": "none",
        "modalities": ["text"],
    }
    r = await served.http.post("/v1/chat/completions", json=body_for("/v1/chat/completions", **fields))
    assert r.status_code == 200, r.text
    fields |= {"max_completion_tokens": None, "messages": None, "top_logprobs": 0}
    r = await served.http.post("/v1/completions", json=body_for("/v1/completions", **fields))
    assert r.status_code == 200, r.text


async def test_add_special_tokens_is_honoured(serve: Serve) -> None:
    served = await serve()
    await served.http.post("/v1/completions", json=body_for("/v1/completions"))
    await served.http.post("/v1/completions", json=body_for("/v1/completions", add_special_tokens=False))
    with_bos, without = served.engine.calls[-2][0], served.engine.calls[-1][0]
    assert with_bos[1:] == without and len(with_bos) == len(without) + 1
    await served.http.post("/v1/chat/completions", json=body_for("/v1/chat/completions"))
    await served.http.post(
        "/v1/chat/completions", json=body_for("/v1/chat/completions", add_special_tokens=True)
    )
    plain, added = served.engine.calls[-2][0], served.engine.calls[-1][0]
    assert added[1:] == plain


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_repetition_penalty_the_sampler_cannot_divide_by_is_a_400(serve: Serve, path: str) -> None:
    # Found by fuzzing: 5e-324 is above 0 but 0 in the engine's float32 sampler, which divided
    # by it; under a grammar vLLM then ended the answer with finish_reason "error" (a 500 now).
    served = await serve()
    body = body_for(path, repetition_penalty=5e-324)
    if path == "/v1/responses":
        body = {"model": "base", "input": "Hi", "repetition_penalty": 5e-324}
    r = await served.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    # 1e-45, the smallest float32 above 0, still makes logit / penalty infinite (a review ran
    # vLLM's own apply_penalties: every probability NaN); 1e-30 keeps it finite
    body["repetition_penalty"] = 1e-45
    r = await served.http.post(path, json=body)
    assert r.status_code == 400 and "at least 1e-30" in r.json()["error"]["message"], r.text
    body["repetition_penalty"] = 1e-30
    r = await served.http.post(path, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_repetition_penalty_above_2_is_taken_as_vllm_takes_it(serve: Serve, path: str) -> None:
    # vLLM's server takes any repetition_penalty above 0 (OpenAI has none): 2.5 and 10 were 400s.
    served = await serve()
    for penalty in (2.5, 10, 1e30):
        body = body_for(path, repetition_penalty=penalty)
        if path == "/v1/responses":
            body = {"model": "base", "input": "Hi", "repetition_penalty": penalty}
        r = await served.http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert served.engine.calls[-1][1].repetition_penalty == penalty
    # beyond 1e30, logit * penalty may overflow float32 (0 * inf is NaN)
    body["repetition_penalty"] = 1e31
    r = await served.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


async def test_top_logprobs_over_the_limit_names_top_logprobs(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", json=body_for("/v1/chat/completions", logprobs=True, top_logprobs=21)
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


# -- null, as the SDKs send for their Optional fields, is the default ---------------------------
@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "n"),
        ("/v1/chat/completions", "logprobs"),
        ("/v1/chat/completions", "stream"),
        ("/v1/completions", "n"),
        ("/v1/completions", "echo"),
        ("/v1/completions", "stream"),
    ],
)
async def test_null_is_the_default(serve: Serve, path: str, name: str) -> None:
    served = await serve()
    r = await served.http.post(path, json=body_for(path, **{name: None}))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(
    "fields", [{"logprobs": 0}, {"top_logprobs": 0}, {"logprobs": 0, "top_logprobs": 0}, {"n": 1.0}]
)
async def test_house_chat_takes_what_asks_for_nothing_as_chat_does(
    serve: Serve, fields: dict[str, Any]
) -> None:
    """``logprobs: 0`` is false and ``n: 1.0`` one choice as chat reads them (they were 400s)."""
    served = await serve()
    header = await served.http.post(
        "/v1/chat/completions",
        headers={"X-Stream-Format": "house"},
        json={"model": "base", "messages": [{"role": "user", "content": "Hi"}], **fields},
    )
    assert header.status_code == 200, header.text
    r = await served.http.post("/chat", json={"question": "Hi", **fields})
    assert r.status_code == 200, r.text
    assert r.text.startswith("event: message"), r.text


async def test_house_chat_refuses_top_logprobs_without_logprobs_as_chat_does(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post("/chat", json={"question": "Hi", "top_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


async def test_house_header_takes_stream_null_as_left_out(serve: Serve) -> None:
    """Null for ``stream`` is its default, as left out: a house stream, not ``stream: false``."""
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions",
        headers={"X-Stream-Format": "house"},
        json={"model": "base", "messages": [{"role": "user", "content": "Hi"}], "stream": None},
    )
    assert r.status_code == 200, r.text
    assert r.text.startswith("event: message"), r.text
