"""Property-based fuzzing of the live gateway from its own ``/openapi.json`` (schemathesis).

Every operation of the document is fuzzed against the real gateway (real vLLM, the real
model): schemathesis's examples, coverage (boundary values, wrong types, missing fields,
methods a path does not allow) and fuzzing phases (random valid bodies on the generating
operations, valid and invalid ones elsewhere), with a bounded number of fuzzing examples
per operation (``MAX_EXAMPLES``). Each answer is
checked: no 5xx, the status and content type documented, the body valid against its
schema (JSON, and each SSE event), every error OpenAI's error object, and a key-protected
operation refusing a request without the key. After it the gateway still serves.

For the time on 2 CPU cores, and only here, a generating body's ``max_tokens`` (and its
spellings, set to 4 where the body has none), ``n`` and ``min_tokens`` are clamped before
it is sent (``_clamp``): an answer of 2,000 tokens per choice is what any test could ask
for, not a fuzzing find. Three in four bodies of the fuzzing phase are made plausible
(``_plausible``: a real route as ``model``, plain turns, ...), so that they reach the engine
with their generated sampling values instead of a 400.

Checks left out, and why: ``negative_data_rejection`` (pydantic's lax mode, like vLLM's
server, takes ``"5"`` for an integer and ``"true"`` for a boolean, where the document says
integer and boolean), ``positive_data_acceptance`` (a well-formed request is refused for
reasons no schema states: a model that does not exist, a prompt over the context, ``n > 1``
at temperature 0), and the stateful ones (no links between operations).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from gateway.openapi import build_document
from gateway.routes import PUBLIC_PATHS, ROUTES
from tests.helpers import still_serves
from tests.integration.conftest import ADMIN_KEY, LiveGateway

# Fuzzing examples per operation (the coverage and examples phases add their own, bounded
# by the schema). Generation is the slow part: ~0.1-0.5 s a request on 2 cores.
MAX_EXAMPLES = {
    "POST /v1/chat/completions": 80,
    "POST /v1/completions": 60,
    "POST /v1/responses": 40,
    "POST /chat": 30,
}
DEFAULT_EXAMPLES = 25
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the admin key may use every operation
TOKEN_CAP, N_CAP = 4, 2
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/chat"})
CASES: Counter[str] = Counter()  # cases sent, per operation
PHASES: Counter[str] = Counter()  # ... per schemathesis phase
STATUSES: dict[str, Counter[int]] = {}  # ... per operation and status


def _config() -> schemathesis.Config:
    # The generating operations fuzz with valid bodies only: their invalid ones (wrong types,
    # missing fields, values out of range) come from the coverage phase, and a valid body
    # may reach the engine.
    fuzzing = {"generation": {"mode": "positive"}}
    operations = [
        {"include-name": label, "generation": {"max-examples": count}, "phases": {"fuzzing": fuzzing}}
        for label, count in MAX_EXAMPLES.items()
    ]
    return schemathesis.Config.from_dict(
        {
            # One seed, so CI sees the same cases each run; FUZZ_SEED=<n> explores others.
            "seed": int(os.environ.get("FUZZ_SEED", "20261204")),
            "generation": {
                "max-examples": DEFAULT_EXAMPLES,
                "database": "none",
                "with-security-parameters": False,
            },
            "phases": {"stateful": {"enabled": False}},
            "operations": operations,
        }
    )


# The document as the gateway builds it: known at collection, without a server (the
# schemathesis fixture-loaded schema does not run under pytest 9). The first test checks
# that the live gateway serves this very document.
schema = schemathesis.openapi.from_dict(build_document(ROUTES, PUBLIC_PATHS), config=_config())
MODELS: list[str] = []  # the live gateway's model names, read by the first test


@schema.hook
def before_generate_body(context: Any, strategy: Any) -> Any:
    """Three bodies in four made plausible (``_plausible``), the rest as generated."""
    # Hypothesis leans to 0, the simplest value, so 0 is the plausible side.
    return st.tuples(strategy, st.integers(0, 3)).map(
        lambda b: b[0] if b[1] == 3 else _plausible(b[0], MODELS)
    )


def _plausible(body: Any, models: list[str]) -> Any:
    """The body, repaired where a random one is refused before it reaches the engine: one
    of the gateway's model names (chosen by the body's size), plain user/assistant turns,
    ``logprobs`` and ``stream`` where ``top_logprobs`` and ``stream_options`` need them,
    token-id keys in ``logit_bias``, one kind of structured output. The sampling values,
    texts, stops, schemas, regexes and grammars stay as generated."""
    if not models or not isinstance(body, dict):
        return body
    body = {**body, "model": models[len(str(body)) % len(models)]}
    body.pop("task", None)
    body.pop("previous_response_id", None)  # nothing is stored under a random id
    if isinstance(body.get("messages"), list):
        turns = [
            m for m in body["messages"] if isinstance(m, dict) and m.get("role") in ("user", "assistant")
        ]
        turns = [{"role": m["role"], "content": m.get("content") or "Hi"} for m in turns]
        body["messages"] = (
            turns if any(m["role"] == "user" for m in turns) else [{"role": "user", "content": "Hi"}]
        )
    if isinstance(body.get("input"), list):
        items = [i for i in body["input"] if isinstance(i, dict) and i.get("role") in ("user", "assistant")]
        body["input"] = [{"role": i["role"], "content": str(i.get("content") or "Hi")} for i in items] or "Hi"
    if body.get("tools") is None:
        body.pop("tool_choice", None)
    if body.get("top_logprobs"):
        body["logprobs"] = True
    if body.get("stream_options") is not None:
        body["stream"] = True
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {k: v for k, v in body["logit_bias"].items() if k.isdigit()}
    if body.get("response_format") is not None:
        body.pop("structured_outputs", None)
    return body


def _clamp(path: str, body: Any) -> Any:
    """Fuzzing only: small answers (see the module docstring). A generating body without a
    token limit gets one (the route's default would be 256 tokens per prompt and choice)."""
    if path not in GENERATING or not isinstance(body, dict):
        return body
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    if body.get(limit) is None and body.get("max_completion_tokens") is None:
        body[limit] = TOKEN_CAP
    caps = {"max_tokens": TOKEN_CAP, "max_completion_tokens": TOKEN_CAP, "max_output_tokens": TOKEN_CAP}
    caps |= {"min_tokens": TOKEN_CAP, "n": N_CAP}
    for name, cap in caps.items():
        value = body.get(name)
        if type(value) is int and value > cap:
            body[name] = cap
    return body


def openai_errors(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx and 5xx is OpenAI's error object, exactly (the probes answer in their own
    documented shape; a failed reload adds its report beside the error)."""
    path = case.operation.path
    if response.status_code < 400 or path in ("/health", "/ready"):
        return None
    body = json.loads(response.content)
    report = path == "/admin/adapters/reload" and response.status_code == 422
    assert set(body) == ({"error", "reloaded", "routes"} if report else {"error"}), body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    unsupported_method,
    allow_header_conformance,
    ignored_auth,
    openai_errors,
]


def test_the_gateway_serves_the_document_that_is_fuzzed(gateway: LiveGateway) -> None:
    with gateway.client() as http:
        assert http.get("/openapi.json", headers={"Authorization": ""}).json() == schema.raw_schema
        MODELS[:] = [card["id"] for card in http.get("/v1/models").json()["data"]]


@schema.parametrize()
def test_fuzz(case: Case, gateway: LiveGateway) -> None:
    case.body = _clamp(case.operation.path, case.body)
    CASES[case.operation.label] += 1
    PHASES[case.meta.phase.name.value if case.meta is not None else "explicit"] += 1
    response = case.call_and_validate(base_url=gateway.url, headers=ADMIN, checks=CHECKS, timeout=120)
    STATUSES.setdefault(case.operation.label, Counter())[response.status_code] += 1


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Iterator[None]:
    yield
    with capsys.disabled():
        for label, count in sorted(CASES.items()):
            print(f"fuzz cases {label}: {count} (statuses {dict(sorted(STATUSES.get(label, {}).items()))})")
        print(f"fuzz cases in total: {sum(CASES.values())} ({dict(PHASES)})")


def test_the_gateway_still_serves_after_fuzzing(gateway: LiveGateway, report: None) -> None:
    assert len(CASES) == 20, CASES  # every operation was fuzzed
    still_serves(gateway, "base")
    with gateway.client() as http:
        assert http.get("/openapi.json").status_code == 200
