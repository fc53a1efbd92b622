"""The router view on /metrics: vLLM's queue metrics with the gateway's own LoRA queue
added, for LoRA-affinity routers (Gateway API Inference Extension, llm-d)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Gauge
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from gateway.metrics import RETIRED_KEPT, GatewayMetrics, RequestRecord, router_view
from tests.helpers import eventually_async
from tests.unit.conftest import ADMIN, Serve
from tests.unit.fakes import FakeEngine
from tests.unit.test_adapter_slots import SlotEngine

INFO_LABELS = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]


def vllm_metrics(registry: CollectorRegistry, waiting: float) -> tuple[Gauge, Gauge]:
    """The two vLLM gauges a router reads, as vLLM names and labels them."""
    queue = Gauge("vllm:num_requests_waiting", "waiting", ["model_name", "engine"], registry=registry)
    queue.labels("base", "0").set(waiting)
    info = Gauge("vllm:lora_requests_info", "lora info", INFO_LABELS, registry=registry)
    return queue, info


def families(registry: CollectorRegistry) -> list[Metric]:
    return list(registry.collect())


def test_the_gateways_queue_adds_to_vllms_and_its_routes_to_the_waiting_adapters() -> None:
    registry = CollectorRegistry()
    _, info = vllm_metrics(registry, waiting=2)
    info.labels("a", "b", "4").set(100.0)  # an older step's: not the one a router reads
    info.labels("x,y", "z", "4").set(200.0)
    view = {m.name: m for m in router_view(families(registry), Counter({"q": 2, "z": 1}), 300.0)}
    [waiting] = view["gateway_num_requests_waiting"].samples
    assert waiting.value == 2 + 3
    [newest] = view["gateway_lora_requests_info"].samples
    assert newest.labels == {"running_lora_adapters": "x,y", "waiting_lora_adapters": "z,q", "max_lora": "4"}
    assert newest.value == 300.0  # now: newer than any of vLLM's own


def test_pinned_routes_are_running_adapters_even_while_idle() -> None:
    """vLLM names an adapter in ``running_lora_adapters`` only while it runs requests; a
    pinned one is in a GPU slot, ready: a router must see it as resident."""
    registry = CollectorRegistry()
    _, info = vllm_metrics(registry, waiting=0)
    info.labels("json", "", "4").set(100.0)
    view = {m.name: m for m in router_view(families(registry), Counter(), 200.0, ["shout", "json"])}
    [newest] = view["gateway_lora_requests_info"].samples
    assert newest.labels["running_lora_adapters"] == "json,shout"  # json once


def test_without_vllms_lora_info_only_the_count_and_without_vllm_nothing() -> None:
    registry = CollectorRegistry()
    vllm_metrics(registry, waiting=1)  # LoRA off: vLLM's info gauge has no sample
    view = router_view(families(registry), Counter(), 1.0)
    assert [(m.name, [s.value for s in m.samples]) for m in view] == [("gateway_num_requests_waiting", [1.0])]
    assert router_view(families(CollectorRegistry()), Counter({"q": 1}), 1.0) == []


@pytest.fixture
def engine_gauges() -> Iterator[tuple[Gauge, Gauge]]:
    """vLLM's gauges in the default registry, where the real engine puts them."""
    gauges = vllm_metrics(REGISTRY, waiting=0)
    try:
        yield gauges
    finally:
        for gauge in gauges:
            REGISTRY.unregister(gauge)


async def test_metrics_shows_requests_waiting_for_their_adapter_to_a_router(
    serve: Serve, engine_gauges: tuple[Gauge, Gauge]
) -> None:
    """One slot, shout running, json waiting in the gateway: vLLM's own metrics say nothing
    waits, the router view says json does."""
    _, info = engine_gauges
    info.labels("shout", "", "1").set(1.0)
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)

    def body(model: str) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "shout in the engine")
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    await eventually_async(
        lambda: served.gw.scheduler is not None and served.gw.scheduler.queued == 1, 5, "json queued"
    )
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert "gateway_num_requests_waiting 1.0" in metrics
    assert (
        'gateway_lora_requests_info{max_lora="1",running_lora_adapters="shout",waiting_lora_adapters="json"}'
        in metrics
    )
    gate.set()
    assert [r.status_code for r in await asyncio.gather(shout, json_)] == [200, 200]
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert "gateway_num_requests_waiting 0.0" in metrics
    assert 'waiting_lora_adapters=""' in metrics


async def test_the_router_view_is_there_with_lora_scheduling_off(
    serve: Serve, engine_gauges: tuple[Gauge, Gauge]
) -> None:
    """deploy/README points the endpoint picker at gateway_num_requests_waiting and
    gateway_lora_requests_info. With limits.lora_scheduling: off nothing waits in the gateway,
    but the metrics it was told to read vanished: the view is vLLM's own, then."""
    queue, info = engine_gauges
    queue.labels("base", "0").set(3)
    info.labels("shout", "json", "2").set(1.0)
    served = await serve(FakeEngine(), limits__lora_scheduling="off")
    assert served.gw.scheduler is None
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert "gateway_num_requests_waiting 3.0" in metrics
    assert (
        'gateway_lora_requests_info{max_lora="2",running_lora_adapters="shout",waiting_lora_adapters="json"}'
        in metrics
    )


