"""The middleware through the whole app in-process: deny-by-default auth, scoped and admin
keys, the header limit, admission (429 at capacity and per key, 503 while draining), and the
access log."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from gateway.errors import EngineFailed
from gateway.metrics import RETIRED_KEPT
from gateway.middleware import Admission, Place, Principal
from tests.helpers import (
    assert_openai_error,
    chat_body,
    completion_body,
    eventually_async,
    still_serves_async,
)
from tests.unit.conftest import (
    ADMIN,
    ADMIN_KEY,
    BASE,
    SHOUT_ONLY_KEY,
    SINGLE_KEY,
    USER_KEY,
    Serve,
    Served,
    body_then_disconnect,
    http_scope,
)
from tests.unit.fakes import FakeEngine

NO_KEY = {"Authorization": ""}  # the client sends the user's key unless told otherwise


def raw(served: Served, method: str, raw_path: bytes, headers: dict[str, str]) -> httpx.Request:
    """A request whose path reaches the app as written (no client normalisation of '//')."""
    return served.http.build_request(
        method, httpx.URL("http://gateway.test", raw_path=raw_path), headers=headers
    )


# -- deny by default ---------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/ready", "/playground"])
async def test_public_paths_need_no_key(serve: Serve, path: str) -> None:
    served = await serve()
    assert (await served.http.get(path, headers=NO_KEY)).status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/shout", "/admin/adapters", "/admin/status", "/v1/nothing", "/", "/metrics"],
)
async def test_everything_else_needs_a_key(serve: Serve, path: str) -> None:
    served = await serve()
    r = await served.http.get(path, headers=NO_KEY)
    err = assert_openai_error(r, 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error"  # as OpenAI
    assert r.headers["www-authenticate"] == "Bearer"


async def test_metrics_are_public_only_when_configured(serve: Serve) -> None:
    served = await serve(auth__public_metrics=True)
    r = await served.http.get("/metrics", headers=NO_KEY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "gateway_engine_up 1.0" in r.text
    assert (await served.http.get("/v1/models", headers=NO_KEY)).status_code == 401  # the rest is not


async def test_metrics_with_a_key(serve: Serve) -> None:
    served = await serve()
    assert (await served.http.get("/metrics")).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer sk-wrong-key-000"},
        {"Authorization": f"Basic {USER_KEY}"},
        {"Authorization": f"Bearer {USER_KEY}x"},
        {"Authorization": "Bearer "},
        {"x-api-key": "sk-wrong-key-000", "Authorization": ""},
    ],
)
async def test_a_wrong_key_is_401(serve: Serve, headers: dict[str, str]) -> None:
    served = await serve()
    r = await served.http.post("/v1/chat/completions", json=chat_body("base"), headers=headers)
    assert_openai_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert served.engine.calls == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {USER_KEY}"},
        {"Authorization": f"bearer {USER_KEY}"},
        {"Authorization": f"Bearer  {USER_KEY} "},
        {"x-api-key": USER_KEY, "Authorization": ""},
    ],
)
async def test_bearer_and_x_api_key_are_accepted(serve: Serve, headers: dict[str, str]) -> None:
    served = await serve()
    assert (await served.http.get("/v1/models", headers=headers)).status_code == 200


# -- scoped keys -------------------------------------------------------------------------
async def test_a_key_limited_to_routes_sees_only_those(serve: Serve) -> None:
    served = await serve()
    only = {"Authorization": f"Bearer {SHOUT_ONLY_KEY}"}
    ok = await served.http.post("/v1/chat/completions", json=chat_body("loud", max_tokens=2), headers=only)
    assert ok.status_code == 200 and ok.json()["model"] == "shout"
    for other in ("json", BASE, "base", "concise"):
        r = await served.http.post("/v1/chat/completions", json=chat_body(other, max_tokens=2), headers=only)
        assert_openai_error(r, 404, "model_not_found")  # as if the route did not exist
    by_task = await served.http.post(
        "/v1/chat/completions", json=chat_body(BASE, task="extract"), headers=only
    )
    assert_openai_error(by_task, 404, "model_not_found")
    house = await served.http.post("/chat", json={"question": "hi", "model": "json"}, headers=only)
    assert_openai_error(house, 404, "model_not_found")
    completion = await served.http.post(
        "/v1/completions", json={"model": "json", "prompt": "hi"}, headers=only
    )
    assert_openai_error(completion, 404, "model_not_found")
    models = (await served.http.get("/v1/models", headers=only)).json()["data"]
    assert {m["id"] for m in models} == {"shout", "loud"}
    assert (await served.http.get("/v1/models/loud", headers=only)).status_code == 200
    assert_openai_error(await served.http.get("/v1/models/json", headers=only), 404)
    assert len(served.engine.calls) == 1  # only the allowed request reached the engine


async def test_a_scoped_key_learns_nothing_from_a_model_and_task_that_disagree(serve: Serve) -> None:
    """A route the key may not use is a 404 before ``model`` and ``task`` are compared: the
    400 "name different routes" would tell the key that the route exists."""
    served = await serve()
    only = {"Authorization": f"Bearer {SHOUT_ONLY_KEY}"}
    for model, task, param in [("json", "shouting", "model"), ("shout", "extract", "task")]:
        body = chat_body(model, task=task, max_tokens=2)
        r = await served.http.post("/v1/chat/completions", json=body, headers=only)
        assert assert_openai_error(r, 404, "model_not_found")["param"] == param
        r = await served.http.post(
            "/tokenize", json={"model": model, "task": task, "prompt": "x"}, headers=only
        )
        assert assert_openai_error(r, 404, "model_not_found")["param"] == param
    # the base model's name with a task the key may use: the task picks, as for any key
    r = await served.http.post("/v1/chat/completions", json=chat_body(BASE, task="shouting"), headers=only)
    assert r.status_code == 200 and r.json()["model"] == "shout"
    # no model at all (house /chat): the base model, which this key may not use
    house = await served.http.post("/chat", json={"question": "hi"}, headers=only)
    assert assert_openai_error(house, 404, "model_not_found")["param"] == "model"
    assert len(served.engine.calls) == 1


async def test_a_key_may_name_its_routes_by_alias(serve: Serve) -> None:
    """``routes: [loud, base]`` (an alias of shout, the base model's alias) let the key use
    nothing and list nothing: the scope was matched against route names only."""
    by_alias = "sk-test-by-alias"
    keys = [{"name": "user", "key": USER_KEY}, {"name": "alias", "key": by_alias, "routes": ["loud", "base"]}]
    served = await serve(auth__keys=keys)
    headers = {"Authorization": f"Bearer {by_alias}"}
    for model in ("shout", "loud", BASE, "base"):
        r = await served.http.post(
            "/v1/chat/completions", json=chat_body(model, max_tokens=2), headers=headers
        )
        assert r.status_code == 200, (model, r.text)
    r = await served.http.post("/v1/chat/completions", json=chat_body("json"), headers=headers)
    assert_openai_error(r, 404, "model_not_found")
    models = (await served.http.get("/v1/models", headers=headers)).json()["data"]
    assert {m["id"] for m in models} == {"shout", "loud", BASE, "base"}


async def test_a_key_naming_no_route_is_warned_of_once_per_change(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``routes: [shuot]`` (a typo) let the key use nothing, and nothing said why."""
    keys = [
        {"name": "user", "key": USER_KEY},
        {"name": "typo", "key": "sk-test-typo", "routes": ["shuot", "loud"]},
    ]
    caplog.set_level(logging.WARNING, logger="gateway.state")
    served = await serve(auth__keys=keys)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no route of the catalog" in r.getMessage()]

    assert warnings() == [
        "API key 'typo' may use shuot, which no route of the catalog answers to: "
        "its requests there get 404 model_not_found"
    ]
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 1  # the same names: said once
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(catalog.read_text().replace("aliases: [loud", "aliases: [shuot, loud"))
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 1  # now it answers: nothing to say
    catalog.write_text(catalog.read_text().replace("aliases: [shuot, loud", "aliases: [caps"))
    assert await served.gw.reload_catalog()
    assert "may use loud, shuot," in warnings()[-1] and len(warnings()) == 2


async def test_a_key_limited_to_routes_may_not_read_metrics(serve: Serve) -> None:
    """Metrics name every route: the key would learn of the routes /v1/models hides from it."""
    scrape = "sk-test-scrape-only"
    keys = [
        {"name": "user", "key": USER_KEY},
        {"name": "admin", "key": ADMIN_KEY, "admin": True, "routes": ["shout"]},
        {"name": "shout-only", "key": SHOUT_ONLY_KEY, "routes": ["shout"]},
        {"name": "scrape", "key": scrape, "routes": []},
    ]
    served = await serve(auth__keys=keys)
    assert (await served.http.post("/v1/chat/completions", json=chat_body("json"))).status_code == 200
    scoped = await served.http.get("/metrics", headers={"Authorization": f"Bearer {SHOUT_ONLY_KEY}"})
    err = assert_openai_error(scoped, 403, "scoped_key")
    assert err["type"] == "permission_error" and 'route="json"' not in scoped.text
    for key in (USER_KEY, ADMIN_KEY, scrape):
        r = await served.http.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and 'route="json"' in r.text, key


async def test_public_metrics_stay_public_for_a_scoped_key(serve: Serve) -> None:
    served = await serve(auth__public_metrics=True)
    r = await served.http.get("/metrics", headers={"Authorization": f"Bearer {SHOUT_ONLY_KEY}"})
    assert r.status_code == 200


async def test_an_unscoped_key_sees_every_route(serve: Serve) -> None:
    served = await serve()
    models = (await served.http.get("/v1/models")).json()["data"]
    assert {m["id"] for m in models} == {BASE, "base", "shout", "loud", "json", "concise"}


# -- admin paths -------------------------------------------------------------------------
ADMIN_PATHS = [
    ("GET", b"/admin/adapters"),
    ("GET", b"/admin/status"),
    ("POST", b"/admin/adapters/reload"),
    ("GET", b"//admin/adapters"),
    ("GET", b"///admin//status"),
    ("POST", b"//admin/adapters/reload"),
    ("GET", b"/ADMIN/adapters"),
    ("GET", b"/Admin/status"),
    ("GET", b"/admin%2Fadapters"),
    ("GET", b"/admin"),
    ("GET", b"/admin/nothing"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_PATHS)
async def test_admin_paths_are_403_for_a_user_key(serve: Serve, method: str, path: bytes) -> None:
    served = await serve()
    r = await served.http.send(raw(served, method, path, {"Authorization": f"Bearer {USER_KEY}"}))
    err = assert_openai_error(r, 403, "admin_only")
    assert err["type"] == "permission_error"


@pytest.mark.parametrize(("method", "path"), ADMIN_PATHS)
async def test_admin_paths_are_401_without_a_key(serve: Serve, method: str, path: bytes) -> None:
    served = await serve()
    r = await served.http.send(raw(served, method, path, NO_KEY))
    assert_openai_error(r, 401, "invalid_api_key")


async def test_an_admin_key_may_use_admin_paths(serve: Serve) -> None:
    served = await serve()
    adapters = await served.http.get("/admin/adapters", headers=ADMIN)
    assert adapters.status_code == 200
    body = adapters.json()
    assert body["last_error"] is None and body["rejected"] == {}
    assert body["engine_loras"] == body["live_loras"] == sorted(served.engine.loras)  # both adapters loaded
    assert len(body["live_loras"]) == 2
    status = await served.http.get("/admin/status", headers={"x-api-key": ADMIN_KEY, "Authorization": ""})
    assert status.status_code == 200
    assert status.json()["inflight"] == 0 and status.json()["engine_ready"] is True
    reload = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert reload.status_code == 200 and reload.json()["reloaded"] is True


# -- header limit ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/models", "/health"])
async def test_oversized_headers_are_431_before_auth(serve: Serve, path: str) -> None:
    served = await serve()
    for headers in ({"x-junk": "a" * 20_000}, {**NO_KEY, "x-junk": "a" * 20_000}):
        assert_openai_error(await served.http.get(path, headers=headers), 431, "headers_too_large")
    assert (await served.http.get(path, headers={"x-junk": "a" * 8_000})).status_code == 200  # under 16 KiB


async def test_the_header_limit_is_a_setting(serve: Serve) -> None:
    """The limit is the largest head taken: one of exactly ``max_header_bytes`` (path, query
    and headers, each header counted with its ": " and CRLF) is served, one byte more is 431."""
    served = await serve(server__max_header_bytes=2048)
    assert_openai_error(await served.http.get("/v1/models", headers={"x-junk": "a" * 3000}), 431)
    body = json.dumps(chat_body("base")).encode()
    auth = f"Bearer {USER_KEY}"
    head = len("/v1/chat/completions") + len("authorization") + len(auth) + 4 + len("x-junk") + 4
    for size, status in ((2048, 200), (2049, 431)):
        sent = await by_hand(served, {"authorization": auth, "x-junk": "a" * (size - head)}, body)
        assert sent[0]["status"] == status


async def test_a_long_query_string_counts_toward_the_header_limit(serve: Serve) -> None:
    served = await serve()
    assert_openai_error(await served.http.get("/v1/models", params={"q": "a" * 20_000}), 431)


# -- admission ---------------------------------------------------------------------------
async def soon(request: Awaitable[httpx.Response]) -> httpx.Response:
    """A request that must be answered at once: one admitted by mistake would wait on the
    engine's closed gate, and fail here instead of hanging the test."""
    return await asyncio.wait_for(request, 5)


async def held(served: Served, count: int, key: str = USER_KEY) -> list[asyncio.Task[httpx.Response]]:
    """``count`` chat requests admitted and waiting in the engine (its gate is closed)."""
    headers = {"Authorization": f"Bearer {key}"}
    before = served.engine.running
    tasks = [
        asyncio.ensure_future(
            served.http.post("/v1/chat/completions", json=chat_body("base"), headers=headers)
        )
        for _ in range(count)
    ]
    await eventually_async(
        lambda: served.engine.running == before + count, 5, f"{count} more requests in the engine"
    )
    return tasks


async def test_above_max_inflight_is_a_fast_429_with_retry_after(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), limits__max_inflight=2)
    running = await held(served, 2)
    for path, body in [
        ("/v1/chat/completions", chat_body("base")),
        ("/v1/completions", {"prompt": "hi"}),
        ("/chat", {"question": "hi"}),
    ]:
        r = await soon(served.http.post(path, json=body))
        err = assert_openai_error(r, 429, "rate_limit_exceeded")
        assert err["type"] == "rate_limit_exceeded"
        assert r.headers["retry-after"] == "1"
    assert len(served.engine.calls) == 2  # the refused requests never reached the engine
    assert (await served.http.get("/v1/models")).status_code == 200  # only inference is bounded
    status = (await served.http.get("/admin/status", headers=ADMIN)).json()
    assert status["inflight"] == 2 and status["rejected"] == 3
    assert served.gw.metrics.registry.get_sample_value("gateway_admission_rejected_total") == 3  # alerts
    gate.set()
    assert [(await soon(t)).status_code for t in running] == [200, 200]
    assert served.gw.admission.inflight == 0
    await still_serves_async(served.http)


async def test_retry_after_is_a_setting(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), limits__max_inflight=1, limits__retry_after_s=7)
    running = await held(served, 1)
    r = await soon(served.http.post("/v1/chat/completions", json=chat_body("base")))
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    gate.set()
    assert (await soon(running[0])).status_code == 200


