"""ChatService: an OpenAI request on a route -> a prompt and sampling -> engine steps.

The service validates what only it can (prompt length against the context, limits),
builds the prompt with the tokenizer's chat template (or the route's), merges sampling
values (request > route defaults > gateway defaults), and returns a ``Generation``: an
async stream of engine steps that releases the route lease and aborts the engine
request if the consumer stops early. Wire formats are the encoders' business (``sse``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.catalog import Lease, Route
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.protocol import ChatCompletionRequest, CompletionRequest, HouseChatRequest, SamplingFields
from gateway.settings import LimitSettings
from gateway.structured import choose, request_constraint
from gateway.tokenizing import PromptTokenizer
from gateway.types import EngineBackend, LoraSpec, SamplingSpec, StepOutput, TokenLogprob

# Templating and tokenising a prompt takes milliseconds (2.4 ms for 512 tokens, measured
# with py-spy at 256 streams); below this size it is cheaper than a thread hop, above it
# it runs in the tokenizing thread so the event loop keeps streaming other requests' tokens.
_THREAD_TOKENIZE_CHARS = 256

# Abort tasks are fire-and-forget (they must outlive a cancelled request); keep references.
_background: set[asyncio.Task[None]] = set()


@dataclass(slots=True)
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Collected:
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int


class Generation:
    """One admitted request: iterate ``steps()`` once, or ``collect()``."""

    def __init__(
        self,
        engine: EngineBackend,
        lease: Lease,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        params: Any,
        id_prefix: str,
    ) -> None:
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.route: Route = lease.route
        self.sampling = sampling
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.on_gap: Callable[[float], None] | None = None  # inter-step latency, for metrics
        self._engine = engine
        self._lease = lease
        self._prompt_ids = prompt_ids
        self._params = params  # the engine's form of ``sampling``

    @property
    def lora(self) -> LoraSpec | None:
        return self.route.lora

    async def steps(self) -> AsyncIterator[StepOutput]:
        finished = False
        last = 0.0
        try:
            async for step in self._engine.generate(self._prompt_ids, self._params, self.id, self.lora):
                now = time.monotonic()
                if self.first_token_at is None:
                    self.first_token_at = now
                elif self.on_gap is not None:
                    self.on_gap(now - last)
                last = now
                for chunk in step.chunks:
                    self.completion_tokens += chunk.num_tokens
                finished = step.finished
                yield step
        finally:
            self._lease.release()
            if not finished:
                # The consumer left early (disconnect, error). Abort in a task of its own:
                # awaiting here could be cancelled again before the engine hears of it.
                task = asyncio.get_running_loop().create_task(self._engine.abort(self.id))
                _background.add(task)
                task.add_done_callback(_background.discard)

    def close(self) -> None:
        """Release a generation that was never iterated."""
        self._lease.release()

    async def collect(self) -> Collected:
        choices = {i: Choice(index=i) for i in range(self.sampling.n)}
        async for step in self.steps():
            for chunk in step.chunks:
                choice = choices[chunk.index]
                choice.text.append(chunk.text)
                if chunk.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + chunk.logprobs
                if chunk.finish_reason is not None:
                    choice.finish_reason = chunk.finish_reason
        return Collected(list(choices.values()), self.prompt_tokens, self.completion_tokens)


class ChatService:
    def __init__(self, engine: EngineBackend, limits: LimitSettings) -> None:
        self._engine = engine
        self._limits = limits
        self._prompts = PromptTokenizer(lambda: engine.tokenizer)

    async def chat(self, request: ChatCompletionRequest, lease: Lease) -> Generation:
        route = lease.route
        messages = [{"role": m.role, "content": m.text} for m in request.messages]
        if route.system_prompt and not any(m["role"] in ("system", "developer") for m in messages):
            messages.insert(0, {"role": "system", "content": route.system_prompt})
        prompt_ids = await self._tokenize(
            lambda: self._chat_text(messages, route.chat_template), False, size=_size(messages)
        )
        return self._start(request, lease, prompt_ids, request.token_limit, request.num_logprobs, "chatcmpl")

    async def complete(self, request: CompletionRequest, lease: Lease) -> Generation:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_ids = [int(t) for t in prompt]
            vocab = len(self._engine.tokenizer)
            if max(prompt_ids) >= vocab:
                raise InvalidRequest(f"token ids must be below the vocabulary size {vocab}", param="prompt")
        else:
            text = prompt if isinstance(prompt, str) else str(prompt[0])
            prompt_ids = await self._tokenize(lambda: text, True, size=len(text))
        return self._start(request, lease, prompt_ids, request.token_limit, request.num_logprobs, "cmpl")

    async def house(self, request: HouseChatRequest, lease: Lease) -> Generation:
        chat = ChatCompletionRequest(
            messages=[{"role": "user", "content": request.question}],
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            response_format=(request.model_extra or {}).get("response_format"),
        )
        return await self.chat(chat, lease)

    # -- helpers --------------------------------------------------------------------
    def _chat_text(self, messages: list[dict[str, str]], template: str | None) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if template:
            kwargs["chat_template"] = template
        try:
            return str(self._engine.tokenizer.apply_chat_template(messages, **kwargs))
        except Exception as exc:  # jinja raise_exception() in a template, bad roles
            raise InvalidRequest(f"messages could not be formatted: {exc}", param="messages") from None

    async def _tokenize(self, render: Callable[[], str], add_special_tokens: bool, size: int) -> list[int]:
        """Token ids of ``render()``. A chat template writes <bos> itself, so chat prompts pass
        ``add_special_tokens=False`` (adding them again would double it)."""
        if size > _THREAD_TOKENIZE_CHARS:
            return await self._prompts.encode(render, add_special_tokens)
        return list(self._engine.tokenizer.encode(render(), add_special_tokens=add_special_tokens))

    def _start(
        self,
        request: SamplingFields,
        lease: Lease,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        id_prefix: str,
    ) -> Generation:
        limits = self._limits
        if request.n > limits.max_n:
            raise InvalidRequest(f"n must be at most {limits.max_n}", param="n")
        if len(request.stop_list) > limits.max_stop:
            raise InvalidRequest(f"at most {limits.max_stop} stop sequences are allowed", param="stop")
        if logprobs is not None and logprobs > limits.max_logprobs:
            raise InvalidRequest(f"logprobs must be at most {limits.max_logprobs}", param="logprobs")
        if any(not s for s in request.stop_list):
            raise InvalidRequest("stop sequences must not be empty", param="stop")
        context = self._engine.max_model_len
        room = context - len(prompt_ids)
        if room <= 0:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens, "
                f"but the prompt has {len(prompt_ids)} tokens.",
                param="messages" if id_prefix == "chatcmpl" else "prompt",
            )
        defaults = lease.route.defaults
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                param="max_tokens",
            )
        if max_tokens is None:
            max_tokens = min(defaults.max_tokens or limits.default_max_tokens, room)
        asked, param = request_constraint(request.model_extra or {})
        route = lease.route
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            temperature=_pick(request.temperature, defaults.temperature, 1.0),
            top_p=_pick(request.top_p, defaults.top_p, 1.0),
            top_k=request.top_k or 0,
            n=request.n,
            stop=request.stop_list,
            seed=request.seed,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=_pick(request.repetition_penalty, defaults.repetition_penalty, 1.0),
            logprobs=logprobs,
            ignore_eos=request.ignore_eos,
            min_tokens=min(request.min_tokens, max_tokens),
            constraint=choose(asked, param, route.response_format, route.enforce, route.name),
        )
        if sampling.n > 1 and sampling.temperature == 0:
            raise InvalidRequest(
                "n > 1 needs a temperature above 0 (greedy choices are identical)", param="n"
            )
        params = self._prepare(sampling, param)
        return Generation(self._engine, lease, prompt_ids, sampling, params, id_prefix)

    def _prepare(self, sampling: SamplingSpec, constraint_param: str) -> Any:
        """The engine's form of ``sampling``; a constraint its grammar backend refuses is
        reported on the field it came from."""
        try:
            return self._engine.prepare(sampling)
        except InvalidRequest as exc:
            if exc.param == "response_format":
                exc.param = constraint_param
            raise


def _pick(*values: float | None) -> float:
    for value in values:
        if value is not None:
            return value
    raise AssertionError("the last value is a default")


def _size(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages)
