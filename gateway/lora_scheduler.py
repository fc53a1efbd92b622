"""Adapter-aware admission: the order in which LoRA requests reach the engine.

vLLM runs at most ``max_loras`` distinct adapters in one batch. Requests whose adapter
has no slot wait in its queue, and a slot frees only when every running request of an
adapter has finished; with many adapters in random order a few trickling requests keep
slots busy while the rest of the batch waits. The gateway sees every request first, so
it hands the engine work for at most ``slots`` adapters at a time:

- An adapter is *active* while the gateway has requests of it in the engine. A request
  for an active adapter goes at once; one for an inactive adapter goes at once if a slot
  is free, and otherwise waits in its adapter's queue (first in, first out).
- When an active adapter's last request ends its slot frees, and the waiting adapter
  that ranks first gets it with *all* its queued requests at once, so they share batches.
- The choice is weighted fair queuing over *turns* (a turn: an adapter gets a slot with
  its queue), in two levels. Each turn advances its route's virtual time by 1 / weight,
  and that of each API key with a request in it by 1 / the key's weight; a flow that was
  idle starts again from the virtual clock (no banked credit), and once nothing is active
  or waiting every flow starts level (no debt from an earlier burst). The slot goes to the key
  with the lowest virtual time among those waiting (the oldest request breaks ties), and
  among that key's waiting requests to the route with the lowest (again the oldest
  first). With equal weights and steady demand this is first come, first served over
  adapters, as vLLM's own choice. Lower ``priority`` (as in vLLM) comes before both.
  Charging turns rather than requests keeps a busy adapter's large queue from pushing
  its next turn back: its requests share batches, which is the point.
- Quantum: an adapter that has held its slot for ``quantum_s`` while others wait (or
  while more adapters are active than there are slots) takes no new requests (they
  queue), so it drains and its slot moves on. Once nobody needs its slot any more (the
  adapters it drained for got slots, or left), it takes requests again, those it queued
  meanwhile first.
- Bounded wait: an adapter whose oldest queued request has waited ``max_wait_s`` gets
  its queue sent to the engine anyway, over the slot count; vLLM then schedules it.
  Correctness never depends on this gate, only the order of work does. Not while an
  adapter is pinned: vLLM would then batch more unpinned adapters than it has free GPU
  slots, which kills the engine; the quantum still moves the slots on.

Routes on the same adapter files share one engine LoRA id, so here one adapter: one
queue, one slot and one virtual time at the route level for all of them, charged at the
highest weight among the routes that used it since it was last idle (a turn serves them
all; the highest gives each route at least its own share). Waits, timeouts and
``snapshot`` are booked under each request's own route. A route's new version (a hot swap)
starts at the virtual time of the version it replaces, so the route's requests keep their
order across the swap.

Pinned adapters (``AdapterSlots.pinned``) hold GPU slots for good: their requests never
wait and they count against ``slots``, never also as active (one pinned while active gives
its slot back). Base-model and preset requests never wait.
Everything here runs on the event loop and costs a few dict operations per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from gateway.catalog import Route
from gateway.metrics import GatewayMetrics


class Caller(Protocol):
    """The API key a request came with (``middleware.Principal`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def priority(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Anonymous:
    """The caller when auth is off."""

    name: str = ""
    weight: float = 1.0
    priority: int = 0


ANONYMOUS = Anonymous()


class Ticket:
    """A request's place in the engine; ``release`` when its stream ends (idempotent)."""

    __slots__ = ("_adapter", "_route", "_scheduler")

    def __init__(self, scheduler: LoraScheduler, adapter: _Adapter, route: str) -> None:
        self._scheduler: LoraScheduler | None = scheduler
        self._adapter = adapter
        self._route = route

    def release(self) -> None:
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler._release(self._adapter, self._route)


@dataclass(slots=True)
class _Waiter:
    route: str
    priority: int
    key: str
    key_weight: float
    arrived: float
    future: asyncio.Future[Ticket]
    observed: bool = True  # in the wait metrics (a user request; not a preload's warm-up)


@dataclass(slots=True)
class _Adapter:
    lora_id: int
    weights: dict[str, float] = field(default_factory=dict)  # route -> weight, of the routes on it
    inflight: int = 0
    routes: dict[str, int] = field(default_factory=dict)  # route -> its requests in the engine
    queue: deque[_Waiter] = field(default_factory=deque)
    granted_at: float | None = None  # set while active
    draining: bool = False

    @property
    def weight(self) -> float:
        return max(self.weights.values())


class LoraScheduler:
    def __init__(
        self,
        slots: int,
        *,
        quantum_s: float,
        max_wait_s: float,
        pinned: Collection[int] = frozenset(),
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = slots
        self.quantum_s = quantum_s
        self.max_wait_s = max_wait_s
        self._pinned = pinned  # live: AdapterSlots adds and removes
        self._metrics = metrics
        self._clock = clock
        self._adapters: dict[int, _Adapter] = {}
        self._active: dict[int, _Adapter] = {}  # in insertion (grant) order
        self._waiting: dict[int, _Adapter] = {}  # adapters with a queue
        self._share = _FairShare()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.queued = 0
        self.forced = 0  # requests sent on after max_wait_s
        self._pins_coming = 0  # pins waiting for room (``room_for_pin``): slots already taken
        self._room: list[asyncio.Future[None]] = []

    # -- per request ------------------------------------------------------------------
    async def turn(
        self, route: Route, caller: Caller | None = None, *, observe: bool = True
    ) -> Ticket | None:
        """Wait for ``route``'s adapter to have the engine's attention; None for a route
        without an adapter (never waits). Release the ticket when the stream ends.
        ``observe`` False keeps the wait out of the metrics (a preload's warm-up: no user
        waited, and its route is not in the metrics' labels until its table is live)."""
        if route.lora is None:
            return None
        caller = caller or ANONYMOUS
        adapter = self._adapters.get(route.lora.lora_id)
        if adapter is None:
            # A route's new version (its files changed) takes over the turns of the versions
            # before it, so its requests do not go ahead of theirs still queued.
            before = [a.lora_id for a in self._adapters.values() if route.name in a.weights]
            adapter = self._adapters[route.lora.lora_id] = _Adapter(route.lora.lora_id)
            self._share.inherit(adapter.lora_id, before)
        adapter.weights[route.name] = route.weight  # a reload may change it
        if self._may_enter(adapter, caller):
            return self._enter(adapter, route.name, 0.0 if observe else None)
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(
            route.name, caller.priority, caller.name, caller.weight, self._clock(), future, observe
        )
        adapter.queue.append(waiter)
        self._waiting[adapter.lora_id] = adapter
        self._set_queued(self.queued + 1)
        self._arm()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._cancel(adapter, waiter)
            raise

    def _may_enter(self, adapter: _Adapter, caller: Caller) -> bool:
        if adapter.lora_id in self._pinned:
            self._unslot(adapter)
            return True
        if adapter.granted_at is not None:  # active
            if adapter.draining:
                self._undrain()  # those it drained for may have slots by now
                return not adapter.draining
            if self._clock() - adapter.granted_at >= self.quantum_s and self._short_of_draining():
                adapter.draining = True
                return False
            return True
        if adapter.queue or len(self._active) >= self._capacity():
            return False
        self._share.charge(adapter, {caller.name: caller.weight})
        self._activate(adapter)
        return True

    def _enter(self, adapter: _Adapter, route: str, waited: float | None) -> Ticket:
        """``waited`` None: not observed (``turn``'s ``observe``)."""
        adapter.inflight += 1
        adapter.routes[route] = adapter.routes.get(route, 0) + 1
        if waited is not None:
            self._observe_wait(route, waited)
        return Ticket(self, adapter, route)

    def _short_of_draining(self, spare: int = 0) -> bool:
        """Whether fewer adapters drain than should: one per waiting adapter, plus one per
        active adapter over the slot count (sent on by a timeout). ``spare``: as if that
        many of the draining ones stopped."""
        waiting = sum(1 for a in self._waiting.values() if a.granted_at is None)
        over = len(self._active) - self._capacity()
        return waiting + max(0, over) > sum(1 for a in self._active.values() if a.draining) - spare

    def _undrain(self) -> None:
        """Draining adapters that no longer need to (those they drained for got a slot, or
        left) take requests again, the ones they queued meanwhile first; the last granted
        first, so those that have held their slots longest go on draining. A draining adapter
        still has requests in the engine, so handing its queue over keeps it active."""
        for adapter in reversed(list(self._active.values())):
            if adapter.draining and not self._short_of_draining(spare=1):
                adapter.draining = False
                if adapter.queue:
                    self._hand_over(adapter)

    def _capacity(self, more_pins: int = 0) -> int:
        return max(1, self.slots - len(self._pinned) - self._pins_coming - more_pins)

    def _others_fit(self, lora_id: int, more_pins: int = 0) -> bool:
        """Whether the active adapters other than ``lora_id`` fit the slots the pins leave."""
        return sum(1 for a in self._active.values() if a.lora_id != lora_id) <= self._capacity(more_pins)

    def room_to_pin_now(self, lora_id: int) -> bool:
        """Whether ``room_for_pin`` would enter at once (its own pin held as coming)."""
        return self._others_fit(lora_id, more_pins=1)

    @contextlib.asynccontextmanager
    async def room_for_pin(self, lora_id: int) -> AsyncIterator[None]:
        """Hold a slot for a pin about to be made, and wait until the other active adapters
        fit the slots left. vLLM batches up to ``max_loras`` adapters without counting
        pinned ones: a pin made while ``max_loras`` unpinned adapters run leaves a batch
        needing more GPU slots than are free, which kills the engine. Pin inside the block,
        and add the id to ``pinned`` there."""
        self._pins_coming += 1
        try:
            while not self._others_fit(lora_id):
                room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._room.append(room)
                await room
            yield
        finally:
            self._pins_coming -= 1
            self.pins_changed()

    def pins_changed(self) -> None:
        """``pinned`` gained or lost ids (``AdapterSlots`` calls this after a removal; a pin
        made in ``room_for_pin`` does it on leaving): a newly pinned adapter gives back its
        slot and sends its queue on, freed slots go to waiting adapters, and queues that may
        be forced again get the timer."""
        for lora_id in list(self._pinned):
            adapter = self._adapters.get(lora_id)
            if adapter is not None:
                self._unslot(adapter)
        self._wake_pins()  # a pinned version that left may have made the room one waits for
        self._fill()
        self._arm()

    def removed(self, lora_id: int) -> None:
        """The engine dropped this adapter version (``AdapterSlots.remove``, once drained);
        its id never comes back, so its turns go: a gateway that is never idle would keep
        them for every version a hot swap ever served."""
        self._share.forget(lora_id)

    def _activate(self, adapter: _Adapter) -> None:
        adapter.granted_at = self._clock()
        adapter.draining = False
        self._active[adapter.lora_id] = adapter

    def _deactivate(self, adapter: _Adapter) -> None:
        adapter.granted_at = None
        adapter.draining = False
        del self._active[adapter.lora_id]
        self._level_if_idle()
        self._wake_pins()

    def _wake_pins(self) -> None:
        """The pins waiting in ``room_for_pin`` look again whether the others fit."""
        rooms, self._room = self._room, []
        for room in rooms:
            if not room.done():
                room.set_result(None)

    def _unslot(self, adapter: _Adapter) -> None:
        """A pinned adapter needs none of ``slots``. One pinned while it was active (a reload
        pinned it, or its pin waited for a slot) gives its slot back at once, or it would
        count twice (in ``_active`` and in ``_capacity``) for as long as its traffic lasts.
        Requests it had queued go on with it rather than wait out ``max_wait_s``."""
        if adapter.queue:
            self._hand_over(adapter)
        if adapter.granted_at is not None:
            self._deactivate(adapter)
            self._fill()

    # -- slots freeing ----------------------------------------------------------------
    def _release(self, adapter: _Adapter, route: str) -> None:
        adapter.inflight -= 1
        adapter.routes[route] -= 1
        if not adapter.routes[route]:
            del adapter.routes[route]
        if adapter.inflight > 0:
            return
        if adapter.granted_at is not None:
            self._deactivate(adapter)
        if not adapter.queue:
            self._forget(adapter)
        self._fill()

    def _fill(self) -> None:
        """Give free slots to the best-ranked waiting adapters."""
        while len(self._active) < self._capacity():
            candidates = [
                a for a in self._waiting.values() if a.granted_at is None and a.lora_id not in self._pinned
            ]
            if not candidates:
                break
            best = self._share.choose(candidates)
            self._activate(best)
            self._hand_over(best)
        self._undrain()

    def _hand_over(self, adapter: _Adapter) -> None:
        """All of the adapter's queued requests go to the engine together."""
        now = self._clock()
        self._share.charge(adapter, {w.key: w.key_weight for w in adapter.queue})
        waiters, adapter.queue = adapter.queue, deque()
        del self._waiting[adapter.lora_id]
        self._set_queued(self.queued - len(waiters))
        for waiter in waiters:
            if waiter.future.done():  # cancelled; _cancel is on its way
                continue
            waited = now - waiter.arrived if waiter.observed else None
            waiter.future.set_result(self._enter(adapter, waiter.route, waited))
        if adapter.inflight == 0 and adapter.granted_at is not None:  # all had left
            self._deactivate(adapter)
            self._forget(adapter)

    def _forget(self, adapter: _Adapter) -> None:
        """Drop an adapter with nothing in the engine or queued (a later request starts a fresh
        one, with only its own routes' weights); not one a newer entry replaced."""
        if self._adapters.get(adapter.lora_id) is adapter:
            del self._adapters[adapter.lora_id]

    def _cancel(self, adapter: _Adapter, waiter: _Waiter) -> None:
        """The waiting request left (disconnect, error): take it out of the queue, or give
        back the ticket it was handed as it left."""
        if waiter.future.done() and not waiter.future.cancelled():
            waiter.future.result().release()
            return
        if waiter in adapter.queue:
            adapter.queue.remove(waiter)
            self._set_queued(self.queued - 1)
            if not adapter.queue:
                del self._waiting[adapter.lora_id]
                if adapter.inflight == 0 and adapter.granted_at is None:
                    self._forget(adapter)
                self._level_if_idle()
                self._undrain()  # one it drained for may have been this one

    def _level_if_idle(self) -> None:
        """Nothing active, nothing waiting: the contention is over, and every route and key
        starts the next one level (turns from before the gap are not charged again)."""
        if not self._active and not self._waiting:
            self._share.level()

    # -- bounded wait -----------------------------------------------------------------
    def expire(self) -> int:
        """Send on the queues whose oldest request has waited ``max_wait_s``; returns how
        many requests went. Runs from a timer; tests call it after moving the clock."""
        now = self._clock()
        late = [
            a
            for a in self._waiting.values()
            if now - a.queue[0].arrived >= self.max_wait_s and self._may_force(a)
        ]
        sent = 0
        for adapter in late:
            live = [w for w in adapter.queue if not w.future.done()]  # not those leaving (cancelled)
            routes = Counter(w.route for w in live if w.observed)
            sent += len(live)
            if adapter.granted_at is None:
                self._activate(adapter)  # over the slot count: vLLM queues it
            self._hand_over(adapter)
            if self._metrics is not None:
                for route, count in routes.items():
                    self._metrics.adapter_wait_timeouts.labels(self._metrics.route_label(route)).inc(count)
        self.forced += sent
        # A queue whose requests had all left went on and off at once: those draining for
        # it may take requests again, and its slot is free.
        self._fill()
        self._arm()
        return sent

    def _may_force(self, adapter: _Adapter) -> bool:
        """Whether the bounded wait may send this adapter's queue on. Over the slot count only
        while nothing is pinned: vLLM batches up to ``max_loras`` adapters without counting
        pinned ones, and a batch with more unpinned adapters than free GPU slots evicts one of
        its own adapters and kills the engine (``KeyError`` in ``convert_mapping``). With pins,
        a waiting adapter gets a slot when an active one drains (the quantum sees to it)."""
        return adapter.granted_at is not None or not (self._pinned or self._pins_coming)

    def _arm(self) -> None:
        """One timer, for the earliest deadline among the queue heads that may be forced."""
        heads = [a.queue[0].arrived for a in self._waiting.values() if self._may_force(a)]
        if not heads:
            return
        deadline = min(heads) + self.max_wait_s
        if self._timer is not None and not self._timer.cancelled() and self._timer_at <= deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - self._clock()), self._on_timer
        )

    def _on_timer(self) -> None:
        self._timer = None
        self.expire()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- observation ------------------------------------------------------------------
    def _observe_wait(self, route: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.adapter_wait.labels(self._metrics.route_label(route)).observe(seconds)

    def _set_queued(self, value: int) -> None:
        self.queued = value
        if self._metrics is not None:
            self._metrics.adapter_queued.set(value)

    def snapshot(self) -> dict[str, object]:
        """For ``/admin/status``, by route: requests of active adapters in the engine, queued
        requests, and requests sent on by timeout."""
        inflight: Counter[str] = Counter()
        draining: set[str] = set()
        for a in self._active.values():  # two versions of a route during a hot swap: summed
            for route, count in a.routes.items():
                inflight[route] += count
                if a.draining:
                    draining.add(route)
        return {
            "slots": self._capacity(),
            # adapter versions holding them: two for one route in ``active`` during a hot swap
            "slots_in_use": len(self._active),
            "active": {
                route: {"inflight": count, "draining": route in draining} for route, count in inflight.items()
            },
            "queued": self.queued_routes(),
            "forced": self.forced,
        }

    def queued_routes(self) -> Counter[str]:
        """Route -> its requests waiting here for their adapter's turn."""
        return Counter(w.route for a in self._waiting.values() for w in a.queue)


class _FairShare:
    """Virtual times per route and per key, in turns / weight (see the module docstring).
    The route level is kept per adapter (lora id): the routes sharing one take turns as one."""

    def __init__(self) -> None:
        self._routes: dict[int, float] = {}
        self._keys: dict[str, float] = {}
        self._route_clock = 0.0  # the virtual time of the last flow served, per level
        self._key_clock = 0.0

    def level(self) -> None:
        """Forget all turns: at the end of a busy period every flow is level again (as in
        start-time fair queuing, where the virtual clock then moves past every finish tag)."""
        self._routes.clear()
        self._keys.clear()
        self._route_clock = self._key_clock = 0.0

    def forget(self, lora_id: int) -> None:
        self._routes.pop(lora_id, None)

    def inherit(self, lora_id: int, before: list[int]) -> None:
        """``lora_id`` starts where the latest of ``before`` is (an equal time: the oldest
        request goes first)."""
        times = [self._routes[b] for b in before if b in self._routes]
        if times:
            self._routes[lora_id] = max(self._routes.get(lora_id, 0.0), *times)

    def _route(self, adapter: _Adapter) -> float:
        return max(self._routes.get(adapter.lora_id, 0.0), self._route_clock)

    def _key(self, key: str) -> float:
        return max(self._keys.get(key, 0.0), self._key_clock)

    def choose(self, candidates: list[_Adapter]) -> _Adapter:
        first = min(
            (w for a in candidates for w in a.queue), key=lambda w: (w.priority, self._key(w.key), w.arrived)
        )
        adapter, _ = min(
            (
                (a, w)
                for a in candidates
                for w in a.queue
                if w.priority == first.priority and w.key == first.key
            ),
            key=lambda pair: (self._route(pair[0]), pair[1].arrived),
        )
        return adapter

    def charge(self, adapter: _Adapter, keys: dict[str, float]) -> None:
        """One turn for the adapter's route and for each of ``keys`` (name -> weight), the
        keys with a request in it. The clocks move to where the served flows were."""
        start = self._route(adapter)
        self._route_clock = start
        self._routes[adapter.lora_id] = start + 1.0 / adapter.weight
        if not keys:
            return
        starts = {key: self._key(key) for key in keys}
        self._key_clock = min(starts.values())
        for key, weight in keys.items():
            self._keys[key] = starts[key] + 1.0 / weight
