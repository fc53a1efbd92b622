"""ChatService with a fake engine: prompt building, sampling merge, limits, leases."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

import pytest

from gateway.catalog import Catalog, Route, RoutingTable
from gateway.catalog_file import SamplingDefaults
from gateway.errors import ContextLengthExceeded, EngineFailed, EngineUnavailable, InvalidRequest
from gateway.lora_scheduler import LoraScheduler
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest
from gateway.service import ChatService
from gateway.settings import LimitSettings
from gateway.types import Constraint, LoraSpec, ModelDefaults
from tests.unit.fakes import FakeEngine

PRESET = Route(
    name="concise",
    kind="preset",
    system_prompt="Be brief.",
    defaults=SamplingDefaults(temperature=0.2, max_tokens=5, repetition_penalty=1.1),
)


def setup(engine: FakeEngine | None = None) -> tuple[ChatService, Catalog, FakeEngine]:
    engine = engine or FakeEngine()
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes={"concise": PRESET}, errors={})
    return (
        ChatService(engine, LimitSettings(max_n=4, max_stop=2, max_logprobs=5)),
        Catalog(lambda ids: table),
        engine,
    )


PROMPT_TOKENS = len("system:Be brief.\nuser:Hi\nmodel:")  # chat()'s prompt on the concise route


def chat(**kw: object) -> ChatCompletionRequest:
    body: dict[str, object] = {"model": "concise", "messages": [{"role": "user", "content": "Hi"}]}
    body.update(kw)
    return ChatCompletionRequest.model_validate(body)


async def test_route_system_prompt_and_defaults_apply() -> None:
    service, catalog, engine = setup()
    gen = await service.chat(chat(), catalog.acquire("concise"))
    result = await gen.collect()
    prompt_ids, sampling, _, lora = engine.calls[0]
    assert "".join(map(chr, prompt_ids)) == "system:Be brief.\nuser:Hi\nmodel:"
    assert (sampling.temperature, sampling.max_tokens, sampling.repetition_penalty) == (0.2, 5, 1.1)
    assert lora is None
    assert "".join(result.choices[0].text) == "Hello world!"
    assert result.completion_tokens == 3 and result.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("role", ["system", "developer"])
async def test_request_values_override_route_defaults(role: str) -> None:
    """The caller's own instructions, as a system or a developer message (OpenAI's newer
    name for it), replace the route's system prompt rather than follow it."""
    service, catalog, engine = setup()
    req = chat(
        temperature=0.9,
        max_tokens=7,
        messages=[{"role": role, "content": "Mine."}, {"role": "user", "content": "Hi"}],
    )
    await (await service.chat(req, catalog.acquire("concise"))).collect()
    prompt_ids, sampling, _, _ = engine.calls[0]
    assert sampling.temperature == 0.9 and sampling.max_tokens == 7
    assert "".join(map(chr, prompt_ids)).startswith(f"{role}:Mine.")  # the caller's system prompt wins


async def test_text_parts_are_joined_by_newlines() -> None:
    service, catalog, engine = setup()
    req = chat(
        model="base-model",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
    )
    await (await service.chat(req, catalog.acquire("base-model"))).collect()
    assert "".join(map(chr, engine.calls[0][0])) == "user:a\nb\nmodel:"  # as vLLM joins them


async def test_prompt_longer_than_context_is_context_length_exceeded() -> None:
    service, catalog, _ = setup(FakeEngine(max_model_len=20))
    with pytest.raises(ContextLengthExceeded) as info:
        await service.chat(chat(messages=[{"role": "user", "content": "x" * 50}]), catalog.acquire("concise"))
    assert info.value.to_dict()["error"]["code"] == "context_length_exceeded"


async def test_a_prompt_that_fills_the_context_is_refused_on_its_messages() -> None:
    """A prompt of exactly ``max_model_len`` tokens leaves no room for one more: the 400
    names the messages (what the client must shorten), with or without a max_tokens."""
    service, catalog, _ = setup(FakeEngine(max_model_len=PROMPT_TOKENS))
    for request in (chat(), chat(max_tokens=1)):
        with pytest.raises(ContextLengthExceeded) as info:
            await service.chat(request, catalog.acquire("concise"))
        assert info.value.param == "messages"


