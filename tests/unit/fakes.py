"""A fake engine for unit tests (no vllm): the whole ``gateway.types.Engine`` protocol,
generating scripted words, one token per step.

Knobs for tests of the app: ``start_gate`` holds ``start()`` (the "starting" state),
``gate`` holds every generation before its first step (requests stay in flight), and
``fail()`` marks the engine dead, as vLLM's engine core dying does. ``cached_tokens``: the
prompt tokens each generation reports read from the prefix cache (vLLM's ``num_cached_tokens``,
at most the prompt's).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.errors import EngineUnavailable
from gateway.types import Chunk, LoraSpec, ModelDefaults, SamplingSpec, StepOutput

if TYPE_CHECKING:
    from gateway.types import Engine


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
    def __init__(
        self,
        words: list[str] | None = None,
        max_model_len: int = 100,
        delay: float = 0.0,
        *,
        served_model_name: str = "fake-model",
        start_gate: asyncio.Event | None = None,
        gate: asyncio.Event | None = None,
        cached_tokens: int = 0,
    ) -> None:
        self.words = words or ["Hello", " world", "!"]
        self.cached_tokens = cached_tokens
        self._max_model_len = max_model_len
        self.delay = delay
        self.calls: list[tuple[list[int], SamplingSpec, str, LoraSpec | None]] = []
        self.priorities: dict[str, int] = {}  # request id -> the priority it was generated with
        self.aborted: list[str] = []
        self._tokenizer = FakeTokenizer()
        self.model_defaults = ModelDefaults()  # the model's generation_config says nothing
        self.model_path: str | None = None  # no model directory: adapters' target modules go unchecked
        self.served_model_name = served_model_name
        self.start_gate = start_gate
        self.gate = gate
        self.started = False
        self.shut_down = False
        self._errored = False
        self.running = 0  # generations started and not yet ended (finished, failed or closed)
        self.loras: dict[int, LoraSpec] = {}

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self.start_gate is not None:
            await self.start_gate.wait()
        self.started = True

    async def shutdown(self) -> None:
        self.started = False
        self.shut_down = True

    def fail(self) -> None:
        """The engine dies: ``errored``, not ``ready``; running and new generations raise."""
        self._errored = True

    @property
    def ready(self) -> bool:
        return self.started and not self._errored

    @property
    def errored(self) -> bool:
        return self._errored

    def unfinished_requests(self) -> int | None:
        return self.running

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        request_id: str,
        lora: LoraSpec | None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        """``sampling`` is what ``prepare`` returned: the spec itself."""
        self.calls.append((prompt_ids, sampling, request_id, lora))
        self.priorities[request_id] = priority
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            words = self.words[: sampling.max_tokens]
            for i, word in enumerate(words):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self._errored:
                    raise EngineUnavailable("the engine has stopped")
                last = i == len(words) - 1
                reason = ("length" if len(words) == sampling.max_tokens else "stop") if last else None
                chunks = [
                    Chunk(index=n, text=word, num_tokens=1, finish_reason=reason) for n in range(sampling.n)
                ]
                cached = min(self.cached_tokens, len(prompt_ids))
                yield StepOutput(chunks, len(prompt_ids), last, cached_tokens=cached)
        finally:
            self.running -= 1

    def prepare(self, sampling: SamplingSpec) -> SamplingSpec:
        return sampling  # the fake generates straight from the spec

    def with_max_tokens(self, params: SamplingSpec, max_tokens: int) -> SamplingSpec:
        return replace(params, max_tokens=max_tokens)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    # -- LoRA slots -------------------------------------------------------------------
    async def add_lora(self, lora: LoraSpec) -> None:
        if self._errored:
            raise EngineUnavailable("the engine has stopped")
        self.loras[lora.lora_id] = lora

    async def remove_lora(self, lora_id: int) -> None:
        self.loras.pop(lora_id, None)

    async def list_loras(self) -> set[int]:
        return set(self.loras)

    async def lora_slots(self) -> set[int] | None:
        return None  # as an engine whose workers do not report their slots


if TYPE_CHECKING:  # mypy checks that the fake is a whole Engine
    _engine: Engine = FakeEngine()
