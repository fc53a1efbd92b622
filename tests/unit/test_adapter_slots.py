"""Many adapters: registration (load, pin, preload), residency, engine names in a swap, pins
across hot swaps."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.adapter_slots import PIN_COMING, PIN_REFUSED, PIN_WAITING, AdapterSlots
from gateway.catalog import Catalog, Route, RoutingTable
from gateway.errors import EngineFailed
from gateway.lora_scheduler import LoraScheduler
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.routes import adapter_fields
from gateway.snapshots import SnapshotDir
from gateway.types import LoraSpec
from tests.helpers import chat_body, eventually_async
from tests.unit.conftest import ADMIN, Serve, Served, make_adapter
from tests.unit.fakes import FakeEngine


class SlotEngine(FakeEngine):
    """The fake engine plus LoRA slots, recording what the gateway asked for."""

    def __init__(self) -> None:
        super().__init__(words=["x"])
        self.loras: set[int] = set()
        self.added: list[LoraSpec] = []
        self.pinned: list[int] = []

    async def add_lora(self, lora: LoraSpec) -> None:
        self.added.append(lora)
        self.loras.add(lora.lora_id)

    async def remove_lora(self, lora_id: int) -> None:
        self.loras.discard(lora_id)

    async def pin_lora(self, lora_id: int) -> None:
        if lora_id not in self.loras:  # as vLLM: "Pinning failed. LoRA n is not registered."
            raise EngineFailed("the engine failed to process the request")
        self.pinned.append(lora_id)

    async def list_loras(self) -> set[int]:
        return set(self.loras)


class ReportingEngine(SlotEngine):
    """A slot engine whose workers report their GPU slots, as the gateway's own engine's
    do (``LoraSlotsReport``): ``slots`` is what they say."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: set[int] = set()

    async def lora_slots(self) -> set[int] | None:
        return set(self.slots)


def lora_route(name: str, lora_id: int, **kw: Any) -> Route:
    digest = f"{lora_id:02d}" * 32
    return Route(name=name, kind="lora", lora=LoraSpec(name, lora_id, f"/a/{name}"), digest=digest, **kw)


def slots(max_loras: int = 4) -> tuple[AdapterSlots, SlotEngine, GatewayMetrics]:
    engine = SlotEngine()
    metrics = GatewayMetrics(CollectorRegistry())
    s = AdapterSlots(engine, metrics, max_loras)  # type: ignore[arg-type]
    s.scheduler = LoraScheduler(max_loras, quantum_s=10.0, max_wait_s=60.0, pinned=s.pinned)
    return s, engine, metrics


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_register_loads_once_and_counts_the_load() -> None:
    s, engine, metrics = slots()
    route = lora_route("shout", 1)
    await s.register(route)
    await s.register(route)  # a reload with unchanged files: no second load
    assert [lora.lora_id for lora in engine.added] == [1]
    assert sample(metrics, "gateway_adapter_loads_total", route="shout") == 1
    assert sample(metrics, "gateway_adapter_load_seconds_count", route="shout") == 1
    assert s.residency(route) == "gpu" and engine.calls == [] and engine.pinned == []  # vLLM slots it on load


async def test_a_load_that_evicts_another_adapter_shows_it_not_loaded() -> None:
    """vLLM's CPU cache holds ``max_cpu_loras`` adapters and evicts the least recently used
    on a load: the evicted one is "not loaded" at once, and its next request is cold."""

    class EvictingEngine(SlotEngine):
        async def add_lora(self, lora: LoraSpec) -> None:
            await super().add_lora(lora)
            while len(self.loras) > 2:
                self.loras.discard(min(self.loras))  # the oldest id here is the least recent

    engine = EvictingEngine()
    s = AdapterSlots(engine, GatewayMetrics(CollectorRegistry()), 4)  # type: ignore[arg-type]
    routes = [lora_route(f"r{i}", i) for i in (1, 2, 3)]
    for route in routes:
        await s.register(route)
    assert [s.residency(r) for r in routes] == ["not loaded", "gpu", "gpu"]  # 2 held, 4 slots
    assert s.start_state(routes[0]) == "cold" and s.start_state(routes[2]) == "warm"


