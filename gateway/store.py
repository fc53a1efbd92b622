"""``ResponseStore``: stored ``/v1/responses`` objects, in an embedded SQLite file.

A row is keyed by the response id AND its owner (the caller's key name; ``""`` when
auth is off), so one key never reads, continues or deletes another key's responses: a
row of another owner looks exactly like no row. Each row keeps the Response JSON and the
conversation so far (the messages that ``previous_response_id`` continues from).

Rows expire ``ttl_s`` after they are written (OpenAI keeps responses 30 days). Expired
rows are invisible at once and purged on a later write, at most once a minute.

SQLite calls block, so the async methods run them in a worker thread
(``asyncio.to_thread``); one connection, one lock, so calls never interleave. A path of
``":memory:"`` keeps everything in memory (tests).

``open`` (at the gateway's start) opens the file, so a path that cannot hold the store or a
file that is not one is a ``ConfigError`` naming ``responses.store_path``, not a 500 on
every stored request. A failure later (disk full, locked by another process for longer than
the busy timeout) is a ``StoreFailed``: an OpenAI-shaped 500 saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gateway.errors import ConfigError, StoreFailed

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT NOT NULL,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL,
    response TEXT NOT NULL,
    history TEXT NOT NULL,
    PRIMARY KEY (id, owner)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
"""
_PURGE_EVERY_S = 60.0
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    history: list[dict[str, str]]  # the conversation up to and including this response's output


class ResponseStore:
    def __init__(self, path: str | Path, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.path = str(path)
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._purged_at = 0.0

    # -- async API (for handlers) -----------------------------------------------------
    async def open(self) -> None:
        """Open (or create) the store now; ``ConfigError`` if it cannot be."""
        try:
            await self._call(self.open_now)
        except StoreFailed as exc:
            raise ConfigError(f"responses.store_path: cannot open '{self.path}': {exc.reason}") from exc

    async def put(self, owner: str, response: dict[str, Any], history: list[dict[str, str]]) -> None:
        await self._call(self.put_now, owner, response, history)

    async def get(self, owner: str, response_id: str) -> Stored | None:
        return await self._call(self.get_now, owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._call(self.delete_now, owner, response_id)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except (sqlite3.Error, OSError) as exc:
            # The client's message names the failure, not the path (the log has both).
            reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            log.error("response store %s: %s: %s", self.path, type(exc).__name__, exc)
            raise StoreFailed(reason) from exc

    # -- blocking API -----------------------------------------------------------------
    def open_now(self) -> None:
        with self._lock:
            self._connect()

    def put_now(self, owner: str, response: dict[str, Any], history: list[dict[str, str]]) -> None:
        now = self._clock()
        row = (response["id"], owner, now + self.ttl_s, json.dumps(response), json.dumps(history))
        with self._lock:
            db = self._connect()
            with db:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
                if now - self._purged_at >= _PURGE_EVERY_S:
                    db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
                    self._purged_at = now

    def get_now(self, owner: str, response_id: str) -> Stored | None:
        with self._lock:
            found = (
                self._connect()
                .execute(
                    "SELECT response, history FROM responses WHERE id = ? AND owner = ? AND expires_at > ?",
                    (response_id, owner, self._clock()),
                )
                .fetchone()
            )
        if found is None:
            return None
        return Stored(json.loads(found[0]), json.loads(found[1]))

    def delete_now(self, owner: str, response_id: str) -> bool:
        with self._lock:
            db = self._connect()
            with db:
                cursor = db.execute(
                    "DELETE FROM responses WHERE id = ? AND owner = ? AND expires_at > ?",
                    (response_id, owner, self._clock()),
                )
        return cursor.rowcount > 0

    def count_now(self) -> int:
        """Rows on disk, expired or not (for tests of the purge)."""
        with self._lock:
            (count,) = self._connect().execute("SELECT COUNT(*) FROM responses").fetchone()
        return int(count)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def _connect(self) -> sqlite3.Connection:
        """The one connection, opened on first use (so an app that never stores opens no file)."""
        if self._db is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer
            db.executescript(_SCHEMA)
            self._db = db
        return self._db
