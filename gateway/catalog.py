"""The adapter catalog and router: model name or task -> a route (base, LoRA or preset).

``load_table`` reads ``configs/adapters.yaml`` into an immutable ``RoutingTable``; each
entry is validated at registration (path inside the adapters root, ``adapter_config.json``
parses, rank, tensor shapes against the model: ``adapters_check``). A bad entry is
rejected with a message and the rest keep serving; a different base model name is a
warning on the route unless the entry sets ``strict_base_model``. ``Catalog`` holds the
live table, swaps it atomically on reload, and tracks which LoRA versions are still in
use so old weights leave the engine only after the requests that started on them have
drained.

Lookups never touch the filesystem: a name that is not in the table is simply unknown,
so path-like names (``../x``, ``/etc/passwd``, URLs) cannot reach a file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from gateway import yaml_file
from gateway.adapters_check import (
    AdapterInfo,
    ModelShapes,
    adapter_digest,
    check_adapter,
    one_line,
    safe_adapter_path,
)
from gateway.catalog_file import CatalogFile, RouteEntry, SamplingDefaults, ToolParser
from gateway.errors import ConfigError, GatewayError, InvalidRequest, ModelNotFound
from gateway.snapshots import SnapshotDir
from gateway.structured import route_constraint, schema_watch_paths
from gateway.types import Constraint, LoraSpec

log = logging.getLogger(__name__)

RouteKind = Literal["base", "lora", "preset"]


# -- the routing table -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Route:
    name: str
    kind: RouteKind
    aliases: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    lora: LoraSpec | None = None
    digest: str | None = None
    rank: int | None = None
    system_prompt: str | None = None
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    chat_template: str | None = None
    tool_parser: ToolParser = "json"
    warnings: tuple[str, ...] = ()
    pinned: bool = False
    preload: bool = False
    response_format: Constraint | None = None
    enforce: bool = False
    weight: float = 1.0


@dataclass(frozen=True)
class RoutingTable:
    base: Route
    routes: dict[str, Route]
    errors: dict[str, str]
    _by_name: dict[str, Route] = field(default_factory=dict)
    _by_task: dict[str, Route] = field(default_factory=dict)
    # When its catalog file was read (taken before the read: an edit during the build is later).
    loaded_at: float = field(default_factory=time.time)
    # The ``file:`` schemas its entries name (rejected ones too, missing files too): the
    # watcher watches them as it does the catalog file.
    files: frozenset[Path] = frozenset()

    def __post_init__(self) -> None:
        for route in (self.base, *self.routes.values()):
            for name in (route.name, *route.aliases):
                self._by_name.setdefault(name, route)
            for task in route.tasks:
                self._by_task.setdefault(task, route)

    def all_routes(self) -> list[Route]:
        return [self.base, *self.routes.values()]

    def reject(self, failed: dict[str, str]) -> RoutingTable:
        """This table less the routes in ``failed`` (name -> why), which join ``errors``."""
        routes = {name: r for name, r in self.routes.items() if name not in failed}
        return RoutingTable(
            self.base, routes, {**self.errors, **failed}, loaded_at=self.loaded_at, files=self.files
        )

    def resolve(
        self, model: str | None, task: str | None = None, allowed: Callable[[str], bool] | None = None
    ) -> Route:
        """Pick the route for a request. Unknown names raise 404; never a fallback. A route
        whose name and aliases ``allowed`` all refuse (a key's scope) is unknown too, before
        ``model`` and ``task`` are compared: a 400 there would tell the key that the route
        exists. The base model's name beside a ``task`` only says which model: the task picks."""

        def visible(route: Route) -> bool:
            return allowed is None or any(map(allowed, (route.name, *route.aliases)))

        by_model = None
        if model:
            by_model = self._by_name.get(model)
            if by_model is None or not (visible(by_model) or (task and by_model is self.base)):
                raise ModelNotFound(model)
        if task:
            by_task = self._by_task.get(task)
            if by_task is None or not visible(by_task):
                raise ModelNotFound(task, param="task")
            if by_model is not None and by_model is not self.base and by_model is not by_task:
                raise InvalidRequest(f"model '{model}' and task '{task}' name different routes", param="task")
            return by_task
        route = by_model if by_model is not None else self.base
        if not visible(route):  # no model (house /chat, /tokenize): the base model
            raise ModelNotFound(route.name)
        return route


def load_table(
    catalog_path: Path,
    *,
    base_name: str,
    adapters_root: Path,
    max_lora_rank: int,
    model_modules: ModelShapes | None,
    lora_ids: LoraIds,
    snapshots: SnapshotDir | None = None,
    model_names: tuple[str, ...] = (),
) -> RoutingTable:
    """Build a table from the catalog file. A broken file raises ``ConfigError``;
    a broken entry is left out and reported in ``table.errors``. With ``snapshots``, the
    engine is given a content-addressed copy of each adapter (``gateway.snapshots``).
    ``model_names``: the served model's path or repo id, which an adapter's base model may
    name instead of ``base_name`` (``check_adapter``)."""
    loaded_at = time.time()
    spec = _read_spec(catalog_path)
    base = Route(
        name=base_name,
        kind="base",
        aliases=tuple(spec.base.aliases),
        tasks=tuple(spec.base.tasks),
        defaults=spec.base.defaults,
        tool_parser=spec.base.tool_parser,
    )
    taken = {base.name, *base.aliases}
    taken_tasks = set(base.tasks)
    # A route's own name is its own wherever the entry stands, rejected or not: an alias on
    # another entry that names it is that entry's clash, so an edit never moves an existing
    # route's traffic to another adapter (and a broken entry keeps its name until fixed).
    # The base model's entry cannot be rejected alone: an alias of it that names a route
    # is the file's error (the last good table keeps serving).
    # Aliases and tasks likewise belong to the first entry that lists them, rejected or not:
    # a broken entry's alias or task does not pass to another adapter until it is fixed.
    owners: dict[str, int] = {}
    alias_owners: dict[str, int] = {}
    task_owners: dict[str, int] = {}
    for index, item in enumerate(spec.routes):
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("name"), str):
            owners.setdefault(item["name"], index)
        for key, claimed in (("aliases", alias_owners), ("tasks", task_owners)):
            if isinstance(item.get(key), list):
                for value in item[key]:
                    if isinstance(value, str):
                        claimed.setdefault(value, index)
    if stolen := sorted(set(base.aliases) & owners.keys()):
        raise ConfigError(f"{catalog_path}: base.aliases: {', '.join(stolen)} is a route's name")
    if twice := _repeated([base.name, *base.aliases]):
        raise ConfigError(f"{catalog_path}: base.aliases: {twice} is named twice")
    routes: dict[str, Route] = {}
    errors: dict[str, str] = {}
    for index, item in enumerate(spec.routes):
        label = str(item.get("name", f"routes[{index}]")) if isinstance(item, dict) else f"routes[{index}]"
        if owners.get(label, index) != index:  # a later entry with an earlier one's name
            label = f"routes[{index}]"  # is reported as itself, beside the route of that name
        try:
            entry = RouteEntry.model_validate(item)
            clash = taken.intersection([entry.name, *entry.aliases])
            clash.update(a for a in [entry.name, *entry.aliases] if owners.get(a, index) != index)
            clash.update(a for a in entry.aliases if alias_owners.get(a, index) != index)
            if clash:
                raise ConfigError(f"name already used: {', '.join(sorted(clash))}")
            if twice := _repeated([entry.name, *entry.aliases]):  # one model card per name
                raise ConfigError(f"aliases: {twice} is named twice")
            clash = taken_tasks.intersection(entry.tasks)  # one route per task, never a guess
            clash.update(t for t in entry.tasks if task_owners.get(t, index) != index)
            if clash:
                raise ConfigError(f"task already used: {', '.join(sorted(clash))}")
            route = _build_route(
                entry,
                adapters_root,
                max_lora_rank,
                base_name,
                model_names,
                model_modules,
                lora_ids,
                catalog_path.parent,
            )
            if snapshots is not None and route.lora is not None:
                recheck = partial(
                    check_adapter,
                    max_lora_rank=max_lora_rank,
                    base_name=base_name,
                    model=model_modules,
                    strict_base_model=entry.strict_base_model,
                    model_names=model_names,
                )
                route = _on_snapshot(route, snapshots, lora_ids, recheck)
        except (ConfigError, ValidationError, OSError) as exc:  # OSError: files that changed mid-check
            errors[label] = _one_line(exc)  # logged by the catalog, once while it holds (``_log_news``)
            continue
        except Exception as exc:  # a check that failed on this entry's files: its rejection only
            log.exception("catalog entry %s could not be checked", label)
            errors[label] = f"could not be checked: {_one_line(exc)}"
            continue
        taken.update([route.name, *route.aliases])
        taken_tasks.update(route.tasks)
        routes[route.name] = route
    files = _schema_files(spec.routes, catalog_path.parent)
    return RoutingTable(base=base, routes=routes, errors=errors, loaded_at=loaded_at, files=files)


