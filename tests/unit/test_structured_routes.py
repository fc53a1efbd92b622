"""Structured outputs through the catalog and the service (fake engine)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway import structured
from gateway.catalog import Catalog, LoraIds, Route, RoutingTable, load_table
from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest
from gateway.routes import model_cards
from gateway.service import ChatService
from gateway.settings import LimitSettings
from gateway.types import Constraint, SamplingSpec
from tests.unit.fakes import FakeEngine

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}
ENFORCED = Route(name="json", kind="preset", response_format=Constraint("json", ANSWER), enforce=True)
DEFAULTED = Route(name="soft", kind="preset", response_format=Constraint("json_object"))


def setup() -> tuple[ChatService, Catalog, FakeEngine]:
    engine = FakeEngine()
    routes = {"json": ENFORCED, "soft": DEFAULTED}
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes=routes, errors={})
    return ChatService(engine, LimitSettings()), Catalog(lambda ids: table), engine


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **kw})


async def test_the_request_constraint_reaches_the_engine() -> None:
    service, catalog, engine = setup()
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": ANSWER}}
    await (await service.chat(chat(response_format=fmt), catalog.acquire(None))).collect()
    body = {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    await (await service.complete(CompletionRequest.model_validate(body), catalog.acquire(None))).collect()
    house = HouseChatRequest.model_validate(
        {"question": "q", "response_format": {"type": "json_object"}}
    ).chat_request()
    await (await service.house(house, catalog.acquire(None))).collect()
    assert [c[1].constraint for c in engine.calls] == [
        Constraint("json", ANSWER),
        Constraint("choice", ("a", "b")),
        Constraint("json_object"),
    ]


async def test_route_defaults_and_enforcement() -> None:
    service, catalog, engine = setup()
    await (await service.chat(chat(model="json"), catalog.acquire("json"))).collect()
    await (await service.chat(chat(model="soft"), catalog.acquire("soft"))).collect()
    regex = {"regex": "[0-9]+"}
    gen = await service.chat(chat(model="soft", structured_outputs=regex), catalog.acquire("soft"))
    await gen.collect()
    text = {"type": "text"}
    await (await service.chat(chat(model="soft", response_format=text), catalog.acquire("soft"))).collect()
    await (await service.chat(chat(model="json", response_format=text), catalog.acquire("json"))).collect()
    assert [c[1].constraint for c in engine.calls] == [
        Constraint("json", ANSWER),
        Constraint("json_object"),
        Constraint("regex", "[0-9]+"),
        None,  # plain text asked for wins over the default the route does not enforce
        Constraint("json", ANSWER),  # an enforcing route reads it as left out
    ]
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(model="json", structured_outputs=regex), catalog.acquire("json"))
    assert info.value.param == "structured_outputs"


def test_catalog_entries_with_bad_formats_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "answer.json").write_text('{"type": "object", "properties": {"a": {"type": "string"}}}')
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(
        """
routes:
  - {name: good, system_prompt: x, response_format: "file:answer.json", enforce: true}
  - {name: inline, system_prompt: x, response_format: {type: object}}
  - {name: bad, system_prompt: x, response_format: {type: objekt}}
  - {name: lonely, system_prompt: x, enforce: true}
  - {name: missing, system_prompt: x, response_format: "file:nope.json"}
"""
    )
    table = load_table(
        catalog,
        base_name="base",
        adapters_root=tmp_path,
        max_lora_rank=16,
        model_modules=None,
        lora_ids=LoraIds(),
    )
    assert sorted(table.routes) == ["good", "inline"]
    assert sorted(table.errors) == ["bad", "lonely", "missing"]
    assert table.routes["good"].enforce and table.routes["good"].response_format is not None
    cards = {c["id"]: c for c in model_cards(Catalog(lambda ids: table), 0)}
    schema = cards["good"]["response_format"]["json_schema"]["schema"]
    assert schema["properties"] == {"a": {"type": "string"}}
    assert cards["good"]["response_format_enforced"] is True
    assert cards["inline"]["response_format_enforced"] is False
    assert cards["base"]["response_format"] is None


class SlowChecks(FakeEngine):
    """The grammar backend's check of a constraint takes a while (a 2 MB ``choice`` list:
    0.25 s; vLLM's regex check waits up to its 5 s timeout), on the calling thread: here it
    waits (up to 5 s) for a task on the event loop to run meanwhile, which it never can if
    the check runs on the loop's own thread."""

    def __init__(self) -> None:
        super().__init__()
        self.checking, self.loop_ran = threading.Event(), threading.Event()
        self.waited: list[bool] = []

    def prepare(self, sampling: SamplingSpec) -> SamplingSpec:
        if sampling.constraint is not None:
            self.checking.set()
            self.waited.append(self.loop_ran.wait(5))
        return sampling

    async def another_stream(self) -> None:
        while not self.checking.is_set():
            await asyncio.sleep(0.001)
        self.loop_ran.set()


