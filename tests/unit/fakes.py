"""A fake engine for unit tests of pure logic (no vllm): echoes scripted tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from gateway.engine import Chunk, LoraSpec, SamplingSpec, StepOutput


class FakeTokenizer:
    """One token per character; a chat template that joins role: content lines."""

    def __len__(self) -> int:
        return 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        return [2, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join("<bos>" if i == 2 else chr(i) for i in token_ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        if kwargs.get("chat_template") == "{{ raise }}":
            raise ValueError("template failed")
        return "".join(f"{m['role']}:{m['content']}\n" for m in conversation) + "model:"


class FakeEngine:
    def __init__(self, words: list[str] | None = None, max_model_len: int = 100, delay: float = 0.0) -> None:
        self.words = words or ["Hello", " world", "!"]
        self._max_model_len = max_model_len
        self.delay = delay
        self.calls: list[tuple[list[int], SamplingSpec, str, LoraSpec | None]] = []
        self.aborted: list[str] = []
        self._tokenizer = FakeTokenizer()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingSpec, request_id: str, lora: LoraSpec | None
    ) -> AsyncIterator[StepOutput]:
        """``sampling`` is what ``prepare`` returned: the spec itself."""
        self.calls.append((prompt_ids, sampling, request_id, lora))
        words = self.words[: sampling.max_tokens]
        for i, word in enumerate(words):
            if self.delay:
                await asyncio.sleep(self.delay)
            last = i == len(words) - 1
            reason = ("length" if len(words) == sampling.max_tokens else "stop") if last else None
            chunks = [Chunk(index=n, text=word, num_tokens=1, finish_reason=reason) for n in range(sampling.n)]
            yield StepOutput(chunks=chunks, prompt_tokens=len(prompt_ids), finished=last)

    def prepare(self, sampling: SamplingSpec) -> SamplingSpec:
        return sampling  # the fake generates straight from the spec

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
