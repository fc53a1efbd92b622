"""Types shared across the request path, with no vllm and no web framework in them.

The engine speaks these (``engine`` converts to and from vLLM's own types), the service
and the encoders read them, the catalog hands out ``LoraSpec``. ``EngineBackend`` is the
seam between the gateway and an engine: ``engine.EngineManager`` is the real one, and
``tests/unit/fakes.FakeEngine`` a scripted one for tests without vllm.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar", "text"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """Structured decoding: the engine only samples tokens that keep the output inside
    this language. ``value`` by kind: ``json`` a JSON schema (dict), ``regex`` and
    ``grammar`` a string, ``choice`` a tuple of strings, ``json_object`` None (any JSON
    object). ``text`` (``structured.TEXT``) is plain text asked for by name, which wins over
    a route's default format that the route does not enforce; ``structured.choose`` turns
    it into None, so the engine never sees it."""

    kind: ConstraintKind
    value: Any = None


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    prompt_logprobs: int | None = None  # top-k per prompt token (completions ``echo``)


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """The model's own sampling defaults: its ``generation_config.json`` (or the engine's
    ``override_generation_config``), as vLLM's server applies them to the fields a request
    leaves out. None: the model says nothing (the OpenAI default holds)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None  # Hugging Face's max_new_tokens
    # vLLM's server-wide limit on max_tokens: an override's max_new_tokens (or the model's,
    # under a generation_config folder the operator names)
    max_tokens_limit: int | None = None


@dataclass(frozen=True, slots=True)
class LoraSpec:
    name: str
    lora_id: int
    path: str


@dataclass(slots=True)
class TokenLogprob:
    """One token's logprob and the ``top`` k alternatives, best first. ``logprob`` is None
    for a prompt's first token (nothing precedes it)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """New output of one choice since the last step."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class StepOutput:
    chunks: list[Chunk]
    prompt_tokens: int
    finished: bool
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first step, if asked for
    cached_tokens: int = 0  # of ``prompt_tokens``, those the engine read from its prefix cache


class TokenCounts(Protocol):
    """A request's tokens, as its ``usage`` reports them (``service.Generation``, ``Collected``):
    ``cached_tokens`` are the prompt tokens served from the engine's prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Tokenizer(Protocol):
    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class EngineBackend(Protocol):
    """What the service needs from an engine: generation only."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_defaults(self) -> ModelDefaults: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def prepare(self, sampling: SamplingSpec) -> Any:
        """The engine's own form of ``sampling``, for ``generate``; InvalidRequest if refused."""

    def with_max_tokens(self, params: Any, max_tokens: int) -> Any:
        """``params`` (from ``prepare``) with another ``max_tokens``: a batch's prompts each
        get their own room in the context."""

    def generate(
        self, prompt_ids: list[int], params: Any, request_id: str, lora: LoraSpec | None, priority: int = 0
    ) -> AsyncIterator[StepOutput]:
        """``priority``: lower runs first where the engine schedules by priority; else ignored."""

    async def abort(self, request_id: str) -> None: ...


class Engine(EngineBackend, Protocol):
    """What the app needs on top: life cycle, readiness and LoRA slots."""

    model_path: str | None
    served_model_name: str

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    def unfinished_requests(self) -> int | None: ...

    async def add_lora(self, lora: LoraSpec) -> None: ...

    async def remove_lora(self, lora_id: int) -> None: ...

    async def pin_lora(self, lora_id: int) -> None: ...

    async def list_loras(self) -> set[int]: ...

    async def lora_slots(self) -> set[int] | None:
        """The adapters in a GPU slot; None where the engine cannot say."""
        ...