async def test_a_constraint_is_checked_off_the_event_loop() -> None:
    engine = SlowChecks()
    service, catalog = ChatService(engine, LimitSettings()), setup()[1]
    other = asyncio.ensure_future(engine.another_stream())
    gen = await service.chat(chat(structured_outputs={"choice": ["a", "b"]}), catalog.acquire(None))
    await other
    await gen.collect()
    assert engine.calls[0][1].constraint == Constraint("choice", ("a", "b"))
    assert engine.waited == [True]  # the loop ran while the constraint was checked
    # Without a constraint, nothing to convert: prepared on the loop, no thread hop.
    await (await service.chat(chat(), catalog.acquire(None))).collect()
    assert engine.waited == [True]


class LoopWatch:
    """Stands in for the meta-schema check: it waits (up to 5 s) for a task on the event loop
    to run meanwhile, which it never can if the check runs on the loop's own thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checking, self.loop_ran = threading.Event(), threading.Event()
        self.waited: list[bool] = []
        self._real = structured._meta_check
        monkeypatch.setattr(structured, "_meta_check", self._check)

    def _check(self, schema: dict[str, Any]) -> tuple[str, str] | None:
        self.checking.set()
        self.waited.append(self.loop_ran.wait(5))
        return self._real(schema)

    async def another_stream(self) -> None:
        while not self.checking.is_set():
            await asyncio.sleep(0.001)
        self.loop_ran.set()


def unseen_schema() -> dict[str, Any]:
    """A schema no earlier check cached (the check runs again for it)."""
    return {"type": "object", "properties": {uuid.uuid4().hex: {"type": "string"}}}


@pytest.mark.parametrize(
    "fields",
    [
        lambda: {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": unseen_schema()},
            }
        },
        lambda: {"structured_outputs": {"json": unseen_schema()}},
        lambda: {"tools": [{"type": "function", "function": {"name": "f", "parameters": unseen_schema()}}]},
        lambda: {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": unseen_schema()}}],
            "tool_choice": "required",
        },
    ],
)
async def test_a_chats_schemas_are_checked_while_the_event_loop_runs(
    monkeypatch: pytest.MonkeyPatch, fields: Callable[[], dict[str, Any]]
) -> None:
    """A schema seen for the first time costs its meta-schema check (1 s for 5,000 nodes):
    other requests' streams go on meanwhile."""
    service, catalog, engine = setup()
    watch = LoopWatch(monkeypatch)
    other = asyncio.ensure_future(watch.another_stream())
    gen = await service.chat(chat(**fields()), catalog.acquire(None))
    await other
    await gen.collect()
    assert watch.waited == [True] and len(engine.calls) == 1


async def test_a_completions_schema_is_checked_while_the_event_loop_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, catalog, engine = setup()
    watch = LoopWatch(monkeypatch)
    other = asyncio.ensure_future(watch.another_stream())
    request = CompletionRequest.model_validate(
        {
            "prompt": "Hi",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": unseen_schema()},
            },
        }
    )
    gen = await service.complete(request, catalog.acquire(None))
    await other
    await gen.collect()
    assert watch.waited == [True] and len(engine.calls) == 1


async def test_a_bad_schema_is_still_a_400_naming_its_field() -> None:
    service, catalog, _ = setup()
    bad = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "strin"}}}
    with pytest.raises(InvalidRequest) as info:
        await service.chat(chat(structured_outputs={"json": bad}), catalog.acquire(None))
    assert info.value.param == "structured_outputs" and "invalid JSON schema" in info.value.message
