"""``ResponseStore``: stored ``/v1/responses`` objects, in an embedded SQLite file.

A row is keyed by the response id AND its owner (the caller's key name; ``""`` when
auth is off), so one key never reads, continues or deletes another key's responses: a
row of another owner looks exactly like no row. Each row keeps the Response JSON and the
conversation so far (the messages that ``previous_response_id`` continues from).

Rows expire ``ttl_s`` after they are written (OpenAI keeps responses 30 days). Expired
rows are invisible at once and purged on a later write, at most once a minute.

The store is bounded: ``max_bytes`` in all and ``max_bytes_per_key`` per owner (0: no
bound), counted as the JSON kept (the response and its conversation). A write that passes a
bound evicts the oldest rows first (of that owner for its own bound, of anyone for the
total) until it holds again; a response larger than a bound by itself is not kept. The
totals are kept as rows come and go (read from an index when the file opens, and again when
another process, a second gateway on the same file, wrote it since: SQLite's ``data_version``),
so a write never scans the table; the oldest rows come from an index by age. Each write is
one ``BEGIN IMMEDIATE`` transaction, so no other process writes between its count and its
evictions.

The file gives its space back: a new file is made with SQLite's incremental auto-vacuum, and
a write that purged or evicted rows frees the pages they leave once they come to a few MB
(``_SHRINK_PAGES``), so the file follows the rows kept down as well as up; a file from
before is rewritten once at open (``VACUUM``) to take the same mode. The write-ahead log is
cut back to ``_WAL_LIMIT`` at each checkpoint.

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
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
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
    created_at REAL NOT NULL DEFAULT 0,
    size INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (id, owner)
)
"""
# A file written before the bound had no age or size: they are filled in once, at open.
_UPGRADE = {
    "created_at": "ALTER TABLE responses ADD COLUMN created_at REAL NOT NULL DEFAULT 0",
    "size": "ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0",
}
_FILL = (
    "UPDATE responses SET created_at = expires_at - ?,"
    " size = length(CAST(response AS BLOB)) + length(CAST(history AS BLOB))"
)
# Both age indexes carry owner and size, so eviction and the totals at open read no row.
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at)",
    "CREATE INDEX IF NOT EXISTS responses_age ON responses (created_at, owner, size)",
    "CREATE INDEX IF NOT EXISTS responses_owner_age ON responses (owner, created_at, size)",
)
_EVICT_BATCH = 64
_SHRINK_PAGES = 1024  # free pages (4 KiB each by default) that a write gives back to the disk
_WAL_LIMIT = 4 << 20
_PURGE_EVERY_S = 60.0
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    history: list[dict[str, str]]  # the conversation up to and including this response's output


