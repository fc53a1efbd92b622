"""ChatService: an OpenAI request on a route -> a prompt and sampling -> engine steps.

The service validates what only it can (prompt length against the context, limits),
builds the prompt with the tokenizer's chat template (or the route's), merges sampling
values (request > route defaults > gateway defaults), and returns a ``Generation``: an
async stream of engine steps that releases the route lease and aborts the engine
request if the consumer stops early. A LoRA request first waits for its adapter's turn
(``lora_scheduler``) when the gateway orders them. Wire formats are the encoders' business
(``sse``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from gateway.batch import Echo, echo_steps, merge_steps
from gateway.catalog import Lease, Route
from gateway.catalog_file import SamplingDefaults
from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest
from gateway.lora_scheduler import Caller, LoraScheduler, Ticket
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    PromptInput,
    SamplingFields,
)
from gateway.read_ahead import ReadAhead
from gateway.settings import LimitSettings
from gateway.structured import TEXT, choose, describe, opened, request_constraint
from gateway.tokenizing import PromptTokenizer, TokenBound, token_bound
from gateway.tools import (
    NO_TOOLS,
    ToolDef,
    ToolPlan,
    answer_or_calls_schema,
    arguments_schema,
    check_tool_messages,
    in_answer_terms,
    offered_tools,
    plan_tools,
    template_messages,
    tool_template,
    uses_tools,
)
from gateway.types import (
    Constraint,
    EngineBackend,
    LoraSpec,
    ModelDefaults,
    SamplingSpec,
    StepOutput,
    TokenLogprob,
)

# Templating and tokenising a prompt takes milliseconds (2.4 ms for 512 tokens, measured
# with py-spy at 256 streams); below this size it is cheaper than a thread hop, above it
# it runs in the tokenizing thread so the event loop keeps streaming other requests' tokens.
_THREAD_TOKENIZE_CHARS = 256
_MESSAGE_CHARS = 16  # a message's cost to render beside its text, as characters (``_size``)
# Decoding is cheaper per token (1,000,000 ids: 0.33 s); below this many, on the loop.
_THREAD_DECODE_IDS = 4096
T = TypeVar("T")

log = logging.getLogger(__name__)

# The grammar backend's checks of new constraints, off the event loop: threads of their own,
# so that a burst of them never holds the default executor (the response store's reads).
_CONSTRAINT_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-check")

# A request's own checks of its schemas: the meta-schema check (``structured.schema_problem``)
# is pure Python at about 0.2 ms a sub-schema, 1 s on the event loop for a 5,000-node schema
# seen for the first time (repeats are cached), every stream stalled meanwhile. In a thread the
# loop takes the GIL back within the 5 ms switch interval. Threads of their own: behind the
# grammar backend's compiles (``_CONSTRAINT_CHECKS``) a tools request would wait its turn.
_SCHEMA_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="schema-check")

# ``/v1/responses``' structured output, and where its schema is: the grammar backend's
# refusals of it name the schema, as the meta-schema check of it does (``responses_api``).
_TEXT_FORMAT = "text.format"
_SCHEMA_PARAMS = {_TEXT_FORMAT: "text.format.schema"}

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
    cached_tokens: int  # of the prompt tokens, those read from the engine's prefix cache


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
        *,
        more_prompts: Sequence[list[int]] = (),
        more_params: Sequence[Any] = (),
        echo: list[Echo] | None = None,
        copies: int = 1,
        scheduler: LoraScheduler | None = None,
    ) -> None:
        """``copies``: engine requests per prompt, each of ``sampling.n // copies`` choices
        (greedy choices: one request each, as vLLM has no greedy ``n``). ``more_params``:
        the engine's params for each of ``more_prompts`` (each prompt's own room in the
        context); none: ``params`` for all."""
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.route: Route = lease.route
        self.sampling = sampling
        self.prompt_tokens = len(prompt_ids) + sum(len(p) for p in more_prompts)
        self.num_choices = sampling.n * (1 + len(more_prompts))
        self.completion_tokens = 0
        self.cached_tokens = 0  # the prompt tokens the engine read from its prefix cache
        self.first_token_at: float | None = None
        # The error a stream ended with after its 200 went out (set by the stream encoders):
        # the access log and the metrics count the request under this error's status.
        self.error: GatewayError | None = None
        self.on_gap: Callable[[float], None] | None = None  # inter-step latency, for metrics
        # Set when the request reaches the engine (after its adapter's turn), for metrics: a
        # request whose client left while it waited never did.
        self.reached_engine = False
        self.on_engine: Callable[[], None] | None = None
        self._engine = engine
        self._lease = lease
        self._prompt_ids = prompt_ids
        self._params = params  # the engine's form of ``sampling``
        self.tools: ToolPlan = NO_TOOLS  # chat only: how answers become tool calls
        self.caller: Caller | None = None  # the API key: its share and priority
        self._scheduler = scheduler
        self._iterated = False  # ``steps`` has begun: ``close`` leaves the release to it
        # completions only: the prompts after the first, and what to echo per prompt
        self._more_prompts = list(more_prompts)
        self._more_params = list(more_params) or [params] * len(more_prompts)
        self._echo = echo
        self._copies = copies
        self._per_stream = sampling.n // copies  # choices per engine stream
        streams = (1 + len(more_prompts)) * copies
        self._request_ids = [self.id] if streams == 1 else [f"{self.id}-{k}" for k in range(streams)]

    @property
    def lora(self) -> LoraSpec | None:
        return self.route.lora

    async def steps(self) -> AsyncGenerator[StepOutput, None]:
        self._iterated = True  # from here on, this generator's end lets go of the lease
        finished = started = False
        last = 0.0  # when the engine stream last stepped (one prompt: the hot path)
        # With several engine streams their steps interleave, and a gap between two streams'
        # steps is no stream's inter-token latency: each stream's last step, by stream.
        lasts: dict[int, float] | None = {} if len(self._request_ids) > 1 else None
        n = self._per_stream
        ticket: Ticket | None = None
        source: AsyncIterator[StepOutput] | None = None
        try:
            if self._scheduler is not None:
                ticket = await self._scheduler.turn(self.route, self.caller)
            started = self.reached_engine = True
            if self.on_engine is not None:
                self.on_engine()
            source = self._engine_steps()
            if ticket is not None:  # the turn ends when the engine is done, not the client
                source = ReadAhead(source, ticket.release)
            async for step in source:
                now = time.monotonic()
                if lasts is not None:
                    for prompt in {chunk.index // n for chunk in step.chunks}:
                        if prompt in lasts and self.on_gap is not None:
                            self.on_gap(now - lasts[prompt])
                        lasts[prompt] = now
                elif self.first_token_at is not None and self.on_gap is not None:
                    self.on_gap(now - last)
                if self.first_token_at is None:
                    self.first_token_at = now
                last = now
                for chunk in step.chunks:
                    self.completion_tokens += chunk.num_tokens
                self.cached_tokens = step.cached_tokens
                finished = step.finished
                yield step
        finally:
            if isinstance(source, ReadAhead):
                source.close()
            if started and not finished:
                # The consumer left early (disconnect, error). Abort in a task of its own:
                # awaiting here could be cancelled again before the engine hears of it.
                task = asyncio.get_running_loop().create_task(self._abort(ticket))
                _background.add(task)
                task.add_done_callback(_background.discard)
            else:
                self._release(ticket)

    async def _abort(self, ticket: Ticket | None) -> None:
        """Abort the engine requests, then let go of the route version and the adapter's
        turn. In the other order the engine could still run these requests when the next
        adapter's arrive (with a pinned slot vLLM cannot place a batch with more unpinned
        adapters than it has free slots: the engine dies) or after a retired version left.
        An abort that fails is logged: the others still go, and nobody awaits this task."""
        try:
            for request_id in self._request_ids:
                try:
                    await self._engine.abort(request_id)
                except Exception as exc:
                    log.warning("could not abort engine request %s: %s", request_id, exc)
        finally:
            self._release(ticket)

    def _release(self, ticket: Ticket | None) -> None:
        self._lease.release()
        if ticket is not None:
            ticket.release()

    def _engine_steps(self) -> AsyncIterator[StepOutput]:
        priority = self.caller.priority if self.caller is not None else 0
        if len(self._request_ids) == 1 and self._echo is None:  # the hot path: one plain stream
            return self._engine.generate(self._prompt_ids, self._params, self.id, self.lora, priority)
        prompts = [self._prompt_ids, *self._more_prompts]
        params = [self._params, *self._more_params]
        streams = []
        for k, request_id in enumerate(self._request_ids):  # prompt-major: choice p * n + copy
            p = k // self._copies
            stream = self._engine.generate(prompts[p], params[p], request_id, self.lora, priority)
            streams.append(echo_steps(stream, self._echo[p]) if self._echo is not None else stream)
        return streams[0] if len(streams) == 1 else merge_steps(streams, self._per_stream, self._copies)

    def close(self) -> None:
        """Release a generation that was never iterated. Once ``steps`` has run, its own end
        releases, after the engine heard of an abort (``_abort``): releasing here too would
        let go of the route version while the engine may still run the request."""
        if not self._iterated:
            self._lease.release()

    async def collect(self) -> Collected:
        choices = {i: Choice(index=i) for i in range(self.num_choices)}
        async for step in self.steps():
            for chunk in step.chunks:
                choice = choices[chunk.index]
                choice.text.append(chunk.text)
                if chunk.logprobs is not None:
                    choice.logprobs = (choice.logprobs or []) + chunk.logprobs
                if chunk.finish_reason is not None:
                    choice.finish_reason = chunk.finish_reason
        return Collected(
            list(choices.values()), self.prompt_tokens, self.completion_tokens, self.cached_tokens
        )


class ChatService:
    def __init__(
        self, engine: EngineBackend, limits: LimitSettings, scheduler: LoraScheduler | None = None
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._scheduler = scheduler  # None: LoRA requests go straight to the engine
        self._prompts = PromptTokenizer(lambda: engine.tokenizer)
        self._token_bound: TokenBound | None = None  # fewest tokens a text has (``measure_tokenizer``)

    async def measure_tokenizer(self) -> None:
        """Once the engine's tokenizer is there (at start): the most characters one token
        stands for, so that a prompt too long for the context by that bound is refused
        without tokenizing it (``_fits``)."""
        try:
            self._token_bound = await self.with_tokenizer(token_bound)
        except Exception:  # a tokenizer of a shape not foreseen: no bound, as for a slow one
            log.warning("could not read the tokenizer's vocabulary for a length bound", exc_info=True)
        bound = self._token_bound
        if bound is None:
            log.info("no bound on the characters a token stands for: every prompt is tokenized whole")
        else:
            log.info(
                "prompts over %d characters%s are refused before tokenizing (a token stands for %d at most)",
                bound.longest * (self._engine.max_model_len - 1),
                f" in {bound.form}" if bound.form else "",
                bound.longest,
            )

    async def chat(
        self,
        request: ChatCompletionRequest,
        lease: Lease,
        constraint: Constraint | None = None,
        limit_param: str | None = None,
    ) -> Generation:
        """``constraint``: structured decoding asked for outside the chat body (``/v1/responses``'
        ``text.format``); ``limit_param``: the name of the request's token limit where it is
        not chat's (``max_output_tokens``), for the errors that name it."""
        route = lease.route
        plan, shape = await self.check_schemas(
            lambda: _chat_shape(request, route, constraint, self._grammar_check), _carries_schemas(request)
        )
        if plan.constraint is not None and (request.stop or request.stop_token_ids):
            self._check_stop(request)
            # A forced call is all JSON, which its grammar ends. Stop sequences end text (OpenAI's
            # apply to the message content, of which such an answer has none); met inside the
            # call, one cut it while the answer still said it was whole.
            request = request.model_copy(update={"stop": None, "stop_token_ids": None})
        messages = _with_system(template_messages(request.messages), route)
        template, tools = route.chat_template, plan.template_tools()
        if uses_tools(plan, request.messages):  # the default Gemma template knows no tools
            template = template or tool_template()
        prompt_ids = await self._tokenize(
            lambda: self._fits(self._chat_text(messages, template, tools), "messages"),
            request.add_special_tokens,
            size=_size(request.messages, route, tools),
        )
        limit, logprobs = request.token_limit, request.num_logprobs
        if limit_param is None:
            limit_param = (
                "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            )
        gen = await self._start(
            request,
            lease,
            prompt_ids,
            limit,
            logprobs,
            "chatcmpl",
            shape,
            logprobs_param="top_logprobs",
            limit_param=limit_param,
        )
        gen.tools = plan
        return gen

    async def complete(self, request: CompletionRequest, lease: Lease) -> Generation:
        if lease.route.system_prompt:  # a raw prompt has no place for it: refused, not dropped
            raise InvalidRequest(
                f"route '{lease.route.name}' answers with a system prompt, which a completion's raw "
                "prompt cannot carry; use /v1/chat/completions",
                param="model" if request.model else "task",  # the field that chose the route
            )
        prompts = [await self._completion_ids(p, request.add_special_tokens) for p in request.prompts]
        echo = None
        prompt_only = request.echo and request.max_tokens == 0
        if request.echo:
            # A prompt too long for the context is refused before its echo is decoded (a
            # 2 MB body holds a million ids), and many ids are decoded off the event loop.
            self._token_budget(max(map(len, prompts)), None, 0, lease, "prompt")
            pairs = list(zip(request.prompts, prompts, strict=True))

            def texts(tokenizer: Any) -> list[tuple[str, str]]:
                return [
                    (p if isinstance(p, str) else str(tokenizer.decode(ids)), str(tokenizer.decode(ids[:1])))
                    for p, ids in pairs
                ]

            many = sum(len(ids) for p, ids in pairs if not isinstance(p, str)) > _THREAD_DECODE_IDS
            decoded = await self.with_tokenizer(texts) if many else texts(self._engine.tokenizer)
            echo = [Echo(text, first, prompt_only) for text, first in decoded]
        shape = await self.check_schemas(lambda: _constraint(request, lease.route), _carries_schemas(request))
        return await self._start(
            request,
            lease,
            prompts[0],
            1 if prompt_only else request.token_limit,
            request.num_logprobs,
            "cmpl",
            shape,
            more_prompts=prompts[1:],
            echo=echo,
        )

    async def tokenize(
        self,
        route: Route,
        text: str | list[Message],
        add_special_tokens: bool,
        tools: list[ToolDef] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a text, or of messages as the route's chat prompt (the route's
        template and system prompt, and ``tools`` offered, as ``chat`` builds them):
        ``/tokenize``."""
        if isinstance(text, str):
            return await self._tokenize(lambda: text, add_special_tokens, size=len(text), background=True)
        check_tool_messages(text, answered_at_end=False)
        messages = _with_system(template_messages(text), route)
        template, offered = route.chat_template, offered_tools([t.function for t in tools or ()])
        if offered or uses_tools(NO_TOOLS, text):  # tools or tool turns: the template chat would use
            template = template or tool_template()
        return await self._tokenize(
            lambda: self._chat_text(messages, template, offered, **template_kwargs),
            add_special_tokens,
            size=_size(text, route, offered),
            background=True,
        )

    async def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (``/detokenize``); a long list in the tokenizing thread (a
        million ids: 0.33 s), after the prompts waiting there."""
        if len(ids) > _THREAD_DECODE_IDS:
            return await self.with_tokenizer(lambda tokenizer: str(tokenizer.decode(ids)), background=True)
        return str(self._engine.tokenizer.decode(ids))

    def _grammar_check(self, constraint: Constraint) -> None:
        """The engine's grammar backend's check of ``constraint``, remembered once passed (an
        app sends the same schemas with every request): InvalidRequest if it refuses it, or
        would not enforce all of it."""
        self._engine.prepare(SamplingSpec(max_tokens=1, constraint=constraint))

    async def check_schemas(self, check: Callable[[], T], carries_schemas: bool = True) -> T:
        """``check()``, a request's checks of its JSON schemas (tools' ``parameters``, a
        ``response_format``), in a thread when it carries any (``_SCHEMA_CHECKS``)."""
        if not carries_schemas:
            return check()
        return await asyncio.get_running_loop().run_in_executor(_SCHEMA_CHECKS, check)

    async def with_tokenizer(self, call: Callable[[Any], T], background: bool = False) -> T:
        """``call(tokenizer)`` in the tokenizing thread, off the event loop; ``background``
        (``/tokenize``'s work): after every generation request's prompt waiting there."""
        return await self._prompts.run(lambda: call(self._engine.tokenizer), background)

    async def _completion_ids(self, prompt: PromptInput, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            vocab = len(self._engine.tokenizer)
            if max(prompt) >= vocab:
                raise InvalidRequest(
                    f"token id {max(prompt)} is out of vocabulary (ids must be below {vocab})", param="prompt"
                )
            return list(prompt)  # ints already (``CompletionRequest``); a copy at C speed
        self._fits(prompt, "prompt")
        return await self._tokenize(lambda: prompt, add_special_tokens, size=len(prompt))

    async def house(self, chat: ChatCompletionRequest, lease: Lease) -> Generation:
        """``POST /chat``'s request (``HouseChatRequest.chat_request``): chat's, with its
        errors about the messages put on the question."""
        try:
            return await self.chat(chat, lease)
        except InvalidRequest as exc:  # the chat path names its messages: here, the question
            if exc.param is not None and exc.param.split(".")[0] == "messages":
                exc.param = "question"
            raise

    # -- helpers --------------------------------------------------------------------
    def _chat_text(
        self,
        messages: list[dict[str, Any]],
        template: str | None,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True, **extra}
        if template:
            kwargs["chat_template"] = template
        if tools:
            kwargs["tools"] = tools
        try:
            return str(self._engine.tokenizer.apply_chat_template(messages, **kwargs))
        except Exception as exc:  # jinja raise_exception() in a template, bad roles
            raise InvalidRequest(f"messages could not be formatted: {exc}", param="messages") from None

    def _fits(self, text: str, param: str) -> str:
        """``text``, unless even its fewest possible tokens (``TokenBound``) leave no room in
        the context: then the 400 its count would give, without counting (a multi-MB prompt
        takes seconds, every other prompt waiting behind it)."""
        if self._token_bound is not None:
            least = self._token_bound.least_tokens(text)
            context = self._engine.max_model_len
            if least >= context:  # as ``_token_budget``: no room left for one token
                raise _over_context(context, f"at least {least}", param)
        return text

    async def _tokenize(
        self, render: Callable[[], str], add_special_tokens: bool, size: int, background: bool = False
    ) -> list[int]:
        """Token ids of ``render()``. A chat template writes <bos> itself, so chat prompts pass
        ``add_special_tokens=False`` (adding them again would double it)."""
        if size > _THREAD_TOKENIZE_CHARS:
            return await self._prompts.encode(render, add_special_tokens, background)
        return list(self._engine.tokenizer.encode(render(), add_special_tokens=add_special_tokens))

    async def _start(
        self,
        request: SamplingFields,
        lease: Lease,
        prompt_ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        id_prefix: str,
        shape: tuple[Constraint | None, str],
        *,
        more_prompts: list[list[int]] | None = None,
        echo: list[Echo] | None = None,
        logprobs_param: str = "logprobs",
        limit_param: str = "max_tokens",
    ) -> Generation:
        limits = self._limits
        if request.n > limits.max_n:
            raise InvalidRequest(f"n must be at most {limits.max_n}", param="n")
        self._check_stop(request)
        if logprobs is not None and logprobs > limits.max_logprobs:
            raise InvalidRequest(
                f"{logprobs_param} must be at most {limits.max_logprobs}", param=logprobs_param
            )
        vocab = len(self._engine.tokenizer)
        if any(token >= vocab for token in request.logit_bias or {}):
            raise InvalidRequest(f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
        # Each prompt's budget is its own room in the context (as in vLLM), the longest's
        # refusal first: a batch's short prompt is not cut to what a long one leaves.
        prompt_param = "messages" if id_prefix == "chatcmpl" else "prompt"
        budgets = {
            n: self._token_budget(n, max_tokens, request.min_tokens, lease, prompt_param, limit_param)
            for n in sorted({len(p) for p in [prompt_ids, *(more_prompts or ())]}, reverse=True)
        }
        constraint, constraint_param = shape
        sampling = _sampling(
            request,
            lease.route.defaults,
            self._engine.model_defaults,
            budgets[len(prompt_ids)],
            logprobs,
            opened(constraint),  # a named function's, a format's: as the tools' grammars are
        )
        if echo is not None and logprobs is not None:
            sampling = replace(sampling, prompt_logprobs=logprobs)
        # vLLM refuses n > 1 when greedy; OpenAI answers it: one engine request per choice
        # (the prompt's KV blocks are shared through the prefix cache). Only at 0: vLLM raises
        # a temperature in (0, 0.01) to 0.01, which samples (choices seeded seed, seed + 1, ...).
        copies = sampling.n if sampling.n > 1 and sampling.temperature == 0 else 1
        try:
            params = await self._prepare(replace(sampling, n=1) if copies > 1 else sampling, constraint_param)
        except InvalidRequest as exc:  # vLLM's refusal names its own field: say the client's
            ours = {"logprobs": logprobs_param, "prompt_logprobs": logprobs_param, "max_tokens": limit_param}
            exc.param = ours.get(exc.param or "", exc.param)
            raise
        resized = {sampling.max_tokens: params}  # checked once; the others differ in max_tokens only
        for budget in budgets.values():
            if budget not in resized:
                resized[budget] = self._engine.with_max_tokens(params, budget)
        return Generation(
            self._engine,
            lease,
            prompt_ids,
            sampling,
            params,
            id_prefix,
            more_prompts=more_prompts or (),
            more_params=[resized[budgets[len(p)]] for p in more_prompts or ()],
            echo=echo,
            copies=copies,
            scheduler=self._scheduler if lease.route.lora is not None else None,
        )

    def _check_stop(self, request: SamplingFields) -> None:
        if len(request.stop_list) > self._limits.max_stop:
            raise InvalidRequest(f"at most {self._limits.max_stop} stop sequences are allowed", param="stop")
        if any(not s for s in request.stop_list):
            raise InvalidRequest("stop sequences must not be empty", param="stop")
        vocab = len(self._engine.tokenizer)
        if any(not 0 <= token < vocab for token in request.stop_token_ids or ()):
            raise InvalidRequest(f"stop_token_ids must be token ids below {vocab}", param="stop_token_ids")

    def _token_budget(
        self,
        prompt_len: int,
        max_tokens: int | None,
        min_tokens: int,
        lease: Lease,
        prompt_param: str,
        limit_param: str = "max_tokens",
    ) -> int:
        """``max_tokens``, or the route's default if None (raised to ``min_tokens`` if that
        is more), checked against the context left and capped at vLLM's server-wide limit
        (``ModelDefaults.max_tokens_limit``). A limit below
        ``min_tokens`` is a 400, as in vLLM. ``limit_param``: the field the limit came from
        (chat's ``max_completion_tokens`` or ``max_tokens``), named in those errors."""
        context = self._engine.max_model_len
        cap = self._engine.model_defaults.max_tokens_limit
        room = context - prompt_len
        if room <= 0:
            raise _over_context(context, str(prompt_len), prompt_param)
        if max_tokens is not None and max_tokens < min_tokens:
            raise InvalidRequest(
                f"min_tokens must be at most {limit_param} ({max_tokens}), got {min_tokens}",
                param="min_tokens",
            )
        if max_tokens is not None and cap is not None:  # vLLM: min(room, max_tokens, the limit)
            max_tokens = min(max_tokens, cap)
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion).",
                param=limit_param,
            )
        if max_tokens is None and min_tokens > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"at least {prompt_len + min_tokens} tokens ({prompt_len} in the prompt, "
                f"min_tokens {min_tokens} for the completion).",
                param="min_tokens",
            )
        if cap is not None and min_tokens > cap:
            raise InvalidRequest(
                f"min_tokens must be at most the server's limit on max_tokens ({cap}), got {min_tokens}",
                param="min_tokens",
            )
        if max_tokens is None:
            default = min(
                lease.route.defaults.max_tokens
                or self._engine.model_defaults.max_tokens
                or self._limits.default_max_tokens,
                room,
                room if cap is None else cap,
            )
            max_tokens = max(default, min_tokens)
        return max_tokens

    async def _prepare(self, sampling: SamplingSpec, constraint_param: str) -> Any:
        """The engine's form of ``sampling``; a constraint its grammar backend refuses is
        reported on the field it came from, at the place in the schema the client wrote.
        With a constraint, in a thread: the grammar backend converts it on the calling
        thread (vLLM's regex check even waits there, up to its 5 s timeout), which took
        0.25 s for 2 MB of choices; on the event loop every stream would stall meanwhile."""
        try:
            if sampling.constraint is None:
                return self._engine.prepare(sampling)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(_CONSTRAINT_CHECKS, self._engine.prepare, sampling)
        except InvalidRequest as exc:
            _name_constraint_field(exc, constraint_param)
            raise


