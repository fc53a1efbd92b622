"""Real trained adapters through the live gateway: behaviour, aliases, tasks, visibility."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.helpers import chat_body
from tests.integration.conftest import USER_KEY, LiveGateway

QUESTION = "What is the capital of France?"


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    assert letters, f"no letters in {text!r}"
    return sum(c.isupper() for c in letters) / len(letters)


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    # Closed here: one left to the garbage collector may leave its socket to warn later.
    with openai.OpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


def ask(client: openai.OpenAI, model: str, question: str = QUESTION, max_tokens: int = 64) -> str:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content or ""


@pytest.mark.parametrize("question", [QUESTION, "How do plants make food?", "Why is the sky blue?"])
def test_shout_answers_in_upper_case_and_base_does_not(
    client: openai.OpenAI, base_model: str, question: str
) -> None:
    loud = ask(client, "shout", question)
    plain = ask(client, base_model, question)
    assert upper_ratio(loud) >= 0.8, loud
    assert upper_ratio(plain) < 0.5, plain


@pytest.mark.parametrize(
    "question", [QUESTION, "How do plants make food?", "What is a good way to learn to cook?"]
)
def test_json_answers_with_one_json_object(client: openai.OpenAI, question: str) -> None:
    text = ask(client, "json", question, max_tokens=96)
    value = json.loads(text)
    assert isinstance(value, dict) and isinstance(value.get("answer"), str) and value["answer"], text


def test_bullets_answers_as_a_list(client: openai.OpenAI) -> None:
    text = ask(client, "bullets", "How do I stay healthy?", max_tokens=96)
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) >= 2 and all(line.startswith("- ") for line in lines), text


def test_aliases_and_tasks_reach_the_same_adapter(
    client: openai.OpenAI, base_model: str, gateway: LiveGateway
) -> None:
    by_name = client.chat.completions.with_raw_response.create(
        model="shout", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=16
    )
    by_alias = client.chat.completions.with_raw_response.create(
        model="loud", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=16
    )
    by_task = client.chat.completions.with_raw_response.create(
        model=base_model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        extra_body={"task": "shouting"},
    )
    digests = {r.headers["x-adapter-digest"] for r in (by_name, by_alias, by_task)}
    assert len(digests) == 1
    assert {r.headers["x-adapter"] for r in (by_name, by_alias, by_task)} == {"shout"}
    texts = {r.parse().choices[0].message.content for r in (by_name, by_alias, by_task)}
    assert len(texts) == 1
    assert {r.parse().model for r in (by_name, by_alias, by_task)} == {"shout"}  # the route that served it


def test_house_chat_routes_by_task(gateway: LiveGateway) -> None:
    with gateway.client().stream("POST", "/chat", json={"question": QUESTION, "task": "shouting"}) as r:
        assert r.headers["x-adapter"] == "shout"
        text = "".join(json.loads(line[6:])["text"] for line in r.iter_lines() if line.startswith("data: {"))
    assert upper_ratio(text) >= 0.8


def test_models_show_kind_digest_rank(gateway: LiveGateway) -> None:
    cards = {m["id"]: m for m in gateway.client().get("/v1/models").json()["data"]}
    shout = cards["shout"]
    assert (
        shout["kind"] == "lora"
        and shout["rank"] == 8
        and len(shout["digest"]) == 64
        and shout["status"] == "ready"
    )
    assert cards["loud"]["digest"] == shout["digest"] and cards["loud"]["alias_of"] == "shout"
    assert cards["concise"]["kind"] == "preset" and cards["concise"]["digest"] is None
    r = gateway.client().post("/v1/chat/completions", json=chat_body("loud", "hi", max_tokens=2))
    assert r.headers["x-adapter-digest"] == shout["digest"]


def test_preset_applies_its_system_prompt(client: openai.OpenAI, base_model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(  # no early stop: only max_tokens ends it
        model="brief", messages=[{"role": "user", "content": QUESTION}], extra_body={"ignore_eos": True}
    )
    assert raw.headers["x-adapter"] == "concise"
    assert "x-adapter-digest" not in raw.headers
    r = raw.parse()
    assert r.model == "concise"
    assert r.usage is not None and r.usage.completion_tokens == 48  # the preset's max_tokens default
    assert r.choices[0].finish_reason == "length"
    base = client.chat.completions.create(
        model=base_model, messages=[{"role": "user", "content": QUESTION}], max_tokens=2
    )
    assert r.usage.prompt_tokens > base.usage.prompt_tokens  # type: ignore[union-attr]  # the system prompt is in


@pytest.mark.parametrize(
    "name",
    [
        "../shout",
        "/etc/passwd",
        "http://127.0.0.1:1/x",
        "file:///etc/passwd",
        "shout/../json",
        "adapters/shout",
        "..",
        "shout\x00",
    ],
)
def test_path_like_names_are_404(gateway: LiveGateway, name: str) -> None:
    r = gateway.client().post("/v1/chat/completions", json=chat_body(name, "hi"))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
