"""LoRA scheduling through the app: requests wait for their adapter's turn before the
engine sees them, the key's priority reaches the engine, and the switch turns it off."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway.engine import EngineManager
from gateway.settings import EngineSettings
from tests.helpers import eventually_async
from tests.unit.conftest import ADMIN, USER_KEY, Serve, body_then_disconnect, http_scope, make_adapter
from tests.unit.fakes import FakeEngine


def body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def test_a_request_waits_for_its_adapters_turn(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)
    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "shout in the engine")
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    base = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("fake-model")))
    await eventually_async(lambda: len(served.engine.calls) == 2, 5, "the base request in the engine")
    assert served.gw.scheduler is not None and served.gw.scheduler.queued == 1
    assert [lora.name if lora else None for *_, lora in served.engine.calls] == ["shout", None]
    status = (await served.http.get("/admin/status", headers=ADMIN)).json()["lora_scheduler"]
    assert status["active"] == {"shout": {"inflight": 1, "draining": False}}
    assert status["queued"] == {"json": 1}
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert "gateway_adapter_queued_requests 1.0" in metrics
    gate.set()
    answers = await asyncio.gather(shout, json_, base)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [lora.name if lora else None for *_, lora in served.engine.calls] == ["shout", None, "json"]
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert 'gateway_adapter_wait_seconds_count{route="json"} 1.0' in metrics
    assert "gateway_adapter_queued_requests 0.0" in metrics


SHARED = """
routes:
  - {name: shout, adapter: shout}
  - {name: shout-strict, adapter: shout, system_prompt: Be strict., weight: 3}
  - {name: json, adapter: json}
"""


async def test_routes_on_one_adapter_are_booked_under_their_own_names(serve: Serve, tmp_path: Path) -> None:
    """shout and shout-strict share the adapter (one lora id): shout-strict's waits, queue and
    requests in the engine are still shout-strict's in /metrics and /admin/status."""
    (tmp_path / "adapters.yaml").write_text(SHARED)
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)
    routes = served.gw.catalog_or_503().table.routes.values()
    assert len({r.lora.lora_id for r in routes if r.lora is not None and r.name.startswith("shout")}) == 1
    scheduler = served.gw.scheduler
    assert scheduler is not None
    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "shout in the engine")
    strict = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout-strict")))
    await eventually_async(lambda: len(served.engine.calls) == 2, 5, "shout-strict joined shout")
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    await eventually_async(lambda: scheduler.queued == 1, 5, "json queued")
    status = (await served.http.get("/admin/status", headers=ADMIN)).json()["lora_scheduler"]
    one = {"inflight": 1, "draining": False}
    assert status["active"] == {"shout": one, "shout-strict": one} and status["queued"] == {"json": 1}
    gate.set()
    assert [a.status_code for a in await asyncio.gather(shout, strict, json_)] == [200, 200, 200]
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    for route in ("shout", "shout-strict", "json"):
        assert f'gateway_adapter_wait_seconds_count{{route="{route}"}} 1.0' in metrics


async def test_auto_slots_let_every_catalog_adapter_run_at_once(serve: Serve, tmp_path: Path) -> None:
    """``engine.max_loras: auto`` (the default) gives each of the catalog's five adapters a
    slot and one more: five requests for five adapters all reach the engine, none waits."""
    for k in range(5):
        make_adapter(tmp_path / "adapters", f"a{k}")
    (tmp_path / "adapters.yaml").write_text(
        "routes:\n" + "".join(f"  - {{name: a{k}, adapter: a{k}}}\n" for k in range(5))
    )
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate))
    assert (await served.http.get("/admin/adapters", headers=ADMIN)).json()["slots"]["gpu"] == 6
    tasks = [
        asyncio.create_task(served.http.post("/v1/chat/completions", json=body(f"a{k}"))) for k in range(5)
    ]
    await eventually_async(lambda: len(served.engine.calls) == 5, 5, "all five in the engine")
    assert served.gw.scheduler is not None and served.gw.scheduler.queued == 0
    gate.set()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 5


async def test_a_client_that_leaves_while_waiting_leaves_no_slot_behind(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)
    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "shout in the engine")
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    scheduler = served.gw.scheduler
    assert scheduler is not None
    await eventually_async(lambda: scheduler.queued == 1, 5, "json queued")
    json_.cancel()  # the client goes away while its request waits
    await eventually_async(lambda: scheduler.queued == 0, 5, "json left the queue")
    gate.set()
    assert (await shout).status_code == 200
    assert scheduler.snapshot()["active"] == {}
    assert served.engine.aborted == []  # nothing reached the engine to abort
    assert (await served.http.post("/v1/chat/completions", json=body("json"))).status_code == 200