def _schema_files(entries: list[dict[str, Any]], configs_dir: Path) -> frozenset[Path]:
    """The files the entries' ``response_format: "file:<path>"`` values name, whether or not
    they exist yet (a fix to a rejected entry may be the file appearing), and the links on
    the way to them."""
    files: set[Path] = set()
    for item in entries:
        value = item.get("response_format") if isinstance(item, dict) else None
        if isinstance(value, str):
            files.update(schema_watch_paths(value, configs_dir))
    return frozenset(files)


def _repeated(names: list[str]) -> str | None:
    """The names listed more than once, or None: each would be a second card in /v1/models."""
    counts = Counter(names)
    return ", ".join(sorted(n for n, c in counts.items() if c > 1)) or None


def _read_spec(catalog_path: Path) -> CatalogFile:
    """The catalog file, validated against its schema; ``ConfigError`` if it cannot be."""
    try:
        text = catalog_path.read_text(encoding="utf-8")
        if not text.strip():  # an editor's save truncates first: never read that as "no routes"
            raise ConfigError(
                f"{catalog_path}: the file is empty (write `routes: []` for a catalog with no routes)"
            )
        data = yaml_file.load(text)
        if not isinstance(data, dict):  # comments only, `---`, `null`, `[]`: a save half done
            raise ConfigError(
                f"{catalog_path}: the file holds no mapping (write `routes: []` for a catalog with no routes)"
            )
        return CatalogFile.model_validate(data)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{catalog_path}: {_one_line(exc)}") from None
    except RecursionError:  # thousands of nested brackets: the reload endpoint's 422, not a 500
        raise ConfigError(f"{catalog_path}: the file is nested too deeply") from None


