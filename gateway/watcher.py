"""Hot swap: reload the catalog when its file or any adapter's files change, or on demand.

``CatalogWatcher.run()`` listens to the kernel's file notifications (``watchfiles``) on
the catalog file and, recursively, the adapters root. watchfiles groups a burst of events
(a save or a copy in progress) until the files are quiet for ``step`` ms, so a reload
reads whole files. A change under the adapters root reloads the whole catalog: entries
that were rejected (a broken ``adapter_config.json``, a directory not there yet) are
validated again and go live once their files are right, with no SIGHUP.

The kernel watches directories (inodes), not paths, so ``WatchPlan`` names what to watch
as the paths resolve now: the catalog's folder and, when the catalog file is a link, the
folder it points into; the adapters root, recursively, and its parent (which sees a root
link swapped to another release, or a root directory replaced whole). Every round (at
least once a second) the plan is made again; when it differs, the watch is set up again and
the catalog reloaded: the paths lead to other files, which may be older than the last read
(a release link rolled back), so their timestamps cannot tell.

The notifications start after the catalog was read: each time they are set up, files
changed since that read (by their timestamps) get a reload too, so no edit made while the
gateway started, or while a watch was set up again, is lost.

A change, ``reload_now`` (SIGHUP) or ``POST /admin/adapters/reload`` all set one event; a
change seen while a reload runs sets it again, so it is read by the next round, never
lost. Between rounds, every ``interval`` seconds, LoRA versions that left the table and
have drained leave the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from watchfiles import Change, awatch

from gateway.catalog import Catalog

log = logging.getLogger(__name__)

QUIET_MS = 100  # a burst of events ends after this much quiet
MAX_WAIT_MS = 1_600  # ... or after this long, even if the files keep changing


@dataclass(frozen=True)
class WatchPlan:
    """What to watch as the paths resolve now: folders, not recursively, each with the names
    in it that matter; the adapters root, recursively (None while it does not exist); and
    each one's (device, inode), so a link swapped or a directory replaced makes another plan."""

    folders: dict[Path, frozenset[str]]
    root: Path | None
    identity: tuple[tuple[int, int] | None, ...]

    @classmethod
    def of(cls, catalog_path: Path, adapters_root: Path, files: Iterable[Path] = ()) -> WatchPlan:
        """``files``: more files to watch, as the catalog file (its ``file:`` schemas)."""
        wanted = [(catalog_path.parent, catalog_path.name), (adapters_root.parent, adapters_root.name)]
        wanted += [(path.parent, path.name) for path in sorted(files)]
        with suppress(OSError, RuntimeError, ValueError):  # a symlink loop (3.11); a NUL byte
            target = catalog_path.resolve()
            wanted.append((target.parent, target.name))
        folders: dict[Path, frozenset[str]] = {}
        first_by_inode: dict[tuple[int, int], Path] = {}
        for folder, name in wanted:
            inode = _dir_inode(folder)
            if inode is not None:
                # One watch per directory: the kernel reports its events under one path.
                first = first_by_inode.setdefault(inode, folder)
                folders[first] = folders.get(first, frozenset()) | {name}
        root: Path | None = None
        with suppress(OSError, RuntimeError, ValueError):
            root = adapters_root.resolve()
        root_inode = _dir_inode(root) if root is not None else None
        return cls(folders, root if root_inode else None, (*first_by_inode, root_inode))


