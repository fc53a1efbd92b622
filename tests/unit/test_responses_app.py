"""``/v1/responses`` in-process, through the openai SDK, with a fake engine (no vllm).

The app is built without its lifespan (no engine start): the catalog is set by hand and
the fake engine says it is ready. The SDK talks to it through starlette's TestClient.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from gateway import structured
from gateway.app import create_app
from gateway.catalog import Catalog, Route, RoutingTable
from gateway.errors import InvalidRequest
from gateway.settings import GatewaySettings
from gateway.types import Constraint, LoraSpec, SamplingSpec, StepOutput
from tests.unit.fakes import FakeEngine

ALICE, BOB = "sk-alice-000000001", "sk-bob-0000000001"
ADMIN = {"name": "ops", "key": "sk-ops-0000000001"}


class ReadyEngine(FakeEngine):
    ready = True
    errored = False
    model_path = None
    served_model_name = "base-model"

    def unfinished_requests(self) -> int:
        return 0


class FailingEngine(ReadyEngine):
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        request_id: str,
        lora: LoraSpec | None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        async for step in super().generate(prompt_ids, sampling, request_id, lora, priority):
            yield step
            raise RuntimeError("the engine fell over")


def make_app(engine: ReadyEngine) -> TestClient:
    keys = [{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}, {**ADMIN, "admin": True}]
    settings = GatewaySettings(auth={"keys": keys}, responses={"store_path": ":memory:"})
    app = create_app(settings, engine)  # type: ignore[arg-type]  # generation and readiness only
    routes = {"shout": Route(name="shout", kind="preset", tasks=("yell",))}
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes=routes, errors={})
    app.state.gateway.catalog = Catalog(lambda ids: table)
    return TestClient(app)  # no ``with``: no lifespan, so no engine start


@pytest.fixture
def engine() -> ReadyEngine:
    return ReadyEngine(max_model_len=1000)


@pytest.fixture
def http_nolife(engine: ReadyEngine) -> TestClient:
    return make_app(engine)


def sdk(http: TestClient, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url="http://testserver/v1", http_client=http, max_retries=0)


def message_events(deltas: int) -> list[str]:
    """The event types of a streamed Response whose output is one message."""
    return [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def prompt_of(engine: ReadyEngine, call: int = -1) -> str:
    return "".join(map(chr, engine.calls[call][0]))


def test_string_input_gives_a_completed_response(http_nolife: TestClient, engine: ReadyEngine) -> None:
    r = sdk(http_nolife).responses.create(model="base-model", input="Hi")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.completed_at is not None and r.top_logprobs == 0  # OpenAI's: 0 when not asked, not null
    assert r.output_text == "Hello world!" and r.model == "base-model"
    assert r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.usage is not None and r.usage.input_tokens == len(engine.calls[0][0])
    assert (r.usage.output_tokens, r.usage.total_tokens) == (3, r.usage.input_tokens + 3)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"
    assert prompt_of(engine) == "user:Hi\nmodel:"


def test_instructions_and_message_list(http_nolife: TestClient, engine: ReadyEngine) -> None:
    items: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]},
    ]
    r = sdk(http_nolife).responses.create(
        model="base-model", input=items, instructions="Be terse.", temperature=0.5
    )
    assert prompt_of(engine) == "system:Be terse.\nuser:Hi\nassistant:Yo\nuser:More\nmodel:"
    assert r.instructions == "Be terse." and r.temperature == 0.5
    assert engine.calls[0][1].temperature == 0.5


def test_an_assistant_refusal_part_sent_back_is_its_text(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    # An OpenAI response's output message may hold a refusal part; sent back as input (the
    # history), it was a 400 "content parts of type 'refusal' are not supported"
    items: Any = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Why?"},
    ]
    sdk(http_nolife).responses.create(model="base-model", input=items)
    assert prompt_of(engine) == "user:Hi\nassistant:No.\nuser:Why?\nmodel:"
    r = http_nolife.post(
        "/v1/responses",
        json={
            "model": "base-model",
            "input": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}],
        },
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].type", r.text


def test_system_or_developer_messages_alone_are_answered(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    """OpenAI and vLLM answer a conversation of system (or developer) messages only, as
    LangChain's system-only prompt templates send it; it was a 400 "messages must contain
    at least one user or assistant message". The chat template folds the text into a user
    turn of its own."""
    client = sdk(http_nolife)
    chat = client.chat.completions.create(
        model="base-model", messages=[{"role": "system", "content": "Write one word."}]
    )
    assert chat.choices[0].message.content == "Hello world!"
    assert prompt_of(engine) == "system:Write one word.\nmodel:"
    chunks = client.chat.completions.create(
        model="base-model", messages=[{"role": "developer", "content": "Write one word."}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world!"
    r = client.responses.create(
        model="base-model", input=[{"role": "developer", "content": "Write one word."}]
    )
    assert r.status == "completed" and r.output_text == "Hello world!"
    assert prompt_of(engine) == "developer:Write one word.\nmodel:"


def test_max_output_tokens_makes_it_incomplete(http_nolife: TestClient, engine: ReadyEngine) -> None:
    r = sdk(http_nolife).responses.create(model="base-model", input="Hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.completed_at is None  # set only on a completed response
    assert r.output_text == "Hello world" and r.max_output_tokens == 2
    assert engine.calls[0][1].max_tokens == 2


def test_routing_by_model_and_by_task(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    assert client.responses.create(model="shout", input="Hi").model == "shout"
    assert client.responses.create(input="Hi", extra_body={"task": "yell"}).model == "shout"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="Hi")


def test_previous_response_id_continues_the_conversation(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    client = sdk(http_nolife)
    first = client.responses.create(model="base-model", input="One", instructions="Old rules.")
    second = client.responses.create(model="base-model", input="Two", previous_response_id=first.id)
    # the first turn is in the prompt; its instructions are not carried over (OpenAI's rule)
    assert prompt_of(engine) == "user:One\nassistant:Hello world!\nuser:Two\nmodel:"
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    client.responses.create(model="base-model", input="Three", previous_response_id=second.id)
    assert prompt_of(engine).startswith(
        "user:One\nassistant:Hello world!\nuser:Two\nassistant:Hello world!\nuser:Three"
    )


def test_retrieve_and_delete_are_per_key(http_nolife: TestClient) -> None:
    alice, bob = sdk(http_nolife, ALICE), sdk(http_nolife, BOB)
    made = alice.responses.create(model="base-model", input="secret")
    assert alice.responses.retrieve(made.id).output_text == made.output_text
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as info:  # as for an unknown id (OpenAI's 400)
        bob.responses.create(model="base-model", input="x", previous_response_id=made.id)
    assert info.value.body == {  # type: ignore[comparison-overlap]
        "message": f"Previous response with id '{made.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made.id)
    deleted = http_nolife.delete(f"/v1/responses/{made.id}", headers={"Authorization": f"Bearer {ALICE}"})
    assert deleted.json() == {"id": made.id, "object": "response.deleted", "deleted": True}  # OpenAI's
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(made.id)


def test_cancel_is_openais_400_for_a_synchronous_response(http_nolife: TestClient) -> None:
    made = sdk(http_nolife, ALICE).responses.create(model="base-model", input="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        sdk(http_nolife, ALICE).responses.cancel(made.id)
    assert info.value.body["message"] == "Cannot cancel a synchronous response."  # type: ignore[index]
    assert info.value.body["param"] is None  # type: ignore[index]  # as vLLM's
    with pytest.raises(openai.NotFoundError) as missing:  # another key's is an unknown id
        sdk(http_nolife, BOB).responses.cancel(made.id)
    assert missing.value.body["param"] == "response_id"  # type: ignore[index]
    assert sdk(http_nolife, ALICE).responses.retrieve(made.id).status == "completed"  # untouched


def test_input_items_list_the_conversation_a_response_answered(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    first = client.responses.create(model="base-model", input="One", instructions="Rules.")
    second = client.responses.create(model="base-model", input="Two", previous_response_id=first.id)
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    texts = [i.content[0].text for i in items.data]  # type: ignore[union-attr]
    assert texts == ["One", "Hello world!", "Two"]  # the instructions are not an item (OpenAI's rule)
    assert [i.content[0].type for i in items.data] == ["input_text", "output_text", "input_text"]  # type: ignore[union-attr]
    newest_first = client.responses.input_items.list(second.id)  # OpenAI's default order: desc
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(items.data)]
    assert len({i.id for i in items.data}) == 3
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc").data] == [
        i.id for i in items.data
    ]  # stable across reads


def test_input_items_page_with_after_and_limit(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    made = client.responses.create(
        model="base-model", input=[{"role": "user", "content": f"m{k}"} for k in range(5)]
    )
    page = client.responses.input_items.list(made.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more  # type: ignore[union-attr]
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    every = [i.content[0].text for i in client.responses.input_items.list(made.id, order="asc", limit=2)]  # type: ignore[union-attr]
    assert every == ["m0", "m1", "m2", "m3", "m4"]  # the SDK follows ``after`` page by page
    last = client.responses.input_items.list(made.id, order="asc", after=page.data[1].id, limit=10)
    assert len(last.data) == 3 and not last.has_more


def test_input_items_page_backwards_with_before(http_nolife: TestClient) -> None:
    """``before`` (OpenAI's, sent by its JS, Ruby and older Python SDKs): the ``limit`` items
    just before that item, in the order asked for."""
    client = sdk(http_nolife)
    made = client.responses.create(
        model="base-model", input=[{"role": "user", "content": f"m{k}"} for k in range(5)]
    )
    ids = [i.id for i in client.responses.input_items.list(made.id, order="asc")]

    def page(**query: Any) -> tuple[list[str], bool]:
        got = client.responses.input_items.list(made.id, extra_query=query)
        return [i.content[0].text for i in got.data], got.has_more  # type: ignore[union-attr]

    assert page(order="asc", before=ids[4], limit=2) == (["m2", "m3"], True)
    assert page(order="asc", before=ids[2], limit=5) == (["m0", "m1"], False)
    assert page(order="desc", before=ids[0], limit=2) == (["m2", "m1"], True)
    assert page(order="asc", after=ids[0], before=ids[4], limit=2) == (["m1", "m2"], True)
    assert page(order="asc", before=ids[0]) == ([], False)


@pytest.mark.parametrize("arguments", ["{}", ""])
def test_input_items_of_a_tool_round_trip(http_nolife: TestClient, arguments: str) -> None:
    """Empty ``arguments`` (a call of a function without parameters, as some clients send it
    back) is a call like any other, kept as sent; only its name and call id must not be empty."""
    client = sdk(http_nolife)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    made = client.responses.create(
        model="base-model",
        input=[{"role": "user", "content": "Use f."}, call, output],  # type: ignore[list-item]
    )
    items = client.responses.input_items.list(made.id, order="asc").to_dict()["data"]
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]
    assert {k: items[1][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "c1",
        "name": "f",
        "arguments": arguments,
    }
    assert (items[2]["call_id"], items[2]["output"]) == ("c1", "42")


def test_a_call_left_unanswered_is_openais_400(http_nolife: TestClient) -> None:
    """A response that ended in a function call, continued with text: the 400 spoke of chat's
    'messages[2]' and 'tool messages'; OpenAI says which call has no output."""
    call = {"type": "function_call", "call_id": "call_7", "name": "f", "arguments": "{}"}
    r = http_nolife.post(
        "/v1/responses",
        json={
            "model": "base-model",
            "input": [{"role": "user", "content": "Use f."}, call, {"role": "user", "content": "and?"}],
        },
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "No tool output found for function call call_7."
    assert r.json()["error"]["param"] == "input"


def test_a_parallel_call_left_without_output_is_openais_400(http_nolife: TestClient) -> None:
    """Two calls, an output for the first only, at the end of ``input`` (as a litellm or agents
    turn that answers some of a parallel turn sends it): it was answered as if the second call
    had not been made."""
    calls = [
        {"type": "function_call", "call_id": f"call_{k}", "name": "f", "arguments": "{}"} for k in (1, 2)
    ]
    output = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": [{"role": "user", "content": "Use f twice."}, *calls, output]},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "No tool output found for function call call_2."
    assert r.json()["error"]["param"] == "input"


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=%C2%B2", "limit"),  # '²': a digit to str.isdigit, not to int()
        ("limit=" + "1" * 5000, "limit"),  # over int()'s digit limit
        ("order=up", "order"),
        ("after=x", "after"),
        ("before=x", "before"),
    ],
)
def test_input_items_bad_queries_are_400(http_nolife: TestClient, query: str, param: str) -> None:
    made = sdk(http_nolife).responses.create(model="base-model", input="Hi")
    r = http_nolife.get(
        f"/v1/responses/{made.id}/input_items?{query}", headers={"Authorization": f"Bearer {ALICE}"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_input_items_are_per_key(http_nolife: TestClient) -> None:
    made = sdk(http_nolife, ALICE).responses.create(model="base-model", input="secret")
    with pytest.raises(openai.NotFoundError):
        sdk(http_nolife, BOB).responses.input_items.list(made.id)


def test_store_false_keeps_nothing(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    made = client.responses.create(model="base-model", input="Hi", store=False)
    assert made.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def assert_previous_not_found(http: TestClient, missing: str) -> None:
    """Alice continuing ``missing`` gets OpenAI's 400 for a response it does not have."""
    r = http.post(
        "/v1/responses",
        json={"model": "base-model", "input": "And?", "previous_response_id": missing},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"Previous response with id '{missing}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }


@pytest.mark.parametrize("store", [False, True])
def test_continuing_a_response_that_is_not_stored_is_openais_400(
    http_nolife: TestClient, store: bool
) -> None:
    client = sdk(http_nolife)
    made = client.responses.create(model="base-model", input="Hi", store=store)
    if store:
        client.responses.delete(made.id)
    for missing in (made.id, "resp_nope", "", "not an id"):
        assert_previous_not_found(http_nolife, missing)


def test_an_evicted_response_is_as_unknown_as_one_never_stored(http_nolife: TestClient) -> None:
    """Over ``responses.max_bytes_per_key`` the key's oldest response goes: retrieving or
    continuing it then answers exactly as for an id never stored (404; OpenAI's 400)."""
    store = http_nolife.app.state.gateway.responses  # type: ignore[attr-defined]
    alice, bob = sdk(http_nolife, ALICE), sdk(http_nolife, BOB)
    kept = bob.responses.create(model="base-model", input="Hi")
    bobs = store.usage()[1]
    first = alice.responses.create(model="base-model", input="Hi")
    store.max_bytes_per_key = (store.usage()[1] - bobs) * 3 // 2  # room for one of alice's, not two
    second = alice.responses.create(model="base-model", input="Hi")
    assert alice.responses.retrieve(second.id).id == second.id
    assert bob.responses.retrieve(kept.id).id == kept.id  # another key's bound is its own
    with pytest.raises(openai.NotFoundError) as gone:
        alice.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        alice.responses.retrieve("resp_" + "0" * (len(first.id) - 5))
    assert gone.value.body == {  # type: ignore[comparison-overlap]
        **unknown.value.body,  # type: ignore[dict-item]
        "message": f"Response with id '{first.id}' not found.",
    }
    for missing in (first.id, "resp_nope"):
        assert_previous_not_found(http_nolife, missing)
    status = http_nolife.get("/admin/status", headers={"Authorization": f"Bearer {ADMIN['key']}"})
    assert status.json()["responses_stored"] == {"count": 2, "bytes": store.usage()[1]}
    metrics = http_nolife.get("/metrics", headers={"Authorization": f"Bearer {ADMIN['key']}"}).text
    assert "gateway_responses_stored 2.0" in metrics.splitlines()


def test_a_store_that_cannot_write_is_a_500_saying_so(
    http_nolife: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(http_nolife.app.state.gateway.responses, "put_now", full)  # type: ignore[attr-defined]
    client = sdk(http_nolife)
    with pytest.raises(openai.InternalServerError) as info:
        client.responses.create(model="base-model", input="Hi")
    assert info.value.body == {  # type: ignore[comparison-overlap]
        "message": "the response store failed: database or disk is full",
        "type": "server_error",
        "param": None,
        "code": "store_error",
    }
    last = list(client.responses.create(model="base-model", input="Hi", stream=True))[-1]
    assert last.type == "response.failed" and last.response.error is not None
    assert last.response.error.message == "the response store failed: database or disk is full"
    assert client.responses.create(model="base-model", input="Hi", store=False).status == "completed"


def test_stream_events_in_order(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    with client.responses.stream(model="base-model", input="Hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == message_events(3)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.response.completed_at for e in events[:2]] == [None, None]  # type: ignore[union-attr]
    assert final.completed_at is not None  # set only once completed
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["Hello", " world", "!"]
    assert final.output_text == "Hello world!" and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens == 3
    assert client.responses.retrieve(final.id).output_text == "Hello world!"  # stored before the end


def test_a_streamed_response_is_stored_before_response_completed_goes_out(http_nolife: TestClient) -> None:
    """A client that continues (``previous_response_id``) or retrieves a response as soon as
    it reads ``response.completed`` must find it stored, not a 400 or 404 for a moment."""
    app = http_nolife.app
    store = app.state.gateway.responses  # type: ignore[attr-defined]
    stored_at_completed: list[int] = []

    async def watching(scope: Scope, receive: Receive, send: Send) -> None:
        async def watch(message: Message) -> None:
            if b"response.completed" in message.get("body", b""):
                stored_at_completed.append(store.count_now())
            await send(message)

        await app(scope, receive, watch)

    events = list(sdk(TestClient(watching)).responses.create(model="base-model", input="Hi", stream=True))
    assert events[-1].type == "response.completed" and stored_at_completed == [1]


def test_stream_cut_short_ends_with_response_incomplete(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    events = list(client.responses.create(model="base-model", input="Hi", max_output_tokens=1, stream=True))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.output_text == "Hello"


def test_engine_failure_mid_stream_is_response_failed() -> None:
    http = make_app(FailingEngine(max_model_len=1000, cached_tokens=2))
    events = list(sdk(http).responses.create(model="base-model", input="Hi", stream=True))
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    assert failed.output_text == "Hello"
    assert failed.output[0].status == "incomplete"  # type: ignore[union-attr]  # cut off, not completed
    whole = sdk(make_app(ReadyEngine(max_model_len=1000))).responses.create(model="base-model", input="Hi")
    assert failed.usage is not None and whole.usage is not None  # the usage of what it ran
    assert (failed.usage.input_tokens, failed.usage.output_tokens) == (whole.usage.input_tokens, 1)
    assert failed.usage.input_tokens_details.cached_tokens == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"reasoning": {"effort": "none", "summary": "auto"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"n": 2}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),
        ({"input": "x" * 2000}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": None}, "input"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"moderation": {"policy": {"input": {"mode": "block"}}}}, "moderation"),
        ({"context_management": [{"type": "compaction", "compact_threshold": 10}]}, "context_management"),
        # vLLM's unimplemented fields and its legacy spellings, as on chat
        ({"bad_words": ["Hello"]}, "bad_words"),
        ({"logit_bias": {str(token): 1 for token in range(301)}}, "logit_bias"),  # OpenAI's cap: 300
        # max_tool_calls: an integer from 1, as OpenAI
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"max_tool_calls": 1.5}, "max_tool_calls"),
        ({"max_tool_calls": 2.0}, "max_tool_calls"),
        ({"max_tool_calls": "2"}, "max_tool_calls"),
        ({"max_tool_calls": True}, "max_tool_calls"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        # chat's spellings of Responses fields
        ({"max_tokens": 5}, "max_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"logprobs": True}, "logprobs"),
        (
            {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
        ),
    ],
)
def test_unsupported_fields_are_400(http_nolife: TestClient, extra: dict[str, Any], param: str) -> None:
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": "Hi", **extra},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize(
    "extra",
    [
        # what a model without reasoning or hosted tools has nothing of: was a 400 on 'include'
        {"include": ["reasoning.encrypted_content"], "store": False},
        {"include": ["web_search_call.action.sources", "file_search_call.results"]},
        {"reasoning": {"effort": "none"}},  # as chat's reasoning_effort "none"
        {"reasoning": {"effort": None, "summary": None}},
    ],
)
def test_fields_that_ask_nothing_of_this_model_are_taken(
    http_nolife: TestClient, extra: dict[str, Any]
) -> None:
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": "Hi", **extra},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "reasoning", "summary": []}, "input[0].type"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
            "input[0].content[0].type",
        ),
        ({"role": "tool", "content": "x"}, "input[0].role"),
    ],
)
def test_unsupported_input_items_are_400(http_nolife: TestClient, item: dict[str, Any], param: str) -> None:
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": [item]},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("name", ["a b", "ab\n", "x" * 65, "é"])
def test_a_format_name_outside_openais_pattern_is_400(http_nolife: TestClient, name: str) -> None:
    fmt = {"type": "json_schema", "name": name, "schema": {"type": "object"}}
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": "Hi", "text": {"format": fmt}},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.name", r.text


def test_text_format_json_schema_constrains_decoding(http_nolife: TestClient, engine: ReadyEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt: Any = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    r = sdk(http_nolife).responses.create(model="base-model", input="Hi", text={"format": fmt})
    assert engine.calls[0][1].constraint == Constraint("json", schema)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    sdk(http_nolife).responses.create(
        model="base-model", input="Hi", text={"format": {"type": "json_object"}}
    )
    assert engine.calls[1][1].constraint == Constraint("json_object")


def test_a_text_format_schema_is_checked_off_the_event_loop(
    http_nolife: TestClient, engine: ReadyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As chat's schemas: in the schema-check threads, where the loop goes on meanwhile."""
    threads: list[str] = []
    real = structured._meta_check

    def check(schema: dict[str, Any]) -> tuple[str, str] | None:
        threads.append(threading.current_thread().name)
        return real(schema)

    monkeypatch.setattr(structured, "_meta_check", check)
    schema = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}  # not cached
    fmt: Any = {"type": "json_schema", "name": "thing", "schema": schema}
    sdk(http_nolife).responses.create(model="base-model", input="Hi", text={"format": fmt})
    assert engine.calls[0][1].constraint == Constraint("json", schema)
    assert len(threads) == 1 and threads[0].startswith("schema-check")


@pytest.mark.parametrize("schema", [{"type": "no-such-type"}, {"$ref": "#"}])  # the second: no end
def test_invalid_json_schema_is_400(http_nolife: TestClient, schema: dict[str, Any]) -> None:
    fmt = {"type": "json_schema", "name": "bad", "schema": schema}
    r = http_nolife.post(
        "/v1/responses",
        json={"model": "base-model", "input": "Hi", "text": {"format": fmt}},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text


def test_a_schema_is_checked_against_its_own_draft_as_on_chat(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    """A draft-07 schema (its ``$schema`` says so) with a tuple ``items``: valid there, though
    not under 2020-12; chat takes it, and so does ``text.format`` (it was a 400)."""
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"p": {"type": "array", "items": [{"type": "string"}]}},
    }
    headers = {"Authorization": f"Bearer {ALICE}"}
    chat = {"model": "base-model", "messages": [{"role": "user", "content": "Hi"}]}
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    assert http_nolife.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
    fmt = {"type": "json_schema", "name": "t", "schema": schema}
    r = http_nolife.post(
        "/v1/responses", json={"model": "base-model", "input": "Hi", "text": {"format": fmt}}, headers=headers
    )
    assert r.status_code == 200, r.text
    assert engine.calls[-1][1].constraint == Constraint("json", schema)
    bad = {**schema, "properties": {"p": {"type": "array", "items": 5}}}  # no draft takes it
    fmt = {"type": "json_schema", "name": "t", "schema": bad}
    r = http_nolife.post(
        "/v1/responses", json={"model": "base-model", "input": "Hi", "text": {"format": fmt}}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text


class GrammarEngine(ReadyEngine):
    """The grammar backend refuses a schema with ``not``, as ``engine_checks`` does under
    xgrammar (an InvalidRequest at ``response_format``; the service names the field)."""

    def prepare(self, sampling: SamplingSpec) -> SamplingSpec:
        constraint = sampling.constraint
        if constraint is not None and constraint.kind == "json" and "not" in str(constraint.value):
            raise InvalidRequest("the JSON schema uses 'not' (at not)", param="response_format")
        return sampling


def test_a_schema_the_grammar_backend_refuses_names_text_format_schema() -> None:
    """As the meta-schema check names it (above), not ``text``; chat's is ``response_format``."""
    http = make_app(GrammarEngine(max_model_len=1000))
    schema = {"type": "object", "not": {"required": ["a"]}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema}
    headers = {"Authorization": f"Bearer {ALICE}"}
    r = http.post(
        "/v1/responses", json={"model": "base-model", "input": "Hi", "text": {"format": fmt}}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]  # auto: answer or call
    body = {"model": "base-model", "input": "Hi", "text": {"format": fmt}, "tools": tools}
    r = http.post("/v1/responses", json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    chat = {"model": "base-model", "messages": [{"role": "user", "content": "Hi"}]}
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    r = http.post("/v1/chat/completions", json=chat, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_another_format_on_an_enforcing_route_names_text_format(engine: ReadyEngine) -> None:
    http = make_app(engine)
    enforced = Route(name="json", kind="preset", response_format=Constraint("json_object"), enforce=True)
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes={"json": enforced}, errors={})
    http.app.state.gateway.catalog = Catalog(lambda ids: table)  # type: ignore[attr-defined]
    fmt = {"type": "json_schema", "name": "thing", "schema": {"type": "object"}}
    r = http.post(
        "/v1/responses",
        json={"model": "json", "input": "Hi", "text": {"format": fmt}},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert "leave 'text.format' out" in r.json()["error"]["message"]


def test_needs_a_key(http_nolife: TestClient) -> None:
    assert http_nolife.post("/v1/responses", json={"input": "Hi"}).status_code == 401
    assert http_nolife.get("/v1/responses/resp_x").status_code == 401


def test_max_tool_calls_is_taken_echoed_and_changes_nothing(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    """OpenAI's cap on built-in tool calls: with function tools only, nothing to cap."""
    client = sdk(http_nolife)
    tools: Any = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    plain = client.responses.create(model="base-model", input="Hi", tools=tools)
    capped = client.responses.create(model="base-model", input="Hi", tools=tools, max_tool_calls=1)
    assert plain.max_tool_calls is None and capped.max_tool_calls == 1
    assert capped.output_text == plain.output_text
    assert engine.calls[1][:2] == engine.calls[0][:2]  # the same prompt and sampling
    assert client.responses.retrieve(capped.id).max_tool_calls == 1
    events = list(client.responses.create(model="base-model", input="Hi", max_tool_calls=3, stream=True))
    assert [e.response.max_tool_calls for e in (events[0], events[-1])] == [3, 3]  # type: ignore[union-attr]
    null = client.responses.create(model="base-model", input="Hi", max_tool_calls=None)
    assert null.max_tool_calls is None


def test_chat_sampling_extensions_pass_through(http_nolife: TestClient, engine: ReadyEngine) -> None:
    extra = {"seed": 7, "stop": ["x"], "top_k": 5, "repetition_penalty": 1.2}
    sdk(http_nolife).responses.create(model="base-model", input="Hi", extra_body=extra)
    sampling = engine.calls[0][1]
    assert (sampling.seed, sampling.stop, sampling.top_k, sampling.repetition_penalty) == (7, ("x",), 5, 1.2)
    extra = {"min_p": 0.5, "stop_token_ids": [5], "include_stop_str_in_output": True, "logit_bias": {"7": 3}}
    sdk(http_nolife).responses.create(model="base-model", input="Hi", extra_body=extra)
    sampling = engine.calls[1][1]
    assert (sampling.min_p, sampling.stop_token_ids, sampling.include_stop_str_in_output) == (0.5, (5,), True)
    assert sampling.logit_bias == ((7, 3.0),)


def test_structured_outputs_constrain_decoding_as_on_chat(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    sdk(http_nolife).responses.create(
        model="base-model", input="Hi", extra_body={"structured_outputs": {"regex": "a+"}}
    )
    assert engine.calls[0][1].constraint == Constraint("regex", "a+")


def test_null_stream_and_store_are_their_defaults(http_nolife: TestClient) -> None:
    client = sdk(http_nolife)
    made = client.responses.create(model="base-model", input="Hi", store=None, stream=None)  # type: ignore[call-overload]
    assert client.responses.retrieve(made.id).id == made.id  # stored: store defaults to true


@pytest.mark.parametrize(
    "query", ["stream=true", "starting_after=3", "include[]=message.output_text.logprobs"]
)
def test_retrieve_refuses_what_it_does_not_do(http_nolife: TestClient, query: str) -> None:
    made = sdk(http_nolife).responses.create(model="base-model", input="Hi")
    r = http_nolife.get(f"/v1/responses/{made.id}?{query}", headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == query.split("=")[0].removesuffix("[]")
    with pytest.raises(openai.BadRequestError):
        list(sdk(http_nolife).responses.retrieve(made.id, stream=True))
    ok = http_nolife.get(
        f"/v1/responses/{made.id}?stream=false", headers={"Authorization": f"Bearer {ALICE}"}
    )
    assert ok.status_code == 200


def test_output_items_of_a_response_can_be_sent_back_as_input(
    http_nolife: TestClient, engine: ReadyEngine
) -> None:
    """The stateless way to continue: the caller resends the earlier output items."""
    client = sdk(http_nolife)
    first = client.responses.create(model="base-model", input="One", store=False)
    items: Any = [
        {"role": "user", "content": "One"},
        *[o.model_dump() for o in first.output],
        {"role": "user", "content": "Two"},
    ]
    client.responses.create(model="base-model", input=items)
    assert prompt_of(engine) == "user:One\nassistant:Hello world!\nuser:Two\nmodel:"


def test_admission_applies(http_nolife: TestClient) -> None:
    gw = http_nolife.app.state.gateway  # type: ignore[attr-defined]
    gw.admission.max_inflight = 0
    r = http_nolife.post("/v1/responses", json={"input": "Hi"}, headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert (
        http_nolife.get("/v1/responses/resp_x", headers={"Authorization": f"Bearer {ALICE}"}).status_code
        == 404
    )


@pytest.mark.parametrize(
    "tools",
    [
        '[{"type":"function","name":"f","parameters":{"type":"object","properties":{"a":{"maximum":1e400}}}}]',
        '[{"type":"function","name":"f","x":NaN}]',
    ],
)
def test_a_non_finite_number_in_an_echoed_field_is_a_400_before_anything_runs(
    http_nolife: TestClient, engine: ReadyEngine, tools: str
) -> None:
    """Tools and schemas are echoed in the Response as sent: a number no float holds came
    back as ``Infinity`` (not JSON), a 500 after the answer was generated and stored."""
    body = f'{{"model":"base-model","input":"hi","tools":{tools}}}'
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    r = http_nolife.post("/v1/responses", content=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert engine.calls == []


def test_null_text_and_format_are_the_default(http_nolife: TestClient, engine: ReadyEngine) -> None:
    """The SDKs' ``text=None`` (and generic wrappers' ``format: null``) leave the format out."""
    headers = {"Authorization": f"Bearer {ALICE}"}
    for text in (None, {"format": None}):
        r = http_nolife.post(
            "/v1/responses", json={"model": "base-model", "input": "hi", "text": text}, headers=headers
        )
        assert r.status_code == 200, r.text
        assert r.json()["text"]["format"] == {"type": "text"}
    assert [call[1].constraint for call in engine.calls] == [None, None]


@pytest.mark.parametrize("value", ["message.output_text.logprob", "reasoning", ""])
def test_an_include_value_openai_does_not_know_is_a_400(http_nolife: TestClient, value: str) -> None:
    headers = {"Authorization": f"Bearer {ALICE}"}
    body = {"model": "base-model", "input": "hi", "include": [value]}
    r = http_nolife.post("/v1/responses", json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text
    assert "unknown value" in r.json()["error"]["message"]
    body["include"] = ["reasoning.encrypted_content", "web_search_call.action.sources"]  # known, no effect
    assert http_nolife.post("/v1/responses", json=body, headers=headers).status_code == 200


def test_plain_text_asked_for_wins_over_a_default_the_route_does_not_enforce(engine: ReadyEngine) -> None:
    http = make_app(engine)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    soft = Route(name="soft", kind="preset", response_format=Constraint("json", schema))
    hard = Route(name="hard", kind="preset", response_format=Constraint("json", schema), enforce=True)
    table = RoutingTable(
        base=Route(name="base-model", kind="base"), routes={"soft": soft, "hard": hard}, errors={}
    )
    http.app.state.gateway.catalog = Catalog(lambda ids: table)  # type: ignore[attr-defined]
    client = sdk(http)
    client.responses.create(model="soft", input="hi")
    client.responses.create(model="soft", input="hi", text={"format": {"type": "text"}})
    client.responses.create(model="hard", input="hi", text={"format": {"type": "text"}})
    assert [call[1].constraint for call in engine.calls] == [
        Constraint("json", schema),  # left out: the route's default
        None,  # asked for by name: plain text
        Constraint("json", schema),  # the route enforces its format
    ]
