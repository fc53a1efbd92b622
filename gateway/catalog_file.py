"""The catalog file's schema: what ``configs/adapters.yaml`` may say, entry by entry.

``catalog.load_table`` validates the file against these models (unknown keys are errors)
and builds its immutable ``RoutingTable`` from them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jinja2
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gateway.protocol import INT64_MAX

# How ``tool_choice: auto`` answers become tool calls (``gateway.tools``): ``json`` reads the
# JSON calls that configs/templates/gemma-tools.jinja asks for; ``none`` keeps them as text.
ToolParser = Literal["json", "none"]

# What a request's ``model`` or ``task`` can name (a route, a task): no empty name (a request's
# empty ``model`` is no model), no whitespace (never matched by a client that trims it), no
# control characters. An alias may also hold a slash, as Hugging Face ids do
# (``google/gemma-3-270m-it``).
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
Alias = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]


def _template(text: str) -> str:
    """A route's chat template must be Jinja text that compiles as transformers compiles it
    (its sandbox, its ``{% generation %}`` tag, filters resolved): an error there would fail
    every request on the route, and text with no Jinja in it (a path: vLLM's
    ``--chat-template`` takes one) would be the prompt whatever the messages."""
    if "{{" not in text and "{%" not in text:
        raise ValueError("chat_template must be the template's Jinja text (a path is not read)")
    from transformers.utils.chat_template_utils import _compile_jinja_template  # as vLLM renders

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not compile: line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat_template does not compile: {exc}") from None
    return text


ChatTemplate = Annotated[str, AfterValidator(_template)]


class SamplingDefaults(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # 0 or -1: off (a model's own top_k, undone)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, ge=1e-30, le=1e30)  # as a request may: logit / it, finite
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class RouteEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    adapter: str | None = None
    aliases: list[Alias] = Field(default_factory=list)
    tasks: list[Name] = Field(default_factory=list)
    system_prompt: str | None = None
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    chat_template: ChatTemplate | None = None
    tool_parser: ToolParser = "json"
    strict_base_model: bool = False  # a different base_model_name_or_path rejects, not warns
    pinned: bool = False  # kept resident in a GPU slot (vLLM pin_lora)
    preload: bool = False  # warmed with a one-token request at registration
    # Share of the engine's LoRA slots under contention (``lora_scheduler``): a route of
    # weight 2 gets twice the turns of one of weight 1.
    weight: float = Field(1.0, gt=0, le=1000)
    # A default response format (OpenAI's object, a bare JSON schema, or "file:<path>"
    # under the catalog's folder); with ``enforce`` requests cannot ask for another.
    response_format: dict[str, Any] | str | None = None
    enforce: bool = False


class BaseEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    aliases: list[Alias] = Field(default_factory=list)
    tasks: list[Name] = Field(default_factory=list)
    defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    tool_parser: ToolParser = "json"


class CatalogFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base: BaseEntry = Field(default_factory=BaseEntry)
    routes: list[dict[str, Any]] = Field(default_factory=list)
