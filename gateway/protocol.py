"""Wire models: OpenAI requests in (validated once per request), response bodies out.

No vllm here. Requests are pydantic models; responses are plain dicts built by small
functions, because a response is built once and a pydantic round trip buys nothing.
Per-chunk streaming bytes are built in ``sse``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant"]


class _Request(BaseModel):
    # Unknown fields are ignored (SDKs send many); NaN/inf are refused everywhere.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, str_max_length=10_000_000)

    # Fields that would change the answer but that this gateway does not implement:
    # refusing them beats silently ignoring them.
    _unsupported = ("tools", "functions", "tool_choice", "function_call", "best_of", "suffix", "echo")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        for name in self._unsupported:
            value = (self.model_extra or {}).get(name)
            if value not in (None, [], False, 1, "none", "auto"):
                raise ValueError(f"'{name}' is not supported by this gateway")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions; ``None`` means the route's default."""

    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("messages")
    @classmethod
    def _needs_a_turn(cls, messages: list[Message]) -> list[Message]:
        if all(m.role in ("system", "developer") for m in messages):
            raise ValueError("messages must contain at least one user or assistant message")
        return messages

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and min(prompt) < 0:
            raise ValueError("token ids must be non-negative")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class HouseChatRequest(_Request):
    """The in-house ``POST /chat`` body."""

    question: str = Field(min_length=1)
    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)


# -- response bodies -------------------------------------------------------------------
def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_card(name: str, owned_by: str, created: int, parent: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": name if parent is None else parent,
        "parent": parent,
        **extra,
    }
