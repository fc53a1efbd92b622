"""The engine's LoRA slots as the gateway sees them: registration and residency.

``AdapterSlots.register`` is what the catalog calls for each LoRA route at start and
after each reload: load the weights into the engine (timed, counted per route), pin them
to a GPU slot when the entry says ``pinned``, and warm them with a one-token request when
it says ``preload``, so the first user request does not pay for the load.

At most ``max_loras - 1`` versions are pinned (vLLM fails a batch that needs a slot when
all are pinned). A pin with no room waits and is retried, in order, each time a pinned
version leaves the engine: when a pinned adapter's files change, its old version keeps
its pin until it drains, then the new version takes it. vLLM cannot unpin: the pin is part
of a version (``catalog.LoraIds``), so clearing it is a new version whose old, pinned one
leaves the engine; the two share one adapter copy until then.

``cpu_cache_size`` sizes the engine's CPU cache of adapters (``engine.max_cpu_loras``) when
the settings leave it out: every adapter the catalog names stays in host memory, so an
adapter whose turn comes is copied to a GPU slot, not read from disk again.

Residency comes from the engine: ``list_loras()`` (the adapters it holds, in a GPU slot or
its CPU cache) and ``lora_slots()`` (the ones in a GPU slot, as its workers report them),
kept here and refreshed after each add and remove and every few seconds, so a request
never waits on an engine round trip to learn whether its adapter is warm: ``"gpu"``,
``"cpu"`` or ``"not loaded"``. Where the workers cannot report their slots (the settings
name a ``worker_extension_cls`` of their own), it follows from vLLM's rules: it puts an
adapter in a GPU slot as it loads it (and as a batch uses it), takes one out of its slot
only to make room for another or as it leaves the engine. So while that engine has never
held more adapters than it has GPU slots, every adapter it holds is in one: ``"gpu"``.
Once it has held more, which ones are is not known: ``"loaded"``, until a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from gateway.adapters_check import weights_file
from gateway.catalog import Route, versioned_name
from gateway.embedded import EMBEDDED_DIMS, embedded_model_dir
from gateway.errors import ConfigError, GatewayError
from gateway.lora_scheduler import LoraScheduler
from gateway.metrics import GatewayMetrics
from gateway.model_dims import attention, read_config, text_config
from gateway.snapshots import SnapshotDir
from gateway.types import Engine, SamplingSpec

log = logging.getLogger(__name__)

Residency = Literal["gpu", "cpu", "loaded", "not loaded"]

PIN_REFUSED = (
    "not pinned: pins need limits.lora_scheduling: fair (vLLM batches up to max_loras adapters "
    "without counting pinned ones; the gateway's scheduler keeps the unpinned ones within the "
    "slots a pin leaves them, and a batch short of slots kills the engine)"
)

PIN_WAITING = (
    "not pinned yet: engine.max_loras - 1 adapters are pinned and one slot must stay free; it is "
    "pinned when a pinned version leaves the engine"
)

PIN_COMING = (
    "not pinned yet: more adapters run than the GPU slots a pin leaves them; it is pinned once "
    "they fit (no new adapter takes its slot meanwhile)"
)

CPU_CACHE_SHARE = 0.1  # of host memory that the adapters' CPU cache may take when sized here
MIN_GPU_SLOTS = 4  # ``engine.max_loras: auto`` never gives fewer (the gateway's fixed default before it)
GPU_SLOTS_BYTES = 1 << 30  # the memory that ``auto`` slots may take together, beyond MIN_GPU_SLOTS


def gpu_slots(adapters: int, slot_bytes: int | None, max_num_seqs: int) -> int:
    """``engine.max_loras`` for ``auto``: a slot for each adapter the catalog names and one
    more (for a new version or entry), so that every adapter can run in one batch and
    nothing is swapped; no more than a batch's sequences (``max_num_seqs``: one adapter
    each), at most ``GPU_SLOTS_BYTES`` of slots at ``slot_bytes`` each, and never fewer
    than ``MIN_GPU_SLOTS``. ``slot_bytes`` None (the model's size is unknown):
    ``MIN_GPU_SLOTS``."""
    if slot_bytes is None:
        return MIN_GPU_SLOTS
    return max(MIN_GPU_SLOTS, min(adapters + 1, max_num_seqs, GPU_SLOTS_BYTES // max(1, slot_bytes)))


def more_slots_hint(adapters: int, slot_bytes: int | None, max_num_seqs: int) -> str:
    """What gives ``adapters`` a GPU slot each, for the warning of a catalog that outgrew
    the ``auto`` slots: a restart where ``gpu_slots`` would then give each one, else the
    setting that caps it."""
    if gpu_slots(adapters, slot_bytes, max_num_seqs) >= adapters:
        return "restart the gateway to give each a slot"
    if slot_bytes is None:
        return f"auto gives {MIN_GPU_SLOTS} where the model's size is unknown: set engine.max_loras"
    if max_num_seqs < min(adapters, GPU_SLOTS_BYTES // max(1, slot_bytes)):
        return (
            f"auto gives at most engine.max_num_seqs={max_num_seqs} (a step runs one adapter per "
            "sequence): raise engine.max_num_seqs to give more"
        )
    return (
        f"auto keeps the slots within {GPU_SLOTS_BYTES >> 20} MiB (about {slot_bytes / 2**20:.0f} MiB "
        "each): set engine.max_loras to give more"
    )


def slot_bytes(config: Mapping[str, Any], max_lora_rank: int, dtype: str) -> int | None:
    """About the memory of one GPU slot: vLLM gives every slot ``max_lora_rank`` columns of
    A and B for each linear layer of the model (q, k, v, o and the MLP's, per expert),
    whichever modules the adapters target; two vocabulary-sized matrices are added for
    models whose embeddings take adapters. From the model's ``config.json`` (a multimodal
    model's ``text_config``); None when it lacks a size."""
    c, a = text_config(config), attention(config)
    if a is None:
        return None
    try:
        layers = int(c["num_hidden_layers"])
        inter = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        experts = int(c.get("num_local_experts") or c.get("num_experts") or 1)
        vocab = int(c.get("vocab_size") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    hidden, q, kv = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    attn = 2 * (hidden + q) + 2 * (hidden + kv)  # q and o, k and v
    mlp = experts * 3 * (hidden + inter)  # gate, up and down
    elements = max_lora_rank * (layers * (attn + mlp) + 2 * vocab)
    return elements * _dtype_bytes(dtype, config)


def _dtype_bytes(dtype: str, config: Mapping[str, Any]) -> int:
    """Bytes of the engine's dtype; ``auto`` is the config's, 4 where it says none (the CPU's)."""
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return 2 if dtype in ("half", "float16", "bfloat16") else 4


def model_config(model: str | None, cache_dir: Path) -> dict[str, Any] | None:
    """The model's ``config.json``: a local folder's, a Hugging Face repo's where its config
    is in the local cache, or the embedded model's (its dimensions before the first start
    has prepared it). None when none of those can be read."""
    if model is None:
        folder = embedded_model_dir(cache_dir / "models")
        return read_config(folder / "config.json") or dict(EMBEDDED_DIMS)
    if Path(model).is_dir():
        return read_config(Path(model) / "config.json")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # a name that is not a repo id, or no hub library: nothing to read
        return None
    return read_config(Path(cached)) if isinstance(cached, str) else None


def cpu_cache_size(max_loras: int, adapter_dirs: Sequence[Path], host_bytes: int | None) -> int:
    """``engine.max_cpu_loras`` when the settings leave it out: room for every adapter the
    catalog names, plus ``max_loras`` for new versions and entries that come later; at most
    ``CPU_CACHE_SHARE`` of ``host_bytes`` by the adapters' mean file size; never fewer than
    ``max_loras`` (vLLM's own default, which re-reads an evicted adapter from disk)."""
    wanted = len(adapter_dirs) + max_loras
    sizes = [adapter_bytes(d) for d in adapter_dirs]
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    if host_bytes and mean > 0:
        wanted = min(wanted, int(host_bytes * CPU_CACHE_SHARE // mean))
    return max(max_loras, wanted)


def adapter_bytes(directory: Path) -> int:
    """The size of the adapter's weights, the one file vLLM loads (0 when there is none or it
    cannot be read): a trainer's checkpoint beside it (``optimizer.pt``) is not the adapter."""
    try:
        return weights_file(directory, directory.name).stat().st_size
    except (ConfigError, OSError):
        return 0


def host_memory_bytes() -> int | None:
    """Physical memory, or the container's limit where one is set (cgroup v2)."""
    try:
        total: int | None = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    if limit.isdigit():
        return min(total, int(limit)) if total else int(limit)
    return total


class AdapterSlots:
    def __init__(
        self, engine: Engine, metrics: GatewayMetrics, max_loras: int, snapshots: SnapshotDir | None = None
    ) -> None:
        self.engine = engine
        self.snapshots = snapshots  # adapter copies under it leave with their version
        self.metrics = metrics
        self.max_loras = max_loras
        self.registered: set[int] = set()  # ids added by us and not removed since
        self.pinned: set[int] = set()
        # Pins refused for want of a free slot, in order: retried when a pinned version leaves.
        self.pins_waiting: dict[int, Route] = {}
        # Pins waiting, in the background, for the adapters running beside them to fit the
        # slots left (``LoraScheduler.room_for_pin``): a reload does not wait for them.
        self.pinning: dict[int, asyncio.Task[None]] = {}
        # Pins the engine refused in the background, with its reason: the route's card says
        # so until a reload tries again.
        self.pins_failed: dict[int, str] = {}
        self._pinning_now: set[int] = set()  # pins asked of the engine, not answered yet
        # The engine's list_loras() and lora_slots() (None: it cannot say) as last read;
        # ``resident`` adds the adapters that requests have loaded since (cold starts).
        self.held: set[int] = set()
        self.in_slots: set[int] | None = None
        self.resident: set[int] = set()
        # Whether the engine has held more adapters than GPU slots (as seen here, which
        # may count one it already evicted: never fewer): residency then stops saying "gpu".
        self.slots_overflowed = False
        self.preloaded: set[int] = set()  # versions warmed since they were added
        self.paths: dict[int, Path] = {}
        # Warm-ups take their turn like any LoRA request: one sent past it could put more
        # adapters in a batch than vLLM has free GPU slots (with a pin, that kills it).
        # None with ``limits.lora_scheduling: off``: pins are then refused (logged), as
        # nothing would keep unpinned adapters within the slots a pin leaves them.
        self.scheduler: LoraScheduler | None = None

    @property
    def may_pin(self) -> bool:
        return self.scheduler is not None

    async def register(self, route: Route) -> None:
        """Add, pin and warm one route's adapter; an id already registered is not loaded
        again. Raises the engine's ``GatewayError`` if it refuses the adapter."""
        lora = route.lora
        assert lora is not None
        fresh = lora.lora_id not in self.registered
        if fresh:
            t0 = time.perf_counter()
            try:
                await self.engine.add_lora(lora)
            except GatewayError:
                self._discard_copy(Path(lora.path))  # refused: no version will remove it
                raise
            self.metrics.adapter_loaded(route.name, time.perf_counter() - t0)
            self.registered.add(lora.lora_id)
            self.paths[lora.lora_id] = Path(lora.path)
            await self._after_load(lora.lora_id)
        try:
            # Pinned first: once pinned, its warm-up needs no turn.
            if route.pinned and lora.lora_id not in self.pinned:
                await self._pin(route)
            # Also a version already loaded whose entry now asks for preload (an edit that
            # sets ``preload: true`` keeps the files, so the version and its id stay).
            if route.preload and lora.lora_id not in self.preloaded and await self._preload(route):
                self.preloaded.add(lora.lora_id)
        except GatewayError:
            if fresh:  # the route is rejected: its weights must not stay behind
                await self.remove(lora.lora_id)
            raise

    async def _pin(self, route: Route) -> None:
        """Pin the route's version, or leave it waiting for a slot when ``max_loras - 1`` are
        pinned: during a hot swap the old pinned version holds its slot until it drains."""
        assert route.lora is not None
        if self.scheduler is None:
            log.warning("adapter %s %s", route.name, PIN_REFUSED)
            return
        lora_id = route.lora.lora_id
        if lora_id in self.pinning:
            return  # on its way
        # vLLM fails a batch that needs a slot when every GPU slot is pinned: keep one free.
        if not self._room_to_pin():
            waiting = route.lora.lora_id in self.pins_waiting
            self.pins_waiting[route.lora.lora_id] = route  # the current entry, pinned when room frees
            if waiting:
                return  # said when it began to wait, not again at every reload
            log.warning(
                "adapter %s not pinned yet: %d of engine.max_loras=%d slots are pinned and one must "
                "stay free; it is pinned when a pinned version leaves the engine",
                route.name,
                len(self.pinned),
                self.max_loras,
            )
            return
        self.pins_waiting.pop(lora_id, None)  # not waiting for a pin to leave any more
        self.pins_failed.pop(lora_id, None)
        if self.scheduler.room_to_pin_now(lora_id):
            await self._pin_in_room(route)
        else:
            # More adapters run than the slots a pin leaves them: pinned once they drain,
            # meanwhile no new adapter takes the slot it needs. Not awaited here: a reload
            # (and the catalog's lock) would wait for streams that may run for minutes.
            log.info(
                "adapter %s is pinned once the adapters running beside it fit the slots left", route.name
            )
            self.pinning[lora_id] = asyncio.create_task(self._pin_when_room(route))

    async def _pin_in_room(self, route: Route) -> None:
        assert route.lora is not None and self.scheduler is not None
        lora_id = route.lora.lora_id
        self._pinning_now.add(lora_id)  # counted by ``_room_to_pin`` while the engine answers
        try:
            async with self.scheduler.room_for_pin(lora_id):
                await self.engine.pin_lora(lora_id)
                self.pinned.add(lora_id)
        finally:
            self._pinning_now.discard(lora_id)
        log.info("adapter %s pinned to a GPU slot", route.name)

    async def _pin_when_room(self, route: Route) -> None:
        """The pin ``_pin`` left waiting for room; refused, it leaves its room to the pins
        waiting for one (a cancelled one leaves it through ``remove``)."""
        assert route.lora is not None
        lora_id = route.lora.lora_id
        try:
            await self._pin_in_room(route)
        except GatewayError as exc:
            self.pins_failed[lora_id] = exc.message
            log.error("adapter %s could not be pinned: %s", route.name, exc.message)
        finally:
            self.pinning.pop(lora_id, None)
        await self._pin_next_waiting()

    def close(self) -> None:
        """Stop the pins still waiting for room (the engine stops)."""
        for task in self.pinning.values():
            task.cancel()

    def _room_to_pin(self) -> bool:
        return len(self.pinned | self._pinning_now | self.pinning.keys()) + 1 < self.max_loras

    async def _pin_next_waiting(self) -> None:
        """A pin left (a pinned version, or one on its way that was removed or refused): the
        waiting pins take the room, first come first. A failure is logged, not raised: it
        must not stop the removal that called it."""
        while self.pins_waiting and self._room_to_pin():
            route = next(iter(self.pins_waiting.values()))
            assert route.lora is not None
            # Out of the queue before the awaits: should the room go meanwhile, ``_pin`` puts
            # it back, and it must stay there (first, as it was).
            lora_id = route.lora.lora_id
            del self.pins_waiting[lora_id]
            try:
                # While it waited, the engine may have evicted it from its CPU cache (LRU,
                # ``max_cpu_loras``), and vLLM refuses to pin an adapter it does not hold: add
                # it again first (a no-op when it is still there).
                await self.engine.add_lora(route.lora)
                await self._after_load(route.lora.lora_id)
                await self._pin(route)  # pinned, or on its way: no longer waiting
            except GatewayError as exc:
                self.pins_failed[lora_id] = exc.message
                log.error("adapter %s could not be pinned: %s", route.name, exc.message)
            if lora_id in self.pins_waiting:
                self.pins_waiting = {lora_id: self.pins_waiting.pop(lora_id), **self.pins_waiting}

    async def _preload(self, route: Route) -> bool:
        """One token on the adapter: its weights and kernels are warm before a user asks.
        The warm-up runs under ``versioned_name``, never the route name, so it never shares
        a name with another version in one batch. It waits for its turn at most the bounded
        wait (``max_adapter_wait_s``; with a pin there is none, and the streams holding the
        slots may run for minutes while the reload holds the catalog's lock): False when it
        was left out, and a later reload warms it."""
        assert route.lora is not None and route.digest is not None
        lora = replace(route.lora, name=versioned_name(route))
        params = self.engine.prepare(SamplingSpec(max_tokens=1, temperature=0.0))
        prompt = self.engine.tokenizer.encode("Hello")
        t0 = time.perf_counter()
        ticket = None
        if self.scheduler is not None:
            # A second more than the bound: where it holds (no pin), it sends the warm-up.
            patience = self.scheduler.max_wait_s + 1.0
            try:
                ticket = await asyncio.wait_for(self.scheduler.turn(route, observe=False), patience)
            except TimeoutError:
                log.info(
                    "adapter %s loaded, not warmed: the GPU slots stayed busy for %.0f s (a later "
                    "reload warms it)",
                    route.name,
                    patience,
                )
                return False
        try:
            request_id = f"preload-{route.name}-{lora.lora_id}"
            async for _ in self.engine.generate(prompt, params, request_id, lora):
                pass
        finally:
            if ticket is not None:
                ticket.release()
        log.info("adapter %s preloaded (%.0f ms)", route.name, (time.perf_counter() - t0) * 1000)
        return True

    async def remove(self, lora_id: int) -> None:
        pinning = self.pinning.pop(lora_id, None)
        if pinning is not None:  # never pinned now: it leaves
            pinning.cancel()
        await self.engine.remove_lora(lora_id)
        self.registered.discard(lora_id)
        self.preloaded.discard(lora_id)
        self.pins_waiting.pop(lora_id, None)
        self.pins_failed.pop(lora_id, None)
        was_pinned = lora_id in self.pinned
        self.pinned.discard(lora_id)
        self.resident.discard(lora_id)
        self.held.discard(lora_id)
        if self.in_slots is not None:
            self.in_slots.discard(lora_id)
        path = self.paths.pop(lora_id, None)
        if path is not None:
            self._discard_copy(path)
        if self.scheduler is not None:
            self.scheduler.removed(lora_id)
            if was_pinned:  # its slot is free for unpinned adapters again
                self.scheduler.pins_changed()
        if was_pinned or pinning is not None:
            await self._pin_next_waiting()

    def _discard_copy(self, path: Path) -> None:
        """Remove an adapter copy no registered version reads (a pinned and an unpinned
        version of the same files share one)."""
        if self.snapshots is not None and path not in self.paths.values():
            self.snapshots.discard(path)

    async def refresh(self) -> None:
        self.held = set(await self.engine.list_loras())
        self.in_slots = await self.engine.lora_slots()
        self._holds(set(self.held))

    def _holds(self, resident: set[int]) -> None:
        self.resident = resident
        if len(resident) > self.max_loras and not self.slots_overflowed:
            self.slots_overflowed = True
            if self.in_slots is None:
                log.info(
                    "the engine holds %d adapters for %d GPU slots and its workers do not report "
                    "their slots: residency says 'loaded' from now on",
                    len(resident),
                    self.max_loras,
                )

    async def _after_load(self, lora_id: int) -> None:
        """Read the engine's adapters again after a load: with more adapters than
        ``max_cpu_loras`` the load evicted the least recently used, which would otherwise
        read as loaded (and its next request as warm) until the next periodic refresh."""
        with contextlib.suppress(GatewayError):
            await self.refresh()
        self._holds(self.resident | {lora_id})  # just added, whatever the read said

    def residency(self, route: Route) -> Residency | None:
        """As last read from the engine: what requests loaded since shows at the next read
        (at most 5 s later), so a burst of cold starts never shows more adapters in GPU
        slots than there are."""
        if route.lora is None:
            return None
        lora_id = route.lora.lora_id
        if lora_id in self.pinned:
            return "gpu"
        if self.in_slots is not None:
            if lora_id in self.in_slots:
                return "gpu"
            return "cpu" if lora_id in self.held else "not loaded"
        if lora_id not in self.resident:
            return "not loaded"
        return "loaded" if self.slots_overflowed else "gpu"

    def start_state(self, route: Route) -> Literal["cold", "warm"] | None:
        """Whether a request on ``route`` finds its adapter in the engine (warm) or makes the
        engine load it (cold); after a cold start the adapter counts as loaded."""
        if route.lora is None:
            return None
        if route.lora.lora_id in self.resident:
            return "warm"
        self._holds(self.resident | {route.lora.lora_id})
        return "cold"
