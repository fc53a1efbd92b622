"""The OpenAI Agents SDK (``openai-agents``) on the live gateway: an agent whose model is a
gateway route over ``/v1/responses`` calls a Python function tool, run whole and streamed.

The embedded model is a 270M base model, so the call is forced (``tool_choice: required``,
one call at a time) and the run stops at the tool's result; what is checked is the protocol:
the SDK reads the ``function_call`` item, runs the tool with the arguments the grammar made
valid, and ends with the tool's output."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import agents
import openai
import pydantic
import pytest
import pytest_asyncio

from tests.integration.conftest import USER_KEY, LiveGateway


def weather_agent(client: openai.AsyncOpenAI, model: str, seen: list[str]) -> agents.Agent:
    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"22 C and sunny in {city}"

    return agents.Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
        ),
        tool_use_behavior="stop_on_first_tool",
    )


@pytest.fixture(autouse=True)
def no_tracing() -> None:
    agents.set_tracing_disabled(True)  # nothing to export traces to


@pytest_asyncio.fixture(loop_scope="function")
async def client(gateway: LiveGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


@pytest.mark.parametrize("model", ["base", "shout"])
async def test_an_agent_calls_a_function_tool(client: openai.AsyncOpenAI, model: str) -> None:
    seen: list[str] = []
    result = await agents.Runner.run(weather_agent(client, model, seen), "What is the weather in Paris?")
    assert len(seen) == 1 and isinstance(seen[0], str)
    assert result.final_output == f"22 C and sunny in {seen[0]}"
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1 and calls[0].raw_item.name == "get_weather"


async def test_a_streamed_agent_run_calls_the_tool(client: openai.AsyncOpenAI) -> None:
    seen: list[str] = []
    run = agents.Runner.run_streamed(weather_agent(client, "base", seen), "Is it raining in Oslo?")
    kinds = [event.type async for event in run.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(seen) == 1 and run.final_output == f"22 C and sunny in {seen[0]}"


async def test_top_logprobs_come_back_on_the_message(client: openai.AsyncOpenAI) -> None:
    """``ModelSettings.top_logprobs`` makes the SDK include the output text's logprobs. The
    json adapter ends its answer on its own (the SDK refuses an incomplete response)."""
    agent = agents.Agent(
        name="plain",
        model=agents.OpenAIResponsesModel(model="json", openai_client=client),
        model_settings=agents.ModelSettings(top_logprobs=2, max_tokens=200),
    )
    result = await agents.Runner.run(agent, "name: Ada, age: 36")
    (message,) = [item for item in result.raw_responses[-1].output if item.type == "message"]
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs
    # the stop token has its logprob too, as under vLLM's server
    joined = "".join(lp.token for lp in part.logprobs).removesuffix("<end_of_turn>")
    assert joined == part.text == result.final_output
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


class Report(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    weather: str = pydantic.Field(max_length=20)


async def test_an_agent_with_an_output_type_and_strict_tools_ends_well(client: openai.AsyncOpenAI) -> None:
    """The SDK's function tools are strict and an output_type is sent as the format with
    them (tool_choice auto): the answers were call-shaped text, neither a call nor a
    Report, and the run failed with ModelBehaviorError ("Invalid JSON"). Each run now calls
    the tool (stopping on its result) or ends with a Report; a run the base model cuts at
    max_tokens (blanks inside the object, README) is the SDK's "incomplete", not counted."""
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=20)]) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "22 C"

    agent = agents.Agent(
        name="reporter",
        instructions="Report the weather.",
        tools=[get_weather],
        output_type=Report,
        model=agents.OpenAIResponsesModel(model="base", openai_client=client),
        model_settings=agents.ModelSettings(temperature=1.0, max_tokens=120),
        tool_use_behavior="stop_on_first_tool",
    )
    ended = 0
    for _ in range(6):
        before = len(seen)
        try:
            result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        except agents.exceptions.ModelBehaviorError as exc:
            assert "max_output_tokens" in str(exc), exc  # cut by the model, not in no format
            continue
        ended += 1
        if len(seen) > before:  # it called the tool, and stopped on its result
            assert result.final_output == "22 C"
        else:
            assert isinstance(result.final_output, Report)
    assert ended >= 2