READING = {"ReadAhead._read", "merge_steps.<locals>.pump"}  # the tasks a LoRA request reads its streams in


async def test_a_client_leaving_a_stream_of_several_engine_requests_leaves_nothing_behind(
    serve: Serve,
) -> None:
    """Two prompts x greedy n=2: four engine requests, merged and read ahead of the client.
    Its client leaves mid-stream: each is aborted, the turn goes back (the one slot serves
    another adapter next), no reading task is left, and the request counts once, as a 499."""
    engine = FakeEngine(words=["a"] * 1000, delay=0.01, max_model_len=2000)  # 10 s: long after it leaves
    served = await serve(engine, engine__max_loras=1)
    raw = json.dumps(
        {"model": "shout", "prompt": ["a", "b"], "n": 2, "temperature": 0, "max_tokens": 1000, "stream": True}
    )
    headers = {"authorization": f"Bearer {USER_KEY}", "content-length": str(len(raw))}
    gone = asyncio.Event()
    chunks = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body" and message.get("body"):
            chunks += 1
            if chunks == 3:
                gone.set()

    receive = body_then_disconnect(raw.encode(), gone)
    await asyncio.wait_for(served.app(http_scope("/v1/completions", headers), receive, send), 5)
    ids = [request_id for *_, request_id, _ in engine.calls]
    assert len(ids) == 4
    await eventually_async(lambda: sorted(engine.aborted) == sorted(ids), 5, "each engine request aborted")

    def reading() -> list[str]:
        return [
            t.get_coro().__qualname__ for t in asyncio.all_tasks() if t.get_coro().__qualname__ in READING
        ]

    await eventually_async(lambda: not reading() and engine.running == 0, 5, "no reading task left", reading)
    scheduler = served.gw.scheduler
    assert scheduler is not None and scheduler.snapshot()["active"] == {}
    assert served.gw.admission.inflight == 0 and served.gw.catalog_or_503().in_use() == {}
    labels = {"route": "shout", "status": "499", "stream": "true"}
    assert served.gw.metrics.registry.get_sample_value("gateway_requests_total", labels) == 1
    later = await asyncio.wait_for(served.http.post("/v1/chat/completions", json=body("json")), 5)
    assert later.status_code == 200


async def test_a_route_a_reload_removes_while_its_request_waits_serves_it_then_leaves(
    serve: Serve, tmp_path: Path
) -> None:
    """The waiting request holds the version it was routed to: it runs on it once its turn
    comes, and only then does the version leave the engine and the scheduler."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)
    scheduler = served.gw.scheduler
    assert scheduler is not None
    catalog = served.gw.catalog_or_503()
    json_id = catalog.table.routes["json"].lora.lora_id  # type: ignore[union-attr]
    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: served.engine.running == 1, 5, "shout in the engine")
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    await eventually_async(lambda: scheduler.queued == 1, 5, "json queued")
    adapters = tmp_path / "adapters.yaml"
    adapters.write_text(
        adapters.read_text().replace("  - name: json\n    adapter: json\n    tasks: [extract]\n", "")
    )
    reload = await served.http.post("/admin/adapters/reload", headers=ADMIN)
    assert reload.json()["routes"] == ["concise", "shout"]
    assert await catalog.remove_drained() == [] and json_id in served.engine.loras  # still waited for
    gate.set()
    assert [r.status_code for r in await asyncio.gather(shout, json_)] == [200, 200]
    assert [lora.name if lora else None for *_, lora in served.engine.calls] == ["shout", "json"]
    assert await catalog.remove_drained() == [json_id] and json_id not in served.engine.loras
    assert scheduler.snapshot()["active"] == {} and scheduler.queued == 0 and catalog.in_use() == {}
    assert (await served.http.post("/v1/chat/completions", json=body("json"))).status_code == 404


async def test_a_request_that_left_while_waiting_counts_no_prompt_tokens(serve: Serve) -> None:
    """It never reached the engine: no prompt tokens, and no cold/warm state that would
    mark its adapter loaded for the next request's TTFT split."""
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1)
    scheduler = served.gw.scheduler
    assert scheduler is not None
    json_id = served.gw.catalog_or_503().table.routes["json"].lora.lora_id  # type: ignore[union-attr]
    shout = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("shout")))
    await eventually_async(lambda: len(served.engine.calls) == 1, 5, "shout in the engine")
    served.gw.adapters.resident.discard(json_id)  # as if the engine had evicted json: it is cold
    json_ = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    await eventually_async(lambda: scheduler.queued == 1, 5, "json queued")
    json_.cancel()
    await eventually_async(lambda: scheduler.queued == 0, 5, "json left the queue")
    gate.set()
    assert (await shout).status_code == 200
    metrics = (await served.http.get("/metrics", headers=ADMIN)).text
    assert 'gateway_prompt_tokens_total{route="json"}' not in metrics
    assert json_id not in served.gw.adapters.resident  # the next json request is cold
    assert 'gateway_prompt_tokens_total{route="shout"}' in metrics


