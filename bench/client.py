"""The benchmark's own streaming client (aiohttp), the prompts it sends, and the metrics.

It talks HTTP only (STYLE.md section 10) and measures what ``vllm bench serve`` measures,
with one deliberate difference in where TTFT stops (see below):

- A point is ``n`` requests sent by ``c`` workers (a closed loop: each worker sends its
  next request when the last one ends). Every request streams ``/v1/chat/completions``
  with ``stream_options.include_usage``, ``max_tokens`` N and ``ignore_eos``, so each
  one returns exactly N tokens (checked against ``usage.completion_tokens``). The
  structured shapes (bench/shapes.py) drop ``ignore_eos``: they end when the object closes.
- duration: from the point's first request to its last response byte.
  req/s = completed / duration; output tok/s = sum(usage.completion_tokens) / duration.
- TTFT: request sent -> first SSE event whose delta carries text (or a finish_reason);
  text is ``content``, or for ``--shape tools`` a tool call's arguments (not its head: the
  gateway sends the id and name of a required call before the engine has run).
  ``vllm bench serve`` stops at the first event with ``choices``; the gateway sends its
  role event (``{"role":"assistant","content":""}``) before the engine has done anything,
  while vLLM's server sends it with the first token, so that rule would flatter the gateway.
- ITL: the gaps between consecutive text events of a request, pooled over all requests
  of the point (as vLLM's bench does: chunk gaps, not per-token gaps). A server that is
  behind coalesces several tokens into one event, so ITL counts events, not tokens;
  ``tokens_per_chunk`` shows how much coalescing there was, and TPOT (per request,
  (latency - TTFT) / (tokens - 1)) is the per-token figure that coalescing cannot hide.
- Percentiles are numpy's linear ones, as in vLLM's bench.

Prompts: words that are one token each ("random token-ish text"), drawn per request from
a seeded RNG, then trimmed or extended until the *chat-templated* prompt has exactly the
wanted number of tokens (checked against ``usage.prompt_tokens``). Each request has its
own random words from the first one on, and the seed differs per server, mix and point,
so neither server gets prefix-cache hits from another run's prompts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.shapes import answer_valid, delta_parts, shape_fields

MARK = "\x00CONTENT\x00"


def seed_for(*parts: object) -> int:
    """A stable seed from ``parts`` (e.g. run, pass, mix, concurrency); request i uses seed + i."""
    return zlib.crc32("/".join(map(str, parts)).encode()) * 100_000


class PromptMaker:
    """Chat prompts of an exact token length for one model directory's tokenizer."""

    def __init__(self, model_dir: str | Path, prompt_tokens: int) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        hf = AutoTokenizer.from_pretrained(str(model_dir))
        text = hf.apply_chat_template(
            [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True
        )
        self.prefix, self.suffix = text.split(MARK)
        self.target = prompt_tokens
        vocab = self.tok.get_vocab()
        words = sorted(
            w[1:]
            for w in vocab
            if w.startswith("\u2581")
            and 3 <= len(w) - 1 <= 8
            and w[1:].isascii()
            and w[1:].isalpha()
            and w[1:].islower()
        )
        encoded = self.tok.encode_batch([" " + w for w in words], add_special_tokens=False)
        self.words = [w for w, e in zip(words, encoded, strict=False) if len(e.ids) == 1]
        overhead = self.count("")
        if overhead >= prompt_tokens:
            raise ValueError(f"prompt_tokens={prompt_tokens} is below the chat template's {overhead} tokens")
        self.overhead = overhead

    def count(self, content: str) -> int:
        return len(self.tok.encode(self.prefix + content + self.suffix, add_special_tokens=False).ids)

    def content(self, seed: int) -> str:
        """Random words whose templated prompt is exactly ``target`` tokens long."""
        rng = random.Random(seed)
        words = rng.choices(self.words, k=self.target - self.overhead)
        best: tuple[int, list[str]] = (1 << 30, words)
        for _ in range(60):
            n = self.count(" ".join(words))
            if n == self.target:
                return " ".join(words)
            if abs(n - self.target) < best[0]:
                best = (abs(n - self.target), list(words))
            if n > self.target:
                words = words[: len(words) - max(1, (n - self.target) // 2)]
            else:
                words = words + rng.choices(self.words, k=max(1, (self.target - n) // 2))
        return " ".join(best[1])  # rare; usage.prompt_tokens shows it

    def token_ids(self, seed: int) -> list[int]:
        """The same prompt as token ids (for the engine without HTTP)."""
        return self.tok.encode(self.prefix + self.content(seed) + self.suffix, add_special_tokens=False).ids


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    valid: bool | None = None  # the answer checked against --shape (None: plain, no check)
    finish_reason: str | None = None
    model: str = ""  # the request's model (per-adapter statistics)


@dataclass(slots=True)
class Job:
    model: str
    content: str = ""
    prompt_ids: list[int] | None = None  # used by the no-HTTP ceiling only


def chat_body(job: Job, max_tokens: int, shape: str = "plain") -> dict[str, Any]:
    """The request body; ``shape`` (bench/shapes.py) adds ``ignore_eos`` (plain) or the
    structure (json_schema, tools)."""
    return {
        "model": job.model,
        "messages": [{"role": "user", "content": job.content}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        **shape_fields(shape),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one_request(session: Any, url: str, job: Job, max_tokens: int, shape: str) -> RequestResult:
    res = RequestResult(start=time.perf_counter(), model=job.model)
    last = res.start
    loads = json.loads
    content: list[str] = []
    arguments: list[str] = []
    try:
        async with session.post(url, json=chat_body(job, max_tokens, shape)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                res.end = time.perf_counter()
                return res
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":  # read on to the body's end: the connection is then reused
                    continue
                now = time.perf_counter()
                obj = loads(data)
                choices = obj.get("choices")
                if choices:
                    ch = choices[0]
                    text, args, carries = delta_parts(ch.get("delta") or {})
                    content.append(text)
                    arguments.append(args)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                    if carries or ch.get("finish_reason"):
                        if res.ttft is None:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
                elif obj.get("usage"):
                    res.prompt_tokens = obj["usage"].get("prompt_tokens") or 0
                    res.completion_tokens = obj["usage"].get("completion_tokens") or 0
                elif obj.get("error"):
                    res.error = str(obj["error"])[:300]
        res.end = last
        res.ok = res.ttft is not None and not res.error
        if res.ok and not res.completion_tokens:
            res.ok, res.error = False, "no usage in the stream"
        if res.ok:
            res.valid = answer_valid(shape, "".join(content), "".join(arguments))
    except Exception as exc:  # a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        res.end = time.perf_counter()
    return res


async def drive(
    base_url: str,
    jobs: list[Job],
    concurrency: int,
    max_tokens: int,
    api_key: str | None = None,
    shape: str = "plain",
) -> tuple[list[RequestResult], float]:
    """Send ``jobs`` with ``concurrency`` workers; return the results and the duration."""
    import aiohttp

    url = base_url.rstrip("/") + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60, force_close=False)
    timeout = aiohttp.ClientTimeout(total=6 * 3600, sock_read=600)
    results: list[RequestResult] = []
    queue = iter(jobs)

    async def worker(session: aiohttp.ClientSession) -> None:
        for job in queue:
            results.append(await _one_request(session, url, job, max_tokens, shape))

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        t1 = max([r.end for r in results] + [t0])
    return results, t1 - t0


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000.0 if values else None


def summarize(results: list[RequestResult], duration: float, max_tokens: int) -> dict[str, Any]:
    """Point metrics (times in ms) from the requests of one point."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    tpot = [
        (r.end - r.start - r.ttft) / (r.completion_tokens - 1)
        for r in ok
        if r.ttft is not None and r.completion_tokens > 1
    ]
    e2e = [r.end - r.start for r in ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    prompt_lens = [r.prompt_tokens for r in ok]
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "invalid": sum(1 for r in ok if r.valid is False),
        "invalid_at_length": sum(1 for r in ok if r.valid is False and r.finish_reason == "length"),
        "first_error": errors[0] if errors else None,
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration else 0.0,
        "out_tok_per_s": out_tokens / duration if duration else 0.0,
        "total_tok_per_s": (out_tokens + in_tokens) / duration if duration else 0.0,
        "ttft_ms_mean": float(np.mean(ttft)) * 1000 if ttft else None,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_mean": float(np.mean(itl)) * 1000 if itl else None,
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "tpot_ms_mean": float(np.mean(tpot)) * 1000 if tpot else None,
        "tpot_ms_p50": _pct(tpot, 50),
        "tpot_ms_p99": _pct(tpot, 99),
        "e2e_ms_mean": float(np.mean(e2e)) * 1000 if e2e else None,
        "e2e_ms_p50": _pct(e2e, 50),
        "e2e_ms_p99": _pct(e2e, 99),
        "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)),
        "prompt_tokens_min": min(prompt_lens) if prompt_lens else None,
        "prompt_tokens_max": max(prompt_lens) if prompt_lens else None,
        "output_tokens_short": sum(1 for r in ok if r.completion_tokens != max_tokens),
    }


def run_loop(coro: Any) -> Any:
    """asyncio.run, on uvloop when it is installed (both servers run on uvloop too)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