async def test_max_tokens_beyond_context_is_context_length_exceeded() -> None:
    """max_tokens may take all the room the prompt leaves in the context, not one token more."""
    service, catalog, engine = setup(FakeEngine(max_model_len=40))
    with pytest.raises(ContextLengthExceeded) as info:
        await service.chat(chat(max_tokens=100), catalog.acquire("concise"))
    assert info.value.param == "max_tokens"
    room = 40 - PROMPT_TOKENS
    await (await service.chat(chat(max_tokens=room), catalog.acquire("concise"))).collect()
    assert engine.calls[-1][1].max_tokens == room
    with pytest.raises(ContextLengthExceeded):
        await service.chat(chat(max_tokens=room + 1), catalog.acquire("concise"))


async def test_limit_errors_name_max_completion_tokens_when_that_was_sent() -> None:
    # The field the client sent, as vLLM names it: "max_tokens" sent nothing here.
    service, catalog, _ = setup(FakeEngine(max_model_len=40))
    with pytest.raises(ContextLengthExceeded) as info:
        await service.chat(chat(max_completion_tokens=100), catalog.acquire("concise"))
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(InvalidRequest) as refused:
        await service.chat(chat(max_completion_tokens=3, min_tokens=5), catalog.acquire("concise"))
    assert refused.value.param == "min_tokens" and "max_completion_tokens (3)" in refused.value.message


async def test_default_max_tokens_fits_the_room_left() -> None:
    """Also under a server-wide limit on max_tokens that is above the room: the default is
    the least of the two, not the limit, which the prompt leaves no room for."""
    service, catalog, engine = setup(FakeEngine(max_model_len=30))
    req = chat(model="base-model")
    await (await service.chat(req, catalog.acquire("base-model"))).collect()
    assert engine.calls[0][1].max_tokens == 30 - len(engine.calls[0][0])
    engine.model_defaults = ModelDefaults(max_tokens_limit=50)
    await (await service.chat(req, catalog.acquire("base-model"))).collect()
    assert engine.calls[1][1].max_tokens == 30 - len(engine.calls[1][0])


async def test_min_tokens_above_max_tokens_is_400() -> None:
    # vLLM refuses it; lowering min_tokens would end answers earlier than asked.
    service, catalog, _ = setup()
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(max_tokens=5, min_tokens=6), catalog.acquire("concise"))
    assert info.value.param == "min_tokens"
    gen = await service.chat(chat(max_tokens=5, min_tokens=5), catalog.acquire("concise"))  # an exact length
    assert (gen.sampling.min_tokens, gen.sampling.max_tokens) == (5, 5)
    gen.close()


async def test_min_tokens_raises_a_default_max_tokens_within_the_context() -> None:
    service, catalog, engine = setup(FakeEngine(max_model_len=40))
    await (await service.chat(chat(min_tokens=8), catalog.acquire("concise"))).collect()  # route: 5
    assert (engine.calls[0][1].max_tokens, engine.calls[0][1].min_tokens) == (8, 8)
    room = 40 - len(engine.calls[0][0])
    await (await service.chat(chat(min_tokens=room), catalog.acquire("concise"))).collect()
    assert engine.calls[1][1].max_tokens == room
    with pytest.raises(ContextLengthExceeded) as info:
        await service.chat(chat(min_tokens=room + 1), catalog.acquire("concise"))
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("n", 5, "n"), ("stop", ["a", "b", "c"], "stop"), ("stop", [""], "stop")],
)
async def test_limits(field: str, value: object, param: str) -> None:
    service, catalog, _ = setup()
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(**{field: value}), catalog.acquire("concise"))
    assert info.value.param == param


async def test_logprobs_cap() -> None:
    service, catalog, _ = setup()
    with pytest.raises(InvalidRequest):
        await service.chat(chat(logprobs=True, top_logprobs=6), catalog.acquire("concise"))


@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        ({"n": 4, "temperature": 1}, "n", 4),
        ({"stop": ["a", "b"]}, "stop", ("a", "b")),
        ({"logprobs": True, "top_logprobs": 5}, "logprobs", 5),
    ],
)
async def test_values_at_the_limits_are_served(fields: dict[str, object], field: str, value: object) -> None:
    """The limits are maxima: n, stop and top_logprobs equal to ``max_n``, ``max_stop`` and
    ``max_logprobs`` (4, 2 and 5 here) reach the engine, as the settings promise."""
    service, catalog, _ = setup()
    gen = await service.chat(chat(**fields), catalog.acquire("concise"))
    assert getattr(gen.sampling, field) == value
    gen.close()


