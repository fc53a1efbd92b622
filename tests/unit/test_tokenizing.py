"""PromptTokenizer: prompts queued while the thread works are encoded in one batch call,
each caller gets its own ids or its own error."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.embedded import embedded_model_dir, is_prepared
from gateway.tokenizing import PromptTokenizer, TokenBound, token_bound
from tests.helpers import assert_openai_error, eventually_async
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
async def test_background_work_waits_for_every_prompt_and_runs_alone() -> None:
    # /tokenize's texts to count (2 MiB: 2 s each on 2 cores) must not hold up a generation
    # request's prompt queued after them, nor join its batch.
    fake = CountingTokenizer()
    tok = PromptTokenizer(lambda: fake)
    head, gate = await hold_the_thread(tok)
    order: list[str] = []

    def render(text: str) -> Any:
        return lambda: order.append(text) or text

    background = [asyncio.ensure_future(tok.encode(render(t), False, background=True)) for t in ("c1", "c2")]
    counted = asyncio.ensure_future(tok.run(lambda: order.append("c3") or "strs", background=True))
    prompts = [asyncio.ensure_future(tok.encode(render(t), False)) for t in ("p1", "p2")]
    await asyncio.sleep(0.05)
    gate.set()
    results = await asyncio.gather(head, *prompts, *background, counted)
    assert order == ["p1", "p2", "c1", "c2", "c3"]  # prompts first, then in arrival order
    assert fake.batch_sizes == [2]  # the prompts together; each background job on its own
    assert results[1:] == [fake.encode(t, False) for t in ("p1", "p2", "c1", "c2")] + ["strs"]


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


async def test_tokenize_and_detokenize_work_after_the_prompts(serve: Serve, monkeypatch: Any) -> None:
    engine, _ = _recording_engine(max_model_len=10_000)
    served = await serve(engine)
    ranks: list[tuple[str, bool]] = []
    encode, run = PromptTokenizer.encode, PromptTokenizer.run

    async def encode_recorded(self: Any, render: Any, special: bool, background: bool = False) -> Any:
        ranks.append(("encode", background))
        return await encode(self, render, special, background)

    async def run_recorded(self: Any, call: Any, background: bool = False) -> Any:
        ranks.append(("run", background))
        return await run(self, call, background)

    monkeypatch.setattr(PromptTokenizer, "encode", encode_recorded)
    monkeypatch.setattr(PromptTokenizer, "run", run_recorded)
    text = "b" * 5000
    r = await served.http.post("/tokenize", json={"model": BASE, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200
    r = await served.http.post(
        "/tokenize", json={"model": BASE, "messages": [{"role": "user", "content": text}]}
    )
    assert r.status_code == 200
    r = await served.http.post("/detokenize", json={"model": BASE, "tokens": [ord("a")] * 5000})
    assert r.status_code == 200
    assert ranks == [("encode", True), ("run", True), ("encode", True), ("run", True)]
    ranks.clear()
    r = await served.http.post("/v1/completions", json={"model": BASE, "prompt": text, "max_tokens": 1})
    assert r.status_code == 200 and ranks == [("encode", False)]


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


class TemplateThreadTokenizer(FakeTokenizer):
    """Records the thread that renders each chat template."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.threads.append(threading.current_thread().name)
        return super().apply_chat_template(conversation, **kwargs)


CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "f", "arguments": '{"text": "%s"}' % ("x" * 400)},
}
MANY_EMPTY = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 20
BIG_CALL = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("fields", "thread"),
    [
        ({"messages": [{"role": "user", "content": "q"}]}, "MainThread"),  # small: no hop
        ({"messages": MANY_EMPTY}, "tokenize"),  # 40 empty turns: each costs its render
        ({"messages": BIG_CALL}, "tokenize"),  # a short text, long call arguments
        ({"messages": [{"role": "user", "content": "q"}], "tools": TOOLS}, "tokenize"),  # written as JSON
    ],
)
async def test_a_chat_prompt_is_rendered_off_the_loop_by_all_the_template_reads(
    serve: Serve, fields: dict[str, Any], thread: str
) -> None:
    """Not only by its messages' text: many empty turns (48,000 of them stalled every stream
    for 4 s), a call's arguments or offered tools make a long render too."""
    engine = FakeEngine(max_model_len=10_000)
    engine._tokenizer = tokenizer = TemplateThreadTokenizer()
    served = await serve(engine)
    r = await served.http.post("/v1/chat/completions", json={"model": BASE, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    assert tokenizer.threads == [thread]


async def test_run_returns_the_result_or_raises_to_its_caller_alone() -> None:
    prompts = PromptTokenizer(lambda: FakeTokenizer())

    def fails() -> str:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await prompts.run(fails)
    assert await prompts.run(lambda: threading.current_thread().name) == "tokenize"
    assert await prompts.encode(lambda: "ab", False) == [97, 98]


# -- a prompt that cannot fit is refused before it is tokenized ------------------------------
MODEL_DIR = embedded_model_dir(Path.home() / ".cache" / "gateway" / "models")
needs_model = pytest.mark.skipif(not is_prepared(MODEL_DIR), reason="the embedded model is not prepared")


@needs_model
def test_no_text_has_fewer_tokens_than_its_characters_over_the_longest_token() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    bound = token_bound(tokenizer)
    assert bound is not None and bound.form is None
    longest = bound.longest
    assert longest == 31  # Gemma 3's longest tokens: runs of 31 newlines, tabs or spaces
    assert len(tokenizer.encode("\n" * longest, add_special_tokens=False)) == 1  # and it is reached
    specials = "".join(tokenizer.get_added_vocab())  # a prompt may spell every added token
    rng = random.Random(7)  # the last but one: byte fallback, CJK, emoji (not surrogates)
    texts = [
        "\n" * 5000,
        " " * 5000,
        "\t" * 5000,
        "▁" * 500,
        "a" * 5000,
        specials,
        "<start_of_turn>user\n" * 300,
        "".join(rng.choice("ab \n\t.") for _ in range(20_000)),
        "".join(chr(c) for c in rng.sample(range(0x20, 0x30000), 5000) if not 0xD800 <= c < 0xE000),
        "Hello world, this is a test of a long prompt. " * 500,
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * longest >= len(text), text[:40]


def _fast(
    model: Any,
    normalizer: Any = None,
    pre_tokenizer: Any = None,
    added: AddedToken | None = None,
) -> PreTrainedTokenizerFast:
    backend = Tokenizer(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    if added is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": [added]})
    return tokenizer


VOCAB = {"a": 0, "abcd": 1, "<0x41>": 2, "<unk>": 3}


def test_the_longest_token_counts_added_tokens_and_byte_fallback_as_one_character() -> None:
    bpe = models.BPE(dict(VOCAB), [], unk_token="<unk>", byte_fallback=True)
    assert token_bound(_fast(bpe, pre_tokenizer=pre_tokenizers.Metaspace())) == TokenBound(5)  # <unk>
    bpe = models.BPE({"a": 0, "abcd": 1, "<0x41>": 2}, [], byte_fallback=True)
    assert token_bound(_fast(bpe)) == TokenBound(4)  # "<0x41>" stands for one byte
    special = AddedToken("<|a_long_special|>", lstrip=False, rstrip=False)
    bpe = models.BPE(dict(VOCAB), [], unk_token="<unk>", byte_fallback=True)
    assert token_bound(_fast(bpe, added=special)) == TokenBound(len("<|a_long_special|>"))  # one token
    bpe = models.BPE(dict(VOCAB), [], unk_token="<unk>", byte_fallback=False, fuse_unk=False)
    assert token_bound(_fast(bpe, pre_tokenizer=pre_tokenizers.ByteLevel())) == TokenBound(6)  # bytes


# A byte-fallback tokenizer whose longest token is four composed characters.
COMPOSED = {"é": 0, "éé": 1, "éééé": 2, "ガ": 3, "ガガ": 4, "ガガガガ": 5, "<0x65>": 6, "<0xCC>": 7}
COMPOSED_MERGES = [("é", "é"), ("éé", "éé"), ("ガ", "ガ"), ("ガガ", "ガガ")]


@pytest.mark.parametrize(
    ("form", "normalizer", "text", "composed"),
    [
        ("NFC", normalizers.NFC(), "e\u0301" * 1000, "é" * 1000),
        ("NFKC", normalizers.NFKC(), "ｶﾞ" * 1000, "ガ" * 1000),  # half-width kana and its mark
    ],
)
def test_a_composing_normalizer_is_measured_on_the_composed_text(
    form: str, normalizer: Any, text: str, composed: str
) -> None:
    """Qwen's tokenizers begin with NFC: two characters become one before the model sees them,
    so the raw length would claim twice the tokens there are (a prompt that fits, refused)."""
    tokenizer = _fast(models.BPE(dict(COMPOSED), COMPOSED_MERGES, byte_fallback=True), normalizer=normalizer)
    bound = token_bound(tokenizer)
    assert bound == TokenBound(4, form)  # type: ignore[arg-type]
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert tokens == len(composed) // 4 == bound.least_tokens(text)  # reached, never passed
    assert -(-len(text) // bound.longest) > tokens  # what the raw length would have claimed
    assert bound.least_tokens("ab") == 1  # ASCII: no normalizing to do


def test_an_added_token_the_normalizer_would_change_leaves_no_bound() -> None:
    """Added tokens are matched before the normalizer: one NFC rewrites may stand for more
    composed characters than its own length says."""
    bpe = models.BPE(dict(COMPOSED), COMPOSED_MERGES, byte_fallback=True)
    assert token_bound(_fast(bpe, normalizer=normalizers.NFC())) is not None
    decomposed = AddedToken("<e\u0301>", lstrip=False, rstrip=False, normalized=False)
    bpe = models.BPE(dict(COMPOSED), COMPOSED_MERGES, byte_fallback=True)
    assert token_bound(_fast(bpe, normalizer=normalizers.NFC(), added=decomposed)) is None


def test_a_byte_level_nfc_tokenizer_never_has_fewer_tokens_than_its_bound() -> None:
    """Qwen's pipeline (NFC, ByteLevel, BPE), trained here on text with composed and
    decomposed accents, Hangul jamo and half-width kana: no text falls below its bound."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(3)
    pieces = ["e\u0301", "é", "\u1100\u1161", "가", "ｶﾞ", "a", " ", "\n", "ñ", "n\u0303", "x\u0323\u0301"]
    corpus = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(400)]
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    bound = token_bound(tokenizer)
    assert bound is not None and bound.form == "NFC" and bound.longest > 1
    texts = [*corpus, *("".join(rng.choice(pieces) for _ in range(3000)) for _ in range(20))]
    texts += ["e\u0301" * 4000, "\u1100\u1161" * 2000, "<|im_start|>" * 100 + "e\u0301" * 100]
    for text in texts:
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= bound.least_tokens(text), text[:40]


@pytest.mark.parametrize(
    "tokenizer",
    [
        # NFKC makes one character of several ("ｶﾞ" -> "ガ"): measured in that form when it comes
        # first, not after another step; Strip drops any run of spaces
        _fast(
            models.BPE(dict(VOCAB), [], byte_fallback=True),
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.NFKC()]),
        ),
        _fast(models.BPE(dict(VOCAB), [], byte_fallback=True), normalizer=normalizers.Strip()),
        _fast(
            models.BPE(dict(VOCAB), [], byte_fallback=True),
            normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace("  ", " ")]),
        ),
        # BERT's split drops whitespace; a Split that removes its pattern drops it too
        _fast(models.BPE(dict(VOCAB), [], byte_fallback=True), pre_tokenizer=pre_tokenizers.Whitespace()),
        _fast(
            models.BPE(dict(VOCAB), [], byte_fallback=True),
            pre_tokenizer=pre_tokenizers.Sequence(
                [pre_tokenizers.Metaspace(), pre_tokenizers.Split(" ", "removed")]
            ),
        ),
        # a run of unknown characters fused into one token; WordLevel's unknown is a whole word
        _fast(models.BPE(dict(VOCAB), [], unk_token="<unk>", fuse_unk=True)),
        _fast(models.WordLevel(dict(VOCAB), unk_token="<unk>")),
        # an added token that takes the spaces beside it
        _fast(
            models.BPE(dict(VOCAB), [], byte_fallback=True),
            added=AddedToken("<mask>", lstrip=True),
        ),
        FakeTokenizer(),  # not a fast tokenizer: nothing to read the pipeline from
    ],
    ids=[
        "nfkc-second",
        "strip",
        "replace-shorter",
        "whitespace",
        "split-removed",
        "fused-unk",
        "wordlevel",
        "lstrip",
        "slow",
    ],
)
def test_no_bound_where_the_tokenizer_may_drop_or_merge_characters(tokenizer: Any) -> None:
    assert token_bound(tokenizer) is None


class BoundedTokenizer(FakeTokenizer):
    """The fake (one token a character) behind a fast tokenizer's vocabulary whose longest
    token has 4 characters (so 4 bounds the fake too); records the texts it encodes."""

    def __init__(self) -> None:
        self.backend_tokenizer = Tokenizer(
            models.BPE({"a": 0, "abcd": 1, "<0x41>": 2}, [], byte_fallback=True)
        )
        self.added_tokens_decoder: dict[int, AddedToken] = {}
        self.encoded: list[int] = []  # the length of each text encoded

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text, add_special_tokens)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        self.encoded.extend(map(len, texts))
        return {"input_ids": [FakeTokenizer.encode(self, t, add_special_tokens) for t in texts]}


async def test_a_prompt_too_long_by_its_characters_is_refused_untokenized(serve: Serve) -> None:
    engine = FakeEngine(max_model_len=100)
    tokenizer = engine._tokenizer = BoundedTokenizer()
    served = await serve(engine)
    context = "This model's maximum context length is 100 tokens, but the prompt has"
    huge = "x" * 400  # at least 100 tokens (4 characters a token at most): no room for one more

    r = await served.http.post("/v1/completions", json={"model": BASE, "prompt": huge + "x"})
    err = assert_openai_error(r, 400, "context_length_exceeded")
    assert err["message"] == f"{context} at least 101 tokens." and err["param"] == "prompt"
    for path, body, param in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/v1/responses", {"input": huge}, "input"),
        ("/chat", {"question": huge}, "question"),
    ]:
        err = assert_openai_error(await served.http.post(path, json={"model": BASE, **body}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == param, path
        assert err["message"].startswith(f"{context} at least "), path
    assert tokenizer.encoded == []  # refused without tokenizing

    # Below the bound the prompt is counted, and refused as before by its count.
    r = await served.http.post("/v1/completions", json={"model": BASE, "prompt": "x" * 396})
    err = assert_openai_error(r, 400, "context_length_exceeded")
    assert err["message"] == f"{context} 397 tokens." and err["param"] == "prompt"
    assert tokenizer.encoded == [396]
    # /tokenize counts a text of any length (a client counts to know what to cut), as vLLM's.
    r = await served.http.post("/tokenize", json={"model": BASE, "prompt": huge})
    assert r.status_code == 200 and r.json()["count"] == 401


async def test_tokenize_takes_nulls_and_answers_token_strs_as_vllm(serve: Serve) -> None:
    served = await serve()
    nulls = {"return_token_strs": None, "add_generation_prompt": None, "continue_final_message": None}
    for body in ({"prompt": "ab"}, {"messages": [{"role": "user", "content": "ab"}]}):
        r = await served.http.post("/tokenize", json={"model": BASE, **body, **nulls})
        assert r.status_code == 200, r.text  # null is the default, as vLLM takes it
        assert r.json()["token_strs"] is None  # not asked for: null, as vLLM answers