def _dir_inode(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory; None if ``path`` is not one (or cannot be read, or
    has a NUL byte: ValueError, not OSError)."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class CatalogWatcher:
    def __init__(
        self,
        catalog_path: Path,
        adapters_root: Path,
        catalog: Catalog,
        reload: Callable[[], Awaitable[bool]],
        interval: float,
        reload_now: asyncio.Event,
    ) -> None:
        self.catalog_path = catalog_path.absolute()
        self.adapters_root = adapters_root.absolute()  # resolved by each plan: it may be a link
        self.catalog = catalog
        self.reload = reload
        self.interval = interval
        self.reload_now = reload_now
        self.plan = self.plan_now()
        self.watching = asyncio.Event()  # set while the notifications are set up (for tests)

    def plan_now(self) -> WatchPlan:
        """The catalog file, the adapters root and the schema files the table names."""
        return WatchPlan.of(self.catalog_path, self.adapters_root, self.catalog.table.files)

    def relevant(self, change: Change, path: str) -> bool:
        """Anything under the adapters root; in the watched folders, the catalog file, the
        file it links to, the adapters root's own entry, and a Kubernetes ConfigMap mount's
        ``..data`` link swap; not editors' files next to the catalog."""
        p = Path(path)
        if self.plan.root is not None and p.is_relative_to(self.plan.root):
            return True
        if p.parent == self.catalog_path.parent and p.name.startswith(".."):
            return True
        return p.name in self.plan.folders.get(p.parent, frozenset())

    async def run(self) -> None:
        watch = asyncio.create_task(self.watch_files())
        try:
            while True:
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.reload_now.wait(), timeout=self.interval)
                if self.reload_now.is_set():
                    # Cleared before the reload reads the files: a change from here on
                    # sets it again and gets its own round.
                    self.reload_now.clear()
                    await _logged(self.reload(), "catalog reload")
                await _logged(self.catalog.remove_drained(), "removing drained adapters")
        finally:
            watch.cancel()
            with suppress(asyncio.CancelledError):
                await watch

    async def watch_files(self) -> None:
        """Watch by the plan until it no longer holds (or the watch fails), then again."""
        # watchfiles logs "N changes detected" at INFO; the watch logs the relevant files.
        logging.getLogger("watchfiles.main").setLevel(logging.WARNING)
        while True:
            try:  # the plan too: an error out of this loop would end file watching for good
                plan = self.plan_now()
                if plan != self.plan:  # set now, so a watch that fails to start loses no reload
                    log.info("catalog files now lead elsewhere (adapters root %s): reloading", plan.root)
                    self.reload_now.set()
                self.plan = plan
                if self.plan.root is None:
                    log.warning(
                        "adapters root %s does not exist: adapter files are not watched", self.adapters_root
                    )
                await self.watch_plan(self.plan)
            except Exception:  # a folder gone while its watch was set up: the next plan sees it
                log.exception("watching the catalog files failed; watching again in 1 s")
                await asyncio.sleep(1.0)
            self.watching.clear()

    async def watch_plan(self, plan: WatchPlan) -> None:
        watches = [(list(plan.folders), False)] if plan.folders else []
        watches += [([plan.root], True)] if plan.root is not None else []
        if not watches:
            await asyncio.sleep(1.0)  # nothing there yet: look again
            return
        moved = asyncio.Event()  # the plan no longer holds: every watch of it ends
        started = [asyncio.Event() for _ in watches]
        async with asyncio.TaskGroup() as group:
            for (paths, recursive), first_round in zip(watches, started, strict=True):
                group.create_task(self.watch(paths, recursive, plan, moved, first_round))
            for first_round in started:
                await first_round.wait()
            if not moved.is_set():
                self.on_watching()

    async def watch(
        self,
        paths: list[Path],
        recursive: bool,
        plan: WatchPlan,
        moved: asyncio.Event,
        started: asyncio.Event,
    ) -> None:
        """One watchfiles watch. Every batch of events is a round, relevant or not (a folder
        busy with other files must not hold back the plan check)."""
        try:
            async for changes in awatch(
                *paths,
                watch_filter=None,
                step=QUIET_MS,
                debounce=MAX_WAIT_MS,
                rust_timeout=1_000,  # how soon a cancelled watch ends
                yield_on_timeout=True,  # an empty round each second: the first says the watch is set
                recursive=recursive,
                stop_event=moved,
            ):
                started.set()
                changed = sorted({p for change, p in changes if self.relevant(change, p)})
                if changed:
                    log.info("catalog files changed: %s", ", ".join(changed[:5]))
                    self.reload_now.set()
                if self.plan_now() != plan:
                    moved.set()  # watchfiles stops at its next step
        finally:
            started.set()

    def on_watching(self) -> None:
        """The notifications are set up: files changed since the catalog was read get a reload."""
        self.watching.set()
        missed = self.changed_since(self.catalog.table.loaded_at)
        if missed:
            log.info("catalog files changed before the watch was set up: %s", missed)
            self.reload_now.set()

    def changed_since(self, read_at: float) -> str | None:
        """A watched file or folder (or link) changed after ``read_at``, less a second for
        coarse file system clocks: its path, or None."""
        since = read_at - 1.0
        paths = [self.catalog_path, self.adapters_root]  # links, and what they point to below
        paths += self.catalog.table.files
        with suppress(OSError, RuntimeError, ValueError):
            paths.append(self.catalog_path.resolve())
        with suppress(OSError):
            paths += [p for p in self.catalog_path.parent.iterdir() if p.name.startswith("..")]
        if self.plan.root is not None:
            for root, dirs, files in os.walk(self.plan.root):
                paths += [Path(root), *(Path(root, name) for name in dirs + files)]
        for path in paths:
            try:
                st = path.lstat()
            except (OSError, ValueError):  # ValueError: a NUL byte in the path
                continue
            if max(st.st_mtime, st.st_ctime) > since:
                return str(path)
        return None


async def _logged(step: Awaitable[object], what: str) -> None:
    """Run one step of a round; an error is logged, and the next round runs as usual (an
    error escaping ``run`` would end hot swap and removals for good, with nothing said)."""
    try:
        await step
    except Exception:
        log.exception("%s failed; the catalog watcher goes on", what)