async def test_completion_with_token_ids_and_text() -> None:
    service, catalog, engine = setup()
    await (
        await service.complete(CompletionRequest(model="base-model", prompt=[5, 6, 7]), catalog.acquire(None))
    ).collect()
    await (
        await service.complete(CompletionRequest(model="base-model", prompt="ab"), catalog.acquire(None))
    ).collect()
    assert engine.calls[0][0] == [5, 6, 7]
    assert engine.calls[1][0] == [2, 97, 98]  # text gets <bos>


async def test_a_prompt_token_id_equal_to_the_vocabulary_size_is_400() -> None:
    """Token ids run from 0 to the vocabulary's size - 1: an id equal to the size is a 400
    naming ``prompt``, not a request the engine fails on."""
    service, catalog, engine = setup()
    vocab = len(engine.tokenizer)
    with pytest.raises(InvalidRequest) as info:
        await service.complete(
            CompletionRequest(model="base-model", prompt=[5, vocab]), catalog.acquire(None)
        )
    assert info.value.param == "prompt"
    await (
        await service.complete(
            CompletionRequest(model="base-model", prompt=[vocab - 1]), catalog.acquire(None)
        )
    ).collect()
    assert engine.calls[-1][0] == [vocab - 1]


async def test_house_request_becomes_a_user_turn() -> None:
    service, catalog, engine = setup()
    request = HouseChatRequest(question="Hi?").chat_request()
    await (await service.house(request, catalog.acquire(None))).collect()
    assert "".join(map(chr, engine.calls[0][0])) == "user:Hi?\nmodel:"


async def test_a_consumer_that_leaves_early_aborts_the_engine_request() -> None:
    service, catalog, engine = setup(FakeEngine(words=["a"] * 5, delay=0.01))
    gen = await service.chat(chat(), catalog.acquire("concise"))
    steps = gen.steps()
    await steps.__anext__()
    await steps.aclose()
    await asyncio.sleep(0)
    assert engine.aborted == [gen.id]


