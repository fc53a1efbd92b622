"""The official OpenAI Node SDK (``openai`` on npm) against the live gateway, as JavaScript and
TypeScript apps use it: ``new OpenAI()`` with ``OPENAI_BASE_URL`` pointed at the gateway.

Each case is a function in one of the ES modules in ``js/`` (run as ``node <script> <case>
<model>``); it calls the SDK and prints one ``RESULT {...}`` line of what it saw, which the
test here asserts on: chat (whole, ``stream: true``, the ``.stream()`` helper), an adapter by
name, structured outputs (``response_format``, ``.parse()`` with ``zodResponseFormat``), tools
(``required``, the stream helper, ``runTools``), ``completions``, ``models``, the Responses API
(plain, streamed, stored and continued, parsed, tools) and the SDK's error classes with the
gateway's ``x-request-id``. The model is a base model: the assertions are on the protocol.

The SDK is installed with ``npm ci`` from ``js/package-lock.json`` into ``js/node_modules``
(not tracked) on the first run, a few seconds, and again only when the lock or package.json
changes. The SDK (openai 6) supports Node 20 and later. Outside CI the tests skip
when ``node`` or ``npm`` is missing; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import USER_KEY, LiveGateway

JS = Path(__file__).parent / "js"
NODE_MIN = 20  # openai 6 supports Node 20 and later (openai 7: 22 and later)
RUN_TIMEOUT_S = 300
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def missing() -> str | None:
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are not installed (apt-get install nodejs npm)"
    version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    found = re.match(r"v(\d+)\.", version)
    if not found or int(found[1]) < NODE_MIN:
        return f"node {version!r} is older than {NODE_MIN}"
    return None


if missing() and not os.environ.get("CI"):
    pytest.skip(str(missing()), allow_module_level=True)  # and don't start an engine for nothing


def npm_ci() -> None:
    """``npm ci`` into js/node_modules unless it holds what package.json and its lock name already."""
    stamp = JS / "node_modules" / ".gateway-lock-sha256"
    with (JS / "package-lock.json").open("rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two pytest runs at once install once
        digest = hashlib.sha256(lock.read() + (JS / "package.json").read_bytes()).hexdigest()
        if stamp.is_file() and stamp.read_text() == digest:
            return
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=JS,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "npm_config_update_notifier": "false"},
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci failed ({done.returncode}) in {JS}:\n{done.stderr}{done.stdout}")
        stamp.write_text(digest)


Run = Callable[[str, str, str], dict[str, Any]]


@pytest.fixture(scope="session", autouse=True)
def node_sdk() -> None:
    """Autouse and session-scoped: set up before the gateway, so a CI without Node fails at once."""
    reason = missing()
    if reason:
        pytest.fail(f"CI must run the OpenAI JS SDK tests: {reason}")
    npm_ci()


@pytest.fixture(scope="module")
def js(gateway: LiveGateway) -> Run:
    """``js(script, case, model)``: the case's result, as the script printed it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(OPENAI_BASE_URL=gateway.v1, OPENAI_API_KEY=USER_KEY, NO_COLOR="1")

    def run(script: str, case: str, model: str) -> dict[str, Any]:
        done = subprocess.run(
            ["node", script, case, model],
            cwd=JS,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        lines = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and len(lines) == 1, (
            f"node {script} {case} {model}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        )
        result: dict[str, Any] = json.loads(lines[0])
        return result

    return run


def ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "thrown" not in result, f"the SDK threw: {json.dumps(result['thrown'], indent=1)}"
    return result


def thrown(result: dict[str, Any]) -> dict[str, Any]:
    assert "thrown" in result, f"expected the SDK to throw, got {result}"
    error: dict[str, Any] = result["thrown"]
    assert error.get("api_error"), f"not an OpenAI.APIError: {error}"
    return error


def usage_adds_up(usage: dict[str, Any]) -> None:
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# Chat completions


def test_chat_create_whole(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "create", base_model))
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["model"] == base_model and isinstance(r["created"], int)
    assert r["role"] == "assistant" and r["content"] and r["tool_calls"] is None
    assert r["finish_reason"] in ("stop", "length")
    usage_adds_up(r["usage"])
    assert r["usage"]["completion_tokens"] <= 12
    # The SDK's _request_id and withResponse().request_id are the gateway's x-request-id,
    # here the one the app sent.
    assert r["_request_id"] == r["request_id"] == "js-sdk-create-1"
    assert r["x_adapter"] == base_model and r["x_adapter_digest"] is None


def test_chat_create_on_an_adapter_by_name_and_alias(js: Run, base_model: str, gateway: LiveGateway) -> None:
    with gateway.client() as http:
        digest = {m["id"]: m for m in http.get("/v1/models").json()["data"]}["shout"]["digest"]
    shout = ok(js("chat.mjs", "create", "shout"))
    loud = ok(js("chat.mjs", "create", "loud"))  # an alias of shout
    base = ok(js("chat.mjs", "create", base_model))
    for r in (shout, loud):
        assert r["x_adapter"] == "shout" and r["x_adapter_digest"] == digest
        assert r["content"] and r["finish_reason"] in ("stop", "length")
    assert shout["model"] == "shout"
    assert shout["content"] == loud["content"]  # greedy, same adapter
    assert base["x_adapter_digest"] is None
    assert shout["content"] != base["content"]


def test_chat_stream_true_assembles_the_whole_answer(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "stream", base_model))
    whole = r["whole"]
    assert r["text"] == whole["content"] and r["text"]
    assert r["content_chunks"] > 1  # really streamed
    assert r["roles"] == ["assistant"]
    assert r["finish_reasons"] == [whole["finish_reason"]]
    assert len(r["ids"]) == 1 and r["ids"][0].startswith("chatcmpl-")
    assert r["objects"] == ["chat.completion.chunk"] and r["models"] == [base_model]
    # include_usage: a last chunk with no choices and the usage of the whole answer.
    assert r["last_choices"] == 0
    assert r["last_usage"] == whole["usage"]