def _sampling(
    request: SamplingFields,
    defaults: SamplingDefaults,
    model: ModelDefaults,
    max_tokens: int,
    logprobs: int | None,
    constraint: Constraint | None,
) -> SamplingSpec:
    """Request values, else the route's defaults, else the model's (its generation_config,
    as vLLM's server applies them), else OpenAI's."""
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=_pick(request.temperature, defaults.temperature, model.temperature, 1.0),
        top_p=_pick(request.top_p, defaults.top_p, model.top_p, 1.0),
        top_k=max(int(_pick(request.top_k, defaults.top_k, model.top_k, 0)), 0),  # -1, as 0: off (vLLM's)
        n=request.n,
        stop=request.stop_list,
        seed=request.seed,
        presence_penalty=_pick(
            request.presence_penalty, defaults.presence_penalty, model.presence_penalty, 0.0
        ),
        frequency_penalty=_pick(
            request.frequency_penalty, defaults.frequency_penalty, model.frequency_penalty, 0.0
        ),
        repetition_penalty=_pick(
            request.repetition_penalty, defaults.repetition_penalty, model.repetition_penalty, 1.0
        ),
        logprobs=logprobs,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        min_p=_pick(request.min_p, defaults.min_p, model.min_p, 0.0),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias=tuple(sorted((request.logit_bias or {}).items())),
        constraint=constraint,
    )


