"""LoRA scheduling on a live engine with one LoRA slot: requests for three adapters at
once all succeed, each with its own adapter, and the metrics show that some waited. With a
pinned adapter, more unpinned adapters in demand than slots never reach one batch."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import chat_body
from tests.integration.conftest import LiveGateway, start_gateway, stop_gateway

ROUTES = ("shout", "json", "bullets")


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    gw = start_gateway(tmp_path_factory.mktemp("one-slot"), "--max-loras", "1")
    yield gw
    stop_gateway(gw)


def test_three_adapters_share_one_slot(one_slot: LiveGateway) -> None:
    def ask(model: str) -> tuple[str, int, str, str]:
        with one_slot.client() as client:
            r = client.post("/v1/chat/completions", json=chat_body(model, "Name a colour.", max_tokens=16))
            text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
            return model, r.status_code, r.headers.get("x-adapter", ""), text

    with ThreadPoolExecutor(len(ROUTES) * 3) as pool:
        answers = list(pool.map(ask, [m for _ in range(3) for m in ROUTES]))
    assert all(status == 200 for _, status, _, _ in answers), answers
    assert all(adapter == model for model, _, adapter, _ in answers), answers
    # The header names the route; the text shows which weights ran: shout's answers, and only
    # those, are in capitals.
    assert all(shouted(text) == (model == "shout") for model, _, _, text in answers), answers

    with one_slot.client() as client:
        metrics = client.get("/metrics").text
    counts = {route: _sample(metrics, "gateway_adapter_wait_seconds_count", route) for route in ROUTES}
    went_at_once = {
        route: _sample(metrics, "gateway_adapter_wait_seconds_bucket", route, 'le="0.0",') for route in ROUTES
    }
    assert counts == {route: 3.0 for route in ROUTES}
    assert sum(went_at_once.values()) < 9  # with one slot, some requests waited for theirs
    assert _sample(metrics, "gateway_adapter_queued_requests") == 0.0
    status = one_slot.status()["lora_scheduler"]
    assert status["slots"] == 1 and status["active"] == {} and status["queued"] == {}


PINNED = """
routes:
  - {name: shout, adapter: shout, pinned: true}
  - {name: json, adapter: json}
  - {name: bullets, adapter: bullets}
"""


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    gw = start_gateway(
        tmp_path_factory.mktemp("pinned"),
        "--max-loras",
        "2",
        "--set",
        "limits.max_adapter_wait_s=0.2",
        catalog_text=PINNED,
    )
    yield gw
    stop_gateway(gw)


def test_a_pinned_slot_survives_more_unpinned_adapters_than_slots(pinned: LiveGateway) -> None:
    """max_loras 2 with shout pinned leaves json and bullets one GPU slot. vLLM batches up to
    max_loras adapters without counting the pinned one, and a batch holding both json and
    bullets kills the engine (KeyError in punica's convert_mapping). The gateway never hands
    it one: not when a request waits past max_adapter_wait_s (0.2 s here), nor ever. (No
    request for shout: with shout in a batch, max_loras keeps the other two apart.)"""
    with pinned.admin() as admin:
        cards = {c["id"]: c for c in admin.get("/v1/models").json()["data"]}
    assert cards["shout"]["residency"] == "gpu"

    def ask(model: str) -> tuple[str, int]:
        with pinned.client() as client:
            r = client.post("/v1/chat/completions", json=chat_body(model, "Name a colour.", max_tokens=48))
            return model, r.status_code

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, [m for _ in range(8) for m in ("json", "bullets")]))
    assert all(status == 200 for _, status in answers), (answers, pinned.log_tail())
    status = pinned.status()
    assert status["engine_ready"] is True and status["lora_scheduler"]["slots"] == 1


def shouted(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isupper() for c in letters) >= 0.8 * len(letters)


def _sample(metrics: str, name: str, route: str | None = None, labels: str = "") -> float:
    where = f'{{{labels}route="{route}"}}' if route is not None else ""
    match = re.search(rf"^{re.escape(name + where)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name}{where} not in /metrics"
    return float(match.group(1))
