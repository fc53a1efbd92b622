"""LoraScheduler on its own: which LoRA requests go to the engine, when, and in what order.

Time is a fake clock moved by hand; ``expire()`` is called where the timer would fire, so
nothing here depends on the wall clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass

import pytest

from gateway.catalog import Route
from gateway.lora_scheduler import LoraScheduler, Ticket
from gateway.metrics import GatewayMetrics
from gateway.types import LoraSpec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Key:
    name: str
    weight: float = 1.0
    priority: int = 0


def lora(name: str, lora_id: int, weight: float = 1.0) -> Route:
    return Route(name=name, kind="lora", lora=LoraSpec(name, lora_id, f"/adapters/{name}"), weight=weight)


A, B, C, D = (lora(n, i) for i, n in enumerate("abcd", start=1))
BASE = Route(name="base", kind="base")
PRESET = Route(name="concise", kind="preset")
ME = Key("me")


def make(
    slots: int = 1,
    quantum_s: float = 10.0,
    max_wait_s: float = 60.0,
    *,
    clock: Callable[[], float] | None = None,
    pinned: Collection[int] = frozenset(),
    metrics: GatewayMetrics | None = None,
) -> LoraScheduler:
    return LoraScheduler(
        slots,
        quantum_s=quantum_s,
        max_wait_s=max_wait_s,
        pinned=pinned,
        metrics=metrics,
        clock=clock or Clock(),
    )


def start_pin(s: LoraScheduler, pinned: set[int], lora_id: int) -> asyncio.Task[None]:
    """What ``AdapterSlots`` does to pin: wait for room, then pin (no engine here)."""

    async def pin() -> None:
        async with s.room_for_pin(lora_id):
            pinned.add(lora_id)

    return asyncio.create_task(pin())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Requests:
    """Turns started as tasks; ``order`` is the order their tickets arrived in."""

    def __init__(self, scheduler: LoraScheduler) -> None:
        self.scheduler = scheduler
        self.tasks: dict[str, asyncio.Task[Ticket | None]] = {}
        self.order: list[str] = []

    async def ask(self, label: str, route: Route, key: Key = ME) -> asyncio.Task[Ticket | None]:
        async def turn() -> Ticket | None:
            ticket = await self.scheduler.turn(route, key)
            self.order.append(label)
            return ticket

        self.tasks[label] = task = asyncio.create_task(turn())
        await settle()
        return task

    def went(self) -> set[str]:
        return {label for label, task in self.tasks.items() if task.done() and not task.cancelled()}

    async def release(self, *labels: str) -> None:
        for label in labels:
            ticket = self.tasks[label].result()
            assert ticket is not None
            ticket.release()
        await settle()


async def test_base_and_preset_requests_never_wait() -> None:
    s = make(slots=1)
    held = await s.turn(A, ME)
    assert held is not None
    assert await s.turn(BASE, ME) is None
    assert await s.turn(PRESET, ME) is None
    assert s.queued == 0


async def test_free_slots_go_at_once_then_requests_wait_for_a_slot() -> None:
    s = make(slots=2)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    await r.ask("c1", C)
    assert r.went() == {"a1", "b1"} and s.queued == 1
    await r.release("a1")
    assert "c1" in r.went() and s.queued == 0


async def test_an_active_adapter_goes_ahead_of_queued_ones() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    await r.ask("a2", A)  # A is resident: no wait, though b1 came first
    assert r.went() == {"a1", "a2"}
    await r.release("a1")
    assert "b1" not in r.went()  # A still has a2 in the engine: its slot is not free
    await r.release("a2")
    assert "b1" in r.went()


async def test_a_queued_adapter_is_handed_over_whole_and_in_order() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    for label in ("b1", "c1", "b2", "b3", "c2"):
        await r.ask(label, B if label[0] == "b" else C)
    await r.release("a1")
    assert r.went() == {"a1", "b1", "b2", "b3"}  # one release: all of B, in arrival order
    assert r.order == ["a1", "b1", "b2", "b3"]
    await r.release("b1", "b2")
    assert "c1" not in r.went()
    await r.release("b3")
    assert r.order[-2:] == ["c1", "c2"]


async def test_a_later_request_of_a_waiting_adapter_does_not_jump_its_queue() -> None:
    s = make(slots=2)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.release("a1")  # the free slot goes to C ...
    await r.ask("c2", C)  # ... and C, now active, takes c2 at once
    assert r.order == ["a1", "b1", "c1", "c2"]


async def test_the_less_served_route_goes_first() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("a2", A)
    await r.ask("a3", A)  # A has had three requests
    await r.ask("b1", B)
    await r.release("a1", "a2", "a3")
    await r.ask("x", D)  # hold the slot while A and B both wait
    await r.ask("a4", A)
    await r.ask("c1", C)
    assert r.went() == {"a1", "a2", "a3", "b1"}
    await r.release("b1")
    assert r.order[-1] == "x"
    await r.release("x")
    assert r.order[-1] == "c1"  # C (no turn yet) before A (had one), though a4 came first


async def test_a_turn_costs_the_same_whatever_its_queue() -> None:
    """Fair share counts turns, not requests: a busy adapter's big queue shares one turn,
    and does not push its next turn back behind an adapter that had a turn of one."""
    s = make(slots=1)
    r = Requests(s)
    await r.ask("x", D)
    for n in range(5):
        await r.ask(f"a{n}", A)
    await r.ask("b0", B)
    await r.release("x")
    await r.ask("a5", A)  # A is in its turn: goes at once
    await r.ask("x2", D)
    await r.release(*(f"a{n}" for n in range(6)))
    assert r.order[-1] == "b0"
    await r.ask("a6", A)
    await r.ask("b1", B)  # B is in its turn: goes at once
    await r.release("b0", "b1")
    assert r.order[-1] == "x2"  # D, A and B have had one turn each: the oldest waiting first
    await r.ask("b2", B)
    await r.release("x2")
    assert r.order[-1] == "a6"


async def test_route_weights_share_turns_in_proportion() -> None:
    heavy, light = lora("heavy", 7, weight=3.0), lora("light", 8)
    grants = await _alternating_backlogs(heavy, ME, light, ME, rounds=40)
    assert grants == {"heavy": 30, "light": 10}


async def test_key_weights_share_turns_in_proportion() -> None:
    big, small = Key("big", weight=2.0), Key("small")
    grants = await _alternating_backlogs(A, big, B, small, rounds=30)
    assert grants == {"a": 20, "b": 10}


async def test_routes_sharing_an_adapter_take_turns_at_their_highest_weight() -> None:
    """heavy (weight 3) and light (1) on one adapter: one flow of weight 3, whichever asked last."""
    heavy, other = lora("heavy", 7, weight=3.0), lora("other", 8)
    light = Route(name="light", kind="lora", lora=LoraSpec("light", 7, "/adapters/heavy"))
    grants = await _alternating_backlogs(heavy, ME, other, ME, rounds=40, one_also=light)
    assert grants == {"heavy": 30, "other": 10}


async def _alternating_backlogs(
    one: Route, one_key: Key, other: Route, other_key: Key, rounds: int, one_also: Route | None = None
) -> dict[str, int]:
    """Both routes always have a request waiting (a quantum of 0 makes the adapter in the
    slot queue its next request); count whose adapter gets the slot each round. With
    ``one_also`` (a route on one's adapter), every other request of one's is on it."""
    r = Requests(make(slots=1, quantum_s=0.0))
    await r.ask("hold", D)
    await r.ask(f"{one.name}0", one, one_key)
    await r.ask(f"{other.name}0", other, other_key)
    grants = {one.name: 0, other.name: 0}
    current, seen = "hold", 1
    for n in range(1, rounds + 1):
        await r.release(current)
        current = r.order[seen]
        seen += 1
        name = next(x for x in grants if current.startswith(x) and current[len(x) :].isdigit())
        grants[name] += 1
        route, key = (one, one_key) if name == one.name else (other, other_key)
        if route is one and one_also is not None and n % 2:
            route = one_also
        await r.ask(f"{name}{n}", route, key)
        assert len(r.went()) == seen  # it queued behind the other
    return grants


async def test_a_busy_scheduler_forgets_the_turns_of_adapter_versions_removed() -> None:
    """Never idle (one adapter always in the engine), the fair share kept a virtual time
    for every adapter version it had served: a hot swap's version has a new id, never
    reused, so weeks of swaps grew it without end. A version the engine dropped goes."""
    s = make(slots=2, quantum_s=0.0)
    busy = await s.turn(A, ME)
    for lora_id in range(100, 600):
        ticket = await s.turn(lora("swapped", lora_id), ME)
        assert ticket is not None
        ticket.release()
        s.removed(lora_id)
    assert set(s._share._routes) == {1}  # A
    assert busy is not None
    busy.release()


async def test_fair_across_keys_before_routes() -> None:
    """A key that floods many routes does not crowd out a key with one request."""
    s = make(slots=1)
    r = Requests(s)
    flood, one = Key("flood"), Key("one")
    await r.ask("hold", D)
    for n, route in enumerate((A, B, A, B, A)):
        await r.ask(f"f{n}", route, flood)
    await r.ask("o", C, one)
    await r.release("hold")
    assert r.went() == {"hold", "f0", "f2", "f4"}  # the oldest waiting request's adapter: A
    await r.release("f0", "f2", "f4")
    assert r.order[-1] == "o"  # flood's B came before o, but flood has had a turn


async def test_turns_from_before_an_idle_gap_are_not_charged_again() -> None:
    """Once nothing runs or waits, every route and key starts level: a flow served last in
    an earlier burst does not lose to a later arrival (seen live: bullets, arriving after
    shout, went first because shout had the last turn of a burst a minute before)."""
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a0", A)
    await r.ask("b0", B)
    await r.release("a0")
    await r.release("b0")  # idle: nothing active, nothing waiting
    await r.ask("x", D)
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.release("x")
    assert r.order[-1] == "b1"  # equal weights, one key: first come, first served


async def test_a_key_served_before_an_idle_gap_is_not_behind_a_flooding_key() -> None:
    """Seen live: a key with one request waited for a flooding key's second adapter,
    because its own turns of a burst before the idle gap still counted."""
    s = make(slots=1)
    r = Requests(s)
    flood, one = Key("flood"), Key("one")
    await r.ask("o0", A, one)
    await r.release("o0")  # idle
    await r.ask("f0", B, flood)
    await r.ask("f1", C, flood)
    await r.ask("o1", D, one)
    await r.release("f0")
    assert r.order[-1] == "o1"  # flood has had a turn since the gap, one has not


async def test_priority_goes_before_fair_share() -> None:
    """A lower priority goes first even when its key has had more turns than the other:
    fair share only orders requests of one priority, so an urgent key that keeps sending is
    never put behind a normal one."""
    s = make(slots=1)
    r = Requests(s)
    urgent = Key("urgent", priority=-1)
    await r.ask("a1", A, urgent)  # urgent's key has had a turn, normal's none
    await r.ask("b1", B, Key("normal"))
    await r.ask("c1", C, urgent)
    await r.release("a1")
    assert r.went() == {"a1", "c1"}


async def test_a_key_new_to_a_busy_period_goes_before_a_key_already_served() -> None:
    """A turn that served two keys moves the key clock to the less served of them: a key
    that arrives later starts there, level with that key, and goes before a key that has
    had a turn since. Starting it at the most served key's time would make it wait behind
    a key that has already been served."""
    s = make(slots=1)
    r = Requests(s)
    x, y, z = Key("x"), Key("y"), Key("z")
    await r.ask("hold", D, x)
    await r.ask("a1", A, x)
    await r.ask("a2", A, y)
    await r.release("hold")  # A's turn serves x (its second turn) and y (its first)
    await r.ask("b1", B, y)
    await r.ask("c1", C, z)  # z has had no turn; y has had one
    await r.release("a1", "a2")
    assert r.order[-1] == "c1"


async def test_a_route_new_to_a_busy_period_gets_no_credit_for_it() -> None:
    """A route that was idle starts from the virtual clock, not from where it left off:
    arriving in the middle of a busy period, it waits its turn behind routes that asked
    before it (equal weights: first come, first served) instead of jumping them for the
    turns the others had while it asked for nothing."""
    s = make(slots=1)
    r = Requests(s)
    await r.ask("d1", D)
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.release("d1")  # B's turn
    await r.ask("d2", D)
    await r.release("b1")  # C's turn
    await r.ask("b2", B)
    await r.release("c1")  # D's turn: B, C and D have had one turn each since d1
    await r.ask("a1", A)  # A's first request, after b2's
    await r.ask("c2", C)
    await r.release("d2")
    assert r.order[-1] == "b2"


async def test_an_adapter_past_its_quantum_drains_while_others_wait() -> None:
    clock = Clock()
    s = make(slots=1, quantum_s=2.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("a2", A)  # within the quantum: goes
    await r.ask("b1", B)
    clock.now += 2.0
    await r.ask("a3", A)  # past it, B waiting: A takes no more and drains
    assert r.went() == {"a1", "a2"}
    await r.release("a1", "a2")
    assert "b1" in r.went() and "a3" not in r.went()
    await r.release("b1")
    assert "a3" in r.went()


async def test_past_its_quantum_with_nobody_waiting_an_adapter_keeps_its_slot() -> None:
    clock = Clock()
    s = make(slots=1, quantum_s=2.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    clock.now += 5.0
    await r.ask("a2", A)
    assert r.went() == {"a1", "a2"}


async def test_only_as_many_adapters_drain_as_are_waiting() -> None:
    clock = Clock()
    s = make(slots=2, quantum_s=1.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    await r.ask("c1", C)  # one adapter waits
    clock.now += 1.0
    await r.ask("a2", A)  # A drains for C ...
    await r.ask("b2", B)  # ... so B need not
    assert r.went() == {"a1", "b1", "b2"}


async def test_a_request_that_waited_max_wait_goes_anyway() -> None:
    clock = Clock()
    metrics = GatewayMetrics()
    metrics.set_routes(frozenset({"a", "b", "c"}))
    s = make(slots=1, max_wait_s=3.0, clock=clock, metrics=metrics)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    clock.now += 1.0
    await r.ask("b2", B)
    await r.ask("c1", C)
    clock.now += 1.9
    assert s.expire() == 0 and r.went() == {"a1"}
    clock.now += 0.1  # b1 has waited 3 s: all of B goes, over the slot count
    assert s.expire() == 2
    await settle()
    assert r.went() == {"a1", "b1", "b2"} and s.forced == 2
    assert metrics.adapter_wait_timeouts.labels("b")._value.get() == 2
    await r.release("a1")
    assert "c1" not in r.went()  # B holds the one slot now
    await r.release("b1", "b2")
    assert "c1" in r.went()


async def test_a_preloads_warm_up_sent_on_by_the_bounded_wait_is_no_user_timeout() -> None:
    """A preload's warm-up (``observe=False``) that waited ``max_wait_s`` is sent on like any
    request, but no user waited: ``gateway_adapter_wait_timeouts`` counts user requests
    only, or an alert on it fires at every reload that preloads an adapter."""
    clock = Clock()
    metrics = GatewayMetrics()
    metrics.set_routes(frozenset({"a", "b"}))
    s = make(slots=1, max_wait_s=3.0, clock=clock, metrics=metrics)
    r = Requests(s)
    await r.ask("b1", B)
    warm_up = asyncio.create_task(s.turn(A, observe=False))
    await settle()
    clock.now += 3.0
    assert s.expire() == 1
    await settle()
    assert warm_up.done()
    assert metrics.adapter_wait_timeouts.labels("a")._value.get() == 0


async def test_the_timer_fires_expire() -> None:
    s = make(slots=1, max_wait_s=0.01, clock=asyncio.get_running_loop().time)
    r = Requests(s)
    await r.ask("a1", A)
    task = await r.ask("b1", B)
    await asyncio.wait_for(task, 5)
    assert s.forced == 1


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    await r.ask("c1", C)
    b1.cancel()
    await settle()
    assert s.queued == 1
    await r.release("a1")
    assert "c1" in r.went()  # B has nobody left: its turn is not taken


async def test_a_waiter_cancelled_as_it_is_handed_its_ticket_gives_the_slot_back() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    await r.ask("c1", C)
    r.tasks["a1"].result().release()  # type: ignore[union-attr]
    b1.cancel()  # the ticket is set, the task has not run yet
    await settle()
    assert b1.cancelled()
    assert "c1" in r.went()  # B's slot was released, not leaked


async def test_a_queue_whose_waiters_all_left_does_not_hold_a_slot() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    await r.ask("c1", C)
    b1.cancel()  # cancelled, but its clean-up has not run when A releases
    r.tasks["a1"].result().release()  # type: ignore[union-attr]
    await settle()
    assert "c1" in r.went()


async def test_release_is_idempotent() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("a2", A)
    await r.ask("b1", B)
    ticket = r.tasks["a1"].result()
    assert ticket is not None
    ticket.release()
    ticket.release()  # a second release must not free A's slot while a2 runs
    await settle()
    assert "b1" not in r.went()


async def test_pinned_adapters_never_wait_and_hold_slots() -> None:
    pinned = {1}
    s = make(slots=3, pinned=pinned)
    r = Requests(s)
    await r.ask("a1", A)  # pinned
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.ask("d1", D)  # 3 slots, one pinned: B and C hold the other two
    await r.ask("a2", A)
    assert r.went() == {"a1", "a2", "b1", "c1"}
    await r.release("a1", "a2")
    assert "d1" not in r.went()  # a pinned adapter's slot never frees
    pinned.discard(1)  # unpinned (removed): its slot is free again
    await r.release("b1")
    assert "d1" in r.went()


async def test_an_adapter_pinned_while_active_gives_its_slot_back() -> None:
    """Pinned while it serves (a reload, or its pin waited for a slot), with steady traffic
    that never lets it reach zero: it must not hold one of the unpinned slots as well."""
    pinned: set[int] = set()
    s = make(slots=2, pinned=pinned)  # one pin: one slot for the unpinned adapters
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)  # waits: A holds the one slot
    pinned.add(1)
    await r.ask("a2", A)
    assert r.went() == {"a1", "a2", "b1"}  # A's next request gave B the slot
    await r.release("a1")
    await r.ask("a3", A)
    await r.ask("c1", C)
    assert "c1" not in r.went()  # B has the slot, A none
    assert s.snapshot()["active"] == {"b": {"inflight": 1, "draining": False}}


async def test_an_adapter_pinned_while_it_waits_takes_its_queue_along() -> None:
    pinned: set[int] = set()
    s = make(slots=2, pinned=pinned)
    r = Requests(s)
    await r.ask("c1", C)
    await r.ask("d1", D)
    await r.ask("a1", A)  # waits
    pinned.add(1)
    await r.ask("a2", A)  # goes at once, and so does a1: it does not wait out max_wait_s
    assert r.went() == {"c1", "d1", "a1", "a2"} and s.queued == 0
    serving = {"inflight": 1, "draining": False}
    assert s.snapshot()["active"] == {"c": serving, "d": serving}  # A holds none of the two slots


async def test_wait_and_queue_metrics() -> None:
    clock = Clock()
    metrics = GatewayMetrics()
    metrics.set_routes(frozenset({"a", "b"}))
    s = make(slots=1, clock=clock, metrics=metrics)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    assert metrics.adapter_queued._value.get() == 1
    clock.now += 1.5
    await r.release("a1")
    assert metrics.adapter_queued._value.get() == 0
    text = metrics.render().decode()
    assert 'gateway_adapter_wait_seconds_sum{route="b"} 1.5' in text
    assert 'gateway_adapter_wait_seconds_count{route="a"} 1.0' in text


async def test_routes_sharing_an_adapter_book_waits_under_their_own_names() -> None:
    """One adapter, one queue and one turn for a and a-strict; each request's wait, timeout
    and place in the snapshot are its own route's."""
    clock = Clock()
    metrics = GatewayMetrics()
    metrics.set_routes(frozenset({"a", "a-strict", "b"}))
    s = make(slots=1, max_wait_s=3.0, clock=clock, metrics=metrics)
    strict = Route(name="a-strict", kind="lora", lora=LoraSpec("a-strict", 1, "/adapters/a"))
    r = Requests(s)
    await r.ask("b1", B)
    await r.ask("s1", strict)
    await r.ask("a1", A)
    await r.ask("s2", strict)
    assert s.snapshot()["queued"] == {"a-strict": 2, "a": 1}
    clock.now += 3.0
    assert s.expire() == 3
    await settle()
    serving = {"draining": False}
    assert s.snapshot()["active"] == {
        "b": {"inflight": 1, **serving},
        "a-strict": {"inflight": 2, **serving},
        "a": {"inflight": 1, **serving},
    }
    assert metrics.adapter_wait_timeouts.labels("a-strict")._value.get() == 2
    assert metrics.adapter_wait_timeouts.labels("a")._value.get() == 1
    await r.release("s1", "s2")
    assert s.snapshot()["active"] == {"b": {"inflight": 1, **serving}, "a": {"inflight": 1, **serving}}
    text = metrics.render().decode()
    assert 'gateway_adapter_wait_seconds_sum{route="a-strict"} 6.0' in text
    assert 'gateway_adapter_wait_seconds_count{route="a"} 1.0' in text


async def test_snapshot_names_active_and_queued_adapters() -> None:
    s = make(slots=1)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    assert s.snapshot() == {
        "slots": 1,
        "slots_in_use": 1,
        "active": {"a": {"inflight": 1, "draining": False}},
        "queued": {"b": 1},
        "forced": 0,
    }


@pytest.mark.parametrize("slots", [1, 3])
async def test_many_requests_all_end_and_leave_nothing_behind(slots: int) -> None:
    s = make(slots=slots)
    routes = [lora(f"r{i}", i + 10) for i in range(6)]

    async def one(n: int) -> None:
        ticket = await s.turn(routes[n % 6], Key(f"k{n % 3}"))
        await asyncio.sleep(0)
        assert ticket is not None
        ticket.release()

    await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(60))), 5)
    assert s.snapshot() == {"slots": slots, "slots_in_use": 0, "active": {}, "queued": {}, "forced": 0}