def _chat_shape(
    request: ChatCompletionRequest,
    route: Route,
    given: Constraint | None,
    grammar: Callable[[Constraint], None],
) -> tuple[ToolPlan, tuple[Constraint | None, str]]:
    """How the answer is shaped: the tools' plan, and the constraint with the field it came
    from (``given``: ``/v1/responses``' ``text.format``). Checks every schema of the request;
    ``grammar``: the grammar backend's check of a constraint (InvalidRequest if refused)."""
    plan = plan_tools(request)
    if plan.constraint is not None:  # calls forced: the grammar of the calls themselves
        _check_forced_calls(plan, request, route, given, grammar)
        return plan, (plan.constraint, "tools")
    shape, param = _constraint(request, route, given, _TEXT_FORMAT)
    plan, constraint = _or_calls(plan, route, shape, param, grammar)
    return plan, (constraint, param)


def _carries_schemas(request: SamplingFields) -> bool:
    """Whether the request has schemas of its own to check (tools, a structured output)."""
    extra = request.model_extra or {}
    return bool(getattr(request, "tools", None)) or any(
        extra.get(name) is not None for name in ("response_format", "structured_outputs")
    )


def _constraint(
    request: SamplingFields, route: Route, given: Constraint | None = None, given_param: str = ""
) -> tuple[Constraint | None, str]:
    """The output's shape and the field it came from: ``given`` (asked for outside the
    body, by ``/v1/responses``' ``given_param``), else the body's ``response_format`` or
    ``structured_outputs``; the route's default when none, its own if it enforces one."""
    asked, param = _asked(request, given, given_param)
    return choose(asked, param, route.response_format, route.enforce, route.name), param