async def test_a_key_above_its_max_concurrency_gets_429_and_others_do_not(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate))
    single = {"Authorization": f"Bearer {SINGLE_KEY}"}
    mine = await held(served, 1, SINGLE_KEY)
    second = await soon(served.http.post("/v1/chat/completions", json=chat_body("base"), headers=single))
    assert_openai_error(second, 429, "rate_limit_exceeded")
    assert second.headers["retry-after"] == "1"
    others = await held(served, 2)  # the bound is per key: the user's requests are admitted
    assert served.gw.admission.per_key == {"single": 1, "user": 2}
    gate.set()
    assert [(await soon(t)).status_code for t in [*mine, *others]] == [200, 200, 200]
    assert served.gw.admission.per_key == {}
    again = await served.http.post(
        "/v1/chat/completions", json=chat_body("base", max_tokens=2), headers=single
    )
    assert again.status_code == 200  # the key's slot came back


FOUR_KEY = "sk-test-four-at-a-time"
FOUR = {"Authorization": f"Bearer {FOUR_KEY}"}
# The user's key (no limit of its own) and one that may have four sequences in flight.
FOUR_KEYS = [{"name": "user", "key": USER_KEY}, {"name": "four", "key": FOUR_KEY, "max_concurrency": 4}]


def post_soon(
    served: Served, path: str, body: dict[str, Any], headers: dict[str, str]
) -> asyncio.Task[httpx.Response]:
    return asyncio.ensure_future(served.http.post(path, json=body, headers=headers))