async def test_over_the_slot_count_after_a_timeout_adapters_drain_back_to_it() -> None:
    clock = Clock()
    s = make(slots=1, quantum_s=1.0, max_wait_s=3.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)
    clock.now += 3.0
    s.expire()  # B goes over the one slot: two adapters active, nobody waiting
    await settle()
    await r.ask("a2", A)  # both past their quantum: one of them must drain
    await r.ask("b2", B)
    assert r.went() == {"a1", "b1", "b2"} and s.queued == 1
    await r.release("b1", "b2")
    assert "a2" in r.went()  # B has left: A is within the slot count again, and nobody waits


async def test_a_draining_adapter_takes_requests_again_once_nobody_waits() -> None:
    """A drains for B; once B has a slot of its own (C's), A holds its slot with nobody
    waiting, so what it queued meanwhile goes on (in order) and so do new requests."""
    clock = Clock()
    s = make(slots=2, quantum_s=1.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("c1", C)
    await r.ask("b1", B)  # both slots taken: B waits
    clock.now += 1.0
    await r.ask("a2", A)  # A is past its quantum while B waits: it drains, a2 queues
    assert r.went() == {"a1", "c1"} and s.snapshot()["active"]["a"]["draining"]
    await r.release("c1")  # B takes C's slot
    assert r.order == ["a1", "c1", "b1", "a2"] and not s.snapshot()["active"]["a"]["draining"]
    await r.ask("a3", A)
    assert "a3" in r.went() and s.queued == 0


async def test_a_drain_ends_when_the_adapter_it_was_for_leaves_the_queue() -> None:
    clock = Clock()
    s = make(slots=1, quantum_s=1.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    clock.now += 1.0
    await r.ask("a2", A)  # drains for B
    b1.cancel()  # B's caller gives up
    await settle()
    assert "a2" in r.went() and s.queued == 0


async def test_with_a_pin_a_request_past_max_wait_still_waits_for_a_slot() -> None:
    """vLLM batches up to max_loras adapters and does not count pinned ones: with one of
    two slots pinned, two unpinned adapters in one batch make the engine evict one of them
    mid-batch and die. The bounded wait must not send a second unpinned adapter in."""
    clock = Clock()
    s = make(slots=2, max_wait_s=3.0, clock=clock, pinned={1})
    r = Requests(s)
    await r.ask("a1", A)  # pinned
    await r.ask("b1", B)  # the one unpinned slot
    await r.ask("c1", C)
    clock.now += 10.0
    assert s.expire() == 0 and r.went() == {"a1", "b1"}
    assert s._timer is None  # nothing to force: no timer spinning on a past deadline
    await r.release("b1")
    assert "c1" in r.went()


async def test_with_a_pin_the_timer_does_not_spin() -> None:
    """A queue the bounded wait may not force (a pin) arms no timer: one that fired with
    nothing to force would be armed again at once, thousands of times a second."""
    s = make(slots=2, max_wait_s=0.01, clock=asyncio.get_running_loop().time, pinned={1})
    expired = 0
    expire = s.expire

    def counted() -> None:
        nonlocal expired
        expired += 1
        expire()

    s.expire = counted  # type: ignore[method-assign]
    r = Requests(s)
    await r.ask("b1", B)
    c1 = await r.ask("c1", C)
    await asyncio.sleep(0.05)
    assert not c1.done() and s.forced == 0
    assert expired <= 1, f"the timer fired {expired} times in 50 ms"
    await r.release("b1")
    assert c1.done()


async def test_a_pin_waits_until_the_other_active_adapters_fit_the_slots_left() -> None:
    """Two slots, A and B active: pinning C now would leave vLLM a batch of A and B with one
    free GPU slot, which kills the engine. The pin waits for one of them to leave, and no
    other adapter takes the slot meanwhile."""
    pinned: set[int] = set()
    s = make(slots=2, pinned=pinned)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("b1", B)

    pinning = start_pin(s, pinned, 3)
    await settle()
    assert not pinning.done()
    await r.release("a1")
    await r.ask("d1", D)  # A's slot is held for the pin
    await asyncio.wait_for(pinning, 5)
    assert "d1" not in r.went() and pinned == {3}
    await r.release("b1")
    assert "d1" in r.went()


async def test_no_queue_is_sent_past_the_slots_while_a_pin_is_being_made() -> None:
    """Pinning D with A, C active and B queued: while the engine pins (nothing is in
    ``pinned`` yet), the bounded wait must not send B over the slot count, or once the pin
    lands vLLM has two unpinned adapters for one free GPU slot."""
    clock = Clock()
    pinned: set[int] = set()
    s = make(slots=2, max_wait_s=5.0, clock=clock, pinned=pinned)
    r = Requests(s)
    await r.ask("a1", A)
    await r.ask("c1", C)
    await r.ask("b1", B)

    async def pin() -> None:
        async with s.room_for_pin(4):
            await asyncio.sleep(0)  # the engine's pin_lora; the timer fires meanwhile
            clock.now += 5.0
            assert s.expire() == 0
            pinned.add(4)

    pinning = asyncio.create_task(pin())
    await settle()
    await r.release("c1")  # room for the pin: A alone fits the slot left
    await asyncio.wait_for(pinning, 5)
    assert r.went() == {"a1", "c1"} and s.snapshot()["slots"] == 1
    await r.release("a1")
    assert "b1" in r.went()


async def test_a_pin_leaving_gives_its_slot_to_a_waiting_adapter() -> None:
    pinned = {1}
    s = make(slots=2, pinned=pinned)
    r = Requests(s)
    await r.ask("b1", B)  # the one slot left beside the pin
    await r.ask("c1", C)
    pinned.discard(1)  # the pinned version drained and left the engine
    s.pins_changed()
    await settle()
    assert r.went() == {"b1", "c1"}
    await r.ask("d1", D)  # a newcomer now waits behind them
    assert "d1" not in r.went()


async def test_a_pin_leaving_arms_the_bounded_wait() -> None:
    """With a pin, a queue is never sent over the slot count, so no timer runs for it; once
    the last pin has left, its wait is bounded again."""
    pinned = {1}
    s = make(slots=2, max_wait_s=0.01, clock=asyncio.get_running_loop().time, pinned=pinned)
    r = Requests(s)
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.ask("d1", D)  # B and C hold the slots: C and D wait
    pinned.discard(1)
    s.pins_changed()  # C takes the freed slot; D waits, now with a timer
    await asyncio.sleep(0.1)
    assert r.went() == {"b1", "c1", "d1"} and s.forced == 1


async def test_a_queue_that_becomes_forceable_moves_the_timer_earlier() -> None:
    """A pin leaving makes a queue that has already waited ``max_wait_s`` forceable while the
    timer is set for a later deadline (another queue's): the timer moves to the earlier
    deadline, so that queue is sent on now rather than after up to ``max_wait_s`` more."""
    clock = Clock()
    pinned = {9}
    s = make(slots=2, quantum_s=1.0, max_wait_s=60.0, clock=clock, pinned=pinned)
    r = Requests(s)
    await r.ask("b1", B)  # the one slot left beside the pin
    await r.ask("c1", C)
    await r.ask("d1", D)  # C and D wait, not forceable while a pin is there
    clock.now += 50.0
    await r.ask("b2", B)  # B, past its quantum, drains: b2 queues, forceable 60 s from now
    clock.now += 15.0  # d1 has waited past max_wait_s
    pinned.discard(9)
    s.pins_changed()  # C takes the freed slot; D is forceable, and overdue
    await settle()
    assert r.went() == {"b1", "c1", "d1"} and s.forced == 1


async def test_an_adapter_pinned_while_queued_sends_its_queue_on_and_takes_no_slot() -> None:
    """A version whose pin waited served unpinned meanwhile, so its requests could queue.
    Pinned, they go at once (pinned adapters never wait), and it never takes one of the
    slots left to unpinned adapters."""
    pinned: set[int] = set()
    s = make(slots=3, pinned=pinned)
    r = Requests(s)
    for label, route in (("b1", B), ("c1", C), ("d1", D), ("a1", A)):
        await r.ask(label, route)
    assert "a1" not in r.went()

    pinning = start_pin(s, pinned, 1)
    await settle()
    await r.release("d1")  # room for the pin
    await asyncio.wait_for(pinning, 5)
    await settle()
    assert "a1" in r.went() and 1 not in {int(a.lora_id) for a in s._active.values()}
    await r.ask("d2", D)  # B and C hold the two unpinned slots
    await r.release("b1")
    assert "d2" in r.went() and set(s.snapshot()["active"]) == {"c", "d"}


async def test_a_cancelled_waiter_is_not_counted_as_sent_on() -> None:
    """A waiter cancelled a moment before the timer fires is still in its queue (its clean-up
    runs on the next turn of the loop): it is not a request sent on, and the adapter it
    leaves behind is forgotten."""
    clock = Clock()
    s = make(slots=1, max_wait_s=3.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    clock.now += 3.0
    b1.cancel()
    assert s.expire() == 0 and s.forced == 0
    await settle()
    assert s.snapshot() == {
        "slots": 1,
        "slots_in_use": 1,
        "active": {"a": {"inflight": 1, "draining": False}},
        "queued": {},
        "forced": 0,
    }
    assert set(s._adapters) == {1}


async def test_of_two_drains_the_later_granted_ends_first() -> None:
    """Two adapters drain for two waiting ones; a slot frees elsewhere and one waiting adapter
    takes it, so one drain is enough: the adapter that has held its slot longer keeps it."""
    clock = Clock()
    s = make(slots=3, quantum_s=1.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    clock.now += 0.5
    await r.ask("b1", B)
    await r.ask("c1", C)
    await r.ask("d1", D)
    await r.ask("e1", lora("e", 5))  # D and E wait
    clock.now += 1.0
    await r.ask("a2", A)  # both past their quantum: both drain
    await r.ask("b2", B)
    assert s.snapshot()["active"]["a"]["draining"] and s.snapshot()["active"]["b"]["draining"]
    await r.release("c1")  # D takes C's slot; E still waits
    assert "d1" in r.went() and "b2" in r.went() and "a2" not in r.went()
    assert s.snapshot()["active"]["a"]["draining"] and not s.snapshot()["active"]["b"]["draining"]


async def test_a_pin_waiting_for_room_lands_once_a_pinned_version_leaving_makes_it() -> None:
    """Room for a pin comes from a pinned version leaving as well as from an active adapter
    going idle: with steady traffic on the active ones only the first happens."""
    pinned: set[int] = {9}  # an old pinned version, about to leave the engine
    s = make(slots=4, pinned=pinned)
    tickets = [await s.turn(route, ME) for route in (A, B, C)]  # 4 slots - 1 pin
    pin = start_pin(s, pinned, 5)  # needs the others to fit 4 - 1 - 1 = 2 slots
    await settle()
    assert 5 not in pinned
    pinned.discard(9)  # AdapterSlots.remove of the old pinned version
    s.pins_changed()
    await settle()
    assert 5 in pinned  # the three others fit the 4 - 1 slots the new pin leaves
    await pin
    for ticket in tickets:
        assert ticket is not None
        ticket.release()


async def test_a_drain_for_a_queue_that_left_as_its_wait_ran_out_ends() -> None:
    """A drains for B; B's only request leaves in the instant its bounded wait sends it on.
    A must take requests again, its queued one first."""
    clock = Clock()
    s = make(slots=1, quantum_s=1.0, max_wait_s=3.0, clock=clock)
    r = Requests(s)
    await r.ask("a1", A)
    b1 = await r.ask("b1", B)
    clock.now += 1.0
    await r.ask("a2", A)  # past its quantum with B waiting: A drains, a2 queues
    assert r.went() == {"a1"}
    clock.now += 2.0
    b1.cancel()  # its client leaves as the timer fires
    s.expire()
    await settle()
    assert r.went() == {"a1", "a2"} and s.queued == 0
    await r.ask("a3", A)
    assert r.order == ["a1", "a2", "a3"]


async def test_requests_of_one_route_keep_their_order_across_a_hot_swap() -> None:
    """The route's new version (a new lora id) must not go ahead of the old version's
    requests still queued: it starts at the old version's virtual time."""
    clock = Clock()
    s = make(slots=1, quantum_s=1.0, clock=clock)
    r = Requests(s)
    new_a = Route(name="a", kind="lora", lora=LoraSpec("a", 7, "/adapters/a"))
    await r.ask("a1", A)
    await r.ask("b1", B)
    clock.now += 2  # past the quantum: A drains for B
    await r.ask("a2", A)
    await r.release("a1")  # B's turn; a2 waits
    assert r.went() == {"a1", "b1"}
    clock.now += 1
    await r.ask("a3", new_a)  # after the swap
    await r.release("b1")
    assert [label for label in r.order if label.startswith("a")][:2] == ["a1", "a2"]


async def test_the_snapshot_sums_both_versions_of_a_route() -> None:
    s = make(slots=2)
    new_a = Route(name="a", kind="lora", lora=LoraSpec("a", 7, "/adapters/a"))
    tickets = [await s.turn(A, ME), await s.turn(A, ME), await s.turn(new_a, ME)]
    assert all(t is not None for t in tickets)
    assert s.snapshot()["active"] == {"a": {"inflight": 3, "draining": False}}
    assert s.snapshot()["slots_in_use"] == 2  # each version holds a slot
