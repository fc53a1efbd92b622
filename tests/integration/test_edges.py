"""Edges of the OpenAI surface (issue 16): refusals that must come before the 200, fields
that must work (logit_bias, echo, batched prompts, logprobs shapes), /tokenize and
/detokenize. Against the live gateway, with the real engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers import assert_openai_error, chat_body, completion_body
from tests.integration.conftest import LiveGateway


@pytest.fixture(scope="module")
def http(gateway: LiveGateway) -> httpx.Client:
    return gateway.client()


def sse_chunks(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_chunks(r)


def token_id(http: httpx.Client, text: str) -> int:
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert len(tokens) == 1, tokens
    return int(tokens[0])


# -- refused before the stream starts ------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64 + 1, -(2**63) - 1, 2**63])
@pytest.mark.parametrize("streamed", [False, True])
def test_out_of_range_seed_is_400_even_streamed(http: httpx.Client, seed: int, streamed: bool) -> None:
    r = http.post("/v1/chat/completions", json=chat_body("base", seed=seed, max_tokens=2, stream=streamed))
    assert assert_openai_error(r, 400)["param"] == "seed"


def test_largest_seed_is_served(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json=completion_body("base", seed=2**63 - 1, max_tokens=2, temperature=1)
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"-3": 5}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"1000000000": 5}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),
        ("/v1/chat/completions", {"model": None}, "model"),
        ("/v1/completions", {"model": None}, "model"),
    ],
)
def test_refused_fields(http: httpx.Client, path: str, fields: dict[str, Any], param: str) -> None:
    body = chat_body("base", max_tokens=2) if "chat" in path else completion_body("base", max_tokens=2)
    r = http.post(path, json={**body, **fields})
    assert assert_openai_error(r, 400)["param"] == param


def test_missing_model_is_400_unless_a_task_routes(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "model" and "model" in err["message"]
    routed = http.post("/v1/chat/completions", json={**body, "task": "shouting"})
    assert routed.status_code == 200 and routed.json()["model"] == "shout"
    house = http.post("/chat", json={"question": "Hi", "max_tokens": 2})
    assert house.status_code == 200  # the house endpoint may still omit it


def test_form_encoded_body_is_415(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", data={"model": "base", "messages": "x"})
    assert_openai_error(r, 415, "unsupported_media_type")
    text = http.post(
        "/v1/chat/completions",
        content=json.dumps(chat_body("base", max_tokens=1)),
        headers={"content-type": "text/plain"},
    )
    assert_openai_error(text, 415)


def test_image_part_says_images_are_not_supported(http: httpx.Client) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    r = http.post(
        "/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": content}]}
    )
    err = assert_openai_error(r, 400)
    assert err["param"] == "messages.0.content"
    assert "image_url" in err["message"] and "not supported" in err["message"]


def test_unknown_model_card_and_base_alias_root(http: httpx.Client, base_model: str) -> None:
    assert_openai_error(http.get("/v1/models/nope"), 404, "model_not_found")
    card = http.get("/v1/models/base").json()
    assert card["alias_of"] == base_model and card["root"] == base_model
    loud = http.get("/v1/models/loud").json()
    assert loud["root"] == base_model and loud["alias_of"] == "shout"


# -- logprobs shapes --------------------------------------------------------------------------
def test_chat_top_logprobs_has_exactly_k_entries(http: httpx.Client) -> None:
    for top, temperature in ((None, 0), (0, 1.0), (3, 1.0), (3, 0)):
        fields: dict[str, Any] = {"logprobs": True, "max_tokens": 6, "temperature": temperature, "seed": 7}
        if top is not None:
            fields["top_logprobs"] = top
        r = http.post("/v1/chat/completions", json=chat_body("base", "Tell me a story", **fields))
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content
        for entry in content:
            assert len(entry["top_logprobs"]) == (top or 0), (top, temperature, entry)
            values = [t["logprob"] for t in entry["top_logprobs"]]
            assert values == sorted(values, reverse=True)
            if top and temperature == 0:
                assert entry["top_logprobs"][0]["token"] == entry["token"]


def test_streamed_text_offset_counts_from_the_start(http: httpx.Client) -> None:
    body = completion_body("base", "The capital of France is", max_tokens=8, temperature=0, logprobs=1)
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    offsets: list[int] = []
    for chunk in stream(http, "/v1/completions", body):
        if chunk["choices"] and chunk["choices"][0]["logprobs"]:
            offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == whole["logprobs"]["text_offset"]
    assert len(set(offsets)) == len(offsets) > 2


# -- logit_bias -----------------------------------------------------------------------------
def test_logit_bias_plus_100_forces_the_token(http: httpx.Client) -> None:
    banana = token_id(http, " banana")
    body = completion_body("base", "The capital of France is", max_tokens=4, temperature=0)
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    forced = http.post("/v1/completions", json={**body, "logit_bias": {str(banana): 100}}).json()
    assert forced["choices"][0]["text"] == " banana" * 4 != plain
    chat = http.post(
        "/v1/chat/completions",
        json=chat_body("base", max_tokens=3, temperature=0, logit_bias={str(banana): 100}),
    )
    assert chat.json()["choices"][0]["message"]["content"] == " banana" * 3


# -- vLLM's sampling extensions ---------------------------------------------------------------
def test_stop_token_ids_and_include_stop_str_in_output(http: httpx.Client) -> None:
    banana = token_id(http, " banana")
    body = completion_body("base", "The capital of France is", max_tokens=4, temperature=0)
    body["logit_bias"] = {str(banana): 100}  # the answer is " banana" x 4 unless something stops it
    stopped = http.post("/v1/completions", json={**body, "stop_token_ids": [banana]}).json()
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", 1)
    cut = http.post("/v1/completions", json={**body, "stop": [" banana"]}).json()["choices"][0]
    kept = http.post(
        "/v1/completions", json={**body, "stop": [" banana"], "include_stop_str_in_output": True}
    ).json()["choices"][0]
    assert (cut["text"], kept["text"]) == ("", " banana")


def test_min_p_1_keeps_only_the_top_token(http: httpx.Client) -> None:
    body = completion_body("base", "Once upon a time", max_tokens=8, seed=3)
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    sampled = http.post("/v1/completions", json={**body, "temperature": 1.0}).json()["choices"][0]["text"]
    top_only = http.post("/v1/completions", json={**body, "temperature": 1.0, "min_p": 1.0}).json()
    assert top_only["choices"][0]["text"] == greedy != sampled


# -- echo and batched prompts -------------------------------------------------------------------
def test_echo_returns_the_prompt_and_its_logprobs(http: httpx.Client) -> None:
    prompt = "The capital of France is"
    body = completion_body("base", prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    r = http.post("/v1/completions", json=body).json()
    plain = http.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
    choice = r["choices"][0]
    assert choice["text"] == prompt + plain["text"]
    lp = choice["logprobs"]
    usage = r["usage"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes it
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["tokens"][-4:] == plain["logprobs"]["tokens"]
    streamed = "".join(
        c["choices"][0]["text"] for c in stream(http, "/v1/completions", {**body, "logprobs": None})
    )
    assert streamed == choice["text"]
    only = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()  # scoring the prompt
    assert only["choices"][0]["text"] == prompt and only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["tokens"] == lp["tokens"][: usage["prompt_tokens"]]


def test_batched_prompts_are_one_choice_per_prompt_and_n(http: httpx.Client) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [
        http.post("/v1/completions", json=completion_body("base", p, max_tokens=5, temperature=0)).json()
        for p in prompts
    ]
    both = http.post(
        "/v1/completions", json=completion_body("base", prompts, max_tokens=5, temperature=0)
    ).json()
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["text"] for c in both["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert both["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert both["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)

    texts: dict[int, str] = {}
    for chunk in stream(
        http, "/v1/completions", completion_body("base", prompts, max_tokens=5, temperature=0)
    ):
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: both["choices"][0]["text"], 1: both["choices"][1]["text"]}

    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_ids = http.post(
        "/v1/completions", json=completion_body("base", ids, max_tokens=5, temperature=0)
    ).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in both["choices"]]

    n2 = http.post(  # echoed, so that each choice says which prompt it continues
        "/v1/completions",
        json=completion_body("base", prompts, max_tokens=3, n=2, temperature=0.8, seed=1, echo=True),
    ).json()
    assert [c["index"] for c in n2["choices"]] == [0, 1, 2, 3]
    for c in n2["choices"]:  # prompt-major: choice p * n + copy
        assert c["text"].startswith(prompts[c["index"] // 2]), n2["choices"]
    assert all(c["finish_reason"] in ("stop", "length") for c in n2["choices"])


# -- /tokenize and /detokenize ----------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(http: httpx.Client, base_model: str) -> None:
    r = http.post("/tokenize", json={"model": base_model, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_strs"] is None  # as vLLM answers when they are not asked for
    assert (
        set(body) == {"count", "max_model_len", "tokens", "token_strs"}
        and body["count"] == len(body["tokens"]) == 3
    )
    assert body["max_model_len"] > 0
    plain = http.post(
        "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert plain["tokens"] == body["tokens"][1:] and len(plain["token_strs"]) == 2
    back = http.post("/detokenize", json={"model": base_model, "tokens": plain["tokens"]})
    assert back.json() == {"prompt": "Hello world"}


def test_tokenize_chat_uses_the_route_template_and_system_prompt(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    base = http.post("/tokenize", json={"model": "base", "messages": messages}).json()
    concise = http.post("/tokenize", json={"model": "concise", "messages": messages}).json()
    assert concise["count"] > base["count"]
    text = http.post("/detokenize", json={"tokens": concise["tokens"]}).json()["prompt"]
    assert "Answer in one short sentence." in text and text.count("<bos>") == 1
    chat = http.post("/v1/chat/completions", json=chat_body("concise", "Hi", max_tokens=1)).json()
    assert chat["usage"]["prompt_tokens"] == concise["count"]  # the very prompt chat builds


def test_tokenize_errors(http: httpx.Client, gateway: LiveGateway) -> None:
    assert httpx.post(gateway.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert_openai_error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model_not_found")
    assert_openai_error(
        http.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}), 400
    )
    assert assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)["param"] == "tokens"
    assert assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"