class ResponseStore:
    def __init__(
        self,
        path: str | Path,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        max_bytes: int = 0,
        max_bytes_per_key: int = 0,
    ) -> None:
        self.path = str(path)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_bytes_per_key = max_bytes_per_key
        self._clock = clock
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._purged_at = 0.0
        # Rows and bytes on disk (expired ones until purged), in all and per owner; None
        # until read from the file (at its first use).
        self._bytes: dict[str, int] | None = None
        self._rows = 0
        self._total = 0
        self._version = -1  # the file's data_version the totals were read at

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
        kept, conversation = json.dumps(response), json.dumps(history)
        size = len(kept) + len(conversation)  # ASCII (json.dumps escapes the rest): bytes
        bounds = [bound for bound in (self.max_bytes, self.max_bytes_per_key) if bound]
        if bounds and size > min(bounds):
            log.warning("response %s of %d bytes is over the store's bound: not stored", response["id"], size)
            return
        row = (response["id"], owner, now + self.ttl_s, kept, conversation, now, size)
        with self._write() as db:
            self._drop(db, "DELETE FROM responses WHERE id = ? AND owner = ?", (response["id"], owner))
            db.execute(
                "INSERT INTO responses (id, owner, expires_at, response, history, created_at, size)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )
            self._count(owner, 1, size)
            if now - self._purged_at >= _PURGE_EVERY_S:
                self._drop(db, "DELETE FROM responses WHERE expires_at <= ?", (now,))
                self._purged_at = now
            self._evict(db, owner)

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
        with self._write() as db:
            return self._drop(
                db,
                "DELETE FROM responses WHERE id = ? AND owner = ? AND expires_at > ?",
                (response_id, owner, self._clock()),
            )

    def count_now(self) -> int:
        """Rows on disk, expired or not (for tests of the purge)."""
        with self._lock:
            (count,) = self._connect().execute("SELECT COUNT(*) FROM responses").fetchone()
        return int(count)

    def usage(self) -> tuple[int, int]:
        """Rows and bytes kept (expired ones until purged); read without the lock, so a
        scrape never waits on the disk."""
        return self._rows, self._total

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, under the lock; a failed one leaves the totals as they were. After
        it commits, the free pages it left go back to the disk once there are enough of them."""
        with self._lock:
            db = self._connect()
            before = None
            try:
                with db:
                    db.execute("BEGIN IMMEDIATE")  # another process's writes wait until this commits
                    self._read_totals(db)
                    assert self._bytes is not None
                    before = dict(self._bytes), self._rows, self._total  # a dict per key: a few entries
                    yield db
            except BaseException:
                if before is not None:
                    self._bytes, self._rows, self._total = before
                raise
            _shrink(db, self.path)

    def _drop(self, db: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> bool:
        """Run a DELETE and take its rows off the totals; whether it removed any."""
        gone = db.execute(f"{sql} RETURNING owner, size", args).fetchall()
        for owner, size in gone:
            self._count(owner, -1, -size)
        return bool(gone)

    def _evict(self, db: sqlite3.Connection, owner: str) -> None:
        """The oldest rows until the bounds hold: the owner's own first, then anyone's."""
        assert self._bytes is not None
        if self.max_bytes_per_key:
            over = self._bytes.get(owner, 0) - self.max_bytes_per_key
            self._evict_oldest(db, over, "WHERE owner = ?", (owner,))
        if self.max_bytes:
            self._evict_oldest(db, self._total - self.max_bytes, "", ())

    def _evict_oldest(self, db: sqlite3.Connection, over: int, where: str, args: tuple[Any, ...]) -> None:
        evicted = 0
        while over > 0:
            oldest = db.execute(  # rowid: of rows written in one clock tick, the first first
                f"SELECT rowid, size FROM responses {where} ORDER BY created_at, rowid LIMIT {_EVICT_BATCH}",
                args,
            ).fetchall()
            if not oldest:
                return
            rowids = []
            for rowid, size in oldest:
                if over <= 0:
                    break
                rowids.append(rowid)
                over -= size
            marks = ", ".join("?" * len(rowids))
            self._drop(db, f"DELETE FROM responses WHERE rowid IN ({marks})", tuple(rowids))
            evicted += len(rowids)
        log.debug("response store: evicted the %d oldest responses to stay under its bound", evicted)

    def _count(self, owner: str, rows: int, size: int) -> None:
        assert self._bytes is not None
        self._rows += rows
        self._total += size
        left = self._bytes.get(owner, 0) + size
        if rows < 0 and not left:
            self._bytes.pop(owner, None)  # no entry per owner that ever stored
        else:
            self._bytes[owner] = left

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
            self._set_up(db)
            self._db = db
        if self._bytes is None:
            self._read_totals(self._db)
        return self._db

    def _set_up(self, db: sqlite3.Connection) -> None:
        """WAL, the table, the columns an older file lacks and the indexes, in one
        transaction under the write lock. Statement by statement, a gateway opening the file
        while another does could fail: on a duplicate column (SQLite's ALTERs each commit by
        themselves), or at once with "database is locked" (a statement that reads the schema,
        then writes, after another connection changed it, gets no busy wait). Under the lock
        a second opener waits, then finds everything there."""
        # Before the first table: it takes effect only in a file with none (an old one: below).
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        _locked_retry(lambda: db.execute("PRAGMA journal_mode=WAL"))  # readers never wait for a writer
        db.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}")
        with db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(_SCHEMA)
            missing = _missing_columns(db)
            for column in missing:
                db.execute(_UPGRADE[column])
            if missing:
                db.execute(_FILL, (self.ttl_s,))  # its age as if written under this ttl
            for statement in _INDEXES:
                db.execute(statement)
        (mode,) = db.execute("PRAGMA auto_vacuum").fetchone()
        if mode != _INCREMENTAL:
            _take_auto_vacuum(db, self.path)

    def _read_totals(self, db: sqlite3.Connection) -> None:
        """The totals from the file, unless they are current: nothing but this connection
        wrote it since they were read (its own commits leave ``data_version`` as it was)."""
        (version,) = db.execute("PRAGMA data_version").fetchone()
        if version == self._version and self._bytes is not None:
            return
        totals = db.execute("SELECT owner, COUNT(*), SUM(size) FROM responses GROUP BY owner").fetchall()
        # Built aside, then set: a scrape (``usage``, no lock) never sees them half read.
        per_key = {owner: size for owner, _, size in totals}
        self._bytes, self._rows, self._total = per_key, sum(t[1] for t in totals), sum(per_key.values())
        self._version = version


def _locked_retry(statement: Callable[[], object], wait_s: float = 5.0) -> None:
    """``statement`` again while SQLite answers "database is locked" without waiting (a
    change of journal mode while another connection opens the file), up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            statement()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL


def _shrink(db: sqlite3.Connection, path: str) -> None:
    """Give the free pages back to the disk once there are ``_SHRINK_PAGES`` of them (rows
    purged, evicted, deleted or replaced), so a store that shrank does not keep its peak size.
    Its own transaction, after the write's: a failure here (another process holds the file)
    leaves the pages for the next write and fails nothing."""
    try:
        (free,) = db.execute("PRAGMA freelist_count").fetchone()
        if free >= _SHRINK_PAGES:
            # ``executescript`` steps it to the end; ``execute`` would free one page a call.
            db.executescript("PRAGMA incremental_vacuum")
    except sqlite3.OperationalError as exc:
        log.debug("response store %s: free pages kept for now: %s", path, exc)


def _take_auto_vacuum(db: sqlite3.Connection, path: str) -> None:
    """A file made before the store shrank: rewrite it once (``VACUUM``) so the auto-vacuum
    mode set above applies. Another gateway using the file at that moment leaves it as it is
    until a later start; the store works the same, only its file keeps its size."""
    try:
        db.execute("VACUUM")
    except sqlite3.OperationalError as exc:
        log.warning(
            "response store %s: not rewritten to give space back (%s); it will be at a later start", path, exc
        )


def _missing_columns(db: sqlite3.Connection) -> list[str]:
    have = {column[1] for column in db.execute("PRAGMA table_info(responses)")}
    return [column for column in _UPGRADE if column not in have]