def test_chat_stream_helper_final_chat_completion(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "stream_helper", base_model))
    final = r["final"]
    assert final["object"] == "chat.completion" and final["id"].startswith("chatcmpl-")
    assert (
        final["content"] and "".join(r["deltas"]) == final["content"] == r["snapshot"] == r["final_content"]
    )
    assert len(r["deltas"]) > 1
    assert final["role"] == "assistant" and final["finish_reason"] in ("stop", "length")


def test_chat_response_format_json_schema(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "json_schema", base_model))
    assert r["finish_reason"] == "stop", r
    answer = json.loads(r["content"])
    assert set(answer) == {"city", "is_capital"}
    assert answer["city"] in ("Paris", "Lyon", "Nice") and isinstance(answer["is_capital"], bool)


def test_chat_parse_with_zod_response_format(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "parse", base_model))
    assert r["finish_reason"] == "stop" and r["refusal"] is None
    assert r["parsed"] == json.loads(r["content"])
    assert r["parsed"]["city"] in ("Paris", "Lyon", "Nice") and isinstance(r["parsed"]["is_capital"], bool)


def test_chat_tool_choice_required_and_the_round_trip(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "tools_required", base_model))
    first = r["first"]
    assert first["finish_reason"] == "tool_calls" and first["content"] is None
    [call] = first["tool_calls"]  # parallel_tool_calls: false
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    # The SDK's message (content null, tool_calls) and the tool messages, sent back.
    nxt = r["next"]
    assert nxt["tool_calls"] is None and nxt["content"] and nxt["finish_reason"] in ("stop", "length")


def test_chat_tool_helpers_stream_and_run_tools(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "tools_helpers", base_model))
    streamed = r["streamed"]
    assert streamed["finish_reason"] == "stop" and streamed["content"] is None  # forced: OpenAI's stop
    [call] = streamed["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert "".join(r["argument_deltas"]) == call["function"]["arguments"]
    assert r["done_arguments"] == [call["function"]["arguments"]]
    assert len(r["argument_deltas"]) > 1
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"}
    # runTools: one forced call, parsed by the zodFunction and answered by the app's function.
    [args] = r["run_calls"]
    assert set(args) == {"city"} and isinstance(args["city"], str)
    roles = [m["role"] for m in r["run_messages"]]
    assert roles == ["user", "assistant", "tool"]
    assert json.loads(r["run_messages"][2]["content"]) == {"temperature_c": 22}
    [call_id] = r["run_messages"][1]["tool_call_ids"]
    assert call_id.startswith("call_") and r["run_messages"][2]["tool_call_id"] == call_id
    assert r["final_call"]["name"] == "get_weather"
    assert json.loads(r["final_call"]["arguments"]) == args


def test_completions_whole_and_streamed(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "completions", base_model))
    assert r["object"] == "text_completion" and r["model"] == base_model and r["id"]
    assert r["text"].strip() and r["finish_reason"] in ("stop", "length")
    usage_adds_up(r["usage"])
    assert r["streamed_text"] == r["text"] and r["chunks"] > 1
    assert r["stream_objects"] == ["text_completion"]


def test_models_list_and_retrieve(js: Run, base_model: str) -> None:
    r = ok(js("chat.mjs", "models", base_model))
    assert r["ids"] == r["page_ids"] and r["has_next_page"] is False
    for name in (base_model, "base", "shout", "loud", "json", "concise"):
        assert name in r["ids"], name
    assert r["shout"]["id"] == "shout" and r["shout"]["object"] == "model"
    assert r["shout"]["parent"] == base_model


# The Responses API


