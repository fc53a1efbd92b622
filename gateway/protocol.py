"""Wire models: OpenAI requests in (validated once per request), response bodies out.

No vllm here. Requests are pydantic models; responses are plain dicts built by small
functions, because a response is built once and a pydantic round trip buys nothing.
Per-chunk streaming bytes are built in ``sse``.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.errors import InvalidRequest
from gateway.tools import ToolCall, ToolChoice, ToolDef
from gateway.types import TokenCounts

Role = Literal["system", "developer", "user", "assistant", "tool"]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed range
MAX_LOGIT_BIAS = 300  # entries in one logit_bias, as OpenAI (vLLM has no cap)


class _Request(BaseModel):
    # Unknown fields are ignored (SDKs send many); NaN/inf are refused everywhere.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, str_max_length=10_000_000)

    # Fields that would change the answer but that this gateway does not implement:
    # refusing them beats silently ignoring them. (Chat requests declare ``tools`` and
    # ``tool_choice`` as fields, completions ``echo``, so only the other endpoints refuse
    # them here; chat refuses ``echo`` itself.)
    _unsupported: tuple[str, ...] = ("tools", "tool_choice", "best_of", "suffix")

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_left_out(cls, data: Any) -> Any:
        """Null for a field ``null_is_default`` takes is that field left out, in
        ``model_fields_set`` too (``stream: null`` is not a ``stream: false`` given)."""
        if isinstance(data, dict):
            nulls = _null_fields(cls)
            if any(data.get(name, 0) is None for name in nulls):
                return {key: value for key, value in data.items() if value is not None or key not in nulls}
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Request:
        extra = self.model_extra or {}
        for name in ("functions", "function_call"):  # OpenAI's deprecated forms of tools
            if extra.get(name) not in (None, [], "none"):
                raise InvalidRequest(
                    f"'{name}' is deprecated and not supported; use 'tools' and 'tool_choice'", param=name
                )
        for name in self._unsupported:
            if not _harmless(extra.get(name)):
                raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name)
        for name in VLLM_UNIMPLEMENTED:
            value = extra.get(name)
            if _asks_nothing(value) or _at_number_default(name, value):
                continue
            if name not in _VLLM_BOOLS or not _reads_as(value, False):
                raise InvalidRequest(f"{name}: vLLM's '{name}' is not supported by this gateway", param=name)
        for name, default in VLLM_DEFAULT_ONLY.items():
            if extra.get(name) is not None and not _reads_as(extra.get(name), default):
                raise InvalidRequest(
                    f"{name}: only {str(default).lower()} is supported by this gateway", param=name
                )
        _refuse_openai_chat_options(extra)
        return self


_BOOL = TypeAdapter(bool)


def _reads_as(value: Any, default: bool) -> bool:
    """``value`` is ``default`` as vLLM's request model reads a bool (``0``, ``"false"`` and
    ``"off"`` are false there, ``1`` and ``"true"`` true); a value that is no bool is not."""
    try:
        return _BOOL.validate_python(value) is default
    except ValidationError:
        return False


def _generation_prompt(value: Any) -> bool:
    """Unset, or true as vLLM's request model reads a bool (``"false"``, ``0`` and ``"off"``
    are false there too); a value that is no bool is a 400."""
    if value is None:
        return True
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        raise InvalidRequest(
            f"add_generation_prompt must be a boolean, not {str(value)[:40]!r}", param="add_generation_prompt"
        ) from None


def _refuse_openai_chat_options(extra: dict[str, Any]) -> None:
    """OpenAI chat's fields for what this model cannot do: audio answers, web search,
    moderation, a verbosity or a reasoning effort. A request for them is refused, not
    answered without them (on completions too, where OpenAI refuses them as unknown and vLLM
    would ignore them)."""
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequest("modalities: this model answers in text only (['text'])", param="modalities")
    for name in ("audio", "web_search_options"):  # ``{}`` asks for web search with its defaults
        if extra.get(name) is not None:
            raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name)
    if extra.get("moderation") is not None:
        raise InvalidRequest("'moderation' is not supported by this gateway", param="moderation")
    if extra.get("verbosity") not in (None, "medium"):  # OpenAI's; low/high would change the answer
        raise InvalidRequest("verbosity: only 'medium' is supported by this gateway", param="verbosity")
    # OpenAI refuses it for a model that does not reason; vLLM hands it to the chat template,
    # which here does not read it. "none" (no reasoning) is what this model does anyway.
    if extra.get("reasoning_effort") not in (None, "none"):
        raise InvalidRequest(
            "reasoning_effort: this model does not reason; only 'none' is supported",
            param="reasoning_effort",
        )


# vLLM's own request fields that would change the answer (or its shape) and that this
# gateway does not implement: a 400 naming the field, never silently ignored.
VLLM_UNIMPLEMENTED = (
    "prompt_logprobs",
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "continue_final_message",
    "min_characters",
    "bad_words",
    "allowed_token_ids",
    "prompt_embeds",
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "watermarking",
    "thinking_token_budget",
    "logprob_token_ids",
    "repetition_detection",
    "return_token_offsets",
    "return_prompt_text",
    "truncation_side",
    "vllm_xargs",
)
# Those of them whose vLLM default is a number: sent at it, the field asks nothing (a client
# that sends a whole vLLM request sends ``length_penalty: 1.0``).
_VLLM_NUMBER_DEFAULTS: dict[str, float] = {"length_penalty": 1.0}
# Those that vLLM types as a bool: its default, false, is any value vLLM reads as false (0, "false").
_VLLM_BOOLS = frozenset(
    {
        "use_beam_search",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "continue_final_message",
        "return_token_offsets",
        "return_prompt_text",
        "watermarking",
    }
)
# vLLM's bools that this gateway only has at their default: any other value is a 400.
VLLM_DEFAULT_ONLY: dict[str, bool] = {"skip_special_tokens": True, "spaces_between_special_tokens": True}


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``field_validator(mode="before")``: null for a field the SDKs type ``Optional``
    (``n``, ``stream``, ...) means its default, as in vLLM. ``/openapi.json`` shows these
    fields as nullable."""
    if value is None:
        return cls.model_fields[info.field_name or ""].get_default(call_default_factory=True)
    return value