def _asked(
    request: SamplingFields, given: Constraint | None, given_param: str
) -> tuple[Constraint | None, str]:
    asked, param = request_constraint(request.model_extra or {})
    return (given, given_param) if given is not None else (asked, param)


def _or_calls(
    plan: ToolPlan,
    route: Route,
    shape: Constraint | None,
    param: str,
    grammar: Callable[[Constraint], None],
) -> tuple[ToolPlan, Constraint | None]:
    """Under ``tool_choice: auto`` the model may call a tool or answer; a structured output
    shapes the answer, so the grammar takes either (as OpenAI; openai-agents sends an
    agent's ``output_type`` and its tools together). A route that enforces its format, or
    reads no calls (``tool_parser: none``), keeps the format alone. A strict function's
    arguments are decoded against its schema where the grammar backend holds it whole;
    where not (a keyword it would ignore, a ``format`` it lacks) they stay free. Either way
    the grammar decides what is a call (``ToolPlan.formatted``): text here must be the answer."""
    if plan.mode != "auto" or not plan.tools or shape is None or route.tool_parser != "json":
        return plan, shape
    if (route.enforce and route.response_format is not None) or shape.kind == "json_object":
        return plan, shape  # enforced; or any JSON object, which a call is
    if shape.kind != "json":
        raise InvalidRequest(
            f"a {shape.kind} structured output leaves no room for a tool call under tool_choice 'auto': "
            "use a JSON schema, or tool_choice 'none'",
            param=param or "structured_outputs",
        )
    decoded = frozenset(
        fn.name for fn in plan.tools if fn.is_strict and _holds(grammar, arguments_schema(fn))
    )
    plan = replace(plan, formatted=True)
    return plan, Constraint("json", answer_or_calls_schema(plan.tools, plan.parallel, shape.value, decoded))


