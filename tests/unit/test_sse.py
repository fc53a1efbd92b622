"""Wire formats: exact house bytes, OpenAI chunks that parse, error events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.catalog import Catalog, LoraIds, Route, RoutingTable
from gateway.errors import EngineUnavailable
from gateway.service import Generation
from gateway.sse import (
    HouseEncoder,
    OpenAIChatEncoder,
    OpenAICompletionEncoder,
    chat_logprobs,
    encode_stream,
)
from gateway.types import Chunk, SamplingSpec, StepOutput, TokenLogprob
from tests.unit.fakes import FakeEngine


def make_gen(engine: FakeEngine | None = None, n: int = 1, route: str = "shout") -> Generation:
    base = Route(name="base-model", kind="base")
    table = RoutingTable(base=base, routes={route: Route(name=route, kind="preset")}, errors={})
    catalog = Catalog(lambda ids: table)
    spec = SamplingSpec(max_tokens=10, n=n)
    return Generation(engine or FakeEngine(), catalog.acquire(route), [1, 2, 3], spec, spec, "chatcmpl")


def events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


async def collect(gen: Generation, encoder: object) -> bytes:
    return b"".join([part async for part in encode_stream(gen, encoder)])  # type: ignore[arg-type]


class Scripted(FakeEngine):
    """Yields the given steps, whatever the request."""

    def __init__(self, *steps: StepOutput) -> None:
        super().__init__()
        self.steps = steps

    async def generate(self, *args: object, **kwargs: object) -> AsyncIterator[StepOutput]:
        for step in self.steps:
            yield step


async def test_house_format_is_byte_exact_and_utf8() -> None:
    """The last step often brings only the finish reason (no text): it sends no empty message."""
    gen = make_gen(FakeEngine(words=["Où", " est", " 東京?", ""]))
    raw = await collect(gen, HouseEncoder(gen))
    assert (
        raw
        == (
            'event: message\ndata: {"text": "Où"}\n\n'
            'event: message\ndata: {"text": " est"}\n\n'
            'event: message\ndata: {"text": " 東京?"}\n\n'
            "event: done\ndata: [DONE]\n\n"
        ).encode()
    )


async def test_house_text_with_unicode_line_breaks_reads_line_by_line() -> None:
    """U+2028, U+2029 and U+0085 end a line for ``str.splitlines`` (httpx's and requests'
    ``iter_lines``), not for SSE: raw, they cut an event's data line in two for those clients."""
    words = ["a\u2028b", "c\u2029d", "e\x85f", " 東京"]
    gen = make_gen(FakeEngine(words=words))
    raw = await collect(gen, HouseEncoder(gen))
    lines = raw.decode().splitlines()
    texts = [json.loads(line[6:])["text"] for line in lines if line.startswith("data: {")]
    assert texts == words
    assert "東京" in raw.decode()  # the rest stays UTF-8 as it is


def test_house_error_event() -> None:
    gen = make_gen()
    assert (
        HouseEncoder(gen).error(EngineUnavailable("engine stopped"))
        == b'event: error\ndata: {"error": "engine stopped"}\n\n'
    )


async def test_openai_chat_chunks_parse_and_end_with_done() -> None:
    gen = make_gen(route="json")
    raw = await collect(gen, OpenAIChatEncoder(gen, include_usage=True))
    parts = events(raw)
    assert parts[-1] == "data: [DONE]"
    chunks = [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]
    assert all(
        c["id"] == gen.id and c["object"] == "chat.completion.chunk" and c["model"] == "json" for c in chunks
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_openai_chat_without_usage_has_no_usage_key() -> None:
    gen = make_gen()
    chunks = [
        json.loads(p[6:])
        for p in events(await collect(gen, OpenAIChatEncoder(gen, include_usage=False)))[:-1]
    ]
    assert all("usage" not in c for c in chunks)


async def test_openai_chat_n_greater_than_one_indexes_choices() -> None:
    """Each choice is a message of its own: each opens with its own role chunk, as OpenAI's
    (clients that assemble choices by index take the role from there)."""
    gen = make_gen(n=2)
    chunks = [json.loads(p[6:]) for p in events(await collect(gen, OpenAIChatEncoder(gen, False)))[:-1]]
    by_index: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks:
        for choice in c["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content", "")
            roles[choice["index"]] += [choice["delta"]["role"]] if "role" in choice["delta"] else []
    assert by_index == {0: "Hello world!", 1: "Hello world!"}
    assert roles == {0: ["assistant"], 1: ["assistant"]}


async def test_openai_chat_streams_the_logprobs_of_text_held_back() -> None:
    """A token whose text the detokenizer holds back (it may start a stop string) comes in a
    step with no text but with its logprobs: they are sent at once, or the stream's logprobs
    lose that token and no longer add up to its text."""
    x = [TokenLogprob("x", -0.5, [("x", -0.5)])]
    y = [TokenLogprob("y", -0.25, [("y", -0.25)])]
    gen = make_gen(
        Scripted(
            StepOutput([Chunk(0, "", 1, logprobs=x)], 3, False),
            StepOutput([Chunk(0, "xy", 1, finish_reason="stop", logprobs=y)], 3, True),
        )
    )
    chunks = [json.loads(p[6:]) for p in events(await collect(gen, OpenAIChatEncoder(gen, False)))[:-1]]
    choices = [c["choices"][0] for c in chunks]
    text = "".join(c["delta"].get("content", "") for c in choices)
    tokens = [t["token"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert text == "xy" and tokens == ["x", "y"]


async def test_completion_chunks() -> None:
    gen = make_gen()
    chunks = [json.loads(p[6:]) for p in events(await collect(gen, OpenAICompletionEncoder(gen, False)))[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " world", "!"]
    assert chunks[0]["object"] == "text_completion"


async def test_engine_failure_mid_stream_becomes_an_error_event() -> None:
    class Dying(FakeEngine):
        async def generate(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
            yield StepOutput([Chunk(0, "partial", 1)], 3, False)
            raise EngineUnavailable("the engine has stopped")

    gen = make_gen(Dying())
    parts = events(await collect(gen, OpenAIChatEncoder(gen, False)))
    assert parts[-1] == "data: [DONE]"  # after the error, as vLLM's server ends a failed stream
    error = json.loads(parts[-2][6:])
    assert error["error"]["type"] == "service_unavailable"
    assert error["error"]["message"] == "the engine has stopped"
    gen2 = make_gen(Dying())
    assert (
        events(await collect(gen2, HouseEncoder(gen2)))[-1]
        == 'event: error\ndata: {"error": "the engine has stopped"}'
    )


def test_chat_logprobs_shape() -> None:
    shaped = chat_logprobs([TokenLogprob("Hi", -0.5, [("Hi", -0.5), ("Yo", -1.0)])])
    assert shaped == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                    {"token": "Yo", "logprob": -1.0, "bytes": [89, 111]},
                ],
            }
        ]
    }


def test_unused_ids_helper_is_stable() -> None:
    ids = LoraIds()
    assert ids.id_for("a", False) == ids.id_for("a", False) != ids.id_for("b", False)
    assert ids.id_for("a", True) not in (ids.id_for("a", False), ids.id_for("b", False))