def check_file(catalog_path: Path) -> None:
    """The file's own errors (missing, unreadable, empty, not YAML, not the schema) as
    ``ConfigError`` now: the start checks it before the engine's minutes of building."""
    _read_spec(catalog_path)


def adapter_dirs(catalog_path: Path, adapters_root: Path) -> list[Path]:
    """The adapter folders the catalog file names, each once, as far as they can be read now
    (for sizing the engine before the catalog is loaded; ``load_table`` reports what is wrong)."""
    try:
        spec = _read_spec(catalog_path)
    except ConfigError:
        return []
    dirs = []
    for item in spec.routes:
        raw = item.get("adapter") if isinstance(item, dict) else None
        if isinstance(raw, str):
            try:
                dirs.append(safe_adapter_path(raw, adapters_root))
            except ConfigError:
                continue
    return list(dict.fromkeys(dirs))  # two routes may serve one folder


def _build_route(
    entry: RouteEntry,
    adapters_root: Path,
    max_lora_rank: int,
    base_name: str,
    model_names: tuple[str, ...],
    model_modules: ModelShapes | None,
    lora_ids: LoraIds,
    configs_dir: Path,
) -> Route:
    if entry.enforce and entry.response_format is None:
        raise ConfigError("enforce: true needs a response_format")
    common: dict[str, Any] = dict(
        name=entry.name,
        aliases=tuple(entry.aliases),
        tasks=tuple(entry.tasks),
        system_prompt=entry.system_prompt,
        defaults=entry.defaults,
        chat_template=entry.chat_template,
        tool_parser=entry.tool_parser,
        response_format=route_constraint(entry.response_format, configs_dir),
        enforce=entry.enforce,
    )
    if entry.adapter is None:
        asked = [k for k in ("strict_base_model", "pinned", "preload") if getattr(entry, k)]
        asked += ["weight"] if entry.weight != 1.0 else []
        if asked:
            raise ConfigError(f"{', '.join(asked)} need an adapter")
        return Route(kind="preset", **common)
    path = safe_adapter_path(entry.adapter, adapters_root)
    info = check_adapter(
        path,
        max_lora_rank,
        base_name,
        model_modules,
        strict_base_model=entry.strict_base_model,
        model_names=model_names,
    )
    digest = adapter_digest(path)
    # The engine's LoRA name is the route name: vLLM reports running and waiting adapters
    # by it (``vllm:lora_requests_info``) and LoRA-affinity routers match it to ``model``.
    lora = LoraSpec(name=entry.name, lora_id=lora_ids.id_for(digest, entry.pinned), path=str(path))
    return Route(
        kind="lora",
        lora=lora,
        digest=digest,
        rank=info.rank,
        warnings=info.warnings,
        pinned=entry.pinned,
        preload=entry.preload,
        weight=entry.weight,
        **common,
    )