async def test_bad_template_is_400() -> None:
    route = Route(name="t", kind="preset", chat_template="{{ raise }}")
    table = RoutingTable(base=Route(name="b", kind="base"), routes={"t": route}, errors={})
    service = ChatService(FakeEngine(), LimitSettings())
    with pytest.raises(InvalidRequest):
        await service.chat(chat(model="t"), Catalog(lambda ids: table).acquire("t"))


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        {"messages": [{"role": "user", "content": "x"}], "temperature": float("nan")},
        {"messages": [{"role": "user", "content": "x"}], "n": 0},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    ],
)
def test_invalid_chat_bodies_are_rejected(body: dict[str, object]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


async def test_greedy_choices_are_one_engine_request_each() -> None:
    """vLLM refuses ``n > 1`` when greedy; OpenAI answers it, so each choice is a request."""
    service, catalog, engine = setup()
    gen = await service.chat(chat(n=3, temperature=0), catalog.acquire("concise"))
    result = await gen.collect()
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert {"".join(c.text) for c in result.choices} == {"Hello world!"}
    assert all(c.finish_reason == "stop" for c in result.choices)
    assert [call[1].n for call in engine.calls] == [1, 1, 1]
    assert len({call[2] for call in engine.calls}) == 3  # request ids of their own
    assert result.prompt_tokens == len(engine.calls[0][0])  # the prompt counted once, as OpenAI does
    assert result.completion_tokens == 3 * 3


async def test_greedy_choices_of_several_prompts_keep_openais_order() -> None:
    service, catalog, engine = setup()
    request = CompletionRequest(model="base-model", prompt=["ab", "cde"], n=2, temperature=0, echo=True)
    result = await (await service.complete(request, catalog.acquire(None))).collect()
    # choice index = prompt * n + copy, each echoing its own prompt
    assert ["".join(c.text) for c in result.choices] == [
        "abHello world!",
        "abHello world!",
        "cdeHello world!",
        "cdeHello world!",
    ]
    assert [call[1].n for call in engine.calls] == [1] * 4
    assert result.prompt_tokens == len(engine.calls[0][0]) + len(engine.calls[2][0])


@pytest.mark.parametrize("temperature", [0.5, 1e-6])
async def test_sampled_choices_stay_one_engine_request(temperature: float) -> None:
    """vLLM raises a temperature in (0, 0.01) to 0.01, which samples: one request, whose
    choices vLLM seeds seed, seed + 1, ... (copies would all carry the one seed, identical)."""
    service, catalog, engine = setup()
    request = chat(n=2, temperature=temperature, seed=7)
    await (await service.chat(request, catalog.acquire("concise"))).collect()
    assert [(call[1].n, call[1].seed) for call in engine.calls] == [(2, 7)]


async def test_the_models_generation_config_fills_what_request_and_route_leave_out() -> None:
    """As vLLM's server: request, else the route's defaults, else the model's, else OpenAI's."""
    engine = FakeEngine()
    engine.model_defaults = ModelDefaults(
        temperature=0.6,
        top_p=0.95,
        top_k=64,
        min_p=0.05,
        repetition_penalty=1.05,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        max_tokens=9,
    )
    service, catalog, _ = setup(engine)
    await (await service.chat(chat(model="base-model"), catalog.acquire(None))).collect()
    spec = engine.calls[-1][1]
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.max_tokens) == (0.6, 0.95, 64, 0.05, 9)
    assert (spec.repetition_penalty, spec.presence_penalty, spec.frequency_penalty) == (1.05, 0.1, 0.2)
    await (await service.chat(chat(), catalog.acquire("concise"))).collect()  # the route's win
    spec = engine.calls[-1][1]
    assert (spec.temperature, spec.max_tokens, spec.repetition_penalty, spec.top_k) == (0.2, 5, 1.1, 64)
    table = RoutingTable(
        base=Route(name="base-model", kind="base"),
        routes={"plain": Route(name="plain", kind="preset", defaults=SamplingDefaults(top_k=0, min_p=0.1))},
        errors={},
    )
    await (await service.chat(chat(model="plain"), Catalog(lambda ids: table).acquire("plain"))).collect()
    spec = engine.calls[-1][1]  # a preset undoes the model's top_k, sets its own min_p
    assert (spec.top_k, spec.min_p, spec.top_p) == (0, 0.1, 0.95)
    request = chat(temperature=1.0, top_k=-1, min_p=0, presence_penalty=0, max_tokens=3)
    await (await service.chat(request, catalog.acquire("concise"))).collect()  # the request's win
    spec = engine.calls[-1][1]
    assert (spec.temperature, spec.top_k, spec.min_p, spec.presence_penalty, spec.max_tokens) == (
        1.0,
        0,
        0,
        0,
        3,
    )


async def test_the_servers_max_new_tokens_limits_every_request() -> None:
    """vLLM's server makes an override's ``max_new_tokens`` a server-wide limit: an explicit
    ``max_tokens`` or a route's default above it is cut to it; a ``min_tokens`` above it is a 400."""
    engine = FakeEngine()
    engine.model_defaults = ModelDefaults(max_tokens=4, max_tokens_limit=4)
    service, catalog, _ = setup(engine)
    await (await service.chat(chat(max_tokens=50), catalog.acquire(None))).collect()
    assert engine.calls[-1][1].max_tokens == 4
    await (await service.chat(chat(max_tokens=2), catalog.acquire(None))).collect()
    assert engine.calls[-1][1].max_tokens == 2
    await (await service.chat(chat(), catalog.acquire("concise"))).collect()  # the route's default is 5
    assert engine.calls[-1][1].max_tokens == 4
    await (await service.chat(chat(min_tokens=4), catalog.acquire(None))).collect()  # at the limit: fine
    assert (engine.calls[-1][1].min_tokens, engine.calls[-1][1].max_tokens) == (4, 4)
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(min_tokens=5), catalog.acquire(None))
    assert info.value.param == "min_tokens" and "limit on max_tokens (4)" in info.value.message
    # beyond the context's room (100 tokens): cut to the limit first, as vLLM takes the least
    await (await service.chat(chat(max_tokens=500), catalog.acquire(None))).collect()
    assert engine.calls[-1][1].max_tokens == 4
    engine.model_defaults = ModelDefaults(max_tokens=4)  # generation_config.json's: a default only
    await (await service.chat(chat(max_tokens=50), catalog.acquire(None))).collect()
    assert engine.calls[-1][1].max_tokens == 50