async def test_a_request_holds_its_prompts_times_n_against_its_key(serve: Serve) -> None:
    """Two prompts with n=2 are four sequences in the engine: the key's four, not one."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), auth__keys=FOUR_KEYS)
    batch = completion_body("base", ["a", "b"], n=2, temperature=1.0, max_tokens=2)
    held_batch = post_soon(served, "/v1/completions", batch, FOUR)
    await eventually_async(lambda: served.engine.running == 2, 5, "both prompts in the engine")
    assert served.gw.admission.per_key == {"four": 4} and served.gw.admission.inflight == 4
    one_more = await soon(served.http.post("/v1/chat/completions", json=chat_body("base"), headers=FOUR))
    err = assert_openai_error(one_more, 429, "rate_limit_exceeded")
    assert err["message"] == "this key has 4 sequences in flight already"
    assert one_more.headers["retry-after"] == "1"
    others = await held(served, 1)  # another key is not held back
    gate.set()
    assert [(await soon(t)).status_code for t in [held_batch, *others]] == [200, 200]
    assert served.gw.admission.per_key == {} and served.gw.admission.inflight == 0


async def test_requests_and_sequences_in_flight_are_both_shown(serve: Serve) -> None:
    """Two prompts with n=2 are one request and four sequences, in /metrics and /admin/status
    alike (``inflight``, sequences, is kept for older readers)."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate))

    async def shown() -> tuple[float | None, ...]:
        status = (await served.http.get("/admin/status", headers=ADMIN)).json()
        await served.http.get("/metrics")  # sets the gauges
        registry = served.gw.metrics.registry
        return (
            status["inflight_requests"],
            status["inflight_sequences"],
            status["inflight"],
            registry.get_sample_value("gateway_inflight_requests"),
            registry.get_sample_value("gateway_inflight_sequences"),
        )

    batch = completion_body("base", ["a", "b"], n=2, temperature=1.0, max_tokens=2)
    held_batch = post_soon(served, "/v1/completions", batch, {})
    await eventually_async(lambda: served.engine.running == 2, 5, "both prompts in the engine")
    assert await shown() == (1, 4, 4, 1.0, 4.0)
    gate.set()
    assert (await soon(held_batch)).status_code == 200
    assert await shown() == (0, 0, 0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("path", "body", "what", "fits"),
    [
        ("/v1/chat/completions", chat_body("base", n=5, temperature=1.0), "5 sequences (n=5)", {"n": 4}),
        (
            "/v1/completions",
            completion_body("base", ["a", "b", "c"], n=2, temperature=1.0),
            "6 sequences (3 prompts x n=2)",
            {"n": 1},
        ),
        (
            "/v1/completions",
            completion_body("base", [[5, 6]] * 5),
            "5 sequences (5 prompts x n=1)",
            {"prompt": [[5, 6]] * 4},
        ),
    ],
)
async def test_a_request_larger_than_its_keys_limit_is_too_large(
    serve: Serve, path: str, body: dict[str, Any], what: str, fits: dict[str, Any]
) -> None:
    """OpenAI's "Request too large": a 429 that waiting would not cure, so no Retry-After."""
    served = await serve(auth__keys=FOUR_KEYS)
    r = await served.http.post(path, json=body, headers=FOUR)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["message"] == (
        f"Request too large for this key: {what}, more than its limit of 4 in flight. "
        "Send fewer prompts or a lower n."
    )
    assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"  # the SDKs' word
    assert served.engine.calls == [] and served.gw.admission.inflight == 0
    assert served.gw.admission.rejected == 1
    assert served.gw.metrics.registry.get_sample_value("gateway_admission_rejected_total") == 1
    assert (await served.http.post(path, json={**body, **fits}, headers=FOUR)).status_code == 200
    assert (await served.http.post(path, json=body)).status_code == 200  # a key with no limit


