"""ResponseStore: per-key rows, expiry, purge, persistence across opens."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.errors import ConfigError, StoreFailed
from gateway.settings import GatewaySettings, ResponsesSettings
from gateway.store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def response(rid: str = "resp_1") -> dict[str, object]:
    return {"id": rid, "object": "response", "status": "completed"}


HISTORY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


async def test_a_key_reads_its_own_rows_only() -> None:
    store = ResponseStore(":memory:", ttl_s=60)
    await store.put("alice", response(), HISTORY)
    mine = await store.get("alice", "resp_1")
    assert mine is not None and mine.response == response() and mine.history == HISTORY
    assert await store.get("bob", "resp_1") is None
    assert await store.get("", "resp_1") is None  # auth off is an owner of its own


async def test_the_same_id_under_two_keys_stays_apart() -> None:
    store = ResponseStore(":memory:", ttl_s=60)
    store.put_now("alice", response(), HISTORY)
    store.put_now("bob", response(), [{"role": "user", "content": "other"}])
    alice, bob = store.get_now("alice", "resp_1"), store.get_now("bob", "resp_1")
    assert alice is not None and bob is not None and alice.history != bob.history


async def test_delete_is_per_key() -> None:
    store = ResponseStore(":memory:", ttl_s=60)
    await store.put("alice", response(), HISTORY)
    assert not await store.delete("bob", "resp_1")
    assert await store.get("alice", "resp_1") is not None
    assert await store.delete("alice", "resp_1")
    assert await store.get("alice", "resp_1") is None
    assert not await store.delete("alice", "resp_1")


def test_expired_rows_are_invisible_then_purged() -> None:
    """The purge (a scan for expired rows) runs on a write at most once a minute, so a busy
    store does not pay for it on every write; until then expired rows are only hidden."""
    clock = Clock()
    store = ResponseStore(":memory:", ttl_s=10, clock=clock)
    store.put_now("alice", response("resp_old"), HISTORY)  # the first write purges
    clock.now += 9
    assert store.get_now("alice", "resp_old") is not None
    clock.now += 1
    assert store.get_now("alice", "resp_old") is None  # at expiry, gone
    assert not store.delete_now("alice", "resp_old")
    assert store.count_now() == 1  # still on disk until a write purges it
    store.put_now("alice", response("resp_soon"), HISTORY)  # 10 s after the last purge: none
    assert store.count_now() == 2
    clock.now += 60
    store.put_now("alice", response("resp_new"), HISTORY)
    assert store.count_now() == 1 and store.get_now("alice", "resp_new") is not None


def test_rows_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "responses.sqlite3"
    first = ResponseStore(path, ttl_s=60)
    first.put_now("alice", response(), HISTORY)
    first.close()
    again = ResponseStore(path, ttl_s=60).get_now("alice", "resp_1")
    assert again is not None and again.history == HISTORY


def test_no_file_until_first_use(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, ttl_s=60)
    assert not path.exists()
    store.get_now("alice", "nothing")
    assert path.exists()


def test_store_path_settings(tmp_path: Path) -> None:
    assert ResponsesSettings().resolved_path(tmp_path) == str(tmp_path / "responses.sqlite3")
    assert ResponsesSettings(store_path=":memory:").resolved_path(tmp_path) == ":memory:"
    assert ResponsesSettings(store_path=str(tmp_path / "x.db")).resolved_path(Path("/nowhere")) == str(
        tmp_path / "x.db"
    )
    settings = GatewaySettings(responses={"ttl_s": 5})
    assert settings.responses.ttl_s == 5
    assert ResponsesSettings().ttl_s == 30 * 24 * 3600


async def test_a_file_that_is_not_a_store_fails_open_with_the_setting_named(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"not a database " * 100)
    with pytest.raises(ConfigError, match=r"responses.store_path: cannot open .*: file is not a database"):
        await ResponseStore(path, ttl_s=60).open()
    under_a_file = tmp_path / "responses.sqlite3" / "x.sqlite3"  # its folder cannot be made
    with pytest.raises(ConfigError, match="responses.store_path: cannot open"):
        await ResponseStore(under_a_file, ttl_s=60).open()


async def test_a_failure_later_is_store_failed_not_an_internal_error(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, ttl_s=60)
    await store.open()
    await store.put("alice", response(), HISTORY)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN EXCLUSIVE")  # another process holding the file past the busy timeout
    try:
        store._connect().execute("PRAGMA busy_timeout = 10")  # not 5 s of waiting in a test
        with pytest.raises(StoreFailed) as info:
            await store.put("alice", response("resp_2"), HISTORY)
        assert info.value.status_code == 500
        assert info.value.to_dict()["error"] == {
            "message": "the response store failed: database is locked",
            "type": "server_error",
            "param": None,
            "code": "store_error",
        }
    finally:
        other.execute("ROLLBACK")
        other.close()
    await store.put("alice", response("resp_2"), HISTORY)  # and works again once it is free
    assert await store.get("alice", "resp_2") is not None


def size_of(rid: str = "resp_1", history: list[dict[str, str]] = HISTORY) -> int:
    """What a row counts against the bounds: its JSON."""
    return len(json.dumps(response(rid))) + len(json.dumps(history))


def ids(store: ResponseStore, owner: str, *rids: str) -> list[str]:
    return [rid for rid in rids if store.get_now(owner, rid) is not None]


def test_over_max_bytes_the_oldest_go_first_whoever_wrote_them() -> None:
    clock = Clock()
    store = ResponseStore(":memory:", ttl_s=600, clock=clock, max_bytes=3 * size_of("resp_1"))
    for owner, rid in (("alice", "resp_1"), ("bob", "resp_2"), ("alice", "resp_3")):
        store.put_now(owner, response(rid), HISTORY)
        clock.now += 1
    assert store.usage() == (3, 3 * size_of("resp_1"))  # at the bound, nothing goes
    store.put_now("bob", response("resp_4"), HISTORY)
    assert ids(store, "alice", "resp_1", "resp_3") == ["resp_3"]
    assert ids(store, "bob", "resp_2", "resp_4") == ["resp_2", "resp_4"]
    assert store.usage() == (3, 3 * size_of("resp_1")) and store.count_now() == 3
    clock.now += 1
    big = HISTORY * 2  # one row that needs the room of two
    store.put_now("alice", response("resp_5"), big)
    assert ids(store, "bob", "resp_2", "resp_4") == ["resp_4"]  # resp_2 alone was not enough room
    assert ids(store, "alice", "resp_3", "resp_5") == ["resp_5"]
    assert store.usage() == (2, size_of("resp_4") + size_of("resp_5", big))


def test_a_keys_bound_evicts_its_own_oldest_only() -> None:
    clock = Clock()
    store = ResponseStore(":memory:", ttl_s=600, clock=clock, max_bytes_per_key=2 * size_of("resp_1"))
    store.put_now("bob", response("resp_0"), HISTORY)
    for rid in ("resp_1", "resp_2", "resp_3", "resp_4"):
        clock.now += 1
        store.put_now("alice", response(rid), HISTORY)
    assert ids(store, "alice", "resp_1", "resp_2", "resp_3", "resp_4") == ["resp_3", "resp_4"]
    assert ids(store, "bob", "resp_0") == ["resp_0"]  # older than all of them, and kept
    assert store.usage() == (3, 3 * size_of("resp_1"))


def test_rows_written_in_one_clock_tick_go_in_the_order_written() -> None:
    big = HISTORY * 2  # the first row is the largest: neither id nor size may order them
    bound = size_of("resp_9", big) + size_of("resp_5")
    store = ResponseStore(":memory:", ttl_s=600, clock=lambda: 1000.0, max_bytes_per_key=bound)
    for rid, history in (("resp_9", big), ("resp_5", HISTORY), ("resp_1", HISTORY)):
        store.put_now("alice", response(rid), history)
    assert ids(store, "alice", "resp_9", "resp_5", "resp_1") == ["resp_5", "resp_1"]


def test_a_response_over_a_bound_by_itself_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(":memory:", ttl_s=600, max_bytes=10 * size_of(), max_bytes_per_key=size_of())
    store.put_now("alice", response("resp_1"), HISTORY)
    store.put_now("alice", response("resp_2"), HISTORY * 2)
    assert ids(store, "alice", "resp_1", "resp_2") == ["resp_1"]
    assert store.usage() == (1, size_of())


def test_no_bound_keeps_everything() -> None:
    store = ResponseStore(":memory:", ttl_s=600, max_bytes=0, max_bytes_per_key=0)
    for n in range(100):
        store.put_now("alice", response(f"resp_{n}"), HISTORY * 10)
    assert store.count_now() == 100 and store.usage()[0] == 100


def test_the_totals_follow_deletes_purges_replaces_and_reopens(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, ttl_s=10, clock=clock, max_bytes=1 << 20)
    store.put_now("alice", response("resp_1"), HISTORY)
    store.put_now("alice", response("resp_1"), HISTORY * 2)  # the same id again replaces it
    store.put_now("bob", response("resp_2"), HISTORY)
    assert store.usage() == (2, size_of("resp_1", HISTORY * 2) + size_of("resp_2"))
    assert store.delete_now("bob", "resp_2")
    assert store.usage() == (1, size_of("resp_1", HISTORY * 2))
    store.close()
    again = ResponseStore(path, ttl_s=10, clock=clock, max_bytes=1 << 20)
    again.open_now()
    assert again.usage() == (1, size_of("resp_1", HISTORY * 2))  # read back from the file
    clock.now += 60  # resp_1 expired; the next write purges it
    again.put_now("bob", response("resp_3"), HISTORY)
    assert again.usage() == (1, size_of("resp_3")) == (again.count_now(), size_of("resp_3"))


def test_a_failed_write_leaves_the_totals_right(monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResponseStore(":memory:", ttl_s=600, max_bytes=2 * size_of())
    store.put_now("alice", response("resp_1"), HISTORY)
    store.put_now("alice", response("resp_2"), HISTORY)

    def full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "_evict", full)  # the insert is rolled back with it
    with pytest.raises(sqlite3.OperationalError):
        store.put_now("alice", response("resp_3"), HISTORY)
    monkeypatch.undo()
    assert store.usage() == (2, 2 * size_of()) and ids(store, "alice", "resp_1", "resp_2", "resp_3") == [
        "resp_1",
        "resp_2",
    ]


def test_a_file_from_before_the_bound_is_upgraded_at_open(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE responses (id TEXT NOT NULL, owner TEXT NOT NULL, expires_at REAL NOT NULL,"
        " response TEXT NOT NULL, history TEXT NOT NULL, PRIMARY KEY (id, owner));"
    )
    for rid, expires in (("resp_1", 1600.0), ("resp_2", 1700.0)):
        old.execute(
            "INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
            (rid, "alice", expires, json.dumps(response(rid)), json.dumps(HISTORY)),
        )
    old.commit()
    old.close()
    store = ResponseStore(path, ttl_s=1000, clock=Clock(), max_bytes=2 * size_of())
    store.open_now()
    assert store.usage() == (2, 2 * size_of())
    store.put_now("alice", response("resp_3"), HISTORY)  # the oldest by its written age goes
    assert ids(store, "alice", "resp_1", "resp_2", "resp_3") == ["resp_2", "resp_3"]


def test_bound_settings() -> None:
    assert ResponsesSettings().max_bytes == 1 << 30 and ResponsesSettings().max_bytes_per_key == 0
    settings = GatewaySettings(responses={"max_bytes": 0, "max_bytes_per_key": 4096})
    assert (settings.responses.max_bytes, settings.responses.max_bytes_per_key) == (0, 4096)
    for field in ("max_bytes", "max_bytes_per_key"):
        with pytest.raises(ValidationError, match="greater than or equal to 0"):
            ResponsesSettings(**{field: -1})


def old_file(path: Path) -> None:
    """A store file as written before the bound: five columns, one row."""
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE responses (id TEXT NOT NULL, owner TEXT NOT NULL, expires_at REAL NOT NULL,"
        " response TEXT NOT NULL, history TEXT NOT NULL, PRIMARY KEY (id, owner));"
    )
    old.execute(
        "INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
        ("resp_1", "alice", 1600.0, json.dumps(response()), json.dumps(HISTORY)),
    )
    old.commit()
    old.close()


def test_gateways_opening_one_file_at_once_all_open(tmp_path: Path) -> None:
    """The set-up is one transaction that checks the columns again under the write lock, so
    a second opener waits and finds it done rather than failing on a duplicate column or at
    once with "database is locked" (seen in CI: a change of journal mode, or an index made
    after another connection changed the schema, gets no busy wait). New and old files."""

    def open_it(store: ResponseStore, start: threading.Barrier, failed: list[sqlite3.Error]) -> None:
        start.wait()
        try:
            store.open_now()
        except sqlite3.Error as exc:
            failed.append(exc)

    for n in range(60):  # without the lock most rounds fail on an old file, one in 20 on a new
        path = tmp_path / f"responses{n}.sqlite3"
        if n % 2:
            old_file(path)
        stores = [ResponseStore(path, ttl_s=1000, clock=Clock()) for _ in range(3)]
        start, failed = threading.Barrier(3), []
        threads = [threading.Thread(target=open_it, args=(store, start, failed)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failed == []
        assert [store.usage() for store in stores] == [(n % 2, size_of() if n % 2 else 0)] * 3


def test_a_half_upgraded_file_is_finished_at_open(tmp_path: Path) -> None:
    """A file that gained ``created_at`` but not ``size`` (an upgrade cut short by an older
    build, whose ALTERs were not one transaction) gets the rest, not a duplicate column."""
    path = tmp_path / "responses.sqlite3"
    old_file(path)
    half = sqlite3.connect(path)
    half.execute("ALTER TABLE responses ADD COLUMN created_at REAL NOT NULL DEFAULT 0")
    half.commit()
    half.close()
    store = ResponseStore(path, ttl_s=1000, clock=Clock())
    store.open_now()
    assert store.usage() == (1, size_of()) and store.get_now("alice", "resp_1") is not None


def test_a_file_shared_with_another_gateway_counts_its_writes(tmp_path: Path) -> None:
    """Totals kept in memory go stale when another process writes the file: they are read
    again then (SQLite's data_version), so a write evicts for what is really there."""
    clock = Clock()
    path = tmp_path / "responses.sqlite3"
    mine = ResponseStore(path, ttl_s=600, clock=clock, max_bytes=3 * size_of())
    theirs = ResponseStore(path, ttl_s=600, clock=clock, max_bytes=3 * size_of())
    for rid in ("resp_1", "resp_2", "resp_3"):
        mine.put_now("alice", response(rid), HISTORY)
        clock.now += 1
    for rid in ("resp_1", "resp_2", "resp_3"):
        assert theirs.delete_now("alice", rid)
    theirs.put_now("bob", response("resp_4"), HISTORY)
    clock.now += 1
    mine.put_now("alice", response("resp_5"), HISTORY)  # two rows of three: nothing to evict
    assert ids(mine, "bob", "resp_4") == ["resp_4"] and ids(mine, "alice", "resp_5") == ["resp_5"]
    assert mine.usage() == (2, 2 * size_of())


def _fill(store: ResponseStore, owner: str, n: int, size: int = 20_000) -> None:
    for i in range(n):
        store.put_now(owner, {**response(f"resp_{owner}_{i}"), "text": "x" * size}, HISTORY)


def test_the_file_gives_space_back_when_rows_expire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.store._SHRINK_PAGES", 16)
    path = tmp_path / "responses.sqlite3"
    clock = Clock()
    store = ResponseStore(path, ttl_s=10, clock=clock)
    _fill(store, "alice", 200)  # about 4 MB
    db = sqlite3.connect(path)
    full = db.execute("PRAGMA page_count").fetchone()[0]
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental, from the first table on
    clock.now += 100
    store.put_now("alice", response("resp_new"), HISTORY)  # purges the 200
    assert store.count_now() == 1
    after = db.execute("PRAGMA page_count").fetchone()[0]
    assert after < full / 20, (full, after)  # pages, as the next checkpoint cuts the file to


def test_deletes_give_space_back_only_past_the_threshold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, ttl_s=1000, clock=Clock())
    _fill(store, "alice", 40)
    db = sqlite3.connect(path)
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    assert store.delete_now("alice", "resp_alice_0")
    assert db.execute("PRAGMA page_count").fetchone()[0] == pages  # a few free pages: kept for reuse
    assert db.execute("PRAGMA freelist_count").fetchone()[0] > 0
    monkeypatch.setattr("gateway.store._SHRINK_PAGES", 1)
    assert store.delete_now("alice", "resp_alice_1")
    assert db.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert db.execute("PRAGMA page_count").fetchone()[0] < pages
    assert store.get_now("alice", "resp_alice_2") is not None  # the rest as they were


def test_a_file_made_before_it_shrank_is_rewritten_once_at_open(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    old = sqlite3.connect(path)
    old.execute("PRAGMA auto_vacuum = NONE")
    old.execute("CREATE TABLE t (x)")
    old.commit()
    old.close()
    first = ResponseStore(path, ttl_s=1000, clock=Clock())
    first.put_now("alice", response(), HISTORY)
    first.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    again = ResponseStore(path, ttl_s=1000, clock=Clock()).get_now("alice", "resp_1")
    assert again is not None and again.history == HISTORY


def test_a_file_it_cannot_rewrite_now_is_left_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gateway.store import _take_auto_vacuum

    db = sqlite3.connect(tmp_path / "responses.sqlite3")
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")  # a transaction open: SQLite refuses VACUUM in one
    _take_auto_vacuum(db, "the path")
    assert "the path: not rewritten" in caplog.text
    assert db.execute("SELECT x FROM t").fetchall() == [(1,)]
