"""Metrics per route with bounded labels, and one JSON access-log line per request."""

from __future__ import annotations

import json
import re
import uuid

from tests.helpers import chat_body, eventually
from tests.integration.conftest import LiveGateway


def scrape(gw: LiveGateway) -> str:
    r = gw.client().get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chat(gw: LiveGateway, model: str, stream: bool = False, **extra: object) -> None:
    body = chat_body(model, max_tokens=4, stream=stream, **extra)
    with gw.client() as http:
        http.post("/v1/chat/completions", json=body).read()


def test_metrics_count_requests_tokens_and_latency_by_route(gateway: LiveGateway) -> None:
    before = scrape(gateway)
    chat(gateway, "shout")
    chat(gateway, "loud", stream=True)
    after = scrape(gateway)
    assert (
        value(after, "gateway_requests_total", route="shout", status="200", stream="false")
        == value(before, "gateway_requests_total", route="shout", status="200", stream="false") + 1
    )
    assert (
        value(after, "gateway_requests_total", route="shout", status="200", stream="true")
        == value(before, "gateway_requests_total", route="shout", status="200", stream="true") + 1
    )
    assert (
        value(after, "gateway_completion_tokens_total", route="shout")
        - value(before, "gateway_completion_tokens_total", route="shout")
        == 8
    )
    assert value(after, "gateway_prompt_tokens_total", route="shout") > value(
        before, "gateway_prompt_tokens_total", route="shout"
    )
    for hist in ("gateway_time_to_first_token_seconds_count", "gateway_request_duration_seconds_count"):
        assert value(after, hist, route="shout") == value(before, hist, route="shout") + 2
    assert value(after, "gateway_inter_token_latency_seconds_count", route="shout") > value(
        before, "gateway_inter_token_latency_seconds_count", route="shout"
    )
    assert value(after, "gateway_engine_up") == 1
    assert "gateway_inflight_requests" in after and "gateway_engine_queued_requests" in after
    assert re.search(r"^vllm:", after, re.M), "vLLM's own metrics are exposed too"


def test_route_labels_are_bounded_by_the_catalog(gateway: LiveGateway) -> None:
    names = [f"made-up-{uuid.uuid4().hex[:8]}" for _ in range(5)] + ["../etc/passwd"]
    before = value(scrape(gateway), "gateway_requests_total", route="unknown", status="404")
    for name in names:
        chat(gateway, name)
    text = scrape(gateway)
    assert value(text, "gateway_requests_total", route="unknown", status="404") == before + len(names)
    assert not any(name in text for name in names)


def test_reloads_are_counted(gateway: LiveGateway) -> None:
    before = value(scrape(gateway), "gateway_adapter_reloads_total", result="ok")
    assert gateway.admin().post("/admin/adapters/reload").status_code == 200
    assert value(scrape(gateway), "gateway_adapter_reloads_total", result="ok") == before + 1


def access_lines(gw: LiveGateway) -> list[dict[str, object]]:
    return [
        json.loads(line)
        # "\n", not splitlines(): a logged path may hold U+2028 (the fuzzing sends such paths)
        for line in gw.log.read_text(errors="replace").split("\n")
        if line.startswith('{"request_id"')
    ]


def access_line(gw: LiveGateway, request_id: str) -> dict[str, object]:
    """The one access-log line of ``request_id`` (it is written as the response ends)."""
    mine = eventually(
        lambda: [line for line in access_lines(gw) if line["request_id"] == request_id],
        5,
        "an access-log line for the request",
        interval=0.1,
    )
    assert len(mine) == 1
    return mine[0]


def test_one_json_log_line_per_request_without_prompt_text(gateway: LiveGateway) -> None:
    request_id = f"test-{uuid.uuid4().hex}"
    secret = f"SECRET-{uuid.uuid4().hex}"
    body = chat_body("json", f"Remember {secret}", max_tokens=6)
    r = gateway.client().post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
    assert r.headers["x-request-id"] == request_id
    line = access_line(gateway, request_id)
    assert line["route"] == "json" and line["status"] == 200 and line["stream"] is False
    assert line["adapter_digest"] == r.headers["x-adapter-digest"]
    usage = r.json()["usage"]
    assert (
        line["prompt_tokens"] == usage["prompt_tokens"]
        and line["completion_tokens"] == usage["completion_tokens"]
    )
    assert isinstance(line["ttft_ms"], float) and line["duration_ms"] >= line["ttft_ms"]  # type: ignore[operator]
    assert line["client_disconnected"] is False
    assert secret not in gateway.log.read_text(errors="replace")


def test_a_disconnect_is_logged(gateway: LiveGateway) -> None:
    request_id = f"test-{uuid.uuid4().hex}"
    body = chat_body("base", "Story?", max_tokens=500, ignore_eos=True, stream=True)
    with (
        gateway.client() as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as r,
    ):
        lines = r.iter_lines()
        next(lines)
    line = access_line(gateway, request_id)
    assert line["client_disconnected"] is True and line["stream"] is True


def test_a_stream_read_to_the_end_is_not_logged_as_a_disconnect(gateway: LiveGateway) -> None:
    # The server sees the connection's end as soon as its last byte is out (uvicorn reports
    # http.disconnect once a response is complete); that is not a client leaving early.
    request_id = f"test-{uuid.uuid4().hex}"
    body = chat_body("base", max_tokens=4, ignore_eos=True, stream=True)
    with (
        gateway.client() as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as r,
    ):
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    line = access_line(gateway, request_id)
    assert line["stream"] is True and line["status"] == 200 and line["completion_tokens"] == 4
    assert line["client_disconnected"] is False


def test_start_up_heap_is_frozen_out_of_the_garbage_collector(gateway: LiveGateway) -> None:
    # torch, transformers and the engine client leave ~650k objects behind; a full collection
    # over them took ~480 ms on 2 CPU cores, a stall for every open stream. Frozen, they are skipped.
    status = gateway.admin().get("/admin/status").json()
    assert status["gc_frozen_objects"] > 100_000
    assert 'python_gc_collections_total{generation="2"}' in scrape(gateway)  # collections stay visible