async def test_too_large_is_refused_before_its_prompts_are_tokenized(serve: Serve) -> None:
    """A key's limit bounds what its requests cost too: a batch it may never run is refused
    before 256 prompts are tokenized; and the OpenAI SDK does not send it again."""
    served = await serve(auth__keys=FOUR_KEYS)
    encoded: list[str] = []
    encode = served.engine.tokenizer.encode
    served.engine.tokenizer.encode = lambda text, add_special_tokens=True: (  # type: ignore[method-assign]
        encoded.append(text) or encode(text, add_special_tokens)
    )
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=served.app), base_url="http://gateway.test")
    client = openai.AsyncOpenAI(base_url="http://gateway.test/v1", api_key=FOUR_KEY, http_client=http)
    with pytest.raises(openai.RateLimitError, match="Request too large"):
        await client.completions.create(model="base", prompt=["x" * 1000] * 256, max_tokens=1)
    await http.aclose()
    assert encoded == [] and served.gw.admission.rejected == 1  # once: not retried
    assert served.gw.metrics.registry.get_sample_value("gateway_admission_rejected_total") == 1


def test_admission_reads_the_keys_limit_before_its_own_bound() -> None:
    """With max_inflight 1 a request's size was cut to 1 before its key's limit was read
    (the app refuses such a request earlier too: ``routes``, before tokenizing)."""
    admission = Admission(max_inflight=1, retry_after_s=1)
    four = Principal("four", None, admin=False, max_concurrency=4)
    assert admission.admit(four) is None
    refused = admission.grow(Place(four), 8, "n=8")
    assert refused is not None and "Request too large" in refused.message
    assert refused.headers == {"x-should-retry": "false"}


