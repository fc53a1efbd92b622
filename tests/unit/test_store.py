"""ResponseStore: per-key rows, expiry, purge, persistence across opens."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

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
    clock = Clock()
    store = ResponseStore(":memory:", ttl_s=10, clock=clock)
    store.put_now("alice", response("resp_old"), HISTORY)
    clock.now += 9
    assert store.get_now("alice", "resp_old") is not None
    clock.now += 1
    assert store.get_now("alice", "resp_old") is None  # at expiry, gone
    assert not store.delete_now("alice", "resp_old")
    assert store.count_now() == 1  # still on disk until a write purges it
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
