"""PromptTokenizer: prompts queued while the thread works are encoded in one batch call,
each caller gets its own ids or its own error."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from gateway.tokenizing import PromptTokenizer
from tests.helpers import eventually_async
from tests.unit.conftest import BASE, Serve
from tests.unit.fakes import FakeEngine, FakeTokenizer


class CountingTokenizer(FakeTokenizer):
    """Records batch sizes; a text containing "BAD" fails to encode."""

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BAD" in text:
            raise ValueError("cannot encode")
        return super().encode(text, add_special_tokens)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        self.batch_sizes.append(len(texts))
        return super().__call__(texts, add_special_tokens)


async def hold_the_thread(tok: PromptTokenizer) -> tuple[asyncio.Future[list[int]], threading.Event]:
    """A first job ("first") that keeps the thread busy until the returned gate is set."""
    gate, entered = threading.Event(), threading.Event()

    def first() -> str:
        entered.set()
        gate.wait(5)
        return "first"

    head = asyncio.ensure_future(tok.encode(first, False))
    # Until the thread has taken the first job and waits in it (a fixed sleep was not always
    # long enough on a busy machine: the others then joined the first job's batch).
    await eventually_async(entered.is_set, 5, "the tokenizing thread taking the first job", interval=0.005)
    return head, gate


async def queued_behind_a_gate(tok: PromptTokenizer, texts: list[tuple[str, bool]]) -> list[Any]:
    """The others queue while the first job holds the thread, so they form one batch."""
    head, gate = await hold_the_thread(tok)

    def render(text: str) -> Any:
        def r() -> str:
            if text == "RAISE":
                raise LookupError("template failed")
            return text

        return r

    rest = [asyncio.ensure_future(tok.encode(render(t), special)) for t, special in texts]
    await asyncio.sleep(0.05)
    gate.set()
    return await asyncio.gather(head, *rest, return_exceptions=True)


@pytest.mark.asyncio
async def test_prompts_queued_together_are_encoded_in_one_batch_in_order() -> None:
    fake = CountingTokenizer()
    tok = PromptTokenizer(lambda: fake)
    texts = [f"prompt {i}" for i in range(20)]
    results = await queued_behind_a_gate(tok, [(t, False) for t in texts])
    assert results[0] == fake.encode("first", False)
    assert results[1:] == [fake.encode(t, False) for t in texts]
    assert fake.batch_sizes == [20] and tok.batches == 1


@pytest.mark.asyncio
async def test_each_caller_gets_its_own_error_and_the_others_their_ids() -> None:
    fake = CountingTokenizer()
    tok = PromptTokenizer(lambda: fake)
    results = await queued_behind_a_gate(
        tok, [("a", False), ("RAISE", False), ("b BAD", True), ("c", True), ("d", False)]
    )
    assert results[1] == fake.encode("a", False)
    assert isinstance(results[2], LookupError)  # its template failed
    assert isinstance(results[3], ValueError)  # its text failed to encode; the batch fell back to one by one
    assert results[4] == fake.encode("c", True)  # with <bos>: flags are kept per prompt
    assert results[5] == fake.encode("d", False)


@pytest.mark.asyncio
async def test_a_request_cancelled_while_queued_is_skipped() -> None:
    fake = CountingTokenizer()
    tok = PromptTokenizer(lambda: fake)
    head, gate = await hold_the_thread(tok)
    rendered: list[str] = []
    gone = asyncio.ensure_future(tok.encode(lambda: rendered.append("gone") or "gone", False))
    kept = asyncio.ensure_future(tok.encode(lambda: "kept", False))
    await asyncio.sleep(0.05)
    gone.cancel()
    await asyncio.sleep(0.05)
    gate.set()
    assert await kept == fake.encode("kept", False)
    assert await head == fake.encode("first", False)
    assert rendered == [] and gone.cancelled()


@pytest.mark.asyncio
async def test_the_thread_survives_a_missing_tokenizer() -> None:
    fake = CountingTokenizer()
    ready = False

    def tokenizer() -> CountingTokenizer:
        if not ready:
            raise RuntimeError("the engine is not ready")
        return fake

    tok = PromptTokenizer(tokenizer)
    with pytest.raises(RuntimeError, match="not ready"):
        await asyncio.wait_for(tok.encode(lambda: "early", False), 5)
    ready = True
    assert await asyncio.wait_for(tok.encode(lambda: "later", False), 5) == fake.encode("later", False)


# -- long decodes and token strings run in the tokenizing thread, not on the event loop ----------
class ThreadRecordingTokenizer(FakeTokenizer):
    """Records the thread of every decode and token-strings call with many ids."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.decoded: list[int] = []  # ids per decode

    def decode(self, token_ids: list[int]) -> str:
        self.decoded.append(len(token_ids))
        if len(token_ids) > 1000:
            self.threads.append(threading.current_thread().name)
        return super().decode(token_ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        self.threads.append(threading.current_thread().name)
        return super().convert_ids_to_tokens(ids)


def _recording_engine(max_model_len: int = 100) -> tuple[FakeEngine, ThreadRecordingTokenizer]:
    engine = FakeEngine(max_model_len=max_model_len)
    tokenizer = ThreadRecordingTokenizer()
    engine._tokenizer = tokenizer
    return engine, tokenizer


async def test_detokenize_and_token_strs_of_many_ids_leave_the_event_loop(serve: Serve) -> None:
    # A million ids (a 2 MB body) took 0.33 s to decode with Gemma's tokenizer: on the event
    # loop, every stream stalled that long, per request.
    engine, tokenizer = _recording_engine()
    served = await serve(engine)
    ids = [ord("a")] * 5000
    r = await served.http.post("/detokenize", json={"model": BASE, "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == "a" * 5000
    r = await served.http.post(
        "/tokenize", json={"model": BASE, "prompt": "b" * 5000, "return_token_strs": True}
    )
    assert r.status_code == 200 and r.json()["token_strs"][1:3] == ["b", "b"]
    assert tokenizer.threads == ["tokenize", "tokenize"]


async def test_completion_echo_of_many_ids_leaves_the_event_loop(serve: Serve) -> None:
    engine, tokenizer = _recording_engine(max_model_len=10_000)
    served = await serve(engine)
    body = {"model": BASE, "prompt": [ord("a")] * 5000, "echo": True, "max_tokens": 1}
    r = await served.http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("a" * 5000)
    assert tokenizer.threads == ["tokenize"]
    # A prompt longer than the context is refused before its echo is decoded.
    tokenizer.decoded.clear()
    r = await served.http.post("/v1/completions", json={**body, "prompt": [ord("a")] * 20_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert tokenizer.decoded == []


async def test_run_returns_the_result_or_raises_to_its_caller_alone() -> None:
    prompts = PromptTokenizer(lambda: FakeTokenizer())

    def fails() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await prompts.run(fails)
    assert await prompts.run(lambda: threading.current_thread().name) == "tokenize"
    assert await prompts.encode(lambda: "ab", False) == [97, 98]