def test_responses_create_retrieve_and_continue(js: Run, base_model: str) -> None:
    r = ok(js("responses.mjs", "create", base_model))
    first, retrieved, nxt = r["first"], r["retrieved"], r["next"]
    assert first["object"] == "response" and first["id"].startswith("resp_")
    assert first["status"] == "completed" and first["output_types"] == ["message"]
    assert first["model"] == base_model
    assert json.loads(first["output_text"])["city"] in ("Paris", "Lyon", "Nice")  # text.format held
    assert first["_request_id"]
    usage = first["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert {k: v for k, v in retrieved.items() if k != "_request_id"} == {
        k: v for k, v in first.items() if k != "_request_id"
    }
    assert retrieved["_request_id"] != first["_request_id"]
    assert nxt["previous_response_id"] == first["id"] and nxt["id"] != first["id"]
    assert nxt["status"] in ("completed", "incomplete") and nxt["output_text"]
    # The conversation: the first question, the first answer, the second question.
    assert r["items"] == [
        {"type": "message", "role": "user"},
        {"type": "message", "role": "assistant"},
        {"type": "message", "role": "user"},
    ]


def test_responses_max_output_tokens_is_incomplete(js: Run, base_model: str) -> None:
    r = ok(js("responses.mjs", "incomplete", base_model))
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["output_tokens"] == 3


def test_responses_stream_events_and_helper(js: Run, base_model: str) -> None:
    r = ok(js("responses.mjs", "stream", base_model))
    types = r["types"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert types.count("response.output_text.delta") > 1
    assert r["sequence_numbers"] == list(range(len(types)))
    assert r["text"] == r["done_text"] and set(json.loads(r["text"])) == {"city", "is_capital"}
    assert r["last"]["status"] == "completed"
    helper = r["helper"]
    assert helper["status"] == "completed" and helper["id"].startswith("resp_")
    assert helper["output_text"] == r["helper_text"] == r["text"]  # greedy: the same answer


def test_responses_parse_with_zod_text_format(js: Run, base_model: str) -> None:
    r = ok(js("responses.mjs", "parse", base_model))
    assert r["status"] == "completed"
    assert r["output_parsed"] == json.loads(r["output_text"])
    assert r["output_parsed"]["city"] in ("Paris", "Lyon", "Nice")


def test_responses_function_call_and_its_output(js: Run, base_model: str) -> None:
    r = ok(js("responses.mjs", "tools", base_model))
    assert r["first"]["output_types"] == ["function_call"]
    [call] = r["calls"]
    assert call["name"] == "get_weather" and call["call_id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"city"}
    nxt = r["next"]
    assert nxt["previous_response_id"] == r["first"]["id"]
    assert nxt["output_types"] == ["message"] and nxt["output_text"]


# Errors


def test_unknown_model_is_not_found_error(js: Run, base_model: str) -> None:
    e = thrown(js("errors.mjs", "unknown_model", base_model))
    assert e["class"] == "NotFoundError" and e["not_found"] and e["status"] == 404
    assert e["code"] == "model_not_found" and e["param"] == "model" and e["type"] == "invalid_request_error"
    assert "no-such-adapter" in e["message"]
    # The gateway made an id; the SDK carries it.
    assert e["request_id"] and e["request_id"] == e["header_request_id"]


def test_error_carries_the_request_id_the_app_sent(js: Run, base_model: str) -> None:
    e = thrown(js("errors.mjs", "unknown_model_with_id", base_model))
    assert e["not_found"] and e["request_id"] == "js-sdk-error-1"


@pytest.mark.parametrize("case", ["bad_param", "bad_param_stream"])
def test_bad_param_is_bad_request_error_with_the_gateway_message(
    js: Run, base_model: str, gateway: LiveGateway, case: str
) -> None:
    with gateway.client() as http:
        raw = http.post(
            "/v1/chat/completions", json={"model": base_model, "messages": QUESTION, "temperature": 5}
        )
    assert raw.status_code == 400
    e = thrown(js("errors.mjs", case, base_model))
    assert e["class"] == "BadRequestError" and e["bad_request"] and e["status"] == 400
    assert e["param"] == "temperature" and e["type"] == "invalid_request_error"
    assert e["error"] == raw.json()["error"]
    assert e["message"] == f"400 {raw.json()['error']['message']}"
    assert e["request_id"]


def test_bad_param_on_responses_is_bad_request_error(js: Run, base_model: str) -> None:
    e = thrown(js("errors.mjs", "bad_param_responses", base_model))
    assert e["bad_request"] and e["status"] == 400 and e["param"] == "temperature"


def test_bad_key_is_authentication_error(js: Run, base_model: str) -> None:
    e = thrown(js("errors.mjs", "bad_key", base_model))
    assert e["class"] == "AuthenticationError" and e["authentication"] and e["status"] == 401
    assert e["request_id"]


def test_unknown_response_id_is_not_found_error(js: Run, base_model: str) -> None:
    e = thrown(js("errors.mjs", "unknown_response", base_model))
    assert e["not_found"] and e["status"] == 404
