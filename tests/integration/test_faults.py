"""Faults against the real gateway: disconnects, overload, oversized input, SIGTERM under
load, and the engine process dying mid-stream. Every case checks the status, the error
shape and that a normal request still works afterwards (where the gateway should live)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.helpers import chat_body, eventually, still_serves
from tests.integration.conftest import SINGLE_KEY, LiveGateway, start_gateway, stop_gateway


def long_story(model: str, **fields: object) -> dict[str, object]:
    """A request that runs for a long time (1500 tokens, no early stop), unless it is cut."""
    return chat_body(
        model, "Write a long story.", **{"max_tokens": 1500, "ignore_eos": True, "temperature": 0, **fields}
    )


def unfinished(gw: LiveGateway) -> int:
    return int(gw.status()["engine_unfinished_requests"])


def inflight(gw: LiveGateway) -> int:
    return int(gw.status()["inflight"])


# -- client disconnects abort the engine request ------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_stream_disconnect_aborts_in_the_engine(gateway: LiveGateway, n: int) -> None:
    assert unfinished(gateway) == 0
    with (
        gateway.client() as http,
        http.stream(
            "POST", "/v1/chat/completions", json=long_story("base", stream=True, n=n, temperature=0.8)
        ) as r,
    ):
        started = time.monotonic()
        read: list[str] = []
        lines = r.iter_lines()
        while sum('"delta":{"content"' in line for line in read) < 2 * n:
            read.append(next(lines))
        # 0 here means the engine was done (finished or aborted) before the client left:
        # the stream's lines and the gateway's log tell which
        assert unfinished(gateway) >= 1, (
            f"after {time.monotonic() - started:.1f} s, read: {[line[:200] for line in read]}\n"
            f"{gateway.log_tail()}"
        )
    # the connection is closed here, long before 1500 tokens
    eventually(lambda: unfinished(gateway) == 0, 5, "engine request aborted after disconnect")
    still_serves(gateway)


def test_house_disconnect_aborts_in_the_engine(gateway: LiveGateway) -> None:
    house = {"X-Stream-Format": "house"}
    with (
        gateway.client() as http,
        http.stream("POST", "/v1/chat/completions", json=long_story("base"), headers=house) as r,
    ):
        assert r.status_code == 200, r.read()
        data = (line for line in r.iter_lines() if line.startswith("data: {"))  # keep a reference:
        next(data)  # a dropped iterator closes the response, which is a disconnect
        assert unfinished(gateway) == 1
    eventually(lambda: unfinished(gateway) == 0, 5, "engine request aborted after disconnect")


def test_non_stream_disconnect_aborts_in_the_engine(gateway: LiveGateway) -> None:
    with pytest.raises(httpx.ReadTimeout):
        gateway.client().post(
            "/v1/chat/completions",
            json=long_story("shout", n=2, temperature=0.8),
            timeout=httpx.Timeout(60, read=1.5),
        )
    eventually(lambda: unfinished(gateway) == 0, 5, "engine request aborted after disconnect")
    still_serves(gateway, "shout")


# -- per-key concurrency and oversized input ---------------------------------------------
def test_per_key_concurrency_limit_is_429_with_retry_after(gateway: LiveGateway) -> None:
    headers = {"Authorization": f"Bearer {SINGLE_KEY}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=long_story("base", stream=True)) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            next(lines)
            second = http.post("/v1/chat/completions", json=chat_body("base", "hi", max_tokens=1))
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
        # The stream is closed; the key's slot frees once the gateway has seen the disconnect.
        eventually(lambda: inflight(gateway) == 0, 5, "the key's slot released after the disconnect")
        ok = http.post("/v1/chat/completions", json=chat_body("base", "hi", max_tokens=1))
        assert ok.status_code == 200


def test_n_counts_against_the_keys_concurrency(gateway: LiveGateway) -> None:
    """A request counts the sequences it puts in the engine (prompts x n): for a key allowed
    one, n=2 or two prompts are "Request too large", before the engine hears of them."""
    headers = {"Authorization": f"Bearer {SINGLE_KEY}"}
    two_choices = chat_body("base", "hi", max_tokens=1, n=2, temperature=1.0)
    two_prompts = {"model": "base", "prompt": ["a", "b"], "max_tokens": 1}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        for path, body, what in [
            ("/v1/chat/completions", two_choices, "2 sequences (n=2)"),
            ("/v1/completions", two_prompts, "2 sequences (2 prompts x n=1)"),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "retry-after" not in r.headers
            assert error["message"].startswith(f"Request too large for this key: {what}")
        assert unfinished(gateway) == 0 and inflight(gateway) == 0
        ok = http.post("/v1/chat/completions", json={**two_choices, "n": 1})
        assert ok.status_code == 200
    both = gateway.client().post("/v1/completions", json=two_prompts)  # a key with no limit
    assert both.status_code == 200 and len(both.json()["choices"]) == 2


def test_oversized_headers_are_refused(gateway: LiveGateway) -> None:
    r = gateway.client().get("/v1/models", headers={"x-junk": "a" * 100_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    still_serves(gateway)


def test_deeply_nested_json_is_400(gateway: LiveGateway) -> None:
    body = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = gateway.client().post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    still_serves(gateway)


# -- overload and SIGTERM, on a gateway of its own with a small admission bound -----------
SMALL_BOUND = 4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    # Also the one gateway of the suite that logs prompts (server.log_prompts; off by default),
    # and whose model has sampling defaults (vLLM's --override-generation-config).
    gw = start_gateway(
        tmp_path_factory.mktemp("small"),
        *(
            "--set",
            f"limits.max_inflight={SMALL_BOUND}",
            "--set",
            "limits.drain_timeout_s=60",
            "--set",
            "server.log_prompts=true",
            "--set",
            "engine.engine_args.override_generation_config={max_new_tokens: 100, top_k: 1}",
        ),
    )
    yield gw
    stop_gateway(gw)


async def test_burst_of_ten_times_the_bound_gets_fast_429s(small: LiveGateway) -> None:
    body = chat_body("base", "Tell me a story.", max_tokens=40, ignore_eos=True)
    outcomes: list[tuple[int, float, dict[str, object]]] = []

    async def one(http: httpx.AsyncClient) -> None:
        r = await http.post("/v1/chat/completions", json=body)
        outcomes.append(
            (r.status_code, time.monotonic(), {**r.json(), "retry": r.headers.get("retry-after")})
        )

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(
        base_url=small.url, headers=small.headers, timeout=300, limits=limits
    ) as http:
        await asyncio.gather(*(one(http) for _ in range(10 * SMALL_BOUND)))
    ok = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] == 429]
    assert len(ok) + len(refused) == len(outcomes)
    assert len(ok) >= SMALL_BOUND and len(refused) >= 5 * SMALL_BOUND
    assert all(o[2]["retry"] == "1" and o[2]["error"]["code"] == "rate_limit_exceeded" for o in refused)  # type: ignore[index]
    assert all(o[2]["usage"]["completion_tokens"] == 40 for o in ok)  # type: ignore[index]
    # Refusals did not wait in a queue: every 429 came back before the first admitted answer.
    assert max(t for _, t, _ in refused[: 5 * SMALL_BOUND]) < min(t for _, t, _ in ok)
    still_serves(small)


def test_the_models_sampling_defaults_fill_what_the_request_leaves_out(small: LiveGateway) -> None:
    """As under ``vllm serve``: the model's generation config (here the engine's override:
    ``max_new_tokens`` 100, ``top_k`` 1) for the fields a request leaves out, and its
    ``max_new_tokens`` a limit on every request."""
    with small.client() as http:
        body = chat_body("base", "Tell me a story.", ignore_eos=True, n=3, temperature=1.0, seed=5)
        answer = http.post("/v1/chat/completions", json=body).json()
        assert answer["usage"]["completion_tokens"] == 3 * 100
        assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
        assert len({c["message"]["content"] for c in answer["choices"]}) == 1  # top_k 1: one token each step
        unlimited = {**body, "max_tokens": 12, "top_k": 0}  # the request's own values win
        answer = http.post("/v1/chat/completions", json=unlimited).json()
        assert answer["usage"]["completion_tokens"] == 3 * 12
        assert len({c["message"]["content"] for c in answer["choices"]}) > 1
        over = {**body, "n": 1, "max_tokens": 150}  # vLLM: max_new_tokens is a server-wide limit
        answer = http.post("/v1/chat/completions", json=over).json()
        assert answer["usage"]["completion_tokens"] == 100
        assert answer["choices"][0]["finish_reason"] == "length"


def test_prompts_are_logged_when_enabled(small: LiveGateway) -> None:
    secret = f"SECRET-{time.time_ns()}"
    chat = chat_body("base", f"Remember {secret}", max_tokens=2)
    assert small.client().post("/v1/chat/completions", json=chat).status_code == 200
    house = {"question": f"House {secret}", "max_tokens": 2}
    assert small.client().post("/chat", json=house).status_code == 200

    def logged() -> list[dict[str, object]]:
        return [json.loads(x) for x in small.log.read_text(errors="replace").splitlines() if secret in x]

    def both_logged() -> list[dict[str, object]]:
        found = logged()
        return found if len(found) >= 2 else []

    lines = eventually(
        both_logged, 5, "prompts in the access log", lambda: f"found: {logged()}", interval=0.1
    )
    assert lines[0]["prompt"] == [{"role": "user", "content": f"Remember {secret}"}]
    assert lines[1]["prompt"] == f"House {secret}"


def in_group(pgid: int) -> list[psutil.Process]:
    """Live processes of a process group (the gateway runs in its own session)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def test_sigterm_drains_in_flight_requests_then_stops(small: LiveGateway) -> None:
    results: list[str] = []
    seen: list[int] = []

    def stream() -> None:
        body = chat_body("shout", "Story?", max_tokens=100, ignore_eos=True, stream=True)
        try:
            with small.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
                results.append(f"{r.status_code} " + r.read().decode())
        except Exception as exc:  # noqa: BLE001 -- reported by the asserts below, not lost in the thread
            results.append(f"client error {exc!r}")

    def three_in_flight() -> bool:
        seen.append(inflight(small))
        return seen[-1] == 3

    import threading

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()

    def detail() -> str:
        return (
            f"in flight seen: {sorted(set(seen))}; finished: {[r[:300] for r in results]}\n{small.log_tail()}"
        )

    eventually(three_in_flight, 30, "three requests in flight", detail)
    small.process.send_signal(signal.SIGTERM)

    def ready_status() -> int:
        try:
            return httpx.get(small.url + "/ready").status_code
        except httpx.TransportError as exc:  # say what the gateway did, not just that it is gone
            for t in threads:
                t.join(20)
            raise AssertionError(
                f"/ready: {exc!r}; gateway exit code {small.process.poll()}; {detail()}"
            ) from exc

    eventually(lambda: ready_status() == 503, 3, "/ready turns 503 at once", detail)
    assert inflight(small) >= 1, "the streams were still running when /ready turned 503"
    refused = small.client().post("/v1/chat/completions", json=chat_body("base", "hi"))
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    for t in threads:
        t.join(120)
    assert len(results) == 3
    for raw in results:  # every in-flight stream finished normally
        assert raw.startswith("200 ") and raw.endswith("data: [DONE]\n\n") and '"error"' not in raw
        assert sum(1 for line in raw.splitlines() if '"content"' in line) >= 2
    assert small.process.wait(60) == 0, small.log_tail()  # a drain is a clean stop
    time.sleep(1)
    assert not in_group(small.process.pid), "a process of the gateway outlived it"