async def test_each_prompt_of_a_batch_has_its_own_room() -> None:
    """As vLLM budgets each prompt: a short prompt is not cut to what a long one leaves. A
    refusal names the longest prompt, the one the client has to shorten most."""
    engine = FakeEngine(max_model_len=100)
    service, catalog, _ = setup(engine)
    # "a" is 2 tokens (<bos> a): room 98; the long one 96 tokens: room 4
    body = {"model": "base-model", "prompt": ["x" * 95, "a", "b"], "n": 2}
    await (await service.complete(CompletionRequest.model_validate(body), catalog.acquire(None))).collect()
    assert [(len(ids), spec.max_tokens, spec.n) for ids, spec, _, _ in engine.calls] == [
        (96, 4, 2),
        (2, 98, 2),
        (2, 98, 2),
    ]
    body = {"model": "base-model", "prompt": ["a", "x" * 95], "max_tokens": 5}
    with pytest.raises(ContextLengthExceeded):  # an explicit max_tokens must fit every prompt
        await service.complete(CompletionRequest.model_validate(body), catalog.acquire(None))
    body = {"model": "base-model", "prompt": ["x" * 90, "a", "x" * 95], "max_tokens": 10}
    with pytest.raises(ContextLengthExceeded) as info:  # of several too long, the longest is named
        await service.complete(CompletionRequest.model_validate(body), catalog.acquire(None))
    assert "(96 in the prompt, 10 for the completion)" in info.value.message


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "f"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def routes_with_formats() -> tuple[ChatService, Catalog, FakeEngine]:
    enforced = Route(name="json", kind="preset", response_format=Constraint("json", SCHEMA), enforce=True)
    soft = Route(name="soft", kind="preset", response_format=Constraint("json_object"))
    table = RoutingTable(
        base=Route(name="base-model", kind="base"), routes={"json": enforced, "soft": soft}, errors={}
    )
    engine = FakeEngine(max_model_len=1000)
    return ChatService(engine, LimitSettings()), Catalog(lambda ids: table), engine


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            "response_format",
        ),
    ],
)
async def test_forced_tool_calls_take_the_tools_grammar_beside_a_structured_output(
    choice: object, fields: dict[str, object], param: str
) -> None:
    """As OpenAI (and instructor's RESPONSES_TOOLS, which sends both): the answer is a call,
    so the structured output shapes nothing; it is still checked."""
    service, catalog, engine = routes_with_formats()
    gen = await service.chat(
        chat(model="soft", tools=[F], tool_choice=choice, **fields), catalog.acquire("soft")
    )
    assert gen.sampling.constraint is not None and gen.sampling.constraint.kind == "json"
    assert gen.sampling.constraint != Constraint("json_object")
    gen.close()
    bad = {param: {"type": "json_schema"}} if param == "response_format" else {param: {"bogus": 1}}
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(model="soft", tools=[F], tool_choice=choice, **bad), catalog.acquire("soft"))
    assert info.value.param is not None and info.value.param.startswith(param)


async def test_forced_tool_calls_and_route_response_formats() -> None:
    service, catalog, engine = routes_with_formats()
    with pytest.raises(InvalidRequest) as info:  # the route's enforced schema would be bypassed
        await service.chat(chat(model="json", tools=[F], tool_choice="required"), catalog.acquire("json"))
    assert info.value.param == "tool_choice" and "enforces" in info.value.message
    auto = await service.chat(chat(model="json", tools=[F]), catalog.acquire("json"))
    assert auto.sampling.constraint == Constraint("json", SCHEMA)
    auto.close()
    for body in ({"tool_choice": NAMED}, {"tool_choice": "required", "response_format": {"type": "text"}}):
        gen = await service.chat(chat(model="soft", tools=[F], **body), catalog.acquire("soft"))
        assert gen.sampling.constraint is not None and gen.sampling.constraint.kind == "json"
        assert gen.sampling.constraint != Constraint("json_object")  # the tools' grammar, not the default
        gen.close()
    gen = await service.chat(  # /v1/responses' text.format, given beside the body: the calls' grammar
        chat(tools=[F], tool_choice="required"), catalog.acquire(None), Constraint("json_object")
    )
    assert gen.sampling.constraint is not None and gen.sampling.constraint != Constraint("json_object")
    gen.close()


