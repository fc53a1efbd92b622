"""The catalog watcher on a real directory: rejected entries come back when fixed."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from watchfiles import Change

from gateway.catalog import Catalog, LoraIds, RoutingTable, load_table
from gateway.watcher import CatalogWatcher, WatchPlan
from tests.helpers import eventually_async

SHIPPED = Path(__file__).resolve().parents[2] / "adapters"
CATALOG = """
routes:
  - {name: shout, adapter: shout}
  - {name: broken, adapter: broken}
  - {name: later, adapter: later}
"""


def write_release(root: Path, catalog_path: Path, catalog: str = CATALOG) -> None:
    """Shout and a broken adapter under ``root``; ``catalog`` (naming them) at ``catalog_path``."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(SHIPPED / "shout", root / "shout")
    shutil.copytree(SHIPPED / "shout", root / "broken")
    (root / "broken" / "adapter_config.json").write_text("{not json")
    catalog_path.parent.mkdir(parents=True, exist_ok=True)
    catalog_path.write_text(catalog)


class Rig:
    """An adapters root (``tmp_path/adapters`` unless given; it may be a link) with shout and
    a broken adapter, and a catalog file (``tmp_path/conf/adapters.yaml`` unless given; it
    may be a link) naming them and ``later`` (or ``catalog``). ``written``: the files are
    there already."""

    def __init__(
        self,
        tmp_path: Path,
        root: Path | None = None,
        catalog_path: Path | None = None,
        catalog: str = CATALOG,
        written: bool = False,
    ) -> None:
        self.root = root or tmp_path / "adapters"
        self.catalog_path = catalog_path or tmp_path / "conf" / "adapters.yaml"
        if not written:
            write_release(self.root, self.catalog_path, catalog)
        self.reloads = 0
        self.catalog = Catalog(self.build)
        self.reload_now = asyncio.Event()
        self.watcher = CatalogWatcher(
            self.catalog_path, self.root, self.catalog, self.reload, 0.05, self.reload_now
        )

    def build(self, ids: LoraIds) -> RoutingTable:
        return load_table(
            self.catalog_path,
            base_name="gemma-3-270m",
            adapters_root=self.root,
            max_lora_rank=16,
            model_modules=None,
            lora_ids=ids,
        )

    async def reload(self) -> bool:
        self.reloads += 1
        return await self.catalog.reload()


@asynccontextmanager
async def watching(
    tmp_path: Path, before: Callable[[Rig], None] | None = None, **layout: Any
) -> AsyncIterator[Rig]:
    """A rig (``layout``: its root, catalog path, ...) with its watcher running (in the test's
    own event loop); ``before(rig)`` runs after the catalog was read and before the watch starts."""
    rig = Rig(tmp_path, **layout)
    # The rig wrote its files just now: count them as read (the watcher allows a second of
    # file system clock slack before the read, and would reload once).
    rig.catalog.table = replace(rig.catalog.table, loaded_at=time.time() + 1.0)
    time.sleep(0.05)  # file times come from a coarse clock, a tick behind time.time()
    if before is not None:
        before(rig)
    task = asyncio.create_task(rig.watcher.run())
    await rig.watcher.watching.wait()  # set once the kernel's notifications are set up
    yield rig
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def within(seconds: float, ok: Callable[[], bool]) -> bool:
    """Poll ``ok`` until it holds or ``seconds`` pass (the issue's bound: 2 s)."""
    for _ in range(int(seconds / 0.05)):
        if ok():
            return True
        await asyncio.sleep(0.05)
    return ok()