async def test_too_large_holds_when_the_gateway_runs_one_sequence(serve: Serve) -> None:
    # With limits.max_inflight 1 a request's size was cut to 1 before its key's limit was read.
    served = await serve(auth__keys=FOUR_KEYS, limits__max_inflight=1)
    body = chat_body("base", n=8, temperature=1.0, max_tokens=2)
    r = await served.http.post("/v1/chat/completions", json=body, headers=FOUR)
    assert "Request too large" in assert_openai_error(r, 429, "rate_limit_exceeded")["message"]
    assert served.engine.calls == []


async def test_a_request_that_fits_later_gets_a_429_with_retry_after(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), auth__keys=FOUR_KEYS)
    three = post_soon(served, "/v1/chat/completions", chat_body("base", n=3, temperature=1.0), FOUR)
    await eventually_async(lambda: served.gw.admission.per_key == {"four": 3}, 5, "three sequences held")
    two = chat_body("base", n=2, temperature=1.0)
    r = await soon(served.http.post("/v1/chat/completions", json=two, headers=FOUR))
    err = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert err["message"] == "this key may have 4 sequences in flight and has 3; this request needs 2 (n=2)"
    assert r.headers["retry-after"] == "1"
    assert served.gw.admission.per_key == {"four": 3}  # the refused request let go of its place
    gate.set()
    assert (await soon(three)).status_code == 200
    assert (await served.http.post("/v1/chat/completions", json=two, headers=FOUR)).status_code == 200


async def test_the_gateway_bound_counts_sequences_too(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), limits__max_inflight=4)
    running = await held(served, 2)
    three = completion_body("base", ["a"] * 3, max_tokens=2)
    full = await soon(served.http.post("/v1/completions", json=three))
    err = assert_openai_error(full, 429, "rate_limit_exceeded")
    assert (
        err["message"]
        == "the gateway is at capacity: this request needs 3 sequences (3 prompts x n=1), 2 are free"
    )
    assert full.headers["retry-after"] == "1"
    five = completion_body("base", ["a"] * 5, max_tokens=2)
    err = assert_openai_error(await soon(served.http.post("/v1/completions", json=five)), 429)
    assert err["message"] == (
        "the gateway is at capacity: this request needs all 4 sequences the gateway runs or queues "
        "at once (5 prompts x n=1), 2 are free"
    )
    assert served.engine.running == 2 and served.gw.admission.inflight == 2
    gate.set()
    assert [(await soon(t)).status_code for t in running] == [200, 200]
    assert (await served.http.post("/v1/completions", json=three)).status_code == 200
    assert served.gw.admission.inflight == 0