class SlowAbortEngine(FakeEngine):
    """Aborts wait for ``abort_gate``: the engine has not heard of them yet."""

    def __init__(self) -> None:
        super().__init__(words=["a"] * 100, delay=0.01)  # still running when its client leaves
        self.abort_gate = asyncio.Event()

    async def abort(self, request_id: str) -> None:
        await self.abort_gate.wait()
        await super().abort(request_id)


def two_adapters_one_slot(engine: FakeEngine) -> tuple[ChatService, Catalog, LoraScheduler]:
    """Routes ``a`` and ``b`` on two adapters, and one adapter slot in the scheduler."""
    scheduler = LoraScheduler(1, quantum_s=60.0, max_wait_s=60.0)
    a, b = (
        Route(name=n, kind="lora", lora=LoraSpec(name=n, lora_id=i, path="/x"))
        for i, n in ((1, "a"), (2, "b"))
    )
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes={"a": a, "b": b}, errors={})
    return ChatService(engine, LimitSettings(), scheduler), Catalog(lambda ids: table), scheduler


async def test_a_request_that_leaves_gives_up_its_adapters_turn_after_the_abort() -> None:
    """With one slot, b's adapter gets its turn only once a's abort reached the engine: before
    that a's request may still run there, and (with a pinned slot) vLLM dies of a batch with
    more unpinned adapters than free slots. The retired-version lease waits for it too."""
    engine = SlowAbortEngine()
    service, catalog, scheduler = two_adapters_one_slot(engine)
    gen_a = await service.chat(chat(model="a"), catalog.acquire("a"))
    steps = gen_a.steps()
    await steps.__anext__()
    gen_b = await service.chat(chat(model="b"), catalog.acquire("b"))
    task_b = asyncio.create_task(gen_b.collect())
    await asyncio.sleep(0.05)
    assert scheduler.queued == 1
    await steps.aclose()  # a's client leaves mid-stream
    await asyncio.sleep(0.05)
    assert scheduler.queued == 1 and [lora.name for *_, lora in engine.calls if lora] == ["a"]
    assert catalog._in_use.get(1) == 1  # a's version is still held
    engine.abort_gate.set()
    await asyncio.wait_for(task_b, 5)
    assert engine.aborted == [gen_a.id] and [lora.name for *_, lora in engine.calls if lora] == ["a", "b"]
    assert 1 not in catalog._in_use


async def test_closing_a_collect_its_client_left_keeps_the_version_until_the_abort() -> None:
    """``collect_unless_gone`` cancels the collect and then calls ``close`` at once: that
    released the route version before the abort reached the engine, which may still run the
    request, on a version whose adapter a reload is about to remove."""
    engine = SlowAbortEngine()
    service, catalog, _ = two_adapters_one_slot(engine)
    gen = await service.chat(chat(model="a"), catalog.acquire("a"))
    work = asyncio.create_task(gen.collect())
    await asyncio.sleep(0.05)  # it streams from the engine
    work.cancel()
    gen.close()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    assert catalog._in_use.get(1) == 1  # held until the engine hears of the abort
    engine.abort_gate.set()
    await asyncio.sleep(0.05)
    assert engine.aborted == [gen.id] and 1 not in catalog._in_use


async def test_close_releases_a_generation_never_iterated() -> None:
    service, catalog, _ = two_adapters_one_slot(FakeEngine())
    gen = await service.chat(chat(model="a"), catalog.acquire("a"))
    work = asyncio.create_task(gen.collect())
    work.cancel()  # before it ever ran: steps() and its release never run
    gen.close()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    assert 1 not in catalog._in_use