def null_default_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` for which ``null_is_default`` takes null."""
    return frozenset(
        name
        for validator in model.__pydantic_decorators__.field_validators.values()
        if getattr(validator.func, "__func__", validator.func) is null_is_default
        for name in validator.info.fields
    )


_null_fields = functools.cache(null_default_fields)


def _asks_nothing(value: Any) -> bool:
    """Absent, null, false or empty: a vLLM field at its default. (0 and 1 ask for
    something here: ``prompt_logprobs: 0`` is the prompt's own logprobs.)"""
    return value is None or value is False or (isinstance(value, list | dict) and not value)


def _at_number_default(name: str, value: Any) -> bool:
    """``value`` is vLLM's numeric default for ``name`` (by type too: ``True == 1``)."""
    default = _VLLM_NUMBER_DEFAULTS.get(name)
    return default is not None and type(value) in (int, float) and value == default


def _harmless(value: Any) -> bool:
    """A value that asks for nothing: absent, empty, off, "none"/"auto", or best_of 1.
    Compared by type too: ``True == 1`` in Python, and ``echo: true`` is not harmless."""
    if value is None or value is False or value in ([], {}, "none", "auto"):
        return True
    return type(value) is int and value == 1


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # null: the default, as vLLM takes it
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk, refused when true


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions; ``None`` means the route's default."""

    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # vLLM's: 0 or -1 disables it; int64 (msgpack)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's server takes any value above 0; logit / it and logit * it stay finite in float32
    repetition_penalty: float | None = Field(None, ge=1e-30, le=1e30)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # vLLM's: drop tokens below min_p x the top token's probability; stop on these ids;
    # keep the stop string that ended the answer in its text.
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    user: str | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # token id (a JSON object's keys are strings) -> bias added to its logit, as OpenAI
    logit_bias: dict[int, float] | None = None

    _nulls = field_validator("n", "stream", "min_tokens", "ignore_eos", mode="before")(null_is_default)

    # InvalidRequest (not ValueError) passes through pydantic untouched, with its param.
    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _penalty_floor(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e-30:
            raise InvalidRequest(
                "repetition_penalty must be at least 1e-30: the sampler divides logits by it in float32",
                param="repetition_penalty",
            )
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, bias: Any) -> Any:
        if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", param="logit_bias"
            )
        if isinstance(bias, dict) and not all(str(k).isascii() and str(k).isdigit() for k in bias):
            raise InvalidRequest(
                "logit_bias keys must be token ids (non-negative integers)", param="logit_bias"
            )
        if isinstance(bias, dict) and not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()
        ):  # as OpenAI: true and "5" are not biases
            raise InvalidRequest("logit_bias values must be numbers", param="logit_bias")
        return bias

    @model_validator(mode="after")
    def _check_sampling(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options can only be set when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequest(
                "stream_options.continuous_usage_stats is not supported by this gateway",
                param="stream_options.continuous_usage_stats",
            )
        if any(not -100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()):
            raise InvalidRequest("logit_bias values must be between -100 and 100", param="logit_bias")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            # Choice i is seeded seed + i (vLLM's ParentRequest, and the greedy copies here):
            # past int64 the engine core's seed array overflows.
            raise InvalidRequest(
                f"seed must be at most {INT64_MAX - self.n + 1} with n={self.n}", param="seed"
            )
        best_of = (self.model_extra or {}).get("best_of")  # 1 asks nothing, but only for one choice
        if type(best_of) is int and best_of == 1 and self.n > 1:
            raise InvalidRequest("best_of must be at least n", param="best_of")  # as OpenAI
        return self

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
    # Validated when left out too: only an assistant's may be (``_content_needed``).
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    @field_validator("content")
    @classmethod
    def _content_needed(cls, content: Any, info: ValidationInfo) -> Any:
        """OpenAI requires the content of every message but an assistant's (vLLM's server too:
        a 400); rendered as empty text, such a turn became a prompt neither would send."""
        role = info.data.get("role")
        if content is None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message needs content: a string or a list of text parts")
        return content

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any, info: ValidationInfo) -> Any:
        # An image or audio part gets a clear answer rather than "should be a valid string".
        # An assistant's refusal part (OpenAI's, in a replayed history) is its text, as vLLM
        # reads it.
        if not isinstance(content, list):
            return content
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal" and info.data.get("role") == "assistant":
                part = {"type": "text", "text": part.get("refusal")}
            elif isinstance(kind, str) and kind != "text":
                raise ValueError(f"'{kind[:40]}' content parts are not supported by this model (text only)")
            parts.append(part)
        return parts

    @model_validator(mode="before")
    @classmethod
    def _no_function_call(cls, message: Any) -> Any:
        # OpenAI's deprecated form of a call in the history: answering as if the call had not
        # been made would change the answer, so it is refused like the top-level form.
        if isinstance(message, dict) and message.get("function_call") is not None:
            raise ValueError("'function_call' is deprecated and not supported; send 'tool_calls'")
        return message

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins text parts


def no_empty_tools(tools: list[ToolDef] | None) -> None:
    if tools == []:  # as OpenAI and vLLM
        raise InvalidRequest("'tools' must not be an empty array; leave it out instead", param="tools")


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes <bos>; true adds another

    _chat_nulls = field_validator("logprobs", "add_special_tokens", mode="before")(null_is_default)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        extra = self.model_extra or {}
        # vLLM's default, true, is what the gateway does (completions have no such field)
        if not _generation_prompt(extra.get("add_generation_prompt")):
            raise InvalidRequest(
                "add_generation_prompt: false is not supported by this gateway", param="add_generation_prompt"
            )
        if extra.get("echo") is not None and not _reads_as(extra.get("echo"), False):
            raise InvalidRequest("echo is not supported on chat completions", param="echo")
        no_empty_tools(self.tools)
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


# Chat's names for what completions name otherwise (vLLM ignores them there, and the
# answer would not be what was asked): refused, naming the field to use.
_CHAT_ONLY = {
    "max_completion_tokens": "'max_tokens'",
    "messages": "'prompt' (or use /v1/chat/completions)",
    "top_logprobs": "'logprobs' (the number of top tokens)",
}
PromptInput = str | list[int]
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
MAX_PROMPTS = 256  # prompts in one /v1/completions request (vLLM allows 1024)


class CompletionRequest(SamplingFields):
    # The types say what ``_check_prompts`` checks first (with clearer messages), for the schema.
    prompt: (
        str
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(max_length=MAX_PROMPTS)]
    ) = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, as vLLM
    add_special_tokens: bool = True  # vLLM's: <bos> before a text prompt

    _completion_nulls = field_validator("echo", "add_special_tokens", mode="before")(null_is_default)

    @model_validator(mode="after")
    def _zero_tokens_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
        extra = self.model_extra or {}
        for name, instead in _CHAT_ONLY.items():  # a request that sends them means them
            if extra.get(name) not in (None, False):
                raise InvalidRequest(
                    f"'{name}' is a chat completions field; /v1/completions takes {instead}", param=name
                )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompts(cls, prompt: Any) -> Any:
        # Before pydantic's union, so that a bad prompt is one clear message on "prompt"
        # (the union's own errors would name a member: "prompt.constrained-str").
        if not isinstance(prompt, str | list):
            raise ValueError("prompt must be a string, a list of strings, token ids, or lists of token ids")
        if isinstance(prompt, str) or not prompt:
            return prompt
        prompts = _as_prompts(prompt)
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        for one in prompts:
            if not one:
                raise ValueError("prompts must not be empty")
            if isinstance(one, list) and not all(type(t) is int and t >= 0 for t in one):
                raise ValueError("token ids must be non-negative integers")
            if not isinstance(one, str | list) or type(one) is not type(prompts[0]):
                raise ValueError(
                    "prompt must be a string, a list of strings, token ids, or lists of token ids"
                )
        return prompt

    @property
    def prompts(self) -> list[PromptInput]:
        """One entry per prompt: text, or token ids."""
        return _as_prompts(self.prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def _as_prompts(prompt: Any) -> list[PromptInput]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


# What the house stream cannot carry (one choice, text only): refused unless unused.
# Refused up front; ``n`` and ``logprobs`` go on to chat, which reads them (``logprobs: 1`` is
# true there), and the route refuses what the house stream then cannot carry.
_HOUSE_CANNOT = ("messages", "tools", "tool_choice", "parallel_tool_calls")


class HouseChatRequest(_Request):
    """The in-house ``POST /chat`` body. Chat's other fields (``stop``, ``top_p``, ``seed``,
    ``response_format``, ...) go on to the chat request, which honours or refuses them."""

    # Tools are chat completions' (``_HOUSE_CANNOT`` says so), not missing from the gateway.
    _unsupported = ("best_of", "suffix")

    question: str = Field(min_length=1)
    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    stream: bool = True  # it always streams: false is refused, not ignored

    _nulls = field_validator("stream", mode="before")(null_is_default)

    @model_validator(mode="after")
    def _house_shape(self) -> HouseChatRequest:
        if not self.stream:
            raise InvalidRequest(
                "POST /chat always streams (the house SSE format); for one JSON answer use "
                "/v1/chat/completions",
                param="stream",
            )
        extra = self.model_extra or {}
        for name in _HOUSE_CANNOT:
            if not _harmless(extra.get(name)):
                raise InvalidRequest(
                    f"'{name}' is not supported by POST /chat; use /v1/chat/completions", param=name
                )
        options = extra.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") not in (None, False):
            raise InvalidRequest(
                "the house stream format carries no usage chunk", param="stream_options.include_usage"
            )
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this asks: the question as the user's message, chat's other
        fields as given (chat checks them: a 400 names the field)."""
        extra = self.model_extra or {}
        try:
            return ChatCompletionRequest(
                messages=[{"role": "user", "content": self.question}],
                stream=True,  # the house format always streams (chat checks stream_options under it)
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                **{name: value for name, value in extra.items() if name not in _HOUSE_CANNOT},
            )
        except ValidationError as exc:
            raise invalid_request(exc) from None


# -- validation errors -----------------------------------------------------------------
# How pydantic names the member of a union in an error's location ("input.constrained-str").
_MEMBER = re.compile(
    r"(constrained-)?(str|int|float|bool|none)|(list|dict|tuple|set|function-\w+|nullable)\[.*\]"
)


def _union_member(part: str | int) -> bool:
    """A union member's name, or ``[key]`` (a dict key's error): not a field."""
    return isinstance(part, str) and (part == "[key]" or _MEMBER.fullmatch(part) is not None)


def invalid_request(exc: ValidationError, at: str | None = None) -> InvalidRequest:
    """A request model's first validation error as a 400 naming the field (under ``at``, the
    place of the model validated in the request: ``tools[1]``)."""
    err = exc.errors()[0]
    fields = [str(p) for p in err["loc"] if not _union_member(p)]
    param = ".".join([at, *fields] if at else fields) or None
    message = err["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"{param}: {message}" if param else message, param=param)


# -- response bodies -------------------------------------------------------------------
def usage_dict(tokens: TokenCounts) -> dict[str, Any]:
    """Chat's and completions' ``usage`` (OpenAI's ``CompletionUsage``, one type for both)."""
    return {
        "prompt_tokens": tokens.prompt_tokens,
        "completion_tokens": tokens.completion_tokens,
        "total_tokens": tokens.prompt_tokens + tokens.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": tokens.cached_tokens},
    }


def model_card(
    name: str, owned_by: str, created: int, parent: str | None, root: str | None = None, **extra: Any
) -> dict[str, Any]:
    """``root``: the model at the bottom (default: ``parent``, else ``name`` itself)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": root or parent or name,
        "parent": parent,
        **extra,
    }