async def test_a_request_larger_than_the_gateway_bound_runs_alone(serve: Serve) -> None:
    """More prompts than the bound: it holds the whole bound, so it runs when nothing else
    does (256 prompts stay possible with the defaults) and nothing else starts meanwhile."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), limits__max_inflight=4)
    body = completion_body("base", ["a"] * 5, max_tokens=2)
    five = post_soon(served, "/v1/completions", body, {"Authorization": f"Bearer {USER_KEY}"})
    await eventually_async(lambda: served.gw.admission.inflight == 4, 5, "the whole bound held")
    r = await soon(served.http.post("/v1/chat/completions", json=chat_body("base")))
    assert_openai_error(r, 429, "rate_limit_exceeded")
    gate.set()
    done = await soon(five)
    assert done.status_code == 200 and len(done.json()["choices"]) == 5
    assert served.gw.admission.inflight == 0


async def test_a_failed_request_releases_its_slot(serve: Serve) -> None:
    served = await serve(limits__max_inflight=1)
    for _ in range(3):
        r = await served.http.post("/v1/chat/completions", json=chat_body("no-such-route"))
        assert_openai_error(r, 404, "model_not_found")
    assert served.gw.admission.inflight == 0
    await still_serves_async(served.http)


async def test_draining_refuses_new_work_with_503(serve: Serve) -> None:
    served = await serve()
    served.gw.admission.draining = True
    r = await served.http.post("/v1/chat/completions", json=chat_body("base"))
    err = assert_openai_error(r, 503)
    assert err["type"] == "service_unavailable" and r.headers["retry-after"] == "1"
    assert served.engine.calls == []
    # a drain is no overload: gateway_admission_rejected counts the 429s of a full gateway only
    assert served.gw.metrics.registry.get_sample_value("gateway_admission_rejected_total") == 0
    ready = await served.http.get("/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert (await served.http.get("/health")).status_code == 200  # alive, just not taking work
    assert (await served.http.get("/v1/models")).status_code == 200


async def test_request_id_is_returned(serve: Serve) -> None:
    served = await serve()
    assert (await served.http.get("/health", headers={"x-request-id": "abc-123"})).headers[
        "x-request-id"
    ] == "abc-123"
    assert len((await served.http.get("/health")).headers["x-request-id"]) == 32
    unsafe = await served.http.get("/health", headers={"x-request-id": "a b<script>"})
    assert len(unsafe.headers["x-request-id"]) == 32  # replaced, not echoed
    longest = "a" * 128  # the longest echoed: a longer one is replaced, as it would fill the logs
    echoed = await served.http.get("/health", headers={"x-request-id": longest})
    assert echoed.headers["x-request-id"] == longest
    too_long = await served.http.get("/health", headers={"x-request-id": "a" * 129})
    assert len(too_long.headers["x-request-id"]) == 32
    refused = await served.http.get("/v1/models", headers={**NO_KEY, "x-request-id": "denied-1"})
    assert refused.headers["x-request-id"] == "denied-1"  # errors from middleware carry it too


async def by_hand(served: Served, headers: dict[str, str], body: bytes) -> list[dict[str, Any]]:
    """One request through the app with headers no HTTP client would send as they are."""
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        for message in messages:
            return message
        await asyncio.Event().wait()  # the client stays: no disconnect
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope("/v1/chat/completions", {})
    scope["headers"] = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]  # as sent
    await asyncio.wait_for(served.app(scope, receive, send), 5)
    return sent


async def test_a_request_id_ending_in_a_newline_is_replaced(serve: Serve) -> None:
    served = await serve()
    body = json.dumps(chat_body("base")).encode()
    sent = await by_hand(served, {"authorization": f"Bearer {USER_KEY}", "x-request-id": "abc\n"}, body)
    ids = [v for k, v in sent[0]["headers"] if k == b"x-request-id"]
    assert sent[0]["status"] == 200 and len(ids) == 1 and len(ids[0]) == 32


async def test_a_content_length_of_non_ascii_digits_is_not_a_500(serve: Serve) -> None:
    """``"²".isdigit()`` is true but ``int("²")`` fails: the declared length is ignored, and
    the body read as it comes."""
    served = await serve()
    body = json.dumps(chat_body("base")).encode()
    sent = await by_hand(served, {"authorization": f"Bearer {USER_KEY}", "content-length": "\u00b2"}, body)
    assert sent[0]["status"] == 200
    assert served.gw.admission.inflight == 0


async def test_a_client_leaving_during_its_upload_is_499_not_an_error(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    served = await serve()
    body = json.dumps(chat_body("base")).encode()
    headers = {"authorization": f"Bearer {USER_KEY}", "content-length": str(len(body))}
    scope = http_scope("/v1/chat/completions", headers)
    messages = iter(
        [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
    )
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO):
        await served.app(scope, receive, send)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["status"], a["client_disconnected"]) for a in access] == [(499, True)]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert sent == []  # nothing is written to a client that has gone
    labels = {"route": "unknown", "status": "499", "stream": "false"}
    assert served.gw.metrics.registry.get_sample_value("gateway_requests_total", labels) == 1
    assert served.gw.admission.inflight == 0


class FailsMidStream(FakeEngine):
    """Two tokens, then the engine fails the request (after the stream's 200 went out)."""

    async def generate(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        steps = 0
        async for step in super().generate(*args, **kwargs):
            if steps == 2:
                raise EngineFailed("the engine failed to process the request")
            steps += 1
            yield step


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body("base", stream=True)),
        ("/chat", {"question": "Hi"}),
        ("/v1/responses", {"model": "base", "input": "Hi", "stream": True}),
    ],
)
async def test_a_stream_that_fails_after_its_200_is_counted_and_logged_as_the_error(
    serve: Serve, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    served = await serve(FailsMidStream(words=["a"] * 10))
    with caplog.at_level(logging.INFO):
        r = await served.http.post(path, json=body)
    last = [e for e in r.text.split("\n\n") if e and e != "data: [DONE]"][-1]
    assert r.status_code == 200 and "error" in last
    access = [json.loads(m.getMessage()) for m in caplog.records if m.name == "gateway.access"]
    assert [(a["status"], a["error"]) for a in access] == [(500, "the engine failed to process the request")]
    assert_counted_as(served, "500")


async def test_a_client_leaving_mid_stream_is_499_like_one_leaving_a_whole_response(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """The 200 went out with the stream's head; the client left before its end: 499 in
    the log and the metrics, as a non-streamed request's client leaving is, not a success."""
    served = await serve(FakeEngine(words=["a"] * 50, delay=0.01))
    body = json.dumps(chat_body("base", stream=True)).encode()
    headers = {"authorization": f"Bearer {USER_KEY}", "content-length": str(len(body))}
    gone = asyncio.Event()
    chunks = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body" and message.get("body"):
            chunks += 1
            if chunks == 3:
                gone.set()

    with caplog.at_level(logging.INFO):
        await served.app(http_scope("/v1/chat/completions", headers), body_then_disconnect(body, gone), send)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["status"], a["client_disconnected"]) for a in access] == [(499, True)]
    assert_counted_as(served, "499")


