"""Hot swap: reload the catalog when its file or an adapter's files change, or on demand.

``CatalogWatcher.run()`` polls a cheap signature (stat of the catalog file and of every
file in each live adapter's directory). A change, or ``reload_now`` (SIGHUP), waits
until the files stop changing (a save or a copy in progress), then calls ``reload``,
which builds a new table, loads its adapters and swaps it in (``Gateway.reload_catalog``).
After each round, LoRA versions that left the table and have drained leave the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

from gateway.catalog import Catalog

T = TypeVar("T")
# (path, mtime_ns, size); None, None for a file that is missing
FileStat = tuple[str, int | None, int | None]
Signature = tuple[FileStat, ...]


class CatalogWatcher:
    def __init__(
        self,
        catalog_path: Path,
        catalog: Catalog,
        reload: Callable[[], Awaitable[bool]],
        interval: float,
        reload_now: asyncio.Event,
    ) -> None:
        self.catalog_path = catalog_path
        self.catalog = catalog
        self.reload = reload
        self.interval = interval
        self.reload_now = reload_now

    def signature(self) -> Signature:
        """Cheap change detector: stat of the catalog file and of every adapter file."""
        paths = [self.catalog_path]
        for route in self.catalog.table.routes.values():
            if route.lora is not None:
                paths += sorted(Path(route.lora.path).iterdir())
        sig: list[FileStat] = []
        for path in paths:
            try:
                st = path.stat()
                sig.append((str(path), st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append((str(path), None, None))
        return tuple(sig)

    async def run(self) -> None:
        last = self.signature()
        while True:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.reload_now.wait(), timeout=self.interval)
            asked = self.reload_now.is_set()  # SIGHUP reloads even when no file changed
            self.reload_now.clear()
            current = self.signature()
            if asked or current != last:
                current = await settled(self.signature, current, quiet=min(0.1, self.interval))
                await self.reload()
                # Files the reload read keep the stat seen before it: one changed while the
                # reload ran (it awaits the engine) differs at the next poll, not never.
                before = {path: (mtime, size) for path, mtime, size in current}
                last = tuple((p, *before.get(p, (m, s))) for p, m, s in self.signature())
            await self.catalog.remove_drained()


async def settled(signature: Callable[[], T], seen: T, *, quiet: float, max_wait: float = 2.0) -> T:
    """Wait until ``signature()`` stays the same for ``quiet`` seconds (a save or a copy in
    progress), at most ``max_wait``: a reload should read whole files, not half of an edit."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet)
        now = signature()
        if now == seen:
            break
        seen = now
    return seen