def _on_snapshot(
    route: Route, snapshots: SnapshotDir, lora_ids: LoraIds, recheck: Callable[..., AdapterInfo]
) -> Route:
    assert route.lora is not None
    original = Path(route.lora.path)
    try:
        path, digest = snapshots.copy(original, route.digest)
    except OSError as exc:
        raise ConfigError(f"could not copy the adapter to {snapshots.path}: {one_line(exc)}") from None
    # The engine reads the copy, so the copy is what must fit: the files may have changed
    # since their check (a save, a directory renamed into place while the catalog loads),
    # and vLLM loads tensors of the wrong shape only to fail copying them into a GPU slot.
    # A copy does not change; checking it reads its headers only.
    try:
        info = recheck(path, label=original.name)
    except ConfigError:
        # Bytes that fit no entry (not just a strict entry's name check) are read by no
        # version, now or later: every registered copy passed this check.
        try:
            recheck(path, label=original.name, strict_base_model=False)
        except ConfigError:
            snapshots.discard(path)
        raise
    lora = replace(route.lora, lora_id=lora_ids.id_for(digest, route.pinned), path=str(path))
    return replace(route, lora=lora, digest=digest, rank=info.rank, warnings=info.warnings)


def _log_news(table: RoutingTable, before: RoutingTable | None) -> None:
    """What ``table`` says that ``before`` did not: each rejected entry's error while it
    holds, and each route's warnings (another base model's name) once per version. A reload
    brought on by another entry's edit does not say them again; they stay in
    ``/admin/adapters`` (and the warnings in ``/v1/models``) for as long as they hold."""
    for label, error in table.errors.items():
        if before is None or before.errors.get(label) != error:
            log.error("catalog entry %s rejected: %s", label, error)
    for route in table.routes.values():
        old = before.routes.get(route.name) if before is not None else None
        said = old.warnings if old is not None and old.digest == route.digest else ()
        for warning in route.warnings:
            if warning not in said:
                log.warning("catalog entry %s: %s", route.name, warning)


def _errors_line(table: RoutingTable) -> str | None:
    return "; ".join(f"{k}: {v}" for k, v in table.errors.items()) or None


def _lora_ids(table: RoutingTable) -> set[int]:
    return {r.lora.lora_id for r in table.all_routes() if r.lora is not None}


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        return f"{loc}: {err['msg']}" if loc else err["msg"]
    if isinstance(exc, yaml.YAMLError) and (described := yaml_file.describe(exc)):
        return described
    return one_line(exc)


