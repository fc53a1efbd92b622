"""Prompt tokenizing off the event loop, in one thread, with queued prompts encoded in batches.

Templating and encoding a 512-token prompt takes about 2 ms of CPU. On the event loop that
would stall every open stream; in a thread it does not, but one thread encodes one prompt
after another, so a burst of new requests (a closed-loop client at 256 streams sends them
in cohorts) queues for up to half a second. Prompts that queue while the thread works are
therefore encoded in one batch call, which the Rust tokenizer spreads over all cores with
the GIL released: 256 prompts of ~820 tokens took 521 ms one by one and 242 ms as one
batch on 2 CPU cores (measured with the embedded Gemma 3 tokenizer).

One thread, not a pool: a fast tokenizer must not be used from two threads at once, and
each pool thread grew a malloc arena of its own (+876 MB RSS at 16 streams, measured).

Work for ``/tokenize`` (``background=True``) waits while any prompt of a generation request
does, and runs alone: a flood of 2 MiB texts to count (2 s each on 2 cores) then delays a
prompt by at most the one being counted, not by the whole queue of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import queue
import re
import threading
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

MAX_BATCH = 256
_PROMPT, _BACKGROUND = 0, 1  # queue ranks: a generation request's prompt first
T = TypeVar("T")

# A byte-fallback token (``<0x41>``) stands for one byte: at most one character of a prompt.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Steps of a fast tokenizer's pipeline that never drop a character or merge several into one
# (NFC, NFKC, Strip, StripAccents, BERT's clean-up, whitespace splits and fused unknowns do).
_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel"}  # and ``_keeps``' own
_KEEPING_PRE_TOKENIZERS = {"Metaspace", "ByteLevel", "Digits", "UnicodeScripts"}


@dataclass(slots=True)
class _Job:
    render: Callable[[], str]  # the prompt text (a chat template may raise)
    add_special_tokens: bool
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    call: Callable[[], Any] | None = None  # ``run``'s: its result is the job's, no encoding


class PromptTokenizer:
    """``await encode(render, add_special_tokens)``: ``render()`` and its token ids, computed
    in the tokenizing thread; an exception from either is raised to that caller alone."""

    def __init__(self, tokenizer: Callable[[], Any], max_batch: int = MAX_BATCH) -> None:
        self._tokenizer = tokenizer  # a getter: the engine's tokenizer exists once it has started
        self._max_batch = max_batch
        # (rank, arrival, job): prompts before background work, each rank in arrival order
        self._queue: queue.PriorityQueue[tuple[int, int, _Job]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0  # batch calls made (for tests and curiosity)

    async def encode(
        self, render: Callable[[], str], add_special_tokens: bool, background: bool = False
    ) -> list[int]:
        loop = asyncio.get_running_loop()
        job = _Job(render, add_special_tokens, loop.create_future(), loop)
        ids: list[int] = await self._queued(job, background)
        return ids

    async def run(self, call: Callable[[], T], background: bool = False) -> T:
        """``call()`` (a decode of many ids, their token strings) in the tokenizing thread:
        decoding 1,000,000 ids took 0.33 s, which on the event loop stalls every stream, and
        the thread is the one place that uses the tokenizer."""
        loop = asyncio.get_running_loop()
        job = _Job(str, False, loop.create_future(), loop, call)
        result: T = await self._queued(job, background)
        return result

    def _queued(self, job: _Job, background: bool) -> asyncio.Future[Any]:
        self._ensure_thread()
        self._queue.put((_BACKGROUND if background else _PROMPT, next(self._arrivals), job))
        return job.future

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="tokenize", daemon=True)
                    self._thread.start()

    def _work(self) -> None:
        while True:
            rank, _, first = self._queue.get()
            jobs = [first]
            while rank == _PROMPT and len(jobs) < self._max_batch:  # background work runs alone
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item[0] != _PROMPT:  # no prompt is left: it waits for its own turn
                    self._queue.put(item)
                    break
                jobs.append(item[2])
            try:
                self._run(jobs)
            except Exception as exc:  # e.g. no tokenizer (the engine stopped): fail these, keep serving
                for job in jobs:
                    _settle(job, None, exc)

    def _run(self, jobs: list[_Job]) -> None:
        tokenizer = self._tokenizer()
        ready: dict[bool, list[tuple[_Job, str]]] = {}
        for job in jobs:
            if job.future.done():  # the request is gone (cancelled) before its turn
                continue
            if job.call is not None:
                try:
                    _settle(job, job.call(), None)
                except Exception as exc:
                    _settle(job, None, exc)
                continue
            try:
                ready.setdefault(job.add_special_tokens, []).append((job, job.render()))
            except Exception as exc:
                _settle(job, None, exc)
        for add_special, items in ready.items():
            texts = [text for _, text in items]
            try:
                if len(texts) == 1:
                    ids = [list(tokenizer.encode(texts[0], add_special_tokens=add_special))]
                else:
                    ids = [list(x) for x in tokenizer(texts, add_special_tokens=add_special)["input_ids"]]
                    self.batches += 1
            except Exception:
                # One bad text must not fail the others: encode them one by one.
                for job, text in items:
                    try:
                        _settle(job, list(tokenizer.encode(text, add_special_tokens=add_special)), None)
                    except Exception as exc:
                        _settle(job, None, exc)
                continue
            for (job, _), one in zip(items, ids, strict=True):
                _settle(job, one, None)


@dataclass(frozen=True, slots=True)
class TokenBound:
    """The most characters one token stands for (``longest``), in the text as the tokenizer's
    normalizer first composes it (``form``: NFC or NFKC, which may merge several characters
    into one; None when it does not): a text has at least ``least_tokens(text)`` tokens."""

    longest: int
    form: Literal["NFC", "NFKC"] | None = None

    def least_tokens(self, text: str) -> int:
        if self.form is not None and not text.isascii():  # ASCII is its own normal form
            # Python's tables may be older than the tokenizer's, never so that they compose
            # more: composition is stable across Unicode versions (new precomposed characters
            # are composition exclusions). Composing across an added token's edge, which the
            # tokenizer would not, only shortens the text: the bound stays low.
            text = unicodedata.normalize(self.form, text)
        return -(-len(text) // self.longest)


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The most characters of a prompt that one token can stand for, or None (no bound).

    A prompt of ``c`` characters then has at least ``c / longest`` tokens, so one that cannot
    fit the context is refused without tokenizing it (a 2.3 MB prompt took 2.3 s to encode on
    2 cores, every other prompt queued behind it). Vocabulary entries count their length
    (``▁`` and ByteLevel's characters stand for one character or byte each), byte-fallback
    tokens one, added and special tokens their text, which a prompt may spell out. The bound
    holds only where the pipeline keeps every character, so it is None for other tokenizers:
    not a fast one, a normalizer or pre-tokenizer that may drop or merge characters (Strip,
    BERT's whitespace split, NFC anywhere but first), unknown characters fused into one token,
    or an added token that swallows the whitespace beside it (``lstrip`` / ``rstrip``). A
    normalizer that begins with NFC or NFKC (Qwen's) is measured on the text in that form."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    normalizers = _steps(backend.normalizer, "normalizers")
    pre_tokenizers = _steps(backend.pre_tokenizer, "pretokenizers")
    form = normalizers[0]["type"] if normalizers and normalizers[0]["type"] in ("NFC", "NFKC") else None
    if not all(_keeps(step, _KEEPING_NORMALIZERS) for step in normalizers[1 if form else 0 :]):
        return None
    if not all(_keeps(step, _KEEPING_PRE_TOKENIZERS) for step in pre_tokenizers):
        return None
    model = backend.model
    kind = type(model).__name__
    byte_fallback = bool(getattr(model, "byte_fallback", False))
    byte_level = any(step["type"] == "ByteLevel" for step in pre_tokenizers)  # no byte is unknown
    unknown_apart = getattr(model, "unk_token", None) is not None and not getattr(model, "fuse_unk", True)
    if not (byte_fallback or (kind == "BPE" and (byte_level or unknown_apart))):
        return None
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    if any(token.lstrip or token.rstrip for token in added):
        return None
    added_texts = {token.content for token in added}
    # An added token is matched before the normalizer: one that the form would change could
    # stand for more characters of the composed text than its own.
    if form and any(unicodedata.normalize(form, text) != text for text in added_texts):
        return None
    longest = 1
    for token in tokenizer.get_vocab():
        if byte_fallback and token not in added_texts and _BYTE_TOKEN.fullmatch(token):
            continue  # one character at most
        longest = max(longest, len(token))
    return TokenBound(longest, form)


def _steps(step: Any, nested: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps (their JSON), sequences flattened."""
    if step is None:
        return []
    state: dict[str, Any] = json.loads(step.__getstate__())
    if state.get("type") != "Sequence":
        return [state]
    flat: list[dict[str, Any]] = []
    parts = list(state.get(nested, ()))
    while parts:
        part = parts.pop(0)
        if part.get("type") == "Sequence":
            parts[:0] = part.get(nested, ())
        else:
            flat.append(part)
    return flat


def _keeps(step: dict[str, Any], kinds: set[str]) -> bool:
    """Whether one step keeps every character apart: a kind that does, a ``Replace`` of a
    string by one at least as long (a regex may match anything), a split that drops nothing."""
    kind = step.get("type")
    if kind in kinds:
        return True
    if kind == "Replace":
        pattern = step.get("pattern", {}).get("String")
        return pattern is not None and len(step.get("content", "")) >= len(pattern)
    return kind in ("Split", "Punctuation") and step.get("behavior") != "Removed"


def _settle(job: _Job, result: Any, exc: BaseException | None) -> None:
    def done() -> None:
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop has closed (shutdown): nobody is waiting
        job.loop.call_soon_threadsafe(done)