async def test_residency_is_gpu_until_the_engine_holds_more_adapters_than_slots(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM slots an adapter as it loads it and unslots one only to make room: while it holds
    no more adapters than slots, each is in one. Past that it does not say which are."""
    caplog.set_level(logging.INFO, "gateway.adapter_slots")
    s, _, _ = slots(max_loras=2)
    routes = [lora_route(f"r{i}", i) for i in (1, 2, 3)]
    await s.register(routes[0])
    await s.register(routes[1])
    assert [s.residency(r) for r in routes] == ["gpu", "gpu", "not loaded"]
    await s.register(routes[2])
    assert [s.residency(r) for r in routes] == ["loaded", "loaded", "loaded"]
    await s.remove(3)
    await s.refresh()  # back within the slots, but which were unslotted meanwhile is unknown
    assert [s.residency(r) for r in routes] == ["loaded", "loaded", "not loaded"]
    assert sum("residency says 'loaded'" in r.getMessage() for r in caplog.records) == 1


async def test_residency_reads_gpu_or_cpu_from_the_workers_slots() -> None:
    """Workers that report their slots tell an adapter in one ("gpu") from one only in the
    CPU cache ("cpu"), past the slots too. What requests load shows at the next read: a burst
    of cold starts never shows more adapters in slots than there are."""
    engine = ReportingEngine()
    s = AdapterSlots(engine, GatewayMetrics(CollectorRegistry()), 2)  # type: ignore[arg-type]
    routes = [lora_route(f"r{i}", i) for i in (1, 2, 3, 4)]
    for route in routes[:3]:
        engine.slots = {1, 2} if route is not routes[2] else {2, 3}  # r3's load took r1's slot
        await s.register(route)
    assert [s.residency(r) for r in routes] == ["cpu", "gpu", "gpu", "not loaded"]
    engine.slots = {1, 3}  # a batch of r1 took r2's slot
    await s.refresh()
    assert [s.residency(r) for r in routes] == ["gpu", "cpu", "gpu", "not loaded"]
    assert s.start_state(routes[1]) == "warm" and s.start_state(routes[3]) == "cold"
    assert s.start_state(routes[3]) == "warm"  # its first request loaded it
    assert [s.residency(r) for r in routes] == ["gpu", "cpu", "gpu", "not loaded"]  # until read
    engine.loras.add(4)
    engine.slots = {3, 4}
    await s.refresh()
    assert [s.residency(r) for r in routes] == ["cpu", "cpu", "gpu", "gpu"]
    await s.remove(3)
    assert s.residency(routes[2]) == "not loaded" and s.in_slots == {4}


async def test_a_request_that_loads_its_adapter_past_the_slots_ends_gpu_residency() -> None:
    """An adapter the engine evicted from its CPU cache is loaded again by its next request,
    unseen by ``list_loras`` until the next read: the request's own cold start counts it."""
    s, engine, _ = slots(max_loras=2)
    routes = [lora_route(f"r{i}", i) for i in (1, 2, 3)]
    for route in routes[:2]:
        await s.register(route)
    engine.loras.discard(1)  # evicted from its CPU cache
    await s.refresh()
    assert s.start_state(routes[2]) == "cold" and s.residency(routes[1]) == "gpu"  # 2 held
    assert s.start_state(routes[0]) == "cold" and s.residency(routes[1]) == "loaded"  # 3 held


async def test_preload_warms_with_one_token_under_a_versioned_name() -> None:
    s, engine, _ = slots()
    await s.register(lora_route("json", 3, preload=True))
    (prompt, spec, request_id, lora) = engine.calls[0]
    assert spec.max_tokens == 1 and prompt and request_id == "preload-json-3"
    assert lora is not None and lora.lora_id == 3 and lora.name == "json@" + "03" * 6 + ".3"


async def test_setting_preload_on_a_loaded_adapter_warms_it_once() -> None:
    """``preload: true`` added to an entry whose files did not change: same version, same
    id, already registered; it must still be warmed (once, not at every reload)."""
    s, engine, _ = slots()
    await s.register(lora_route("json", 3))
    assert engine.calls == []
    await s.register(lora_route("json", 3, preload=True))
    await s.register(lora_route("json", 3, preload=True))  # another reload
    assert [call[2] for call in engine.calls] == ["preload-json-3"]


async def test_a_warm_up_waits_for_its_adapters_turn() -> None:
    """With max_loras=2 and one pin, one unpinned adapter may be in the engine at a time: a
    warm-up sent past the scheduler would make two, which kills vLLM's engine."""
    s, engine, _ = slots(max_loras=2)
    await s.register(lora_route("pin", 1, pinned=True))
    busy = await s.scheduler.turn(lora_route("busy", 2))  # a user request holds the slot
    assert busy is not None
    warm = asyncio.create_task(s.register(lora_route("new", 3, preload=True)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert engine.calls == [] and not warm.done()
    busy.release()
    await asyncio.wait_for(warm, 5)
    assert [call[2] for call in engine.calls] == ["preload-new-3"]
    assert s.scheduler.snapshot()["active"] == {}


async def test_a_warm_up_that_waits_past_the_bound_is_left_for_a_later_reload() -> None:
    """With a pin the bounded wait is off, and the streams holding the slots may run for
    minutes while the reload holds the catalog's lock: the warm-up gives up after the bound
    (plus a second), the route is registered unwarmed, and the next registration warms it."""
    s, engine, _ = slots(max_loras=2)
    s.scheduler = LoraScheduler(2, quantum_s=10.0, max_wait_s=0.1, pinned=s.pinned)
    await s.register(lora_route("pin", 1, pinned=True))
    busy = await s.scheduler.turn(lora_route("busy", 2))  # holds the one unpinned slot
    assert busy is not None
    await asyncio.wait_for(s.register(lora_route("new", 3, preload=True)), 3)
    assert engine.calls == [] and 3 in s.registered and 3 not in s.preloaded
    assert s.scheduler.queued == 0  # its turn left the queue
    busy.release()
    await s.register(lora_route("new", 3, preload=True))  # the next reload
    assert [call[2] for call in engine.calls] == ["preload-new-3"] and 3 in s.preloaded


async def test_a_pin_the_engine_has_not_answered_yet_counts_against_the_pins() -> None:
    """max_loras=2 allows one pin. A second pin asked while the engine is still answering the
    first (a background pin beside a reload's) must wait: both would pin every GPU slot,
    and vLLM fails a batch that needs a slot when all are pinned."""
    s, engine, _ = slots(max_loras=2)
    gate = asyncio.Event()
    answer = engine.pin_lora

    async def slow_pin(lora_id: int) -> None:
        await gate.wait()
        await answer(lora_id)

    engine.pin_lora = slow_pin  # type: ignore[method-assign]
    first = asyncio.create_task(s.register(lora_route("one", 1, pinned=True)))
    for _ in range(5):
        await asyncio.sleep(0)
    await asyncio.wait_for(s.register(lora_route("two", 2, pinned=True)), 3)  # waits, pins nothing
    gate.set()
    await first
    assert engine.pinned == [1] and list(s.pins_waiting) == [2]


async def test_a_warm_up_is_not_a_user_request_in_the_wait_metrics() -> None:
    """Warm-ups run before their route is a metrics label: counted, they showed as
    ``gateway_adapter_wait_seconds{route="unknown"}``; a user request after it is counted."""
    s, engine, metrics = slots(max_loras=2)
    s.scheduler = LoraScheduler(2, quantum_s=10.0, max_wait_s=60.0, pinned=s.pinned, metrics=metrics)
    metrics.set_routes(frozenset({"busy", "new", "other"}))
    busy = await s.scheduler.turn(lora_route("busy", 2))
    other = await s.scheduler.turn(lora_route("other", 4))  # both slots taken: the warm-up queues
    warm = asyncio.create_task(s.register(lora_route("new", 3, preload=True)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not warm.done() and busy is not None and other is not None
    busy.release()
    await asyncio.wait_for(warm, 5)
    assert sample(metrics, "gateway_adapter_wait_seconds_count", route="new") is None
    assert sample(metrics, "gateway_adapter_wait_seconds_count", route="unknown") is None
    ticket = await s.scheduler.turn(lora_route("new", 3))
    assert ticket is not None
    assert sample(metrics, "gateway_adapter_wait_seconds_count", route="new") == 1


async def test_pinned_adapters_are_pinned_but_one_slot_stays_free() -> None:
    s, engine, _ = slots(max_loras=3)
    routes = [lora_route(f"r{i}", i, pinned=True) for i in (1, 2, 3)]
    for route in routes:
        await s.register(route)
    assert engine.pinned == [1, 2]  # the third would leave no slot for unpinned adapters
    assert [s.residency(r) for r in routes] == ["gpu", "gpu", "gpu"]  # r3 unpinned, in the third slot
    assert 3 not in s.pinned
    await s.remove(1)
    assert s.residency(routes[0]) == "not loaded"
    assert engine.pinned == [1, 2, 3] and s.residency(routes[2]) == "gpu"  # it took the freed slot
    await s.register(routes[2])  # a reload: already pinned
    assert engine.pinned == [1, 2, 3]


async def test_a_hot_swapped_pinned_adapter_is_pinned_once_its_old_version_leaves() -> None:
    """max_loras=2 allows one pin, which the old version holds while it drains."""
    s, engine, _ = slots(max_loras=2)
    old, new = lora_route("shout", 1, pinned=True), lora_route("shout", 2, pinned=True)
    await s.register(old)
    await s.register(new)
    assert engine.pinned == [1] and s.residency(new) == "gpu" and 2 not in s.pinned  # the other slot
    await s.register(lora_route("json", 3, pinned=True))  # waits behind the new shout
    await s.remove(3)  # a waiting version that leaves gives up its turn
    await s.remove(1)
    assert engine.pinned == [1, 2] and s.residency(new) == "gpu" and s.pins_waiting == {}


async def test_a_pinned_version_leaving_frees_its_slot_for_waiting_requests() -> None:
    s, _, _ = slots(max_loras=2)
    await s.register(lora_route("shout", 1, pinned=True))  # one slot left for the others
    assert s.scheduler is not None
    busy = await s.scheduler.turn(lora_route("json", 2))
    waiting = asyncio.ensure_future(s.scheduler.turn(lora_route("sql", 3)))
    await asyncio.sleep(0)
    assert not waiting.done()
    await s.remove(1)  # e.g. the old version of a hot swap, drained
    ticket = await asyncio.wait_for(waiting, 1)
    assert ticket is not None and busy is not None
    ticket.release()
    busy.release()


async def test_a_pin_that_fails_on_retry_is_logged_and_the_removal_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, engine, _ = slots(max_loras=2)
    await s.register(lora_route("shout", 1, pinned=True))
    await s.register(lora_route("shout", 2, pinned=True))
    tried: list[int] = []

    async def failing_pin(lora_id: int) -> None:
        tried.append(lora_id)
        raise EngineFailed("no")

    engine.pin_lora = failing_pin  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="gateway.adapter_slots"):
        await s.remove(1)
    assert tried == [2]  # the waiting pin was tried when the first one left
    assert s.pins_failed == {2: "no"}
    assert "adapter shout could not be pinned: no" in caplog.text
    assert engine.loras == {2} and s.pinned == set() and s.pins_waiting == {}


async def test_a_waiting_pin_evicted_from_the_cpu_cache_is_pinned_when_its_turn_comes() -> None:
    """max_loras=2: one pin. The second pinned route waits; meanwhile other adapters push
    its version out of vLLM's CPU cache (max_cpu_loras), and vLLM refuses to pin an adapter
    it does not hold. When the first pin leaves, the waiting one must still be pinned."""
    s, engine, _ = slots(max_loras=2)
    first, second = lora_route("r1", 1, pinned=True), lora_route("r2", 2, pinned=True)
    await s.register(first)
    await s.register(second)
    engine.loras.discard(2)  # evicted by the engine's LRU
    await s.remove(1)
    assert engine.pinned == [1, 2] and s.residency(second) == "gpu" and 2 in engine.loras


async def test_cold_then_warm_and_evictions_seen_on_refresh() -> None:
    s, engine, metrics = slots()
    route = lora_route("shout", 1)
    assert s.start_state(route) == "cold"  # not registered: the engine loads it on demand
    assert s.start_state(route) == "warm"
    engine.loras.clear()  # the engine evicted it (its LRU)
    await s.refresh()
    assert s.residency(route) == "not loaded" and s.start_state(route) == "cold"
    assert s.start_state(Route(name="base", kind="base")) is None
    record = RequestRecord("r1", "POST", "/v1/chat/completions", started=10.0, route="shout")
    record.first_token_at, record.adapter_state, record.status = 10.5, "cold", 200
    metrics.set_routes(frozenset({"shout"}))
    metrics.observe(record)
    labels = {"route": "shout", "adapter_state": "cold"}
    assert sample(metrics, "gateway_adapter_time_to_first_token_seconds_count", **labels) == 1


def test_two_versions_of_a_route_never_share_an_engine_name() -> None:
    """vLLM dedups a batch's LoRA requests by name: during a hot swap the new version runs
    as name@digest until the old one drains, then under the route name again."""
    old, new = lora_route("shout", 1), lora_route("shout", 2)
    tables = iter([RoutingTable(Route("b", "base"), {"shout": old}, {})])
    catalog = Catalog(lambda ids: next(tables))
    on_old = catalog.acquire("shout")
    assert on_old.route.lora is not None and on_old.route.lora.name == "shout"
    catalog.table = RoutingTable(Route("b", "base"), {"shout": new}, {})
    during = catalog.acquire("shout")
    assert during.route.lora == LoraSpec("shout@" + "02" * 6 + ".2", 2, "/a/shout")
    assert during.route.name == "shout"  # the route (metrics, headers) keeps its name
    on_old.release()
    after = catalog.acquire("shout")
    assert after.route.lora is not None and after.route.lora.name == "shout"
    during.release()
    after.release()
    assert catalog.in_use() == {}


def test_versions_of_the_same_files_never_share_an_engine_name() -> None:
    """Pinning makes a new version of the same files (same digest, new id); unpinning while
    both still run brings the first id back. Named by digest alone, ids 1 and 3 both ran as
    shout@<digest>: vLLM keeps one of two requests of one name in a batch's adapter set, and
    the batch's mapping then names an adapter not in it (the engine dies)."""
    digest = "ab" * 32
    v1 = replace(lora_route("shout", 1), digest=digest)
    v3 = replace(lora_route("shout", 3, pinned=True), digest=digest)
    catalog = Catalog(lambda ids: RoutingTable(Route("b", "base"), {"shout": v1}, {}))
    catalog.table = RoutingTable(Route("b", "base"), {"shout": v1}, {})
    leases = [catalog.acquire("shout")]
    catalog.table = RoutingTable(Route("b", "base"), {"shout": v3}, {})
    leases.append(catalog.acquire("shout"))
    catalog.table = RoutingTable(Route("b", "base"), {"shout": v1}, {})
    leases.append(catalog.acquire("shout"))
    ids_by_name: dict[str, set[int]] = {}
    for lease in leases:
        assert lease.route.lora is not None
        ids_by_name.setdefault(lease.route.lora.name, set()).add(lease.route.lora.lora_id)
    assert all(len(ids) == 1 for ids in ids_by_name.values()), ids_by_name
    assert sorted(ids_by_name) == ["shout", "shout@abababababab.1", "shout@abababababab.3"]
    for lease in leases:
        lease.release()
    assert catalog.in_use() == {}


async def test_a_removed_version_takes_its_copy_along(tmp_path: Path) -> None:
    engine = SlotEngine()
    snapshots = SnapshotDir(tmp_path)
    s = AdapterSlots(engine, GatewayMetrics(CollectorRegistry()), 4, snapshots)  # type: ignore[arg-type]
    copy = snapshots.path / ("ab" * 32)
    copy.mkdir()
    route = Route(name="shout", kind="lora", lora=LoraSpec("shout", 7, str(copy)), digest="ab" * 32)
    await s.register(route)
    await s.remove(7)
    assert not copy.exists() and engine.loras == set()
    snapshots.close()


async def test_a_refused_adapter_takes_its_copy_along(tmp_path: Path) -> None:
    engine = SlotEngine()
    snapshots = SnapshotDir(tmp_path)
    s = AdapterSlots(engine, GatewayMetrics(CollectorRegistry()), 4, snapshots)  # type: ignore[arg-type]
    live, refused = snapshots.path / ("ab" * 32), snapshots.path / ("cd" * 32)
    live.mkdir()
    refused.mkdir()
    await s.register(Route(name="shout", kind="lora", lora=LoraSpec("shout", 7, str(live)), digest="ab" * 32))

    async def refuse(lora: LoraSpec) -> None:
        raise EngineFailed("the engine refused the adapter")

    engine.add_lora = refuse  # type: ignore[method-assign]
    for name, lora_id, copy in (("bad", 8, refused), ("shout-pinned", 9, live)):
        route = Route(name=name, kind="lora", lora=LoraSpec(name, lora_id, str(copy)), digest="x" * 64)
        with pytest.raises(EngineFailed):
            await s.register(route)
    assert not refused.exists() and live.exists()  # the live version still reads its copy
    snapshots.close()


def test_max_cpu_loras_is_a_flag() -> None:
    from gateway.cli import _overrides, build_parser

    args = build_parser().parse_args(["serve", "--max-cpu-loras", "12"])
    assert _overrides(args)["engine.max_cpu_loras"] == 12


async def test_a_failed_warm_up_takes_the_weights_back_out() -> None:
    s, engine, _ = slots()

    async def failing_generate(*args: Any, **kwargs: Any) -> Any:
        raise EngineFailed("warm-up failed")
        yield  # an async generator, as the engine's

    engine.generate = failing_generate  # type: ignore[method-assign]
    with pytest.raises(EngineFailed, match="warm-up failed"):  # the catalog rejects the route
        await s.register(lora_route("shout", 1, preload=True))
    assert engine.loras == set() and s.registered == set() and s.preloaded == set()


async def test_a_failed_pin_at_registration_takes_the_weights_back_out() -> None:
    s, engine, _ = slots()

    async def failing_pin(lora_id: int) -> None:
        raise EngineFailed("no")

    engine.pin_lora = failing_pin  # type: ignore[method-assign]
    try:
        await s.register(lora_route("shout", 1, pinned=True))
    except EngineFailed:
        pass
    else:
        raise AssertionError("the failure must reach the catalog, which rejects the route")
    assert engine.loras == set() and s.registered == set()


def test_gateways_sharing_a_cache_keep_each_others_copies(tmp_path: Path) -> None:
    first = SnapshotDir(tmp_path)
    (first.path / "digest").mkdir()
    second = SnapshotDir(tmp_path)  # another gateway starting: the first is alive
    assert (first.path / "digest").is_dir() and second.path != first.path
    first._lock.close()  # the first process is gone (its lock goes with it)
    third = SnapshotDir(tmp_path)
    assert not first.path.exists() and second.path.exists()
    second.close()
    third.close()


def test_a_gateway_starting_beside_another_never_takes_its_folder_for_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gateway on the same cache_dir started between this one's making its folder and
    locking it: it saw a ``run-*`` folder with a free lock and removed it, and this one failed
    to start ("cannot write under cache_dir") or lost every adapter copy it then made."""
    import tempfile

    from gateway import snapshots

    made, locked = tempfile.mkdtemp, snapshots.fcntl.flock
    starting = False

    def other_gateway_starts() -> None:
        nonlocal starting
        if not starting:  # (its own check of each folder's lock takes the lock too)
            starting = True
            snapshots._remove_abandoned(tmp_path)
            starting = False

    def mkdtemp(*args: Any, **kwargs: Any) -> str:  # once the folder is made
        folder = made(*args, **kwargs)
        other_gateway_starts()
        return folder

    def flock(fd: Any, operation: int) -> None:  # and before its lock is taken
        other_gateway_starts()
        locked(fd, operation)

    monkeypatch.setattr(snapshots.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(snapshots.fcntl, "flock", flock)
    first = SnapshotDir(tmp_path)
    monkeypatch.undo()
    assert first.path.is_dir() and first.path.name.startswith("run-")
    second = SnapshotDir(tmp_path)  # a later start still sees it alive
    assert first.path.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.path.name, second.path.name]
    )
    first.close()
    second.close()


# -- the engine's CPU cache of adapters (engine.max_cpu_loras) --------------------------
def weights(root: Path, name: str, size: int) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"\0" * size)
    (path / "adapter_config.json").write_text("{}")  # not weights: not counted
    return path


def test_the_cpu_cache_holds_every_catalog_adapter_and_room_for_more(tmp_path: Path) -> None:
    from gateway.adapter_slots import cpu_cache_size

    dirs = [weights(tmp_path, f"a{i}", 1000) for i in range(16)]
    assert cpu_cache_size(4, dirs, host_bytes=10**9) == 16 + 4
    assert cpu_cache_size(4, [], host_bytes=10**9) == 4  # vLLM's own default, max_loras
    assert cpu_cache_size(2, dirs, host_bytes=None) == 18  # memory unknown: no cap


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt"])
def test_an_adapters_size_counts_each_weights_format_it_may_be_saved_in(tmp_path: Path, file: str) -> None:
    """Older PEFT's ``.pt`` is accepted; its size counted as 0, so the cache was not sized for it.
    Only the file vLLM loads counts: a trainer's checkpoint holds optimizer state beside it."""
    from gateway.adapter_slots import adapter_bytes

    (tmp_path / file).write_bytes(b"\0" * 1000)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "optimizer.pt").write_bytes(b"\0" * 2000)
    (tmp_path / "training_args.bin").write_bytes(b"\0" * 100)
    assert adapter_bytes(tmp_path) == 1000
    assert adapter_bytes(tmp_path / "missing") == 0


def test_the_cpu_cache_stays_within_a_share_of_host_memory(tmp_path: Path) -> None:
    from gateway.adapter_slots import CPU_CACHE_SHARE, cpu_cache_size

    dirs = [weights(tmp_path, f"a{i}", 1000) for i in range(16)]
    host = int(10 * 1000 / CPU_CACHE_SHARE)  # the share holds 10 adapters of this size
    assert cpu_cache_size(4, dirs, host_bytes=host) == 10
    assert cpu_cache_size(4, dirs, host_bytes=host // 10) == 4  # never below max_loras


def test_settings_get_a_cpu_cache_sized_to_the_catalog(make_settings: Any) -> None:
    from gateway.state import with_adapter_slots

    sized = with_adapter_slots(make_settings(engine__max_loras=2))
    assert sized.engine.max_cpu_loras == 2 + 2  # shout and json, plus max_loras
    assert with_adapter_slots(make_settings(engine__max_cpu_loras=3)).engine.max_cpu_loras == 3
    assert with_adapter_slots(make_settings(engine__enable_lora=False)).engine.max_cpu_loras is None


def test_auto_gives_a_gpu_slot_to_each_adapter_and_one_more() -> None:
    from gateway.adapter_slots import GPU_SLOTS_BYTES, MIN_GPU_SLOTS, gpu_slots

    assert gpu_slots(16, 30 << 20, 256) == 17  # every adapter in one batch, and room for a new version
    assert gpu_slots(2, 30 << 20, 256) == MIN_GPU_SLOTS == 4
    assert gpu_slots(100, GPU_SLOTS_BYTES // 40, 256) == 40  # within the memory share
    assert gpu_slots(100, GPU_SLOTS_BYTES, 256) == 4  # a large model: the floor
    assert gpu_slots(100, None, 256) == 4  # the model's size unknown: the floor
    assert gpu_slots(16, 30 << 20, 8) == 8  # a batch of 8 sequences runs at most 8 adapters
    assert gpu_slots(16, 30 << 20, 2) == 4  # the floor still


def test_the_advice_for_more_slots_names_what_caps_auto() -> None:
    """A restart helps only where ``auto`` would then give each adapter a slot."""
    from gateway.adapter_slots import more_slots_hint

    assert more_slots_hint(20, 30 << 20, 256) == "restart the gateway to give each a slot"
    assert more_slots_hint(24, 46 << 20, 16) == (
        "auto gives at most engine.max_num_seqs=16 (a step runs one adapter per sequence): "
        "raise engine.max_num_seqs to give more"
    )
    assert more_slots_hint(100, 46 << 20, 256) == (
        "auto keeps the slots within 1024 MiB (about 46 MiB each): set engine.max_loras to give more"
    )
    assert more_slots_hint(8, None, 256) == (
        "auto gives 4 where the model's size is unknown: set engine.max_loras"
    )


def test_a_slots_bytes_are_the_models_linear_layers_at_the_rank(tmp_path: Path) -> None:
    """Against a model's own weights: per slot, rank x (in + out) of each linear layer, plus
    two vocabulary-sized matrices."""
    import numpy
    from safetensors.numpy import save_file

    from gateway.adapter_slots import slot_bytes
    from gateway.adapters_check import model_shapes

    config = {
        "hidden_size": 8,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 6,
        "vocab_size": 50,
    }
    h, i, q, kv = 8, 24, 2 * 6, 6
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    shapes |= {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {"model.embed_tokens.weight": numpy.zeros((50, h), dtype=numpy.float32)}
    for layer in range(3):
        group = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
        for name, shape in shapes.items():
            key = f"model.layers.{layer}.{group.get(name, 'mlp')}.{name}.weight"
            tensors[key] = numpy.zeros(shape, dtype=numpy.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = model_shapes(tmp_path)
    assert model is not None
    linear = sum(o + n for key, (o, n) in model.shapes.items() if "embed" not in key)
    assert slot_bytes(config, 16, "float32") == 16 * (linear + 2 * 50) * 4
    assert slot_bytes(config, 16, "bfloat16") == 16 * (linear + 2 * 50) * 2
    assert slot_bytes(config | {"dtype": "bfloat16"}, 16, "auto") == 16 * (linear + 2 * 50) * 2
    assert slot_bytes({"text_config": config}, 8, "half") == 8 * (linear + 2 * 50) * 2  # multimodal
    assert slot_bytes({"hidden_size": 8}, 16, "auto") is None


def test_auto_slots_from_the_catalog_and_the_models_size(make_settings: Any, tmp_path: Path) -> None:
    from gateway.state import with_adapter_slots

    assert with_adapter_slots(make_settings()).engine.max_loras == 4  # 2 adapters: the floor
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(
        "routes:\n" + "".join(f"  - {{name: r{k}, adapter: {('shout', 'json')[k % 2]}}}\n" for k in range(6))
    )
    assert with_adapter_slots(make_settings()).engine.max_loras == 4  # six routes, two adapters
    root = tmp_path / "adapters"
    for k in range(8):
        make_adapter(root, f"a{k}")
    catalog.write_text("routes:\n" + "".join(f"  - {{name: a{k}, adapter: a{k}}}\n" for k in range(8)))
    sized = with_adapter_slots(make_settings())
    assert (sized.engine.max_loras, sized.engine.max_cpu_loras) == (9, 8 + 9)
    assert with_adapter_slots(make_settings(engine__max_loras=2)).engine.max_loras == 2  # as set
    assert (
        with_adapter_slots(make_settings(engine__max_cpu_loras=5)).engine.max_loras == 5
    )  # vLLM: <= the cache
    assert with_adapter_slots(make_settings(engine__enable_lora=False)).engine.max_loras == 4
    big = tmp_path / "big"
    big.mkdir()
    dims = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
    dims |= {"num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
    (big / "config.json").write_text(json.dumps(dims | {"dtype": "bfloat16"}))
    assert (
        with_adapter_slots(make_settings(engine__model=str(big))).engine.max_loras == 4
    )  # about 400 MiB a slot
    small = with_adapter_slots(make_settings(engine__model=str(big), engine__max_lora_rank=1))
    assert small.engine.max_loras == 9  # 25 MiB a slot at rank 1: every adapter fits


def test_the_embedded_models_sizes_before_it_is_prepared(tmp_path: Path) -> None:
    from gateway.adapter_slots import model_config
    from gateway.embedded import EMBEDDED_DIMS

    assert model_config(None, tmp_path) == EMBEDDED_DIMS  # nothing prepared in this cache
    assert model_config(str(tmp_path / "missing"), tmp_path) is None  # not a folder, not in the hub cache


def test_catalog_adapter_folders_once_without_presets_and_bad_paths(tmp_path: Path) -> None:
    from gateway.catalog import adapter_dirs

    root = tmp_path / "adapters"
    shout = weights(root, "shout", 10)
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(
        "routes:\n"
        "  - {name: shout, adapter: shout}\n"
        "  - {name: shout-again, adapter: ./shout}\n"
        "  - {name: gone, adapter: gone}\n"
        "  - {name: out, adapter: ../elsewhere}\n"
        "  - {name: concise, system_prompt: Be brief.}\n"
    )
    assert adapter_dirs(catalog, root) == [shout.resolve()]
    catalog.write_text("routes: [")  # broken: the catalog's own load reports it
    assert adapter_dirs(catalog, root) == []
    assert adapter_dirs(tmp_path / "missing.yaml", root) == []


# -- pins through the app: hot swaps ------------------------------------------------------
PINNED = """
routes:
  - {name: shout, adapter: shout, pinned: true}
  - {name: json, adapter: json}
"""


async def residency(served: Served, name: str) -> dict[str, Any]:
    card = (await served.http.get(f"/v1/models/{name}")).json()
    return {"pinned": card["pinned"], "residency": card["residency"]}


def lora_id(served: Served, name: str) -> int:
    lora = served.gw.catalog_or_503().table.routes[name].lora
    assert lora is not None
    return lora.lora_id


async def test_editing_a_pinned_adapter_at_the_pin_limit_keeps_it_pinned(
    serve: Serve, tmp_path: Path
) -> None:
    """max_loras=2: one pin allowed. The new version is pinned once the old one has left."""
    engine = SlotEngine()
    served = await serve(engine, engine__max_loras=2, catalog_poll_s=0.05)
    (tmp_path / "adapters.yaml").write_text(PINNED)
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    assert await residency(served, "shout") == {"pinned": True, "residency": "gpu"}
    old = lora_id(served, "shout")
    config = tmp_path / "adapters" / "shout" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 32}))  # the watcher sees it
    await eventually_async(lambda: lora_id(served, "shout") != old, 5, "the new version live")
    await eventually_async(lambda: old not in engine.loras, 5, "the old version gone")
    assert await residency(served, "shout") == {"pinned": True, "residency": "gpu"}
    assert engine.pinned == [old, lora_id(served, "shout")]


async def test_pins_are_refused_with_lora_scheduling_off(serve: Serve, tmp_path: Path) -> None:
    """Nothing keeps unpinned adapters within the slots a pin leaves them: vLLM would die of
    the first batch short of slots. The route serves, unpinned."""
    engine = SlotEngine()
    served = await serve(engine, engine__max_loras=2, limits__lora_scheduling="off")
    (tmp_path / "adapters.yaml").write_text(PINNED)
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    assert await residency(served, "shout") == {"pinned": True, "residency": "loaded"}
    assert engine.pinned == []
    card = (await served.http.get("/v1/models/shout")).json()
    assert card["warnings"] == [PIN_REFUSED]


async def test_a_pin_that_waits_for_a_slot_says_so_on_its_card(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """max_loras=2 allows one pin: the second pinned route serves unpinned until a pin frees.
    Seen live: its card said ``pinned: true`` with no word of why it was not on the GPU."""
    engine = SlotEngine()
    served = await serve(engine, engine__max_loras=2)
    (tmp_path / "adapters.yaml").write_text(
        PINNED.replace("{name: json, adapter: json}", "{name: json, adapter: json, pinned: true}")
    )
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    assert await residency(served, "json") == {"pinned": True, "residency": "loaded"}
    card = (await served.http.get("/v1/models/json")).json()
    assert card["warnings"] == [PIN_WAITING]
    assert (await served.http.get("/v1/models/shout")).json()["warnings"] == []
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    assert sum("json not pinned yet" in r.getMessage() for r in caplog.records) == 1  # not at every reload
    current = served.gw.catalog.table.routes["json"]
    assert current.lora is not None and served.gw.adapters.pins_waiting[current.lora.lora_id] is current


async def test_unpinning_in_the_catalog_unpins(serve: Serve, tmp_path: Path) -> None:
    """vLLM has no unpin: the unpinned route is a new version on the same files, and the
    pinned one leaves the engine, freeing the one pin max_loras=2 allows for json."""
    engine = SlotEngine()
    served = await serve(engine, engine__max_loras=2, catalog_poll_s=0.05)
    (tmp_path / "adapters.yaml").write_text(PINNED)
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    pinned_shout = lora_id(served, "shout")
    (tmp_path / "adapters.yaml").write_text(
        "routes:\n  - {name: shout, adapter: shout}\n  - {name: json, adapter: json, pinned: true}\n"
    )
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    await eventually_async(lambda: pinned_shout not in engine.loras, 5, "the pinned shout gone")
    assert await residency(served, "shout") == {"pinned": False, "residency": "loaded"}
    assert await residency(served, "json") == {"pinned": True, "residency": "gpu"}
    assert engine.pinned == [pinned_shout, lora_id(served, "json")]
    shout = served.gw.catalog_or_503().table.routes["shout"].lora
    assert shout is not None and Path(shout.path).is_dir()  # the copy both versions shared stays


async def test_an_admin_reload_that_pins_answers_while_streams_hold_the_slots(
    serve: Serve, tmp_path: Path
) -> None:
    """2 slots, shout and json streaming: pinning json must wait for room, but the admin
    reload answered only when the streams ended (it held the catalog's lock meanwhile)."""
    engine = SlotEngine()
    engine.gate = asyncio.Event()
    served = await serve(engine, engine__max_loras=2)
    streams = [
        asyncio.create_task(served.http.post("/v1/chat/completions", json=chat_body(m)))
        for m in ("shout", "json")
    ]
    await eventually_async(lambda: engine.running == 2, 5, "both adapters in the engine")
    (tmp_path / "adapters.yaml").write_text(
        "routes:\n  - {name: shout, adapter: shout}\n  - {name: json, adapter: json, pinned: true}\n"
    )
    r = await asyncio.wait_for(served.http.post("/admin/adapters/reload", headers=ADMIN), 5)
    assert r.status_code == 200 and engine.pinned == []
    assert (await served.http.get("/v1/models/json")).json()["warnings"] == [PIN_COMING]
    engine.gate.set()
    assert [s.status_code for s in await asyncio.gather(*streams)] == [200, 200]
    await eventually_async(lambda: engine.pinned == [lora_id(served, "json")], 5, "pinned once room freed")
    assert await residency(served, "json") == {"pinned": True, "residency": "gpu"}
    assert (await served.http.get("/v1/models/json")).json()["warnings"] == []


async def test_a_pin_waits_for_room_among_the_active_adapters_without_holding_the_register() -> None:
    """Two adapters run on 2 slots: the pin waits until one drains, in the background, so
    the reload that registered it (and the catalog's lock) does not wait for their streams."""
    s, engine, _ = slots(max_loras=2)
    tickets = [await s.scheduler.turn(lora_route(f"u{i}", i)) for i in (1, 2)]
    await asyncio.wait_for(s.register(lora_route("p", 3, pinned=True)), 5)
    assert engine.pinned == [] and 3 in s.pinning
    await s._pin(lora_route("p", 3, pinned=True))  # a later reload: the same pin, not another
    assert list(s.pinning) == [3]
    tickets[0].release()  # type: ignore[union-attr]
    await eventually_async(lambda: engine.pinned == [3], 5, "pinned once a slot drained")
    assert s.residency(lora_route("p", 3, pinned=True)) == "gpu" and s.pinning == {}


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_pin_removed_on_its_way_leaves_its_room_to_a_waiting_pin() -> None:
    """max_loras=3: two pins. a is pinned, b's pin waits for room (two adapters run), c waits
    for the pin limit (b counts). b's version leaves before its pin lands: c takes the room."""
    s, engine, _ = slots(max_loras=3)
    assert s.scheduler is not None
    await s.register(lora_route("a", 1, pinned=True))
    tickets = [await s.scheduler.turn(lora_route(f"u{i}", i)) for i in (6, 7)]
    await s.register(lora_route("b", 2, pinned=True))
    await s.register(lora_route("c", 3, pinned=True))
    assert list(s.pinning) == [2] and list(s.pins_waiting) == [3]
    await s.remove(2)
    assert list(s.pinning) == [3] and s.pins_waiting == {}  # on its way: room for it now
    for ticket in tickets:
        ticket.release()  # type: ignore[union-attr]
    await eventually_async(lambda: engine.pinned == [1, 3], 5, "c pinned")


async def test_every_waiting_pin_gets_the_room_that_frees_not_only_the_first() -> None:
    """max_loras=4: three pins. d and e wait for the limit; two pinned versions leave while
    an unpinned adapter runs: d's pin goes on its way, and e, behind it, is not forgotten."""
    s, engine, _ = slots(max_loras=4)
    assert s.scheduler is not None
    for i in (1, 2, 3):
        await s.register(lora_route(f"p{i}", i, pinned=True))
    for name, i in (("d", 4), ("e", 5)):
        await s.register(lora_route(name, i, pinned=True))
    assert list(s.pins_waiting) == [4, 5]
    busy = await s.scheduler.turn(lora_route("u6", 6))  # the one unpinned slot
    later = asyncio.ensure_future(s.scheduler.turn(lora_route("u7", 7)))
    await _settle()
    await s.remove(1)  # u7 takes the slot freed: d's pin waits for room, on its way
    assert list(s.pinning) == [4] and list(s.pins_waiting) == [5]
    await s.remove(2)  # room for e too: pinned at once or on its way, not left waiting
    assert s.pins_waiting == {}
    for ticket in (busy, await asyncio.wait_for(later, 1)):
        ticket.release()  # type: ignore[union-attr]
    await eventually_async(lambda: sorted(engine.pinned) == [1, 2, 3, 4, 5], 5, "d and e pinned")
    assert s.pinned == {3, 4, 5} and s.pins_waiting == {} and s.pinning == {}


async def test_a_pin_refused_on_its_way_says_so_on_the_card_until_a_reload_pins_it() -> None:
    s, engine, _ = slots(max_loras=2)
    assert s.scheduler is not None
    tickets = [await s.scheduler.turn(lora_route(f"u{i}", i)) for i in (1, 2)]
    refusing = True
    pin = engine.pin_lora

    async def sometimes(lora_id: int) -> None:
        if refusing:
            raise EngineFailed("Pinning failed")
        await pin(lora_id)

    engine.pin_lora = sometimes  # type: ignore[method-assign]
    route = lora_route("p", 3, pinned=True)
    await s.register(route)
    for ticket in tickets:
        ticket.release()  # type: ignore[union-attr]
    await eventually_async(lambda: s.pinning == {}, 5, "the pin tried")
    assert adapter_fields(route, s)["warnings"] == [
        "not pinned: the engine refused the pin (Pinning failed); a reload tries again"
    ]
    refusing = False
    await s.register(route)  # the next reload
    assert engine.pinned == [3] and adapter_fields(route, s)["warnings"] == []


async def test_a_version_removed_before_its_pin_landed_is_never_pinned() -> None:
    s, engine, _ = slots(max_loras=2)
    tickets = [await s.scheduler.turn(lora_route(f"u{i}", i)) for i in (1, 2)]
    await s.register(lora_route("p", 3, pinned=True))
    assert 3 in s.pinning
    await s.remove(3)
    for ticket in tickets:
        ticket.release()  # type: ignore[union-attr]
    for _ in range(5):
        await asyncio.sleep(0)
    assert engine.pinned == [] and s.pinning == {} and s.scheduler is not None
    assert s.scheduler._pins_coming == 0  # its slot is the unpinned adapters' again


async def test_a_reload_past_the_auto_slots_is_warned_of_once_while_over(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``auto`` sizes the slots once, at start: adapters added later share them."""
    caplog.set_level(logging.INFO, logger="gateway.state")
    served = await serve()  # shout and json: auto gives 4 slots (at least 4)
    assert served.gw.settings.engine.max_loras == 4

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if "GPU slots" in r.getMessage() and r.levelname == "WARNING"
        ]

    catalog = tmp_path / "adapters.yaml"
    original = catalog.read_text()
    for name in ("a1", "a2", "a3"):
        make_adapter(tmp_path / "adapters", name)
    extra = "".join(f"  - {{name: {n}, adapter: {n}}}\n" for n in ("a1", "a2"))
    catalog.write_text(original + extra + "  - {name: again, adapter: a1}\n")
    assert await served.gw.reload_catalog()
    assert warnings() == []  # four adapters (a1 twice is one): a slot each
    catalog.write_text(original + extra + "  - {name: a3, adapter: a3}\n")
    assert await served.gw.reload_catalog()
    assert warnings() == [
        "the catalog names 5 adapters and the engine has 4 GPU slots (engine.max_loras: auto, sized at "
        "start): at most 4 adapters run in one step, the others wait their turn; restart the gateway "
        "to give each a slot"
    ]
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 1  # the same count: said once
    make_adapter(tmp_path / "adapters", "a4")
    catalog.write_text(original + extra + "  - {name: a3, adapter: a3}\n  - {name: a4, adapter: a4}\n")
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 1  # still over: the new count is an info line, not a second warning
    assert [r.levelname for r in caplog.records if "names 6 adapters" in r.getMessage()] == ["INFO"]
    catalog.write_text(original + extra + "  - {name: a3, adapter: a3}\n")
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 1  # back to a count already said (an entry rejected, then fixed)
    catalog.write_text(original)
    assert await served.gw.reload_catalog()
    catalog.write_text(original + extra + "  - {name: a3, adapter: a3}\n")
    assert await served.gw.reload_catalog()
    assert len(warnings()) == 2  # over again after fitting: said again


async def test_no_slot_warning_when_max_loras_is_set(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.state")
    served = await serve(engine__max_loras=1)  # set: the operator chose to share the slot
    catalog = tmp_path / "adapters.yaml"
    assert await served.gw.reload_catalog()
    assert served.gw.settings.engine.max_loras == 1 and "adapter: json" in catalog.read_text()
    assert not [r for r in caplog.records if "GPU slots" in r.getMessage()]


async def test_pins_turning_the_wait_bound_off_are_said_once_per_change(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator who pins one adapter loses limits.max_adapter_wait_s: the log says so."""
    caplog.set_level(logging.INFO, logger="gateway.state")
    served = await serve(SlotEngine(), engine__max_loras=3, limits__max_adapter_wait_s=5)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "max_adapter_wait_s" in r.getMessage()]

    assert said() == []  # nothing pinned
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(PINNED)
    assert await served.gw.reload_catalog()
    assert said() == [
        "pinned: shout; while an adapter is pinned, limits.max_adapter_wait_s (5 s) does not bound the "
        "wait for an adapter's turn: a waiting adapter gets a slot when an active one drains"
    ]
    assert await served.gw.reload_catalog()
    assert len(said()) == 1  # the same pins: said once
    catalog.write_text(
        PINNED.replace("{name: json, adapter: json}", "{name: json, adapter: json, pinned: true}")
    )
    assert await served.gw.reload_catalog()
    assert said()[-1].startswith("pinned: json, shout;") and len(said()) == 2


async def test_metrics_count_the_routes_by_residency(serve: Serve, tmp_path: Path) -> None:
    """``gateway_adapters{residency}``: what the cards of /v1/models say, counted."""
    engine = ReportingEngine()
    served = await serve(engine, engine__max_loras=2)
    (tmp_path / "adapters.yaml").write_text(PINNED)  # shout pinned, json not
    assert (await served.http.post("/admin/adapters/reload", headers=ADMIN)).status_code == 200
    engine.slots = {lora_id(served, "shout")}  # json only in the CPU cache
    await served.gw.adapters.refresh()
    text = (await served.http.get("/metrics", headers=ADMIN)).text
    counts = dict(re.findall(r'^gateway_adapters\{residency="([a-z ]+)"\} (\S+)$', text, re.M))
    assert counts == {"gpu": "1.0", "cpu": "1.0", "loaded": "0.0", "not loaded": "0.0"}