class LoraIds:
    """Engine LoRA ids by content digest and pin: same files, same id; changed files, new id.
    vLLM can pin an adapter but not unpin it, so the pin is part of the version too: a route
    pinned or unpinned gets a new id on the same files, and the old version drains and
    leaves the engine (its pin with it), as after an edit.

    A version that left the engine (or never reached it) is forgotten (``keep``), so an
    operator editing adapters all day does not grow this map. Its number is never given
    again: vLLM keys its adapter caches by ``lora_int_id``, so files that come back later
    are a new version under a new id, loaded afresh."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, bool], int] = {}
        self._last = 0

    def id_for(self, digest: str, pinned: bool) -> int:
        key = (digest, pinned)
        if key not in self._ids:
            self._last += 1
            self._ids[key] = self._last
        return self._ids[key]

    def keep(self, lora_ids: set[int]) -> None:
        """Forget every version but those of ``lora_ids``."""
        self._ids = {key: i for key, i in self._ids.items() if i in lora_ids}

    def __len__(self) -> int:
        return len(self._ids)


# -- the live catalog ------------------------------------------------------------------
class Lease:
    """A request's hold on the route version it started with."""

    __slots__ = ("route", "_catalog", "_released")

    def __init__(self, route: Route, catalog: Catalog) -> None:
        self.route = route
        self._catalog = catalog
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._catalog._release(self.route)


def versioned_name(route: Route) -> str:
    """A LoRA route's engine name where its plain name may be another version's:
    ``name@<digest>.<id>``. The digest says which files; the id tells apart versions of the
    same files (a pin is part of a version: pinned and unpinned, they are two)."""
    assert route.lora is not None and route.digest is not None
    return f"{route.name}@{route.digest[:12]}.{route.lora.lora_id}"