def _holds(grammar: Callable[[Constraint], None], schema: dict[str, Any]) -> bool:
    try:
        grammar(Constraint("json", schema))
    except InvalidRequest:
        return False
    return True


def _check_forced_calls(
    plan: ToolPlan,
    request: SamplingFields,
    route: Route,
    given: Constraint | None,
    grammar: Callable[[Constraint], None],
) -> None:
    """Forced calls are generated under the tools' grammar. The answer is then a call, not
    text, so a structured output the request asks for (checked all the same, by the grammar
    backend too) shapes nothing, as with OpenAI, which takes both (instructor's
    RESPONSES_TOOLS sends both). Plain text asked for by name (``TEXT``) is no grammar to
    check. A route that enforces its format promises every answer follows it: a forced call
    there is a 400."""
    choice = "'required'" if plan.mode == "required" else f"naming the function '{plan.named}'"
    asked, param = _asked(request, given, _TEXT_FORMAT)
    if route.enforce and route.response_format is not None:
        raise InvalidRequest(
            f"route '{route.name}' enforces its own response format ({describe(route.response_format)}), "
            f"which tool_choice {choice} would replace; use tool_choice 'auto' or 'none'",
            param="tool_choice",
        )
    if asked is not None and asked != TEXT:
        try:
            grammar(asked)
        except InvalidRequest as exc:
            _name_constraint_field(exc, param)
            raise


