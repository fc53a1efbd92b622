"""Issue 16 edges without an engine: request validation, logprobs shapes, text_offset in
streams, batched prompts and echo (merged engine streams), the model requirement, and what
the work on fuzzing the gateway turned up (schemas nested too deep)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.batch import Echo, echo_steps, merge_steps
from gateway.catalog import Catalog, Route, RoutingTable
from gateway.errors import GatewayError, InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest, model_card
from gateway.responses import _is_json
from gateway.routes import require_model
from gateway.service import ChatService, Generation
from gateway.settings import LimitSettings
from gateway.sse import OpenAICompletionEncoder, completion_logprobs, encode_stream
from gateway.tokenize_api import TokenizeRequest
from gateway.tools import parse_calls, parse_required
from gateway.types import Chunk, LoraSpec, SamplingSpec, StepOutput, TokenLogprob
from tests.helpers import assert_openai_error, chat_body
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeEngine

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "base", "messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "base", "prompt": "Hi", **fields})


def refused(make: Any, **fields: Any) -> str | None:
    """The param of the 400 that ``make(**fields)`` raises."""
    with pytest.raises((InvalidRequest, ValidationError)) as info:
        make(**fields)
    if isinstance(info.value, GatewayError):
        return info.value.param
    return ".".join(str(p) for p in info.value.errors()[0]["loc"])


# -- request validation ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64 + 1, 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_refused(seed: int) -> None:
    assert refused(chat, seed=seed) == "seed"
    assert refused(completion, seed=seed) == "seed"


def test_seed_at_the_int64_edges_is_accepted() -> None:
    assert chat(seed=2**63 - 1).seed == 2**63 - 1 and chat(seed=-(2**63)).seed == -(2**63)


def test_a_seed_whose_later_choices_pass_int64_is_refused() -> None:
    """Choice i is seeded seed + i (vLLM's parallel sampling): the engine core's int64
    seed array overflows past the edge."""
    assert refused(chat, seed=2**63 - 1, n=2) == "seed"
    assert refused(completion, seed=2**63 - 2, n=3) == "seed"
    assert chat(seed=2**63 - 2, n=2).seed == 2**63 - 2


def test_echo_true_is_not_mistaken_for_one() -> None:
    assert refused(chat, echo=True) == "echo"
    assert chat(echo=False).model_extra == {"echo": False}
    assert refused(chat, best_of=True) == "best_of"  # True == 1, but best_of=true is not "1"
    assert chat(best_of=1).n == 1


def test_best_of_below_n_is_refused() -> None:
    # OpenAI: best_of must be at least n. best_of 1 asks nothing only for one choice.
    assert refused(completion, best_of=1, n=3) == "best_of"
    assert refused(chat, best_of=1, n=2) == "best_of"
    assert completion(best_of=1, n=1).n == 1 and completion(best_of=1, n=None).n == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat", {"question": "hi", "best_of": 1, "n": "2"}),
        ("/tokenize", {"model": "base", "prompt": "hi", "best_of": 1, "n": "2"}),
        ("/detokenize", {"model": "base", "tokens": [104], "best_of": 1, "n": [2]}),
    ],
)
async def test_best_of_beside_an_n_the_endpoint_does_not_read_is_no_500(
    serve: Serve, path: str, body: dict[str, Any]
) -> None:
    # "2" > 1 raised TypeError in the validator: a 500.
    served = await serve()
    assert (await served.http.post(path, json=body)).status_code in (200, 400)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("modalities", ["text", "audio"]),
        ("modalities", ["audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),  # web search with its defaults
        ("web_search_options", {"search_context_size": "low"}),
    ],
)
def test_audio_answers_and_web_search_are_refused_on_chat(name: str, value: Any) -> None:
    assert refused(chat, **{name: value}) == name


def test_text_modality_and_absent_options_are_accepted() -> None:
    assert chat(modalities=["text"], audio=None, web_search_options=None).messages


def test_top_logprobs_needs_logprobs_and_stream_options_need_stream() -> None:
    assert refused(chat, top_logprobs=2) == "top_logprobs"
    assert chat(top_logprobs=0).num_logprobs is None
    assert chat(logprobs=True).num_logprobs == 0
    assert refused(chat, stream_options={"include_usage": True}) == "stream_options"
    assert refused(completion, stream_options={"include_usage": True}, stream=False) == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prompt_logprobs", 0),
        ("prompt_logprobs", 1),
        ("use_beam_search", True),
        ("length_penalty", 2.0),
        ("length_penalty", True),
        ("truncate_prompt_tokens", 4),
        ("return_token_ids", True),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"x": 1}),
    ],
)
def test_vllm_fields_the_gateway_does_not_implement_are_refused(name: str, value: Any) -> None:
    assert refused(chat, **{name: value}) == name
    assert refused(completion, **{name: value}) == name


@pytest.mark.parametrize("prompt", [None, 5, {"text": "Hi"}])
def test_a_prompt_of_the_wrong_type_names_prompt(prompt: Any) -> None:
    assert refused(completion, prompt=prompt) == "prompt"


def test_vllm_fields_at_their_defaults_are_accepted() -> None:
    quiet = {
        "use_beam_search": False,
        "length_penalty": 1.0,  # vLLM's default: a client sending a whole vLLM request got a 400
        "prompt_logprobs": None,
        "stop_token_ids": [],
        "chat_template_kwargs": {},
    }
    assert chat(add_generation_prompt=True, continue_final_message=False, **quiet).n == 1
    assert completion(**quiet).n == 1
    assert refused(chat, add_generation_prompt=False) == "add_generation_prompt"
    assert chat(stream=True, stream_options={"continuous_usage_stats": False}).stream
    assert (
        refused(chat, stream=True, stream_options={"continuous_usage_stats": True})
        == "stream_options.continuous_usage_stats"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("use_beam_search", 0),
        ("use_beam_search", "false"),
        ("return_token_ids", "off"),
        ("watermarking", "false"),
        ("skip_special_tokens", "true"),
        ("spaces_between_special_tokens", 1),
    ],
)
def test_vllm_bools_at_their_default_as_vllm_reads_them_are_accepted(name: str, value: Any) -> None:
    # vLLM's request model reads 0, "false" and "off" as false (and "true", 1 as true): they
    # ask for its default, and were a 400 naming the field.
    assert chat(**{name: value}).n == 1
    assert completion(**{name: value}).n == 1
    assert chat(continue_final_message="false", echo="false").n == 1
    for bad in ("true", 1, "x"):
        assert refused(chat, use_beam_search=bad) == "use_beam_search"
    assert refused(chat, echo="true") == "echo"
    assert refused(completion, skip_special_tokens="false") == "skip_special_tokens"
    assert refused(completion, skip_special_tokens="x") == "skip_special_tokens"  # no bool at all


@pytest.mark.parametrize(
    "name",
    [
        "use_beam_search",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "continue_final_message",
        "return_token_offsets",
        "return_prompt_text",
        "watermarking",
    ],
)
def test_each_vllm_bool_the_gateway_lacks_is_served_at_false_in_any_spelling(name: str) -> None:
    # vLLM types each of these as a bool, default false: a client sending a whole vLLM
    # request may spell it 0 or "false"; true, in any spelling, asks for what is not here
    for value in (False, 0, "false", "off"):
        assert chat(**{name: value}).n == 1 and completion(**{name: value}).n == 1
    for value in (True, 1, "true"):
        assert refused(chat, **{name: value}) == name


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_length_penalty_at_vllms_default_is_served(serve: Serve, path: str) -> None:
    bodies = {"/v1/chat/completions": chat_body("base"), "/v1/completions": {"model": "base", "prompt": "Hi"}}
    body = bodies.get(path, {"model": "base", "input": "Hi"})
    served = await serve()
    for value in (1.0, 1):
        r = await served.http.post(path, json={**body, "length_penalty": value})
        assert r.status_code == 200, r.text
    r = await served.http.post(path, json={**body, "length_penalty": 2.0})
    assert assert_openai_error(r, 400)["param"] == "length_penalty"


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"\u00b2": 1}, {"7": 100.5}, {"7": -101}, {"7": True}, {"7": "5"}],
)
def test_bad_logit_bias_is_refused(bias: dict[str, object]) -> None:
    assert refused(chat, logit_bias=bias) == "logit_bias"


def test_logit_bias_takes_at_most_300_entries_as_openai() -> None:
    bias = {str(token): 1 for token in range(300)}
    assert len(chat(logit_bias=bias).logit_bias or {}) == 300
    assert len(completion(logit_bias=bias).logit_bias or {}) == 300
    with pytest.raises(InvalidRequest, match="at most 300 entries, got 301") as info:
        completion(logit_bias={**bias, "300": 1})
    assert info.value.param == "logit_bias"
    assert refused(chat, logit_bias={**bias, "300": 1}) == "logit_bias"


def test_logit_bias_keys_become_token_ids() -> None:
    assert completion(logit_bias={"7": 100, "12": -100}).logit_bias == {7: 100.0, 12: -100.0}


def test_image_parts_say_images_are_not_supported() -> None:
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": content}])
    err = info.value.errors()[0]
    assert err["loc"] == ("messages", 0, "content") and "not supported" in err["msg"]


def test_an_assistant_refusal_part_is_its_text() -> None:
    # OpenAI's assistant messages may hold refusal parts (a replayed history); vLLM reads
    # them as text. They were a 400 "'refusal' content parts are not supported".
    refusal = [{"type": "refusal", "refusal": "No."}]
    turns = [*USER, {"role": "assistant", "content": refusal}, *USER]
    assert chat(messages=turns).messages[1].text == "No."
    assert refused(chat, messages=[{"role": "user", "content": refusal}]) == "messages.0.content"


@pytest.mark.parametrize("left_out", [True, False])
@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_only_an_assistant_message_may_have_no_content(role: str, left_out: bool) -> None:
    """OpenAI requires the content of every message but an assistant's, and vLLM's server
    answers 400 without it. The gateway rendered such a turn as empty text: a prompt that
    neither would have sent, for a request both refuse."""
    message: dict[str, Any] = {"role": role} if left_out else {"role": role, "content": None}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    assert refused(chat, messages=[message]) == "messages.0.content"
    assistant = {"role": "assistant"} if left_out else {"role": "assistant", "content": None}
    assert chat(messages=[*USER, assistant, *USER]).messages[1].text == ""


def test_a_deprecated_function_call_in_the_history_is_refused() -> None:
    # It was dropped: the model answered as if the call had never been made.
    call = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    assert refused(chat, messages=[*USER, call, *USER]) == "messages.1"
    assert (
        chat(messages=[*USER, {**call, "function_call": None, "content": "x"}, *USER]).messages[1].text == "x"
    )


def test_prompt_forms() -> None:
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for bad in ([], [""], [[]], [[-1]], ["a", 1], ["a"] * 257):
        assert refused(completion, prompt=bad) == "prompt"


def test_model_is_required_unless_a_task_routes() -> None:
    with pytest.raises(InvalidRequest) as info:
        require_model(None, None)
    assert info.value.param == "model"
    with pytest.raises(InvalidRequest):
        require_model("", None)
    require_model(None, "summary")
    require_model("base", None)


def test_json_content_types() -> None:
    assert _is_json("application/json") and _is_json("Application/JSON; charset=utf-8")
    assert _is_json("application/merge-patch+json")
    assert not _is_json("application/x-www-form-urlencoded") and not _is_json("text/plain")


def test_alias_card_root_names_its_target() -> None:
    assert model_card("base", "gateway", 0, None, "gemma")["root"] == "gemma"
    assert model_card("gemma", "gateway", 0, None)["root"] == "gemma"
    assert model_card("loud", "gateway", 0, "gemma")["root"] == "gemma"


def test_tokenize_request_needs_exactly_one_input() -> None:
    assert TokenizeRequest.model_validate({"prompt": "x"}).messages is None
    for body in ({}, {"prompt": "x", "messages": USER}, {"messages": USER, "continue_final_message": True}):
        with pytest.raises(InvalidRequest):
            TokenizeRequest.model_validate(body)


# -- logprobs and streams ---------------------------------------------------------------------
def test_completion_logprobs_offsets_and_top() -> None:
    items = [
        TokenLogprob("<bos>", None),
        TokenLogprob("Hi", -0.5, [("Yo", -0.2)]),
        TokenLogprob("!", -1.0, []),
    ]
    shaped = completion_logprobs(items, offset=10)
    assert shaped == {
        "tokens": ["<bos>", "Hi", "!"],
        "token_logprobs": [None, -0.5, -1.0],
        "top_logprobs": [None, {"Yo": -0.2, "Hi": -0.5}, {"!": -1.0}],
        "text_offset": [10, 15, 17],
    }


class LogprobEngine(FakeEngine):
    """Each word is one token with a logprob; per prompt, ``prompt_logprobs`` on the first step."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        request_id: str,
        lora: LoraSpec | None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        self.calls.append((prompt_ids, sampling, request_id, lora))
        words = self.words[: sampling.max_tokens]
        for i, word in enumerate(words):
            await asyncio.sleep(0)
            last = i == len(words) - 1
            lps = [TokenLogprob(word, -1.0)] if sampling.logprobs is not None else None
            chunks = [Chunk(n, word, 1, "length" if last else None, lps) for n in range(sampling.n)]
            prompt_lps = None
            if i == 0 and sampling.prompt_logprobs is not None:
                prompt_lps = [TokenLogprob("", None), *(TokenLogprob(chr(t), -2.0) for t in prompt_ids[1:])]
            yield StepOutput(chunks, len(prompt_ids), last, prompt_lps)


def make_gen(**kw: Any) -> Generation:
    table = RoutingTable(base=Route(name="base", kind="base"), routes={}, errors={})
    spec = SamplingSpec(max_tokens=10, logprobs=0)
    return Generation(
        LogprobEngine(), Catalog(lambda ids: table).acquire("base"), [1, 2], spec, spec, "cmpl", **kw
    )


async def test_streamed_text_offset_continues_across_chunks() -> None:
    gen = make_gen()
    raw = b"".join([p async for p in encode_stream(gen, OpenAICompletionEncoder(gen, False))])
    chunks = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets == [[0], [5], [11]]  # "Hello", " world", "!"


def test_streamed_logprobs_of_held_back_text_are_sent() -> None:
    """A token whose text is held back (stop-string candidate) keeps its logprobs in the
    stream, so the streamed tokens and text_offsets equal the whole response's (vLLM's
    test_completion_text_offset)."""
    gen = make_gen()
    encoder = OpenAICompletionEncoder(gen, False)
    steps = [
        [Chunk(0, "", 1, None, [TokenLogprob("ab", -1.0)])],
        [Chunk(0, "abc", 1, None, [TokenLogprob("c", -1.0)])],
        [Chunk(0, "!", 1, "stop", [TokenLogprob("!", -1.0)])],
    ]
    raw = b"".join(encoder.step(StepOutput(chunks, 2, i == 2)) for i, chunks in enumerate(steps))
    chunks = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    assert [lp["tokens"] for lp in logprobs] == [["ab"], ["c"], ["!"]]
    assert [lp["text_offset"] for lp in logprobs] == [[0], [2], [3]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc!"


# -- batched prompts and echo ------------------------------------------------------------------
def service(engine: FakeEngine) -> tuple[ChatService, Catalog]:
    table = RoutingTable(base=Route(name="base", kind="base"), routes={}, errors={})
    return ChatService(engine, LimitSettings(max_n=4, max_logprobs=5)), Catalog(lambda ids: table)


async def test_batched_prompts_index_choices_by_prompt_then_n() -> None:
    engine = LogprobEngine(words=["a", "b"])
    svc, catalog = service(engine)
    gen = await svc.complete(
        completion(prompt=[[2, 120], [2, 121, 122], [5, 6, 7]], n=2, temperature=1), catalog.acquire("base")
    )
    result = await gen.collect()
    assert [c.index for c in result.choices] == [0, 1, 2, 3, 4, 5]
    assert all("".join(c.text) == "ab" for c in result.choices)
    assert result.prompt_tokens == 2 + 3 + 3 and result.completion_tokens == 12
    assert [call[0] for call in engine.calls] == [[2, ord("x")], [2, ord("y"), ord("z")], [5, 6, 7]]
    assert len({call[2] for call in engine.calls}) == 3


async def test_batched_stream_finishes_once_all_prompts_have() -> None:
    async def steps(p: int, count: int) -> AsyncIterator[StepOutput]:
        for i in range(count):
            await asyncio.sleep(0)
            yield StepOutput([Chunk(0, f"{p}{i}", 1)], 1, i == count - 1)

    out = [step async for step in merge_steps([steps(0, 3), steps(1, 1)], n=1)]
    assert [s.finished for s in out][-1] and sum(s.finished for s in out) == 1
    assert sorted((c.index, c.text) for s in out for c in s.chunks) == [
        (0, "00"),
        (0, "01"),
        (0, "02"),
        (1, "10"),
    ]


async def test_batched_stream_sums_cached_tokens_over_prompts_counting_each_once() -> None:
    """Each step carries the request's cached prompt tokens so far: summed over the prompts,
    as their prompt tokens are; a prompt's greedy copies (a request each) count once, with
    the fewest any copy read (one computed the prompt, the other may have read it)."""

    async def steps(cached: int) -> AsyncIterator[StepOutput]:
        for i in range(2):
            await asyncio.sleep(0)
            yield StepOutput([Chunk(0, "x", 1)], 10, i == 1, cached_tokens=cached)

    out = [step async for step in merge_steps([steps(8), steps(4)], n=1)]
    assert out[-1].finished and out[-1].cached_tokens == 12
    copies = [steps(0), steps(8), steps(4), steps(4)]  # two prompts, two copies each
    out = [step async for step in merge_steps(copies, n=1, copies=2)]
    assert out[-1].finished and out[-1].cached_tokens == 0 + 4


async def test_batched_stream_raises_an_engine_error_and_closes_the_rest() -> None:
    closed: list[int] = []

    async def fails() -> AsyncIterator[StepOutput]:
        await asyncio.sleep(0)
        raise InvalidRequest("bad")
        yield  # an async generator

    async def long() -> AsyncIterator[StepOutput]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield StepOutput([Chunk(0, "x", 1)], 1, False)
        finally:
            closed.append(1)

    with pytest.raises(InvalidRequest):
        async for _ in merge_steps([long(), fails()], n=1):
            pass
    assert closed == [1]


async def test_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    engine = LogprobEngine(words=["a", "b"])
    svc, catalog = service(engine)
    gen = await svc.complete(
        completion(prompt=[[2, 120, 121], [5, 6]], echo=True, logprobs=1), catalog.acquire("base")
    )
    result = await gen.collect()
    assert ["".join(c.text) for c in result.choices] == ["<bos>xyab", "\x05\x06ab"]
    first = result.choices[0].logprobs or []
    assert [t.token for t in first] == ["<bos>", "x", "y", "a", "b"] and first[0].logprob is None
    assert engine.calls[0][1].prompt_logprobs == 1


async def test_echo_without_logprobs_asks_for_no_prompt_logprobs() -> None:
    engine = LogprobEngine(words=["a"])
    svc, catalog = service(engine)
    gen = await svc.complete(completion(prompt="hi", echo=True), catalog.acquire("base"))
    assert ["".join(c.text) for c in (await gen.collect()).choices] == ["hia"]
    assert engine.calls[0][1].prompt_logprobs is None


async def test_echo_steps_once_per_choice() -> None:
    async def steps() -> AsyncIterator[StepOutput]:
        yield StepOutput([Chunk(0, "a", 1), Chunk(1, "b", 1)], 1, False)
        yield StepOutput([Chunk(0, "c", 1), Chunk(1, "d", 1, "stop")], 1, True)

    texts = [[c.text for c in s.chunks] async for s in echo_steps(steps(), Echo("P:", "<bos>"))]
    assert texts == [["P:a", "P:b"], ["c", "d"]]


async def test_logit_bias_beyond_the_vocabulary_is_refused() -> None:
    svc, catalog = service(FakeEngine())
    with pytest.raises(InvalidRequest) as info:
        await svc.complete(completion(logit_bias={str(0x110000): 5}), catalog.acquire("base"))
    assert info.value.param == "logit_bias"
    gen = await svc.complete(completion(logit_bias={"65": 5}), catalog.acquire("base"))
    assert gen.sampling.logit_bias == ((65, 5.0),)
    gen.close()


async def test_vllm_sampling_extensions_reach_the_engine() -> None:
    svc, catalog = service(FakeEngine())
    fields = {"min_p": 0.2, "stop_token_ids": [65, 66], "include_stop_str_in_output": True}
    gen = await svc.complete(completion(**fields), catalog.acquire("base"))
    assert (gen.sampling.min_p, gen.sampling.stop_token_ids) == (0.2, (65, 66))
    assert gen.sampling.include_stop_str_in_output
    gen.close()
    for bad in ([0x110000], [-1]):
        with pytest.raises(InvalidRequest) as info:
            await svc.chat(chat(stop_token_ids=bad), catalog.acquire("base"))
        assert info.value.param == "stop_token_ids"
    assert refused(chat, min_p=1.5) == "min_p"
    assert refused(completion, stop_token_ids=list(range(65))) == "stop_token_ids"


async def test_top_k_minus_one_disables_top_k_as_in_vllm() -> None:
    # vLLM's SamplingParams: "Set to 0 (or -1) to consider all tokens"; its server takes -1.
    svc, catalog = service(FakeEngine())
    gen = await svc.complete(completion(top_k=-1), catalog.acquire("base"))
    assert gen.sampling.top_k == 0
    gen.close()
    gen = await svc.chat(chat(top_k=-1), catalog.acquire("base"))
    assert gen.sampling.top_k == 0
    gen.close()
    assert refused(chat, top_k=-2) == "top_k"
    assert refused(completion, top_k=-2) == "top_k"


async def test_echo_with_max_tokens_0_returns_only_the_prompt() -> None:
    engine = LogprobEngine(words=["a", "b"])
    svc, catalog = service(engine)
    gen = await svc.complete(
        completion(prompt="hi", echo=True, max_tokens=0, logprobs=0), catalog.acquire("base")
    )
    result = await gen.collect()
    assert "".join(result.choices[0].text) == "hi" and result.completion_tokens == 0
    assert [t.token for t in result.choices[0].logprobs or []] == ["<bos>", "h", "i"]
    assert engine.calls[0][1].max_tokens == 1
    assert refused(completion, max_tokens=0) == "max_tokens"


# -- found with the fuzzing of /openapi.json (tests/integration/test_fuzz.py) ------------------
def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = _nested_schema(200)  # parses as JSON; the meta-schema check recursed past the limit


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": DEEP}}},
            "response_format",
        ),
        ({"structured_outputs": {"json": DEEP}}, "structured_outputs"),
        ({"structured_outputs": {"json": "[" * 5000 + "]" * 5000}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools"),
    ],
)
async def test_absurdly_deep_schemas_are_400s_not_500s(
    serve: Serve, fields: dict[str, Any], param: str
) -> None:
    served = await serve()
    r = await served.http.post("/v1/chat/completions", json=chat_body("base", **fields))
    assert assert_openai_error(r, 400)["param"] == param


async def test_an_absurdly_deep_text_format_schema_is_a_400(serve: Serve) -> None:
    served = await serve()
    fmt = {"type": "json_schema", "name": "a", "schema": DEEP}
    r = await served.http.post(
        "/v1/responses", json={"model": "base", "input": "Hi", "text": {"format": fmt}}
    )
    assert assert_openai_error(r, 400)["param"] == "text.format.schema"


def test_an_answer_nested_absurdly_deep_is_text_not_a_crash() -> None:
    text = "[" * 5000 + "]" * 5000  # the model wrote it; json.loads raised RecursionError
    assert parse_calls(text, ("f",)) == (text, [])
    assert parse_required(text) == []


async def test_the_min_tokens_error_on_responses_names_max_output_tokens(serve: Serve) -> None:
    # It said "at most max_tokens (2)", a field /v1/responses refuses.
    served = await serve()
    body = {"model": "base", "input": "Hi", "max_output_tokens": 2, "min_tokens": 5}
    r = await served.http.post("/v1/responses", json=body)
    error = assert_openai_error(r, 400)
    assert error["param"] == "min_tokens" and "at most max_output_tokens (2)" in error["message"]


@pytest.mark.parametrize("value", [False, "false", "False", 0, "0", "no", "off", "f", "maybe", [], {}, 2])
def test_add_generation_prompt_false_in_any_spelling_or_no_bool_is_a_400(value: Any) -> None:
    """vLLM's request model reads ``"false"``, ``0`` and ``"off"`` as false (and leaves the
    generation prompt out): refused as ``false`` is, not answered with it."""
    assert refused(chat, add_generation_prompt=value) == "add_generation_prompt"


@pytest.mark.parametrize("value", [True, "true", 1, "yes", "on", None])
def test_add_generation_prompt_true_in_any_spelling_is_the_default(value: Any) -> None:
    assert chat(add_generation_prompt=value).n == 1


@pytest.mark.parametrize("value", [False, "no", 0, "maybe"])
def test_completions_take_add_generation_prompt_as_vllm_does(value: Any) -> None:
    """vLLM's completion request has no such field (no chat template): it changes nothing."""
    assert completion(add_generation_prompt=value).n == 1