class Catalog:
    """The live routing table, swapped atomically; old LoRA versions drain, then leave."""

    def __init__(
        self,
        build: Callable[[LoraIds], RoutingTable],
        remove_lora: Callable[[int], Awaitable[None]] | None = None,
        add_lora: Callable[[Route], Awaitable[None]] | None = None,
    ) -> None:
        self._build = build
        self._remove_lora = remove_lora
        self._add_lora = add_lora
        self._ids = LoraIds()
        self.table = build(self._ids)
        _log_news(self.table, None)
        self.last_error: str | None = None
        self.reloads = 0
        self._in_use: dict[int, int] = {}
        self._versions_in_use: dict[tuple[str, int], int] = {}  # (route, lora id) -> requests
        self._retired: set[int] = set()
        self._pending_removal: list[int] = []
        self._lock = asyncio.Lock()  # a reload or a removal of drained versions, one at a time

    def acquire(
        self, model: str | None, task: str | None = None, allowed: Callable[[str], bool] | None = None
    ) -> Lease:
        route = self.table.resolve(model, task, allowed)
        if route.lora is not None:
            lora_id = route.lora.lora_id
            route = self._unique_engine_name(route, lora_id)
            key = (route.name, lora_id)
            self._in_use[lora_id] = self._in_use.get(lora_id, 0) + 1
            self._versions_in_use[key] = self._versions_in_use.get(key, 0) + 1
        return Lease(route, self)

    def _unique_engine_name(self, route: Route, lora_id: int) -> Route:
        """vLLM tells LoRA requests apart by name within a batch (``LoRARequest.__eq__``),
        so two versions of one route must not run under the same name: while an older
        version still drains, the new one runs as ``versioned_name``."""
        if route.lora is None or route.digest is None:
            return route
        if any(n == route.name and i != lora_id for n, i in self._versions_in_use):
            return replace(route, lora=replace(route.lora, name=versioned_name(route)))
        return route

    def _release(self, route: Route) -> None:
        if route.lora is None:
            return
        lora_id = route.lora.lora_id
        key = (route.name, lora_id)
        if self._versions_in_use.get(key, 0) > 1:
            self._versions_in_use[key] -= 1
        else:
            self._versions_in_use.pop(key, None)
        count = self._in_use.get(lora_id, 0) - 1
        if count > 0:
            self._in_use[lora_id] = count
            return
        self._in_use.pop(lora_id, None)
        if lora_id in self._retired:
            self._retired.discard(lora_id)
            self._pending_removal.append(lora_id)

    async def reload(self, skip: Callable[[], bool] | None = None) -> bool | None:
        """Build a new table, load its adapters, then swap it in; on failure keep serving
        the last good one. The old table serves while the new one's adapters load, so no
        request reaches a version before the engine has it (or has refused it). One at a
        time with ``remove_drained``: a version that a reload brings back (its files
        restored) must not be removed from under it. None, and nothing read, when ``skip()``
        says so once it is this reload's turn."""
        async with self._lock:
            if skip is not None and skip():
                return None
            try:
                # Off the event loop: the build reads every adapter's header, and hashes and
                # copies new ones (GBs for a large adapter), while streams go on. What it
                # touches besides files (the ids, the copies) changes only under this lock.
                table = await asyncio.to_thread(self._build, self._ids)
            except ConfigError as exc:
                self.last_error = str(exc)
                log.error("catalog reload failed, keeping the last good table: %s", exc)
                self._forget_ids()  # those the failed build gave out
                return False
            self._swap(await self._register(table))
            self._forget_ids()  # those of versions that left, or that the engine refused
            return True

    def _swap(self, table: RoutingTable) -> None:
        """Make ``table`` live; versions that left it drain, then leave the engine."""
        live = _lora_ids(table)
        for route in self.table.all_routes():
            if route.lora is not None and route.lora.lora_id not in live:
                if route.lora.lora_id in self._in_use:
                    self._retired.add(route.lora.lora_id)
                else:
                    self._pending_removal.append(route.lora.lora_id)
        self._retired.difference_update(live)
        # A version that comes back (files restored) before it left the engine stays.
        self._pending_removal = [i for i in self._pending_removal if i not in live]
        _log_news(table, self.table)
        self.table = table
        self.last_error = _errors_line(table)
        self.reloads += 1
        log.info("catalog reloaded: %d routes, %d rejected", len(table.routes), len(table.errors))

    async def load_adapters(self) -> None:
        """Load the first table's adapters; the catalog serves only after this (``reload``
        loads each new table's before the swap)."""
        async with self._lock:
            table = await self._register(self.table)
            if table is not self.table:
                _log_news(table, self.table)  # the engine's refusals
                self.table = table
                self.last_error = _errors_line(table)
                self._forget_ids()

    async def _register(self, table: RoutingTable) -> RoutingTable:
        """The one adapter policy, at start and at every reload: each LoRA route's weights
        go into the engine before its table serves, so a broken adapter shows at
        registration and not at its first request. A route whose weights the engine refuses
        is rejected like any invalid entry (``table.errors``); the other routes keep serving.
        Returns ``table`` less those routes."""
        if self._add_lora is None:
            return table
        failed: dict[str, str] = {}
        for route in table.routes.values():
            if route.lora is None:
                continue
            try:
                await self._add_lora(route)
            except GatewayError as exc:
                failed[route.name] = f"the engine could not load the adapter: {exc.message}"
        return table.reject(failed) if failed else table

    async def remove_drained(self) -> list[int]:
        """Remove LoRA versions that left the table and have no running request. Under the
        reload lock, and each checked against the live table just before it goes: a reload
        that restores a version either runs first (the version stays) or after its removal
        (and loads it again, from a fresh copy)."""
        async with self._lock:
            pending, self._pending_removal = self._pending_removal, []
            removed = []
            for lora_id in pending:
                if lora_id in _lora_ids(self.table):
                    continue
                if self._remove_lora is not None:
                    await self._remove_lora(lora_id)
                removed.append(lora_id)
            self._forget_ids()
            return removed

    def _forget_ids(self) -> None:
        """Forget the versions the engine does not hold and will not be asked for: not live,
        not running, not waiting to drain or leave. One that drains keeps its id, so its files
        restored before it leaves are that version again (``_swap``). Under the lock, so no
        table built but not yet swapped in holds an id forgotten here."""
        self._ids.keep(
            _lora_ids(self.table) | self._in_use.keys() | self._retired | set(self._pending_removal)
        )

    def in_use(self) -> dict[int, int]:
        return dict(self._in_use)