def test_health_answers_while_the_engine_starts_and_sigterm_stops_the_start(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    gw = start_gateway(tmp_path_factory.mktemp("starting"), wait=False)
    try:

        def health() -> int:
            try:
                return httpx.get(gw.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                assert gw.process.poll() is None, gw.log_tail()
                return 0

        eventually(lambda: health() == 200, 120, "/health answers while the engine starts", gw.log_tail)
        ready = httpx.get(gw.url + "/ready", timeout=5)
        assert (ready.status_code, ready.json()) == (503, {"status": "starting"})
        r = gw.client().post("/v1/chat/completions", json=chat_body("base", "hi"))
        assert (
            r.status_code == 503
            and r.json()["error"]["type"] == "service_unavailable"
            and r.headers["retry-after"]
        )
        gw.process.send_signal(signal.SIGTERM)
        assert gw.process.wait(300) == 0, gw.log_tail()
        time.sleep(1)
        assert not in_group(gw.process.pid), "a process of the gateway outlived it"
        assert "engine ready" not in gw.log.read_text(), "the start had finished before the signal"
    finally:
        stop_gateway(gw)


# -- engine death -----------------------------------------------------------------------
def engine_core(gw: LiveGateway) -> psutil.Process:
    for child in psutil.Process(gw.process.pid).children(recursive=True):
        if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
            return child
    raise AssertionError("no EngineCore process found")


def test_engine_death_fails_streams_reports_503_and_exits(tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = start_gateway(tmp_path_factory.mktemp("doomed"))
    try:
        with gw.client() as http:
            openai_stream = http.stream("POST", "/v1/chat/completions", json=long_story("base", stream=True))
            house_stream = http.stream(
                "POST", "/v1/chat/completions", json=long_story("base"), headers={"X-Stream-Format": "house"}
            )
            with openai_stream as r1, house_stream as r2:
                lines1, lines2 = r1.iter_lines(), r2.iter_lines()
                next(lines1), next(lines2)
                engine_core(gw).kill()
                rest1 = [line for line in lines1 if line]
                rest2 = [line for line in lines2 if line]
        assert rest1[-1] == "data: [DONE]"  # after the error event, as vLLM's server
        error = json.loads(rest1[-2].removeprefix("data: "))
        assert error["error"]["type"] == "service_unavailable"
        assert rest2[-2:] == ["event: error", rest2[-1]] and json.loads(rest2[-1][6:])["error"]
        health = [httpx.get(gw.url + "/health").status_code for _ in range(3)]
        assert health == [503] * 3  # and stays so until the exit
        assert httpx.get(gw.url + "/ready").status_code == 503
        r = gw.client().post("/v1/chat/completions", json=chat_body("base", "hi"))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert gw.process.wait(60) == 3  # non-zero, so a supervisor restarts it
    finally:
        stop_gateway(gw)
