"""Hot swap: reload the catalog when its file or any adapter's files change, or on demand.

``CatalogWatcher.run()`` listens to the kernel's file notifications (``watchfiles``) on
the catalog file and, recursively, the adapters root. watchfiles groups a burst of events
(a save or a copy in progress) until the files are quiet for ``step`` ms, so a reload
reads whole files. A change under the adapters root reloads the whole catalog: entries
that were rejected (a broken ``adapter_config.json``, a directory not there yet) are
validated again and go live once their files are right, with no SIGHUP.

The notifications start after the catalog was first read: once they are set up, files
changed since that read (by their timestamps) get a reload too, so no edit made while the
gateway started is lost.

A change, ``reload_now`` (SIGHUP) or ``POST /admin/adapters/reload`` all set one event; a
change seen while a reload runs sets it again, so it is read by the next round, never
lost. Between rounds, every ``interval`` seconds, LoRA versions that left the table and
have drained leave the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path

from watchfiles import Change, awatch

from gateway.catalog import Catalog

log = logging.getLogger(__name__)

QUIET_MS = 100  # a burst of events ends after this much quiet
MAX_WAIT_MS = 1_600  # ... or after this long, even if the files keep changing


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
        self.adapters_root = adapters_root.resolve()
        self.catalog = catalog
        self.reload = reload
        self.interval = interval
        self.reload_now = reload_now
        self.watching = asyncio.Event()  # set once the notifications are set up (for tests)

    def relevant(self, change: Change, path: str) -> bool:
        """The catalog file (or, for a Kubernetes ConfigMap mount, its ``..data`` link
        swap) and anything under the adapters root; not editors' files next to the catalog."""
        p = Path(path)
        if p.is_relative_to(self.adapters_root):
            return True
        return p.parent == self.catalog_path.parent and (
            p.name == self.catalog_path.name or p.name.startswith("..")
        )

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
        paths = [p for p in (self.catalog_path.parent, self.adapters_root) if p.is_dir()]
        if self.adapters_root not in paths:
            log.warning("adapters root %s does not exist: adapter files are not watched", self.adapters_root)
        # watchfiles logs "N changes detected" at INFO; the line below names the files.
        logging.getLogger("watchfiles.main").setLevel(logging.WARNING)
        async for changes in awatch(
            *paths,
            watch_filter=self.relevant,
            step=QUIET_MS,
            debounce=MAX_WAIT_MS,
            rust_timeout=1_000,  # how soon a cancelled watch ends
            yield_on_timeout=True,  # an empty round each second: the first says the watch is set
            recursive=True,
        ):
            if not self.watching.is_set():
                self.watching.set()
                missed = self.changed_since(self.catalog.table.loaded_at)
                if missed:
                    log.info("catalog files changed while the gateway started: %s", missed)
                    self.reload_now.set()
            if changes:
                log.info("catalog files changed: %s", ", ".join(sorted({p for _, p in changes})[:5]))
                self.reload_now.set()

    def changed_since(self, read_at: float) -> str | None:
        """A watched file or folder (or link) changed after ``read_at``, less a second for
        coarse file system clocks: its path, or None."""
        since = read_at - 1.0
        paths = [self.catalog_path, self.catalog_path.resolve()]  # a link and what it points to
        with suppress(OSError):
            paths += [p for p in self.catalog_path.parent.iterdir() if p.name.startswith("..")]
        for root, dirs, files in os.walk(self.adapters_root):
            paths += [Path(root), *(Path(root, name) for name in dirs + files)]
        for path in paths:
            try:
                st = path.lstat()
            except OSError:
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