async def test_a_fixed_adapter_config_goes_live_without_sighup(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        assert set(rig.catalog.table.routes) == {"shout"}
        assert "adapter_config.json is invalid" in rig.catalog.table.errors["broken"]
        config = (SHIPPED / "shout" / "adapter_config.json").read_text()
        (rig.root / "broken" / "adapter_config.json").write_text(config)  # fixed in place
        assert await within(2.0, lambda: "broken" in rig.catalog.table.routes)
        assert "broken" not in rig.catalog.table.errors
        assert not rig.reload_now.is_set() or rig.reloads >= 1


async def test_an_edit_made_before_the_watch_started_is_not_lost(tmp_path: Path) -> None:
    """The catalog is read, then the watch starts: a fix in between still goes live."""

    def fix(rig: Rig) -> None:
        config = (SHIPPED / "shout" / "adapter_config.json").read_text()
        (rig.root / "broken" / "adapter_config.json").write_text(config)

    async with watching(tmp_path, before=fix) as rig:
        assert await within(2.0, lambda: "broken" in rig.catalog.table.routes)
        assert rig.reloads == 1


async def test_no_reload_at_start_when_nothing_changed(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        await asyncio.sleep(1.5)  # past the watcher's first round
        assert rig.reloads == 0


async def test_an_adapter_directory_that_appears_later_goes_live(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        assert "adapter directory not found" in rig.catalog.table.errors["later"]
        staging = rig.root.parent / "staging"
        shutil.copytree(SHIPPED / "shout", staging)
        staging.rename(rig.root / "later")  # how a deploy drops an adapter in: whole, at once
        assert await within(2.0, lambda: "later" in rig.catalog.table.routes)


async def test_a_catalog_edit_goes_live_and_editor_files_do_not_reload(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        (rig.catalog_path.parent / ".adapters.yaml.swp").write_text("x")
        (rig.catalog_path.parent / "gateway.yaml").write_text("x")
        await asyncio.sleep(0.5)
        assert rig.reloads == 0
        rig.catalog_path.write_text(CATALOG + "  - {name: concise, system_prompt: Be brief.}\n")
        assert await within(2.0, lambda: "concise" in rig.catalog.table.routes)


def schema_of(rig: Rig, route: str) -> object:
    found = rig.catalog.table.routes.get(route)
    return None if found is None or found.response_format is None else found.response_format.value


@pytest.mark.parametrize("where", ["schema.json", "schemas/answer.json"])
async def test_a_file_schema_that_appears_or_changes_goes_live(tmp_path: Path, where: str) -> None:
    """A route's ``response_format: "file:..."`` is part of the catalog: its file appearing
    (the fix to a rejected entry) or changing reloads as the catalog file does."""
    async with watching(tmp_path) as rig:
        entry = f'  - {{name: answers, system_prompt: JSON., response_format: "file:{where}"}}\n'
        rig.catalog_path.write_text(CATALOG + entry)
        assert await within(2.0, lambda: "answers" in rig.catalog.table.errors)
        assert "No such file" in rig.catalog.table.errors["answers"]
        schema = rig.catalog_path.parent / where
        schema.parent.mkdir(exist_ok=True)
        first = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
        schema.write_text(json.dumps(first))
        assert await within(2.0, lambda: schema_of(rig, "answers") == first)
        second = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
        schema.write_text(json.dumps(second))  # edited in place
        assert await within(2.0, lambda: schema_of(rig, "answers") == second)


async def test_a_file_schema_behind_a_link_goes_live_when_the_link_is_repointed(tmp_path: Path) -> None:
    """``file:schemas/current.json``, a link to the version in use: re-pointing it (``ln -sfn``)
    changes what is read, though neither file changed. Only the file it pointed to was
    watched, so the old schema kept serving until another edit."""
    versions = [{"type": "object", "properties": {k: {"type": "string"}}, "required": [k]} for k in "ab"]
    async with watching(tmp_path) as rig:
        folder = rig.catalog_path.parent / "schemas"
        folder.mkdir()
        for n, schema in enumerate(versions):
            (folder / f"v{n}.json").write_text(json.dumps(schema))
        (folder / "current.json").symlink_to("v0.json")
        entry = '  - {name: answers, system_prompt: JSON., response_format: "file:schemas/current.json"}\n'
        rig.catalog_path.write_text(CATALOG + entry)
        assert await within(2.0, lambda: schema_of(rig, "answers") == versions[0])
        # Settle: the watch set up again for the schema's folder reloads once more, as the catalog
        # was written less than a second (the clock slack) before it was read.
        assert await within(5.0, lambda: rig.reloads >= 2)
        await asyncio.sleep(0.3)
        reloads = rig.reloads
        (folder / "next.json").symlink_to("v1.json")
        (folder / "next.json").rename(folder / "current.json")  # ln -sfn: one rename
        assert await within(2.0, lambda: schema_of(rig, "answers") == versions[1])
        assert rig.reloads > reloads


@pytest.mark.parametrize("wrong", ["current.json", "/etc/hostname"])
async def test_a_file_schema_link_in_a_loop_or_out_of_the_folder_goes_live_once_fixed(
    tmp_path: Path, wrong: str
) -> None:
    """A link that loops or points out of the catalog's folder rejects the entry (nothing out
    of the folder is read) and the watcher goes on; re-pointing the link is the fix, seen
    like a schema file appearing. Before, such an entry's link was not watched at all."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    async with watching(tmp_path) as rig:
        folder = rig.catalog_path.parent / "schemas"
        folder.mkdir()
        (folder / "v0.json").write_text(json.dumps(schema))
        (folder / "current.json").symlink_to(wrong)
        entry = '  - {name: answers, system_prompt: JSON., response_format: "file:schemas/current.json"}\n'
        rig.catalog_path.write_text(CATALOG + entry)
        assert await within(2.0, lambda: "answers" in rig.catalog.table.errors)
        assert await within(5.0, lambda: rig.watcher.watching.is_set() and rig.reloads >= 2)
        await asyncio.sleep(0.3)
        (folder / "next.json").symlink_to("v0.json")
        (folder / "next.json").rename(folder / "current.json")
        assert await within(2.0, lambda: schema_of(rig, "answers") == schema)


async def test_sighup_reloads_with_no_file_change(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        rig.reload_now.set()
        assert await within(2.0, lambda: rig.reloads == 1)


async def test_a_change_during_a_reload_is_not_lost(tmp_path: Path) -> None:
    async with watching(tmp_path) as rig:
        gate = asyncio.Event()
        plain_reload = rig.reload

        async def slow_reload() -> bool:
            ok = await plain_reload()
            await gate.wait()  # the engine is busy loading adapters
            return ok

        rig.watcher.reload = slow_reload
        rig.reload_now.set()
        assert await within(2.0, lambda: rig.reloads == 1)
        config = json.loads((SHIPPED / "shout" / "adapter_config.json").read_text())
        (rig.root / "broken" / "adapter_config.json").write_text(json.dumps(config))  # mid-reload
        await asyncio.sleep(0.5)
        gate.set()
        assert await within(2.0, lambda: "broken" in rig.catalog.table.routes)
        assert rig.reloads == 2


async def test_a_failed_reload_or_removal_is_logged_and_the_watcher_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anything but a ConfigError from a reload or a removal ended the watcher for good, with
    nothing logged: no more hot swap, no more removals."""
    async with watching(tmp_path) as rig:
        plain_reload, plain_remove = rig.watcher.reload, rig.catalog.remove_drained
        failed: set[str] = set()

        async def reload_failing_once() -> bool:
            if "reload" not in failed:
                failed.add("reload")
                raise RuntimeError("reload blew up")
            return await plain_reload()

        async def remove_failing_once() -> list[int]:
            if "remove" not in failed:
                failed.add("remove")
                raise OSError("remove blew up")
            return await plain_remove()

        rig.watcher.reload = reload_failing_once
        rig.catalog.remove_drained = remove_failing_once  # type: ignore[method-assign]
        rig.reload_now.set()
        await eventually_async(lambda: failed == {"reload", "remove"}, 10, "both steps failed once")
        config = (SHIPPED / "shout" / "adapter_config.json").read_text()
        (rig.root / "broken" / "adapter_config.json").write_text(config)
        await eventually_async(lambda: "broken" in rig.catalog.table.routes, 10, "the fix went live")
    logged = [r.getMessage() for r in caplog.records if r.name == "gateway.watcher" and r.exc_info]
    assert logged == [
        "catalog reload failed; the catalog watcher goes on",
        "removing drained adapters failed; the catalog watcher goes on",
    ]


def fix_broken(root: Path) -> None:
    config = (SHIPPED / "shout" / "adapter_config.json").read_text()
    (root / "broken" / "adapter_config.json").write_text(config)


def drop_in_later(rig: Rig, root: Path) -> None:
    staging = rig.catalog_path.parent / "staging"
    shutil.copytree(SHIPPED / "shout", staging)
    staging.rename(root / "later")


async def watches_the_files_as_they_are_now(rig: Rig) -> None:
    """The watch was set up again for where the paths lead now (its plan is today's)."""
    w = rig.watcher
    await eventually_async(
        lambda: w.watching.is_set() and w.plan == WatchPlan.of(w.catalog_path, w.adapters_root),
        10,
        "the watch follows the files",
    )


async def test_an_edit_to_a_catalog_file_linked_from_another_folder_goes_live(tmp_path: Path) -> None:
    """The catalog file is a link into another folder: edits happen there, not next to the link."""
    shared = tmp_path / "shared" / "adapters.yaml"
    shared.parent.mkdir()
    shared.touch()
    link = tmp_path / "conf" / "adapters.yaml"
    link.parent.mkdir()
    link.symlink_to(shared)
    async with watching(tmp_path, catalog_path=link) as rig:
        shared.write_text(CATALOG + "  - {name: concise, system_prompt: Be brief.}\n")
        await eventually_async(lambda: "concise" in rig.catalog.table.routes, 10, "the edit went live")


async def test_an_adapters_root_link_swapped_by_a_deploy_is_watched_again(tmp_path: Path) -> None:
    """``adapters -> releases/1`` is replaced at once by a link to ``releases/2``."""
    release1 = tmp_path / "releases" / "1"
    release1.mkdir(parents=True)
    root = tmp_path / "adapters"
    root.symlink_to(release1)
    async with watching(tmp_path, root=root) as rig:
        release2 = tmp_path / "releases" / "2"
        shutil.copytree(release1, release2)
        fix_broken(release2)
        (tmp_path / "adapters.new").symlink_to(release2)
        (tmp_path / "adapters.new").replace(root)
        await eventually_async(lambda: "broken" in rig.catalog.table.routes, 10, "release 2 went live")
        await watches_the_files_as_they_are_now(rig)
        assert rig.watcher.plan.root == release2.resolve()
        drop_in_later(rig, release2)
        await eventually_async(
            lambda: "later" in rig.catalog.table.routes, 10, "an adapter in release 2 went live"
        )


async def test_an_adapters_root_replaced_whole_is_watched_again(tmp_path: Path) -> None:
    """A deploy deletes the adapters directory and renames a new one into its place."""
    async with watching(tmp_path) as rig:
        new_root = tmp_path / "new-root"
        shutil.copytree(rig.root, new_root)
        fix_broken(new_root)
        shutil.rmtree(rig.root)
        new_root.rename(rig.root)
        await eventually_async(lambda: "broken" in rig.catalog.table.routes, 10, "the new root went live")
        await watches_the_files_as_they_are_now(rig)
        drop_in_later(rig, rig.root)
        await eventually_async(
            lambda: "later" in rig.catalog.table.routes, 10, "an adapter in the new root went live"
        )


def test_what_the_watcher_looks_at(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    relevant = rig.watcher.relevant
    conf = rig.catalog_path.parent
    assert relevant(Change.modified, str(rig.catalog_path))
    assert relevant(Change.added, str(conf / "..data"))  # a ConfigMap mount's atomic swap
    assert relevant(Change.added, str(rig.root.resolve() / "new" / "adapter_config.json"))
    assert not relevant(Change.added, str(conf / "adapters.yaml~"))
    assert not relevant(Change.modified, str(conf / "templates" / "adapters.yaml"))
    assert relevant(Change.added, str(rig.root))  # the root replaced, or a root link swapped
    assert not relevant(Change.modified, str(conf / "schema.json"))  # named by no entry
    assert not relevant(Change.added, str(rig.root.parent / "adapters.new"))


async def test_a_release_link_above_the_root_rolled_back_is_reloaded(tmp_path: Path) -> None:
    """``current -> releases/N`` above both the adapters root and the catalog, re-pointed back
    to an older release: the watch was set up again there, but its files are older than the
    last read, so nothing reloaded and the newer release's adapters kept serving."""
    releases, current = tmp_path / "releases", tmp_path / "current"
    for n in ("1", "2"):
        write_release(releases / n / "adapters", releases / n / "conf" / "adapters.yaml")
    fix_broken(releases / "2" / "adapters")
    current.symlink_to("releases/2")
    time.sleep(1.1)  # the releases are older than the read (and its second of clock slack)
    layout = {"root": current / "adapters", "catalog_path": current / "conf" / "adapters.yaml"}
    async with watching(tmp_path, written=True, **layout) as rig:
        assert "broken" in rig.catalog.table.routes and rig.reloads == 0
        (tmp_path / "current.new").symlink_to("releases/1")
        (tmp_path / "current.new").replace(current)  # ln -sfn releases/1 current: one rename
        assert await within(3.0, lambda: "broken" in rig.catalog.table.errors)
        assert rig.watcher.plan.root == (releases / "1" / "adapters").resolve()


NUL_SCHEMA = '  - {name: odd, system_prompt: x, response_format: "file:a\\0b/c.json"}\n'


def watcher_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.watcher" and r.exc_info]


async def test_a_nul_in_a_file_schema_path_at_start_does_not_stop_the_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NUL byte in a path is ValueError, not OSError: the watcher's first plan raised (in
    ``Gateway.run``, which ended), and its check of file times failed every round, so a fix
    in place was missed."""
    async with watching(tmp_path, catalog=CATALOG + NUL_SCHEMA) as rig:
        assert "odd" in rig.catalog.table.errors
        fix_broken(rig.root)
        assert await within(3.0, lambda: "broken" in rig.catalog.table.routes)
        rig.catalog_path.write_text(CATALOG + "  - {name: concise, system_prompt: Be brief.}\n")
        assert await within(3.0, lambda: "concise" in rig.catalog.table.routes)
    assert watcher_failures(caplog) == []


async def test_a_nul_in_a_file_schema_path_added_by_an_edit_does_not_stop_the_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan made at the top of the watch loop raised out of it: file watching ended
    silently, and every later edit (the one removing the entry too) was missed."""
    async with watching(tmp_path) as rig:
        rig.catalog_path.write_text(CATALOG + NUL_SCHEMA)
        assert await within(3.0, lambda: "odd" in rig.catalog.table.errors)
        await asyncio.sleep(1.5)  # a round or two of the watch with the path in the table
        rig.catalog_path.write_text(CATALOG + "  - {name: concise, system_prompt: Be brief.}\n")
        assert await within(3.0, lambda: "concise" in rig.catalog.table.routes)
    assert watcher_failures(caplog) == []