def _name_constraint_field(exc: InvalidRequest, param: str) -> None:
    """The engine names any refused constraint ``response_format``: name the field it came
    from, at the place in the schema the client wrote."""
    if exc.param == "response_format":
        exc.param = _SCHEMA_PARAMS.get(param, param)
        exc.message = in_answer_terms(exc.message)


def _pick(*values: float | None) -> float:
    for value in values:
        if value is not None:
            return value
    raise AssertionError("the last value is a default")


def _with_system(messages: list[dict[str, Any]], route: Route) -> list[dict[str, Any]]:
    """The template's messages, with the route's system prompt unless they have one."""
    if route.system_prompt and not any(m["role"] in ("system", "developer") for m in messages):
        messages.insert(0, {"role": "system", "content": route.system_prompt})
    return messages


def _over_context(context: int, tokens: str, param: str) -> ContextLengthExceeded:
    """OpenAI's 400 for a prompt that leaves no room in the context; ``tokens``: its count,
    or a bound on it ("at least N")."""
    return ContextLengthExceeded(
        f"This model's maximum context length is {context} tokens, but the prompt has {tokens} tokens.",
        param=param,
    )


def _size(messages: list[Message], route: Route, tools: list[dict[str, Any]] | None = None) -> int:
    """About how much the chat template reads, in characters, for ``_THREAD_TOKENIZE_CHARS``:
    each message's text and calls, and a little for each message (thousands of empty turns
    still take long to render), and the route's system prompt. Offered tools always count as
    large: the template writes each one out as JSON."""
    if tools:
        return _THREAD_TOKENIZE_CHARS + 1
    size = len(route.system_prompt or "")
    for m in messages:
        size += _MESSAGE_CHARS + len(m.text)
        for call in m.tool_calls or ():
            size += len(call.function.name) + len(call.function.arguments)
    return size