async def test_a_stalled_reader_gives_up_its_adapters_turn_once_the_engine_is_done() -> None:
    """vLLM runs a request to its end however slowly its client reads. A client that stops
    reading (its TCP window full, the gateway's send blocked) must not hold its adapter's
    turn after that: with one slot, b would wait for a's client (or for max_wait_s)."""
    engine = FakeEngine(words=["a"] * 5, delay=0.01)
    service, catalog, scheduler = two_adapters_one_slot(engine)
    gen_a = await service.chat(chat(model="a"), catalog.acquire("a"))
    steps = gen_a.steps()
    first = await steps.__anext__()  # a's client reads one step, then stops reading
    gen_b = await service.chat(chat(model="b"), catalog.acquire("b"))
    result = await asyncio.wait_for(gen_b.collect(), 5)  # b has its turn while a's client stalls
    assert "".join(result.choices[0].text) == "a" * 5
    rest = [step async for step in steps]  # a's client reads on: what it missed, merged
    assert [first.chunks[0].text, *(s.chunks[0].text for s in rest)] == ["a", "aaaa"]
    assert rest[-1].finished and rest[-1].chunks[0].num_tokens == 4 and gen_a.completion_tokens == 5
    assert engine.aborted == [] and scheduler.snapshot()["active"] == {} and catalog.in_use() == {}


class AbortFailsEngine(FakeEngine):
    """Every abort raises once the engine has it (its client could not say it went through)."""

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        raise EngineUnavailable("the engine has stopped")


async def test_an_abort_that_raises_still_aborts_the_other_engine_requests_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The abort runs in a task of its own that nobody awaits: an exception from the engine's
    abort stopped it before the generation's other engine requests (n=2 greedy: two of them),
    and asyncio logged "Task exception was never retrieved" with its traceback. Each failed
    abort is a warning naming its request, for the operator."""
    engine = AbortFailsEngine(words=["a"] * 100, delay=0.01)
    service, catalog, scheduler = two_adapters_one_slot(engine)
    gen = await service.chat(chat(model="a", n=2, temperature=0), catalog.acquire("a"))
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        steps = gen.steps()
        await steps.__anext__()
        await steps.aclose()  # its client leaves mid-stream
        await asyncio.sleep(0.01)
        gc.collect()  # a task whose exception nobody took says so as it goes
    finally:
        loop.set_exception_handler(handler)
    assert engine.aborted == [f"{gen.id}-0", f"{gen.id}-1"]
    assert unhandled == []
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [m for m in warned if "could not abort" in m] == [
        f"could not abort engine request {gen.id}-{i}: the engine has stopped" for i in range(2)
    ]
    assert scheduler.snapshot()["active"] == {} and catalog.in_use() == {}


class FailsAfterAStep(FakeEngine):
    """Requests on adapter ``a`` fail in the engine after their first step (as vLLM's
    finish_reason "error": done in the engine, the stream raises)."""

    async def generate(self, prompt_ids, sampling, request_id, lora, priority=0):  # type: ignore[no-untyped-def]
        async with contextlib.aclosing(
            super().generate(prompt_ids, sampling, request_id, lora, priority)
        ) as steps:
            async for step in steps:
                yield step
                if lora is not None and lora.name == "a":
                    raise EngineFailed("the engine failed to process the request")


async def test_a_stalled_reader_gives_up_its_adapters_turn_once_the_engine_request_failed() -> None:
    """As once it finished: a request the engine failed is done there. A client that stopped
    reading before the error held its adapter's turn until it read that far: with one slot, b
    waited for max_wait_s, and with a pin (no bounded wait) until a's send timeout cut it."""
    engine = FailsAfterAStep(words=["a"] * 5, delay=0.01)
    service, catalog, scheduler = two_adapters_one_slot(engine)
    gen_a = await service.chat(chat(model="a"), catalog.acquire("a"))
    steps = gen_a.steps()
    await steps.__anext__()  # a's client reads one step, then stops reading
    gen_b = await service.chat(chat(model="b"), catalog.acquire("b"))
    result = await asyncio.wait_for(gen_b.collect(), 5)  # b has its turn while a's client stalls
    assert "".join(result.choices[0].text) == "a" * 5
    with pytest.raises(EngineFailed):  # a's client reads on: the error, after the step before it
        await steps.__anext__()
    await asyncio.sleep(0.01)
    assert scheduler.snapshot()["active"] == {} and catalog.in_use() == {}
