"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` (text, special tokens added by default) or ``messages``
(rendered as the route's chat prompt: its template and system prompt, as for chat, with
``tools`` as a chat offering them renders them) and
answers ``{count, max_model_len, tokens}`` (plus ``token_strs`` if asked). ``/detokenize``
takes ``tokens`` and answers ``{prompt}``. ``model`` (or ``task``) picks the route, as on
/v1/*; without either, the base model's. They need a key like everything but public
paths, and take no admission slot: they use the tokenizer, not the engine, and their
work in its thread waits while a generation request's prompt does (``PromptTokenizer``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import InvalidRequest
from gateway.protocol import Message, _Request, no_empty_tools, null_is_default
from gateway.responses import read_json
from gateway.state import Gateway
from gateway.tools import ToolChoice, ToolDef


class TokenizeRequest(_Request):
    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=128)  # rendered as chat renders them
    tool_choice: ToolChoice | None = None  # taken; chat renders the tools whatever it is

    _nulls = field_validator(  # null: the default, as vLLM takes it
        "add_generation_prompt", "continue_final_message", "return_token_strs", mode="before"
    )(null_is_default)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both continue_final_message and add_generation_prompt to true",
                param="continue_final_message",
            )
        for name in ("chat_template", "chat_template_kwargs"):
            if (self.model_extra or {}).get(name):
                raise InvalidRequest(f"'{name}' is not supported: the route's template applies", param=name)
        if self.tools is not None and self.messages is None:
            raise InvalidRequest("'tools' needs 'messages': a prompt is tokenized as it is", param="tools")
        no_empty_tools(self.tools)
        return self


class DetokenizeRequest(_Request):
    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    tokens: list[int] = Field(max_length=1_000_000)


def _principal(request: Request) -> Any:
    return request.scope.get("state", {}).get("principal")


async def tokenize(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_json(request, TokenizeRequest, gw.settings.limits)
    lease = gw.lease(_principal(request), body.model, body.task)
    try:
        if body.messages is not None:
            ids = await gw.service.tokenize(
                lease.route,
                body.messages,
                bool(body.add_special_tokens),
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=body.tools,
            )
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await gw.service.tokenize(lease.route, body.prompt or "", special)
    finally:
        lease.release()
    result: dict[str, Any] = {"count": len(ids), "max_model_len": gw.engine.max_model_len, "tokens": ids}
    result["token_strs"] = None  # unless asked for: null, as vLLM answers
    if body.return_token_strs:  # 0.28 s for 520,000 ids (a 2 MB prompt): off the event loop
        result["token_strs"] = await gw.service.with_tokenizer(
            lambda tokenizer: tokenizer.convert_ids_to_tokens(ids), background=True
        )
    return JSONResponse(result)


async def detokenize(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await read_json(request, DetokenizeRequest, gw.settings.limits)
    gw.lease(_principal(request), body.model, body.task).release()  # the route must exist
    vocab = len(gw.engine.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequest(f"token ids must be between 0 and {vocab - 1}", param="tokens")
    return JSONResponse({"prompt": await gw.service.decode(body.tokens)})