async def test_a_client_gone_while_its_disconnect_is_never_told_is_499_and_aborted(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn tells a disconnect only to a connection's latest request: with pipelined requests
    the running stream never hears it, and its next send fails (uvloop: the transport is
    closed). That stream was cut short by its client: 499 and aborted, not a 200."""
    served = await serve(FakeEngine(words=["a"] * 50, delay=0.01))

    async def closed() -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    with caplog.at_level(logging.INFO):
        await stream_by_hand(served, "/v1/chat/completions", chat_body("base", stream=True), closed)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["status"], a["client_disconnected"]) for a in access] == [(499, True)]
    assert_counted_as(served, "499")
    await eventually_async(lambda: len(served.engine.aborted) == 1, 5, "the engine request aborted")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat"])
async def test_a_client_that_stops_reading_is_ended_after_the_send_timeout(
    serve: Serve, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """A client that stops reading (a full TCP window) blocks the stream's send and never
    disconnects: it held its admission slot for as long as its connection stayed open, so a
    few such clients made every other request a 429. Past limits.send_timeout_s it is a
    client that left: 499, aborted in the engine, its slot free."""
    served = await serve(
        FakeEngine(words=["a"] * 500, delay=0.005), limits__max_inflight=1, limits__send_timeout_s=0.3
    )
    request = chat_body("base", stream=True) if path != "/chat" else {"question": "hi"}

    async def full_window() -> None:
        await asyncio.Event().wait()  # the client reads no more

    with caplog.at_level(logging.INFO):
        await asyncio.wait_for(stream_by_hand(served, path, request, full_window), 5)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["status"], a["client_disconnected"]) for a in access] == [(499, True)]
    await eventually_async(lambda: len(served.engine.aborted) == 1, 5, "the engine request aborted")
    assert served.gw.admission.inflight == 0
    again = await served.http.post("/v1/chat/completions", json=chat_body("base", max_tokens=2))
    assert again.status_code == 200


async def test_a_slow_reader_that_keeps_reading_is_not_cut(serve: Serve) -> None:
    """The send timeout bounds one blocked send, not the stream: a client taking each chunk
    a little late, for longer than the timeout in all, gets the whole answer."""
    served = await serve(FakeEngine(words=["a"] * 12), limits__send_timeout_s=0.2)
    body = json.dumps(chat_body("base", stream=True)).encode()
    headers = {"authorization": f"Bearer {USER_KEY}", "content-length": str(len(body))}
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.05)  # 12+ chunks: well over 0.2 s in all
            sent.append(message.get("body", b""))

    receive = body_then_disconnect(body, asyncio.Event())
    await asyncio.wait_for(served.app(http_scope("/v1/chat/completions", headers), receive, send), 5)
    assert b"data: [DONE]" in b"".join(sent)
    assert served.engine.aborted == []


async def stream_by_hand(
    served: Served, path: str, request: dict[str, Any], then: Callable[[], Awaitable[None]]
) -> None:
    """One request through the app from a client that, from the third body chunk on, runs
    ``then`` in each send (raise: the transport closed; wait: it stopped reading) and never
    tells of a disconnect."""
    body = json.dumps(request).encode()
    headers = {"authorization": f"Bearer {USER_KEY}", "content-length": str(len(body))}
    chunks = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body" and message.get("body"):
            chunks += 1
            if chunks >= 3:
                await then()

    await served.app(http_scope(path, headers), body_then_disconnect(body, asyncio.Event()), send)


def assert_counted_as(served: Served, status: str) -> None:
    """One streamed request on the base route, counted under ``status`` and not as a 200,
    and kept out of the latency of successes."""
    registry = served.gw.metrics.registry
    for label, count in ((status, 1), ("200", None)):
        labels = {"route": BASE, "status": label, "stream": "true"}
        assert registry.get_sample_value("gateway_requests_total", labels) == count, label
    assert registry.get_sample_value("gateway_request_duration_seconds_count", {"route": BASE}) is None


async def test_a_request_refused_after_routing_counts_under_its_route(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A 400 the route's request earned (n, context length, house stream limits) is that
    route's, not ``unknown`` (kept for requests no route was found for)."""
    served = await serve()
    with caplog.at_level(logging.INFO):
        for body in (chat_body("loud", n=99), chat_body("base", max_tokens=100_000)):
            assert_openai_error(await served.http.post("/v1/chat/completions", json=body), 400)
        assert_openai_error(await served.http.post("/v1/chat/completions", json=chat_body("nope")), 404)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(a["route"], a["status"]) for a in access] == [("shout", 400), (BASE, 400), (None, 404)]
    registry = served.gw.metrics.registry
    for route, status in (("shout", "400"), (BASE, "400"), ("unknown", "404")):
        labels = {"route": route, "status": status, "stream": "false"}
        assert registry.get_sample_value("gateway_requests_total", labels) == 1, labels