async def test_switched_off_requests_go_straight_to_the_engine(serve: Serve) -> None:
    gate = asyncio.Event()
    served = await serve(FakeEngine(gate=gate), engine__max_loras=1, limits__lora_scheduling="off")
    assert served.gw.scheduler is None
    tasks = [
        asyncio.create_task(served.http.post("/v1/chat/completions", json=body(m))) for m in ("shout", "json")
    ]
    await eventually_async(lambda: len(served.engine.calls) == 2, 5, "both in the engine")
    gate.set()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]


async def test_the_keys_priority_reaches_the_engine(serve: Serve) -> None:
    keys = [{"name": "user", "key": USER_KEY, "priority": -2, "weight": 3}]
    served = await serve(auth__keys=keys)
    assert (await served.http.post("/v1/chat/completions", json=body("shout"))).status_code == 200
    assert (
        await served.http.post("/v1/completions", json={"model": "json", "prompt": "x"})
    ).status_code == 200
    assert list(served.engine.priorities.values()) == [-2, -2]


class _Stream:
    async def __aiter__(self) -> Any:
        return
        yield

    async def aclose(self) -> None:
        pass


class _RecordingEngine:
    errored = False

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.kwargs.append(kwargs)
        return _Stream().__aiter__()


async def test_priority_goes_to_vllm_only_under_its_priority_policy(tmp_path: Any) -> None:
    seen = {}
    for policy in ("fcfs", "priority"):
        manager = EngineManager(EngineSettings(scheduling_policy=policy), tmp_path)
        engine = manager._engine = _RecordingEngine()
        params = SimpleNamespace(logprobs=None, prompt_logprobs=None)
        async for _ in manager.generate([1], params, "r", None, priority=-1):
            pass
        seen[policy] = engine.kwargs[0].get("priority")
    assert seen == {"fcfs": None, "priority": -1}


class _HoldOne(FakeEngine):
    """Requests on the ``json`` adapter wait for ``hold``; the others run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = asyncio.Event()
        self.holding = 0

    async def generate(self, prompt_ids, sampling, request_id, lora, priority=0):  # type: ignore[no-untyped-def]
        if lora is not None and lora.name == "json":
            self.holding += 1
            await self.hold.wait()
        async for step in super().generate(prompt_ids, sampling, request_id, lora, priority):
            yield step


async def test_hot_swaps_under_steady_traffic_leave_no_turns_behind(serve: Serve, tmp_path: Path) -> None:
    """A gateway that is never idle (a ``json`` request always in the engine) and swaps
    ``shout``'s files 40 times: the scheduler kept a fair-share time for each version it
    had served (41), so weeks of swaps grew it without end."""
    engine = _HoldOne()
    served = await serve(engine, engine__max_loras=3)
    held = asyncio.create_task(served.http.post("/v1/chat/completions", json=body("json")))
    await eventually_async(lambda: engine.holding == 1, 5, "json in the engine")
    config = tmp_path / "adapters" / "shout" / "adapter_config.json"
    for version in range(40):
        config.write_text(config.read_text().replace('"lora_alpha": ', f'"lora_alpha": 1{version}', 1))
        assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).json()["routes"]
        assert (await served.http.post("/v1/chat/completions", json=body("shout"))).status_code == 200
        await served.gw.catalog_or_503().remove_drained()
    assert served.gw.scheduler is not None
    assert len(served.gw.scheduler._share._routes) <= 2  # json's and the live shout's
    engine.hold.set()
    assert (await held).status_code == 200
