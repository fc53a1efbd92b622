"""``Gateway``: the app's state, built once per app and read by every handler as
``request.app.state.gateway``: settings, engine, catalog, service, admission, metrics,
the LoRA scheduler.

It also runs what lives as long as the app: the start (engine, then catalog and its
adapters), the catalog watcher, and the engine supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gateway.adapter_slots import (
    MIN_GPU_SLOTS,
    AdapterSlots,
    cpu_cache_size,
    gpu_slots,
    host_memory_bytes,
    model_config,
    more_slots_hint,
    slot_bytes,
)
from gateway.adapters_check import ModelShapes, model_shapes
from gateway.catalog import Catalog, Lease, LoraIds, RoutingTable, adapter_dirs, check_file, load_table
from gateway.embedded import EMBEDDED_NAME
from gateway.engine import EngineManager
from gateway.errors import ConfigError, EngineUnavailable, GatewayError
from gateway.lora_scheduler import LoraScheduler
from gateway.metrics import GatewayMetrics
from gateway.middleware import Admission, Principal
from gateway.service import ChatService
from gateway.settings import GatewaySettings, check_model_path
from gateway.snapshots import SnapshotDir
from gateway.store import ResponseStore
from gateway.types import Engine
from gateway.watcher import CatalogWatcher

log = logging.getLogger(__name__)

WATCHER_RETRY_S = 5.0  # a catalog watcher that failed starts again after this long


class Gateway:
    def __init__(self, settings: GatewaySettings, engine: Engine | None = None) -> None:
        self._auto_slots = settings.engine.max_loras == "auto"  # sized once, here, to the catalog
        settings = self.settings = with_adapter_slots(settings)
        self.engine: Engine = engine or EngineManager(settings.engine, settings.cache_dir)
        self.catalog: Catalog | None = None
        self.started = time.time()
        self.startup_error: str | None = None
        bound = settings.limits.max_inflight or 4 * settings.engine.max_num_seqs
        self.admission = Admission(bound, settings.limits.retry_after_s)
        self.metrics = GatewayMetrics()
        stored = settings.responses
        self.responses = ResponseStore(
            stored.resolved_path(settings.cache_dir),
            stored.ttl_s,
            max_bytes=stored.max_bytes,
            max_bytes_per_key=stored.max_bytes_per_key,
        )
        self.adapters = AdapterSlots(self.engine, self.metrics, settings.engine.gpu_slots)
        self.scheduler = self.adapters.scheduler = lora_scheduler(
            settings, self.adapters.pinned, self.metrics
        )
        self.service = ChatService(self.engine, settings.limits, self.scheduler)
        self.reload_now = asyncio.Event()  # set by SIGHUP: reload even if no file changed
        self._stopping: asyncio.Future[GatewayError] | None = None  # ``stop_requests``
        self.exit_code = 0
        self._model_shapes: ModelShapes | None = None
        self.snapshots: SnapshotDir | None = None  # the adapter copies the engine loads
        self._unknown_key_routes: dict[str, frozenset[str]] = {}  # warned of: ``_routes_changed``
        self._adapters_over_slots = 0  # adapters last warned of (``_slots_outgrown``)
        self._pinned_said: frozenset[str] = frozenset()  # ``_pins_unbound``
        # Set by whoever runs the server (the CLI): ask it to stop. The app calls it when
        # the engine dies, so a supervisor restarts the process.
        self.request_exit: Callable[[], None] = lambda: None

    # -- life cycle -------------------------------------------------------------------
    async def run(self) -> None:
        """Start, then watch the catalog and the engine until cancelled. A failed start
        ends the process (status 2 for a setting, as the CLI's own errors; 1 for an engine
        that could not start), as engine death does: a process left answering 503 would
        never be restarted by compose or a supervisor that only watches the exit."""
        try:
            await self.start()
        except (ConfigError, GatewayError) as exc:
            self.exit_code = 2 if isinstance(exc, ConfigError) else 1
            self.request_exit()
            return
        await asyncio.gather(self.watch_catalog(), self.watch_engine(), self.watch_residency())

    async def start(self) -> None:
        try:
            await self.responses.open()  # before the engine's minutes: a bad path fails at once
            check_file(self.settings.catalog)  # so does a catalog that cannot be read at all
            check_model_path(self.settings.engine.model)  # and a model folder that is not there
            self.snapshots = self.adapters.snapshots = snapshot_dir(self.settings.cache_dir)
            await self.engine.start()
            await self.service.measure_tokenizer()
            self._model_shapes = self._read_model_shapes()
            catalog = Catalog(self.build_table, self.adapters.remove, self.adapters.register)
            await catalog.load_adapters()
            self._routes_changed(catalog.table)
            self.catalog = catalog  # /ready and requests: only once its adapters are loaded
            freeze_startup_heap()
        except (ConfigError, GatewayError) as exc:
            self.startup_error = str(exc)
            log.error("startup failed: %s", exc)
            raise
        except Exception as exc:  # vLLM refusing its arguments, a worker dying while it builds
            # Mostly a setting vLLM refuses (its message names it): one line, not a traceback
            # (which --log-level debug still shows).
            detail = " ".join(str(exc).split())
            self.startup_error = f"the engine could not start: {type(exc).__name__}: {detail}"
            log.error("startup failed: %s", self.startup_error)
            log.debug("startup failed", exc_info=True)
            raise GatewayError(self.startup_error) from exc

    def _read_model_shapes(self) -> ModelShapes | None:
        model = self.engine.model_path or ""
        shapes = model_shapes(model)
        if shapes is None and self.settings.engine.load_format != "dummy":
            log.warning(
                "no safetensors weights found for model %s: adapters are checked without the model's "
                "module shapes (their own tensors still are; vLLM does not check that they fit the model)",
                model,
            )
        return shapes

    def build_table(self, ids: LoraIds) -> RoutingTable:
        s = self.settings
        return load_table(
            s.catalog,
            base_name=self.engine.served_model_name,
            adapters_root=s.adapters_root,
            max_lora_rank=s.engine.max_lora_rank,
            model_modules=self._model_shapes,
            lora_ids=ids,
            snapshots=self.snapshots,
            model_names=self.model_names(),
        )

    def model_names(self) -> tuple[str, ...]:
        """What the served model is known by besides its served name (an alias, maybe): the
        path or repo id it was loaded from, and the embedded model's own name."""
        names = [self.engine.model_path or ""]
        if self.settings.engine.model is None:
            names.append(EMBEDDED_NAME)
        return tuple(name for name in names if name)

    async def reload_catalog(self) -> bool:
        """Read the catalog again (the watcher, SIGHUP, the admin endpoint). Not while
        draining: adapters loaded and warmed in an engine about to stop, which the drain
        does not wait for (False, and a log line)."""
        catalog = self.catalog_or_503()
        # checked again once the reload's turn comes: one may wait for another's adapters
        ok = await catalog.reload(skip=lambda: self.admission.draining)
        if ok is None:
            log.info("catalog reload skipped: the gateway is draining")
            return False
        self.metrics.reloads.labels("ok" if ok else "error").inc()
        if ok:  # no await since the swap: no request has been counted under the new table
            self._routes_changed(catalog.table)
        return ok

    def _routes_changed(self, table: RoutingTable) -> None:
        """The metrics' route labels, and a warning for each key whose ``routes:`` names
        something no route answers to now (a typo, or a route gone): the key gets 404s there.
        Said once per change, not at every reload."""
        self.metrics.set_routes(route_names(table))
        known = {name for r in table.all_routes() for name in (r.name, *r.aliases)}
        for key in self.settings.auth.keys:
            unknown = frozenset(key.routes or ()) - known
            if unknown and unknown != self._unknown_key_routes.get(key.name):
                log.warning(
                    "API key '%s' may use %s, which no route of the catalog answers to: "
                    "its requests there get 404 model_not_found",
                    key.name,
                    ", ".join(sorted(unknown)),
                )
            self._unknown_key_routes[key.name] = unknown
        self._slots_outgrown(table)
        self._pins_unbound(table)

    def _pins_unbound(self, table: RoutingTable) -> None:
        """A line when pinned routes turn ``limits.max_adapter_wait_s`` off (the LoRA
        scheduler sends nothing on early while an adapter is pinned: a batch with more
        unpinned adapters than free slots would kill the engine). Said once per change."""
        pinned = frozenset(r.name for r in table.routes.values() if r.pinned)
        if pinned and pinned != self._pinned_said and self.scheduler is not None:
            log.info(
                "pinned: %s; while an adapter is pinned, limits.max_adapter_wait_s (%g s) does not bound "
                "the wait for an adapter's turn: a waiting adapter gets a slot when an active one drains",
                ", ".join(sorted(pinned)),
                self.settings.limits.max_adapter_wait_s,
            )
        self._pinned_said = pinned

    def _slots_outgrown(self, table: RoutingTable) -> None:
        """A warning when the catalog names more adapters than ``max_loras: auto`` gave GPU
        slots (they are sized once, at start, and capped): the engine then runs at most that
        many adapters in a step, and the others wait their turn. Warned once while the catalog
        stays over the slots (an entry rejected and fixed moves the count back and forth);
        a later count is an info line. The advice says what gives each adapter a slot: a
        restart only where ``auto`` would then do it, else the setting that caps it."""
        engine = self.settings.engine
        slots = engine.gpu_slots
        adapters = len({r.lora.lora_id for r in table.routes.values() if r.lora is not None})
        if not self._auto_slots or adapters <= slots:
            self._adapters_over_slots = 0
            return
        if adapters != self._adapters_over_slots:
            log.log(
                logging.INFO if self._adapters_over_slots else logging.WARNING,
                "the catalog names %d adapters and the engine has %d GPU slots (engine.max_loras: auto, "
                "sized at start): at most %d adapters run in one step, the others wait their turn; %s",
                adapters,
                slots,
                slots,
                more_slots_hint(adapters, model_slot_bytes(self.settings), engine.max_num_seqs),
            )
        self._adapters_over_slots = adapters

    def close(self) -> None:
        """What outlives the engine: the response store and the adapter copies."""
        self.adapters.close()
        self.responses.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.snapshots is not None:
            self.snapshots.close()

    async def watch_catalog(self) -> None:
        """Hot swap and SIGHUP (``CatalogWatcher``). A failure is logged and the watcher starts
        again: out of ``run``, it would end the engine supervisor beside it."""
        assert self.catalog is not None
        while True:
            try:
                watcher = CatalogWatcher(
                    self.settings.catalog,
                    self.settings.adapters_root,
                    self.catalog,
                    self.reload_catalog,
                    self.settings.catalog_poll_s,
                    self.reload_now,
                )
                await watcher.run()
            except Exception:
                log.exception("the catalog watcher failed; starting it again in %g s", WATCHER_RETRY_S)
                await asyncio.sleep(WATCHER_RETRY_S)

    async def watch_engine(self, interval: float = 0.5) -> None:
        """Engine death ends the process (non-zero), after open streams got their error event."""
        while not self.engine.errored:
            await asyncio.sleep(interval)
        log.error("the engine has died; failing open requests and exiting")
        self.exit_code = 3
        self.admission.draining = True
        await asyncio.sleep(2.0)  # let open streams send their error event; /health says 503
        self.request_exit()

    async def watch_residency(self, interval: float = 5.0) -> None:
        """The engine evicts adapters on its own (LRU, ``max_cpu_loras``): re-read which
        it holds now and then, for residency in ``/v1/models`` and cold/warm TTFT."""
        while True:
            await asyncio.sleep(interval)
            if self.engine.ready:
                with contextlib.suppress(GatewayError):
                    await self.adapters.refresh()

    def stopping(self) -> asyncio.Future[GatewayError]:
        """Done, with the error to end them with, once requests still in flight must stop
        (``stop_requests``); streams and whole responses wait on it with their client."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
        return self._stopping

    def stop_requests(self) -> None:
        """The drain timed out: what is still in flight ends now, aborted in the engine, with
        a 503 (an error event once a stream has started) rather than a cut connection."""
        stopping = self.stopping()
        if not stopping.done():
            stopping.set_result(self.admission.shutting_down())

    # -- per request ------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self.catalog is not None and self.engine.ready

    def catalog_or_503(self) -> Catalog:
        if self.catalog is None or not self.engine.ready:
            raise EngineUnavailable("the engine is not ready", headers={"Retry-After": "5"})
        return self.catalog

    def lease(self, principal: Principal | None, model: str | None, task: str | None) -> Lease:
        """The route for this caller. A route the key may not use looks like no route."""
        allowed = principal.may_use if principal is not None else None
        return self.catalog_or_503().acquire(model, task, allowed)


def lora_scheduler(
    settings: GatewaySettings, pinned: set[int], metrics: GatewayMetrics
) -> LoraScheduler | None:
    """The order of LoRA requests (``limits.lora_scheduling``); None: straight to the engine."""
    limits = settings.limits
    if limits.lora_scheduling == "off" or not settings.engine.enable_lora:
        return None
    return LoraScheduler(
        settings.engine.gpu_slots,
        quantum_s=limits.lora_quantum_s,
        max_wait_s=limits.max_adapter_wait_s,
        pinned=pinned,
        metrics=metrics,
    )


def with_adapter_slots(settings: GatewaySettings) -> GatewaySettings:
    """The settings with the engine's adapter capacity sized to the catalog, read once before
    the engine starts: ``engine.max_loras: auto`` (``adapter_slots.gpu_slots``) and
    ``engine.max_cpu_loras`` left out (``adapter_slots.cpu_cache_size``)."""
    engine = settings.engine
    if not engine.enable_lora:  # no adapters: ``auto`` only needs to be a number
        slots = engine.max_loras if isinstance(engine.max_loras, int) else MIN_GPU_SLOTS
        return settings.model_copy(update={"engine": engine.model_copy(update={"max_loras": slots})})
    dirs = adapter_dirs(settings.catalog, settings.adapters_root)
    update = {
        "max_loras": engine.max_loras if isinstance(engine.max_loras, int) else auto_slots(settings, dirs)
    }
    if engine.max_cpu_loras is None:
        update["max_cpu_loras"] = cache = cpu_cache_size(update["max_loras"], dirs, host_memory_bytes())
        room = "room for each" if cache >= len(dirs) + update["max_loras"] else "capped by host memory"
        log.info("engine.max_cpu_loras=%d: the catalog names %d adapters (%s)", cache, len(dirs), room)
    return settings.model_copy(update={"engine": engine.model_copy(update=update)})


def auto_slots(settings: GatewaySettings, dirs: list[Path]) -> int:
    """``engine.max_loras: auto`` for the catalog's adapter folders ``dirs``; an explicit
    ``max_cpu_loras`` caps it (vLLM wants as many in its CPU cache as in slots)."""
    engine = settings.engine
    each = model_slot_bytes(settings)
    slots = gpu_slots(len(dirs), each, engine.max_num_seqs)
    if engine.max_cpu_loras is not None:
        slots = min(slots, engine.max_cpu_loras)
    known = f"about {each / 2**20:.0f} MiB each" if each is not None else "size unknown"
    log.info("engine.max_loras=%d (auto): the catalog names %d adapters; slots %s", slots, len(dirs), known)
    return slots


def model_slot_bytes(settings: GatewaySettings) -> int | None:
    """About the memory of one GPU slot for the settings' model (``adapter_slots.slot_bytes``);
    None when the model's sizes cannot be read."""
    engine = settings.engine
    config = model_config(engine.model, settings.cache_dir)
    return slot_bytes(config, engine.max_lora_rank, engine.dtype) if config is not None else None


def snapshot_dir(cache_dir: Path) -> SnapshotDir:
    """This process's adapter copies under ``cache_dir``, made before the engine's minutes:
    a cache_dir that cannot be written is a setting's error (exit status 2), not the engine's."""
    try:
        return SnapshotDir(cache_dir / "adapters")
    except OSError as exc:
        raise ConfigError(f"cache_dir: cannot write under {cache_dir}: {exc.strerror or exc}") from None


def route_names(table: RoutingTable) -> frozenset[str]:
    return frozenset(r.name for r in table.all_routes())


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (torch, transformers, the engine client: 650k
    objects on the embedded model) out of the collector's sight. Otherwise every full
    collection walks all of them while streams wait on the event loop (480 ms each on 2 CPU
    cores, measured). vLLM's own server does the same."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    log.info(
        "froze %d start-up objects out of the garbage collector (a full collection took %.0f ms)",
        gc.get_freeze_count(),
        took * 1000,
    )