async def test_a_request_on_a_route_a_reload_renamed_counts_under_the_route_that_served_it(
    serve: Serve, tmp_path: Path
) -> None:
    """Admitted on ``shout``, finished after a reload renamed it ``yell``: its headers and log
    say ``shout``, and so does /metrics (it said ``unknown``)."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate))
    task = asyncio.create_task(served.http.post("/v1/chat/completions", json=chat_body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "the request in the engine")
    (tmp_path / "adapters.yaml").write_text("routes:\n  - {name: yell, adapter: shout}\n")
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    gate.set()
    r = await task
    assert r.status_code == 200 and r.headers["x-adapter"] == "shout"
    registry = served.gw.metrics.registry
    labels = {"route": "shout", "status": "200", "stream": "false"}
    assert registry.get_sample_value("gateway_requests_total", labels) == 1
    assert registry.get_sample_value("gateway_requests_total", {**labels, "route": "unknown"}) is None


async def test_renaming_a_route_again_and_again_keeps_the_metrics_bounded(
    serve: Serve, tmp_path: Path
) -> None:
    """Each reload renamed the route; every name ever served kept its label and its series
    (about eight each), so weeks of renames grew /metrics without end. Names a reload
    removed keep their label for the next RETIRED_KEPT removals only."""
    served = await serve()
    registry = served.gw.metrics.registry
    renames = RETIRED_KEPT + 40
    for i in range(renames):
        (tmp_path / "adapters.yaml").write_text(f"routes:\n  - {{name: r{i}, adapter: shout}}\n")
        assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
        assert (await served.http.post("/v1/chat/completions", json=chat_body(f"r{i}"))).status_code == 200
    routes = {s.labels["route"] for m in registry.collect() for s in m.samples if "route" in s.labels}
    kept = {f"r{i}" for i in range(renames - RETIRED_KEPT - 1, renames)}
    assert routes - {BASE, "unknown"} == kept
    labels = {"route": f"r{renames - 1}", "status": "200", "stream": "false"}
    assert registry.get_sample_value("gateway_requests_total", labels) == 1


async def test_every_status_the_gateway_sends_on_inference_paths_has_its_own_label(serve: Serve) -> None:
    """415 (README's status list) was counted as status "other"."""
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", content=json.dumps(chat_body("base")), headers={"content-type": "text/plain"}
    )
    assert_openai_error(r, 415)
    labels = {"route": "unknown", "status": "415", "stream": "false"}
    assert served.gw.metrics.registry.get_sample_value("gateway_requests_total", labels) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body("base")),
        ("/v1/completions", {"model": "base", "prompt": "Hi"}),
        ("/v1/responses", {"model": "base", "input": "Hi"}),
    ],
)
async def test_the_access_log_names_the_id_the_response_body_carries(
    serve: Serve, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    """A client reports the body's id (chatcmpl-..., resp_...); the log line must be found by it."""
    served = await serve()
    with caplog.at_level(logging.INFO):
        r = await served.http.post(path, json=body, headers={"x-request-id": "client-1"})
    access = [json.loads(m.getMessage()) for m in caplog.records if m.name == "gateway.access"]
    assert [(a["request_id"], a["response_id"]) for a in access] == [("client-1", r.json()["id"])]
    # The engine's own lines (an abort, an error) name its request id: the access line must too.
    engine_id = access[0].get("engine_request_id", access[0]["response_id"])
    assert engine_id.startswith("cmpl-" if path == "/v1/completions" else "chatcmpl-")


@pytest.mark.parametrize(("prompts", "n"), [(["ab"], 2), (["ab", "cd", "ef"], 1), (["ab", "cd"], 2)])
async def test_inter_token_latency_is_measured_per_prompt_stream(
    serve: Serve, prompts: list[str], n: int
) -> None:
    """Several prompts run as one engine stream each; their steps interleave. The gap
    between two streams' steps is no stream's inter-token latency: it halved (or worse)
    the reported ITL of a request with several prompts."""
    served = await serve(FakeEngine(words=["a"] * 5, delay=0.05))
    body = {"model": "base", "prompt": prompts, "max_tokens": 5, "n": n, "temperature": 1}
    assert (await served.http.post("/v1/completions", json=body)).status_code == 200
    registry = served.gw.metrics.registry
    route = {"route": BASE}
    # 5 steps per prompt stream: 4 gaps each, each at least the engine's 50 ms per token
    assert registry.get_sample_value("gateway_inter_token_latency_seconds_count", route) == 4 * len(prompts)
    fast = registry.get_sample_value("gateway_inter_token_latency_seconds_bucket", {**route, "le": "0.04"})
    assert fast == 0


# -- CORS --------------------------------------------------------------------------------
APP_ORIGIN = "https://app.example.com"
PREFLIGHT = {
    "Origin": APP_ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    "Authorization": "",
}


async def test_a_browser_preflight_is_answered_without_a_key(serve: Serve) -> None:
    """A preflight carries no key; refusing it (401) would keep every browser app out."""
    served = await serve()
    r = await served.http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].lower().split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed


@pytest.mark.parametrize("stream", [False, True])
async def test_answers_to_a_browser_carry_cors_headers_and_expose_the_request_id(
    serve: Serve, stream: bool
) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", json=chat_body(BASE, stream=stream), headers={"Origin": APP_ORIGIN}
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after"} <= exposed
    assert r.headers["x-request-id"]


async def test_a_refusal_carries_cors_headers_so_the_app_can_read_it(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post(
        "/v1/chat/completions", json=chat_body(BASE), headers={"Origin": APP_ORIGIN, **NO_KEY}
    )
    assert_openai_error(r, 401, "invalid_api_key")
    assert r.headers["access-control-allow-origin"] == "*"
    big = {"Origin": APP_ORIGIN, "x-junk": "a" * 20_000}  # the header limit's 431 too (it had none)
    r = await served.http.post("/v1/chat/completions", json=chat_body(BASE), headers=big)
    assert_openai_error(r, 431, "headers_too_large")
    assert r.headers["access-control-allow-origin"] == "*"
    # a preflight over the limit is a 431 as well: CORS must not answer it (and echo its head)
    big_preflight = {**PREFLIGHT, "Access-Control-Request-Headers": "x-" + "a" * 40_000}
    r = await served.http.options("/v1/chat/completions", headers=big_preflight)
    assert_openai_error(r, 431, "headers_too_large")


async def test_the_fallback_500_carries_cors_headers_and_the_request_id(serve: Serve) -> None:
    """An unhandled error's 500 is made outside CORS (the outermost middleware): it had none."""
    served = await serve()

    async def boom(*_: object, **__: object) -> None:
        raise RuntimeError("a bug")

    served.gw.service.chat = boom  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=served.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as http:
        headers = {"Authorization": f"Bearer {USER_KEY}", "Origin": APP_ORIGIN, "x-request-id": "r-1"}
        r = await http.post("/v1/chat/completions", json=chat_body(BASE), headers=headers)
    assert_openai_error(r, 500)
    assert r.headers["access-control-allow-origin"] == "*" and r.headers["x-request-id"] == "r-1"


async def test_listed_origins_only(serve: Serve) -> None:
    served = await serve(server__cors_allow_origins=[APP_ORIGIN])
    ok = await served.http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert (ok.status_code, ok.headers["access-control-allow-origin"]) == (200, APP_ORIGIN)
    other = await served.http.options(
        "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.test"}
    )
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers
    r = await served.http.post(
        "/v1/chat/completions", json=chat_body(BASE), headers={"Origin": "https://evil.test"}
    )
    assert r.status_code == 200  # not a browser's business here: it will not let the page read it
    assert "access-control-allow-origin" not in r.headers


async def test_no_origins_no_cors(serve: Serve) -> None:
    served = await serve(server__cors_allow_origins=[])
    r = await served.http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    assert_openai_error(r, 401, "invalid_api_key")  # an OPTIONS like any other: no key, no entry
    r = await served.http.post("/v1/chat/completions", json=chat_body(BASE), headers={"Origin": APP_ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