async def test_metrics_keep_only_the_newest_of_vllms_lora_info(
    serve: Serve, engine_gauges: tuple[Gauge, Gauge]
) -> None:
    """vLLM sets vllm:lora_requests_info to the time under labels that list the adapters
    running and waiting, and never removes a label set: each combination of adapters, and each
    ``name@digest`` a hot swap runs under, stayed a series for good (93 after 36 hot swaps in
    18 minutes of soak, still growing). Only the newest is the engine's state, which routers
    read; the others go, from the page and from the gauge."""
    _, info = engine_gauges
    for step in range(50):
        info.labels(f"shout@{step:012x}", "json", "2").set(float(step))
    info.labels("shout", "", "2").set(100.0)
    served = await serve(FakeEngine())
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines == [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="shout",waiting_lora_adapters=""} 100.0'
    ]
    assert len(list(info.collect())[0].samples) == 1  # forgotten, not only hidden
    info.labels("json", "shout", "2").set(101.0)  # vLLM's next step
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")] == [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="json",waiting_lora_adapters="shout"} 101.0'
    ]
    assert 'gateway_lora_requests_info{max_lora="2",running_lora_adapters="json"' in metrics


def test_a_route_name_dropped_from_the_labels_leaves_no_series_behind() -> None:
    """Every route-labelled metric, one added later included: a name past RETIRED_KEPT
    removals has no series left in any of them, and the routes still labelled keep theirs."""
    metrics = GatewayMetrics(CollectorRegistry())
    by_route = [
        m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase) and "route" in m._labelnames
    ]
    assert len(by_route) >= 10
    metrics.set_routes(frozenset({"old", "kept"}))
    for metric in by_route:
        for name in ("old", "kept"):
            values = {n: name if n == "route" else "200" for n in metric._labelnames}
            if "adapter_state" in values:
                values["adapter_state"] = "cold"
            if "stream" in values:
                values["stream"] = "true"
            child = metric.labels(**values)
            child.observe(1) if hasattr(child, "observe") else child.inc()
    metrics.set_routes(frozenset({"kept"}))
    for i in range(RETIRED_KEPT + 1):  # "old", then 64 more names removed
        assert metrics.route_label("old") == "old"
        metrics.set_routes(frozenset({"kept", f"r{i}"}))
    assert metrics.route_label("old") == "unknown" and metrics.route_label("kept") == "kept"
    routes = {s.labels["route"] for m in metrics.registry.collect() for s in m.samples if "route" in s.labels}
    assert routes == {"kept"}


def test_a_retired_route_named_unknown_leaves_the_unknown_series() -> None:
    """A route may be named "unknown", the label of requests no route took: dropping its
    series when it retired wiped the live 404 counts."""
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.set_routes(frozenset({"unknown", "base"}))
    metrics.set_routes(frozenset({"base"}))
    metrics.observe(RequestRecord("r1", "POST", "/v1/chat/completions", route="nope", status=404))
    for i in range(RETIRED_KEPT + 1):
        metrics.set_routes(frozenset({"base", f"r{i}"}))
    labels = {"route": "unknown", "status": "404", "stream": "false"}
    assert metrics.registry.get_sample_value("gateway_requests_total", labels) == 1


def test_the_series_of_an_adapter_loaded_for_a_route_never_served_go_in_time() -> None:
    """An entry whose adapter loaded and that the reload then rejected never became a route:
    its load series stayed for good (the retired names were only the served ones)."""
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.set_routes(frozenset({"base"}))
    metrics.adapter_loaded("rejected", 0.1)
    metrics.set_routes(frozenset({"base"}))  # the reload's table without it
    for i in range(RETIRED_KEPT + 1):  # "rejected", then 64 more names removed
        assert metrics.registry.get_sample_value("gateway_adapter_loads_total", {"route": "rejected"}) == 1
        metrics.set_routes(frozenset({"base", f"r{i}"}))
    assert metrics.registry.get_sample_value("gateway_adapter_loads_total", {"route": "rejected"}) is None
    metrics.adapter_loaded("new", 0.1)
    metrics.set_routes(frozenset({"base", "new"}))  # loaded for a route the table serves: kept
    assert metrics.route_label("new") == "new" and "new" not in metrics._retired


async def test_an_idle_pinned_adapter_is_running_for_the_router(
    serve: Serve, tmp_path: Path, engine_gauges: tuple[Gauge, Gauge]
) -> None:
    _, info = engine_gauges
    (tmp_path / "adapters.yaml").write_text(
        "routes:\n  - {name: shout, adapter: shout, pinned: true}\n  - {name: json, adapter: json}\n"
    )
    engine = SlotEngine()
    served = await serve(engine, engine__max_loras=4)
    await eventually_async(lambda: engine.pinned, 5, "shout pinned")
    info.labels("", "", "4").set(1.0)  # vLLM's, with no request in the engine
    text = (await served.http.get("/metrics", headers=ADMIN)).text
    [line] = [x for x in text.splitlines() if x.startswith("gateway_lora_requests_info{")]
    assert 'running_lora_adapters="shout"' in line
