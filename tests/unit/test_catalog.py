"""Routing and registration-time validation of the adapter catalog."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from safetensors.numpy import save_file

from gateway import catalog as catalog_module
from gateway.adapter_slots import AdapterSlots
from gateway.adapters_check import AdapterInfo, ModelShapes, safe_adapter_path
from gateway.catalog import Catalog, LoraIds, RoutingTable, load_table
from gateway.errors import ConfigError, GatewayError, InvalidRequest, ModelNotFound
from gateway.metrics import GatewayMetrics
from gateway.snapshots import SnapshotDir
from tests.unit.fakes import FakeEngine

_SHAPES = {"q_proj": (32, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 32)}
_SHAPES |= {"gate_proj": (48, 16), "up_proj": (48, 16), "down_proj": (16, 48)}
MODULES = ModelShapes(  # a small model of 2 layers
    {f"layers.{i}.self_attn.{n}": s for i in range(2) for n, s in _SHAPES.items()}
    | {"embed_tokens": (100, 16)}
)


def lora_tensors(rank: int, targets: list[str], seed: str) -> dict[str, np.ndarray]:
    """PEFT-named lora_A [r, in] / lora_B [out, r] tensors that fit MODULES."""
    fill = float(sum(seed.encode()))
    tensors = {}
    for i in range(2):
        for t in targets:
            out_f, in_f = _SHAPES.get(t, (4, 4))
            prefix = f"base_model.model.model.layers.{i}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = np.full((rank, in_f), fill, dtype=np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_f, rank), dtype=np.float32)
    return tensors


def make_adapter(
    root: Path, name: str, *, rank: int = 8, base: str = "base-model", targets: list[str] | None = None
) -> Path:
    path = root / name
    path.mkdir(parents=True)
    config = {
        "r": rank,
        "lora_alpha": 16,
        "target_modules": targets or ["q_proj", "v_proj"],
        "base_model_name_or_path": base,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(lora_tensors(rank, config["target_modules"], name), str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    make_adapter(root, "shout")
    make_adapter(root, "json")
    return root


def write_catalog(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "adapters.yaml"
    path.write_text(text)
    return path


CATALOG = """
base:
  aliases: [base]
  tasks: [general]
routes:
  - name: shout
    adapter: shout
    aliases: [loud, caps]
    tasks: [shouting]
    defaults: {temperature: 0.0, max_tokens: 32}
  - name: json
    adapter: json
    tasks: [extract]
  - name: concise
    system_prompt: Answer in one sentence.
    tasks: [summary]
"""


def table_for(tmp_path: Path, root: Path, text: str = CATALOG, **kw: object) -> RoutingTable:
    opts: dict[str, object] = dict(
        base_name="base-model",
        adapters_root=root,
        max_lora_rank=16,
        model_modules=MODULES,
        lora_ids=LoraIds(),
    )
    opts.update(kw)
    return load_table(write_catalog(tmp_path, text), **opts)  # type: ignore[arg-type]


def test_names_aliases_and_tasks_reach_the_same_route(tmp_path: Path, root: Path) -> None:
    table = table_for(tmp_path, root)
    shout = table.resolve("shout")
    assert shout.kind == "lora" and shout.lora is not None
    assert table.resolve("loud") is shout
    assert table.resolve("caps") is shout
    assert table.resolve(None, "shouting") is shout
    assert table.resolve("base-model", "shouting") is shout  # base name + task: the task picks
    assert table.resolve("base") is table.base
    assert table.resolve(None) is table.base
    assert table.resolve("concise").kind == "preset"
    assert table.resolve("concise").system_prompt == "Answer in one sentence."


@pytest.mark.parametrize(
    "name", ["nope", "../shout", "/etc/passwd", "http://evil/x", "shout/../json", "SHOUT", ""]
)
def test_unknown_and_path_like_names_are_404(tmp_path: Path, root: Path, name: str) -> None:
    table = table_for(tmp_path, root)
    if name == "":
        assert table.resolve(name) is table.base  # empty model: the base, as if absent
        return
    with pytest.raises(ModelNotFound) as info:
        table.resolve(name)
    assert info.value.status_code == 404
    assert info.value.to_dict()["error"]["code"] == "model_not_found"


def test_unknown_task_is_404_on_param_task(tmp_path: Path, root: Path) -> None:
    with pytest.raises(ModelNotFound) as info:
        table_for(tmp_path, root).resolve(None, "nope")
    assert info.value.param == "task"
    assert info.value.message == "No model serves the task 'nope', or you do not have access to it."


def test_model_and_task_naming_different_routes_is_400(tmp_path: Path, root: Path) -> None:
    with pytest.raises(InvalidRequest):
        table_for(tmp_path, root).resolve("json", "shouting")


def test_defaults_are_carried(tmp_path: Path, root: Path) -> None:
    shout = table_for(tmp_path, root).resolve("shout")
    assert shout.defaults.temperature == 0.0
    assert shout.defaults.max_tokens == 32


def test_a_route_default_may_be_what_a_request_may_send(tmp_path: Path, root: Path) -> None:
    """A repetition_penalty default above 2 rejected its entry, though a request may send
    it (up to 1e30, as vLLM takes any positive value)."""
    text = "routes:\n  - {name: strict, system_prompt: Hi, defaults: {repetition_penalty: 2.5}}\n"
    table = table_for(tmp_path, root, text)
    assert not table.errors and table.resolve("strict").defaults.repetition_penalty == 2.5


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        ("../outside", "relative and inside"),
        ("/etc", "relative and inside"),
        ("http://x/y", "relative and inside"),
        ("missing", "not found"),
        ("escape", "escapes the adapters root"),
        ("bigrank", "rank 64 is above"),
        ("otherbase", "trained for base model"),  # with strict_base_model: true
        ("badtargets", "target modules not in the model: lm_head_x"),
        ("badjson", "adapter_config.json is invalid"),
        ("noweights", "missing adapter_model.safetensors"),
        ("loop", "cannot be resolved"),  # a symlink to itself: Path.resolve() raises
    ],
)
def test_bad_entries_are_rejected_and_the_rest_serve(
    tmp_path: Path, root: Path, adapter: str, reason: str
) -> None:
    outside = make_adapter(tmp_path / "elsewhere", "outside")
    os.symlink(outside, root / "escape")
    make_adapter(root, "bigrank", rank=64)
    make_adapter(root, "otherbase", base="/models/llama-3-8b")
    make_adapter(root, "badtargets", targets=["q_proj", "lm_head_x"])
    (make_adapter(root, "badjson") / "adapter_config.json").write_text("{not json")
    (make_adapter(root, "noweights") / "adapter_model.safetensors").unlink()
    os.symlink("loop", root / "loop")
    text = CATALOG + f"  - name: broken\n    adapter: {adapter}\n    strict_base_model: true\n"
    table = table_for(tmp_path, root, text)
    assert "broken" in table.errors
    assert reason in table.errors["broken"]
    assert set(table.routes) == {"shout", "json", "concise"}
    with pytest.raises(ModelNotFound):
        table.resolve("broken")


def test_weights_gone_between_check_and_digest_reject_only_that_entry(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy removes an adapter's files while the catalog reads them."""
    checked = catalog_module.check_adapter

    def check_then_vanish(path: Path, *args: Any, **kw: Any) -> AdapterInfo:
        info = checked(path, *args, **kw)
        if path.name == "json":
            (path / "adapter_model.safetensors").unlink()
        return info

    monkeypatch.setattr(catalog_module, "check_adapter", check_then_vanish)
    table = table_for(tmp_path, root)
    assert "json: missing adapter_model.safetensors" in table.errors["json"]
    assert set(table.routes) == {"shout", "concise"}


def test_a_response_format_file_that_is_a_symlink_loop_rejects_only_that_entry(
    tmp_path: Path, root: Path
) -> None:
    os.symlink("loop.json", tmp_path / "loop.json")
    table = table_for(
        tmp_path, root, CATALOG + "  - {name: looped, system_prompt: x, response_format: 'file:loop.json'}\n"
    )
    assert "response_format: file:loop.json" in table.errors["looped"]
    assert set(table.routes) == {"shout", "json", "concise"}


def test_duplicate_names_are_rejected(tmp_path: Path, root: Path) -> None:
    text = CATALOG + "  - name: other\n    aliases: [loud]\n"
    table = table_for(tmp_path, root, text)
    assert "already used: loud" in table.errors["other"]


def test_a_repeated_name_is_rejected_even_while_the_first_entry_is_broken(tmp_path: Path, root: Path) -> None:
    """The second ``dup`` served while the first was broken, so fixing the first moved the
    route's traffic to other weights; and each entry's report overwrote the other's."""
    text = CATALOG + "  - {name: dup, adapter: missing}\n  - {name: dup, adapter: shout}\n"
    table = table_for(tmp_path, root, text)
    assert "dup" not in table.routes
    assert "not found" in table.errors["dup"] and table.errors["routes[4]"] == "name already used: dup"
    text = CATALOG + "  - {name: dup, adapter: shout}\n  - {name: dup, adapter: json}\n"
    table = table_for(tmp_path, root, text)
    assert table.resolve("dup").lora is not None and "dup" not in table.errors
    assert table.errors["routes[4]"] == "name already used: dup"


def test_a_name_listed_twice_on_one_entry_is_an_error_not_a_second_card(tmp_path: Path, root: Path) -> None:
    """An alias that repeats its entry's name or another of its aliases was accepted and gave
    /v1/models two cards with one id."""
    for extra in ("aliases: [other]", "aliases: [z, z]"):
        table = table_for(tmp_path, root, CATALOG + f"  - {{name: other, system_prompt: x, {extra}}}\n")
        assert "is named twice" in table.errors["other"] and "other" not in table.routes
    with pytest.raises(ConfigError, match="base.aliases: base-model is named twice"):
        table_for(tmp_path, root, CATALOG.replace("aliases: [base]", "aliases: [base, base-model]"))


def test_an_alias_never_takes_another_routes_name(tmp_path: Path, root: Path) -> None:
    """An alias added to an earlier entry that names a later route must not reject that
    route and send its traffic to another adapter: the entry with the alias is the clash."""
    text = CATALOG.replace("aliases: [loud, caps]", "aliases: [loud, caps, json]")
    table = table_for(tmp_path, root, text)
    assert "already used: json" in table.errors["shout"] and "json" not in table.errors
    assert table.resolve("json").name == "json" and table.resolve("json").lora is not None


def test_a_broken_entry_keeps_its_name_from_another_entrys_alias(tmp_path: Path, root: Path) -> None:
    text = CATALOG.replace("adapter: json", "adapter: missing") + "  - name: other\n    aliases: [json]\n"
    table = table_for(tmp_path, root, text)
    assert "not found" in table.errors["json"] and "already used: json" in table.errors["other"]


def test_a_task_that_another_entry_uses_rejects_the_entry_that_repeats_it(tmp_path: Path, root: Path) -> None:
    """A task names one route: a second entry with it was accepted and its task silently went
    to the first (the base model's tasks come first, as its aliases do)."""
    text = CATALOG + "  - {name: other, system_prompt: x, tasks: [shouting]}\n"
    text += "  - {name: general-preset, system_prompt: x, tasks: [general]}\n"
    table = table_for(tmp_path, root, text)
    assert table.errors == {
        "other": "task already used: shouting",
        "general-preset": "task already used: general",
    }
    assert table.resolve(None, "shouting").name == "shout"
    assert table.resolve(None, "general") is table.base


def test_a_base_alias_that_names_a_route_is_the_files_error(tmp_path: Path, root: Path) -> None:
    """The base model's alias took the route's own name and the route was rejected, so an
    edit of the base entry moved the route's traffic to the base model."""
    with pytest.raises(ConfigError, match=r"base.aliases: shout is a route's name"):
        table_for(tmp_path, root, CATALOG.replace("aliases: [base]", "aliases: [base, shout]"))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("aliases", "''", "aliases.0: String should have at least 1 character"),
        ("aliases", "'two words'", "aliases.0: String should match pattern"),
        ("aliases", "' loud2'", "aliases.0: String should match pattern"),
        ("tasks", "''", "tasks.0: String should have at least 1 character"),
        ("tasks", "'a/b'", "tasks.0: String should match pattern"),
    ],
)
def test_aliases_and_tasks_are_names_a_request_can_send(
    tmp_path: Path, root: Path, field: str, value: str, reason: str
) -> None:
    """An empty alias or task could never be asked for (an empty ``model`` is no model) yet
    was listed in /v1/models; one with a space was one no client that trims could reach."""
    table = table_for(
        tmp_path, root, CATALOG + f"  - {{name: other, system_prompt: x, {field}: [{value}]}}\n"
    )
    assert reason in table.errors["other"] and "other" not in table.routes
    line = {"aliases": "aliases: [base]", "tasks": "tasks: [general]"}[field]
    with pytest.raises(ConfigError, match=f"base.{reason}"):  # the base entry: the file's error
        table_for(tmp_path, root, CATALOG.replace(line, line.replace("[", f"[{value}, ")))
    assert table_for(tmp_path, root, CATALOG.replace("[base]", "[base, google/gemma-3-270m-it]"))


def test_rank_check_uses_engine_limit(tmp_path: Path, root: Path) -> None:
    table = table_for(tmp_path, root, max_lora_rank=4)
    assert "rank 8 is above engine.max_lora_rank=4" in table.errors["shout"]


def test_a_key_given_twice_in_an_entry_rejects_the_file(tmp_path: Path, root: Path) -> None:
    """Two ``adapter:`` lines in one entry served whichever came last, without a word."""
    text = "routes:\n  - name: shout\n    adapter: shout\n    adapter: json\n"
    with pytest.raises(ConfigError) as info:
        table_for(tmp_path, root, text)
    assert str(info.value).endswith(
        "line 4, column 5: key 'adapter' is given twice (while reading a mapping)"
    )


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path, root: Path) -> None:
    text = (
        "routes:\n  - &common {name: shout, adapter: shout, aliases: [loud]}\n"
        "  - {<<: *common, name: shout2, aliases: [caps]}\n"
    )
    table = table_for(tmp_path, root, text)
    assert not table.errors and table.resolve("caps").name == "shout2"


def test_broken_catalog_file_raises_one_line_naming_where_and_what(tmp_path: Path, root: Path) -> None:
    with pytest.raises(ConfigError) as info:
        table_for(tmp_path, root, "routes: [unclosed\n")
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(
        "adapters.yaml: line 2, column 1: expected ',' or ']', but got '<stream end>'"
        " (while parsing a flow sequence)"
    )


@pytest.mark.parametrize("text", ["", "   \n\n"])
def test_an_empty_catalog_file_is_an_error_not_an_empty_catalog(
    tmp_path: Path, root: Path, text: str
) -> None:
    with pytest.raises(ConfigError, match="the file is empty"):
        table_for(tmp_path, root, text)
    assert table_for(tmp_path, root, "routes: []\n").routes == {}  # no routes, said on purpose


def test_a_catalog_nested_too_deeply_is_an_error_not_a_crash(tmp_path: Path, root: Path) -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        table_for(tmp_path, root, "routes: " + "[" * 5000 + "]" * 5000 + "\n")


def test_safe_adapter_path_refuses_parent_parts(tmp_path: Path, root: Path) -> None:
    with pytest.raises(ConfigError):
        safe_adapter_path("shout/../../x", root)
    assert safe_adapter_path("shout", root) == (root / "shout").resolve()


# -- the live catalog: atomic swap, new ids for changed files, drain then remove ------------
def table_builder(
    path: Path, root: Path, snapshots: SnapshotDir | None = None
) -> Callable[[LoraIds], RoutingTable]:
    """What the gateway's ``build_table`` does, for the catalog file ``path``."""

    def build(ids: LoraIds) -> RoutingTable:
        return load_table(
            path,
            base_name="base-model",
            adapters_root=root,
            max_lora_rank=16,
            model_modules=MODULES,
            lora_ids=ids,
            snapshots=snapshots,
        )

    return build


def live_catalog(tmp_path: Path, root: Path, removed: list[int]) -> tuple[Catalog, Path]:
    path = write_catalog(tmp_path, CATALOG)

    async def remove(lora_id: int) -> None:
        removed.append(lora_id)

    return Catalog(table_builder(path, root), remove), path


async def test_changed_files_get_a_new_id_and_the_old_drains(tmp_path: Path, root: Path) -> None:
    removed: list[int] = []
    catalog, _ = live_catalog(tmp_path, root, removed)
    old = catalog.table.resolve("shout").lora
    json_before = catalog.table.resolve("json").lora
    assert old is not None
    lease = catalog.acquire("shout")
    save_file(lora_tensors(8, ["q_proj", "v_proj"], "new"), str(root / "shout" / "adapter_model.safetensors"))
    assert await catalog.reload()
    new = catalog.table.resolve("shout").lora
    assert new is not None and new.lora_id != old.lora_id and new.name == old.name == "shout"
    assert catalog.table.resolve("json").lora == json_before  # untouched adapter keeps its id
    assert await catalog.remove_drained() == []  # still running on the old version
    assert lease.route.lora == old  # the running request keeps its version
    lease.release()
    lease.release()  # idempotent
    assert await catalog.remove_drained() == [old.lora_id]
    assert removed == [old.lora_id]
    assert catalog.in_use() == {}


def test_lora_ids_forget_but_never_give_a_number_twice() -> None:
    ids = LoraIds()
    assert [ids.id_for("a", False), ids.id_for("a", True), ids.id_for("b", False)] == [1, 2, 3]
    assert ids.id_for("a", False) == 1  # same files, same pin: same id
    ids.keep({3})
    assert len(ids) == 1 and ids.id_for("b", False) == 3
    assert ids.id_for("a", False) == 4  # the files are back: a new version, never 1 again


async def test_versions_that_left_the_engine_are_forgotten(tmp_path: Path, root: Path) -> None:
    """An operator editing an adapter all day: the ids kept stay those the engine may hold."""
    catalog, _ = live_catalog(tmp_path, root, [])
    weights = str(root / "shout" / "adapter_model.safetensors")
    first = catalog.table.resolve("shout").lora
    assert first is not None and len(catalog._ids) == 2  # shout and json
    lease = catalog.acquire("shout")
    for n in range(5):
        save_file(lora_tensors(8, ["q_proj", "v_proj"], f"edit {n}"), weights)
        assert await catalog.reload()
        await catalog.remove_drained()
    assert len(catalog._ids) == 3  # json, the live shout, and the one a request still runs on
    save_file(lora_tensors(8, ["q_proj", "v_proj"], "shout"), weights)  # make_adapter's bytes again
    assert await catalog.reload()
    assert catalog.table.resolve("shout").lora == first  # back while it drains: that version again
    lease.release()
    save_file(lora_tensors(8, ["q_proj", "v_proj"], "edit 5"), weights)
    assert await catalog.reload() and first.lora_id in await catalog.remove_drained()
    last = catalog.table.resolve("shout").lora
    assert last is not None and len(catalog._ids) == 2
    save_file(lora_tensors(8, ["q_proj", "v_proj"], "shout"), weights)
    assert await catalog.reload()
    back = catalog.table.resolve("shout").lora
    assert back is not None and back.lora_id > last.lora_id  # after it left: a new number


async def test_a_version_the_engine_refused_is_forgotten(tmp_path: Path, root: Path) -> None:
    path = write_catalog(tmp_path, CATALOG)

    async def add(route: Any) -> None:
        if route.name == "json":
            raise GatewayError("no room")

    catalog = Catalog(table_builder(path, root), None, add)
    await catalog.load_adapters()
    assert "json" in catalog.table.errors and len(catalog._ids) == 1
    assert await catalog.reload() and "json" in catalog.table.errors and len(catalog._ids) == 1
    path.write_text("routes: [oops\n")  # a build that fails gives out nothing that stays
    assert not await catalog.reload() and len(catalog._ids) == 1


async def test_a_rejected_entry_is_logged_once_while_it_stays_rejected(
    tmp_path: Path, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watcher reloads on every edit of any entry: a broken one was said again each time."""
    caplog.set_level(logging.ERROR, logger="gateway.catalog")
    make_adapter(root, "bigrank", rank=64)
    catalog, path = live_catalog(tmp_path, root, [])
    broken = "  - {name: broken, adapter: bigrank}\n"

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]

    path.write_text(CATALOG + broken)
    assert await catalog.reload() and said() == [
        f"catalog entry broken rejected: {catalog.table.errors['broken']}"
    ]
    path.write_text(CATALOG + broken + "  - {name: brief, system_prompt: Be brief.}\n")  # another edit
    assert await catalog.reload() and "brief" in catalog.table.routes
    assert len(said()) == 1  # the same error: said once
    path.write_text(CATALOG + "  - {name: broken, adapter: missing}\n")  # another error: said
    assert await catalog.reload() and len(said()) == 2 and "missing" in said()[-1]
    path.write_text(CATALOG)
    assert await catalog.reload()
    path.write_text(CATALOG + "  - {name: broken, adapter: missing}\n")  # back after it was gone: said
    assert await catalog.reload() and len(said()) == 3


class GatedRemoval(FakeEngine):
    """An engine whose ``remove_lora`` takes a round trip: it waits for ``remove_gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.remove_gate = asyncio.Event()

    async def remove_lora(self, lora_id: int) -> None:
        await self.remove_gate.wait()
        await super().remove_lora(lora_id)


async def test_a_version_restored_while_it_is_being_removed_stays_loaded(tmp_path: Path, root: Path) -> None:
    """The watcher removes a drained version while an admin reload brings its files back: the
    reload waits for the removal, then loads the files again (from a fresh copy), as a new
    version: an id the engine dropped is never given again (vLLM caches by it)."""
    path = write_catalog(tmp_path, CATALOG)
    engine = GatedRemoval()
    snapshots = SnapshotDir(tmp_path / "cache")
    slots = AdapterSlots(engine, GatewayMetrics(CollectorRegistry()), 4, snapshots)

    build = table_builder(path, root, snapshots)

    catalog = Catalog(build, slots.remove, slots.register)
    await catalog.load_adapters()
    v1 = catalog.table.resolve("shout").lora
    config = root / "shout" / "adapter_config.json"
    original = config.read_text()
    config.write_text(json.dumps({**json.loads(original), "lora_alpha": 32}))
    assert await catalog.reload()  # v2 is live, v1 is drained
    removing = asyncio.create_task(catalog.remove_drained())  # the watcher: v1 leaves the engine
    await asyncio.sleep(0.05)
    config.write_text(original)  # the operator reverts, and POST /admin/adapters/reload
    reloading = asyncio.create_task(catalog.reload())
    await asyncio.sleep(0.05)
    assert not reloading.done()  # it waits for the removal under way
    engine.remove_gate.set()
    assert v1 is not None and await removing == [v1.lora_id]
    assert await reloading
    live = catalog.table.resolve("shout").lora
    assert live is not None and live.lora_id in engine.loras
    assert live.lora_id > v1.lora_id and (live.name, live.path) == (v1.name, v1.path)
    assert Path(live.path).is_dir()
    snapshots.close()


async def test_a_pending_removal_is_checked_against_the_live_table(tmp_path: Path, root: Path) -> None:
    removed: list[int] = []
    catalog, path = live_catalog(tmp_path, root, removed)
    with_json = catalog.table
    path.write_text(CATALOG.replace("  - name: json\n    adapter: json\n    tasks: [extract]\n", ""))
    assert await catalog.reload()
    catalog.table = with_json  # json's version is live again before its removal ran
    assert await catalog.remove_drained() == [] and removed == []


async def test_unchanged_files_keep_their_id(tmp_path: Path, root: Path) -> None:
    catalog, _ = live_catalog(tmp_path, root, [])
    before = catalog.table.resolve("json").lora
    assert await catalog.reload()
    assert catalog.table.resolve("json").lora == before


async def test_removed_route_leaves_the_engine_when_idle(tmp_path: Path, root: Path) -> None:
    removed: list[int] = []
    catalog, path = live_catalog(tmp_path, root, removed)
    json_id = catalog.table.resolve("json").lora.lora_id  # type: ignore[union-attr]
    path.write_text(CATALOG.replace("  - name: json\n    adapter: json\n    tasks: [extract]\n", ""))
    assert await catalog.reload()
    with pytest.raises(ModelNotFound):
        catalog.table.resolve("json")
    assert await catalog.remove_drained() == [json_id]


async def test_broken_reload_keeps_the_last_good_table(tmp_path: Path, root: Path) -> None:
    catalog, path = live_catalog(tmp_path, root, [])
    good = catalog.table
    path.write_text("routes: [oops\n")
    assert not await catalog.reload()
    assert catalog.table is good
    assert catalog.last_error and "adapters.yaml" in catalog.last_error
    assert catalog.table.resolve("loud").name == "shout"


async def test_a_truncated_catalog_keeps_the_last_good_table(tmp_path: Path, root: Path) -> None:
    """An editor's save truncates, then writes: a reload that lands in between keeps serving."""
    catalog, path = live_catalog(tmp_path, root, [])
    good = catalog.table
    path.write_text("")
    assert not await catalog.reload()
    assert catalog.table is good and "empty" in (catalog.last_error or "")
    path.write_text("routes: [oops\n")  # then a broken edit: still the table before the truncation
    assert not await catalog.reload()
    assert catalog.table.resolve("loud").name == "shout"
    path.write_text(CATALOG)
    assert await catalog.reload() and catalog.last_error is None


def test_a_route_weight_is_carried_and_checked(tmp_path: Path, root: Path) -> None:
    text = CATALOG.replace("    tasks: [extract]\n", "    tasks: [extract]\n    weight: 2.5\n")
    text += (
        "  - {name: heavy-preset, system_prompt: x, weight: 2}\n  - {name: zero, adapter: shout, weight: 0}\n"
    )
    table = table_for(tmp_path, root, text)
    assert table.routes["json"].weight == 2.5
    assert table.routes["shout"].weight == 1.0
    assert "weight need an adapter" in table.errors["heavy-preset"]
    assert "weight" in table.errors["zero"]


async def test_a_pin_flipped_and_back_while_the_pinned_version_drains_is_that_version(
    tmp_path: Path, root: Path
) -> None:
    """pinned -> unpinned -> pinned while a request still runs on the pinned version: the
    pinned version (kept, as it drains) comes back under its id; the unpinned one leaves."""
    removed: list[int] = []
    catalog, path = live_catalog(tmp_path, root, removed)
    start = catalog.table.resolve("shout").lora
    assert start is not None
    pinned_catalog = CATALOG.replace("    adapter: shout\n", "    adapter: shout\n    pinned: true\n")
    path.write_text(pinned_catalog)
    assert await catalog.reload()
    assert await catalog.remove_drained() == [start.lora_id]  # the unpinned one it started with left
    pinned = catalog.table.resolve("shout").lora
    assert pinned is not None
    lease = catalog.acquire("shout")
    path.write_text(CATALOG)
    assert await catalog.reload()
    unpinned = catalog.table.resolve("shout").lora
    assert unpinned is not None and unpinned.lora_id > pinned.lora_id
    assert await catalog.remove_drained() == []  # the pinned one still runs a request
    path.write_text(pinned_catalog)
    assert await catalog.reload()
    assert catalog.table.resolve("shout").lora == pinned
    assert await catalog.remove_drained() == [unpinned.lora_id]
    lease.release()
    assert await catalog.remove_drained() == [] and pinned.lora_id not in removed
    path.write_text(CATALOG)  # unpinned again, after that version left: a new number
    assert await catalog.reload()
    again = catalog.table.resolve("shout").lora
    assert again is not None and again.lora_id > unpinned.lora_id


NUL_ADAPTER = 'routes:\n  - {name: shout, adapter: "sh\\0out"}\n  - {name: json, adapter: json}\n'
NUL_SCHEMA = 'routes:\n  - {name: shout, adapter: shout, response_format: "file:a\\0b"}\n  - {name: json, adapter: json}\n'


@pytest.mark.parametrize("text", [NUL_ADAPTER, NUL_SCHEMA], ids=["adapter", "response_format"])
def test_a_nul_byte_in_a_path_rejects_that_entry_only(tmp_path: Path, root: Path, text: str) -> None:
    # Path.resolve raises ValueError ("embedded null byte"): it failed the whole load (a 500
    # on /admin/adapters/reload) and, through the engine's sizing, the start with a traceback.
    table = table_for(tmp_path, root, text)
    assert "cannot be resolved" in table.errors["shout"] or "null byte" in table.errors["shout"]
    assert set(table.routes) == {"json"}
    assert catalog_module.adapter_dirs(write_catalog(tmp_path, NUL_ADAPTER), root) == [
        (root / "json").resolve()
    ]


@pytest.mark.parametrize("text", ["# being edited\n", "---\n", "null\n", "false\n", "[]\n", "0\n"])
def test_a_catalog_file_without_a_mapping_is_an_error_not_no_routes(
    tmp_path: Path, root: Path, text: str
) -> None:
    """A save half done (the shipped catalog opens with comments) must not drop every route:
    the last good table keeps serving. ``routes: []`` says "no routes"."""
    with pytest.raises(ConfigError, match="holds no mapping"):
        table_for(tmp_path, root, text)
    assert table_for(tmp_path, root, "routes: []\n").routes == {}


def test_a_broken_entrys_aliases_and_tasks_stay_its_own(tmp_path: Path, root: Path) -> None:
    """As its name does: a later entry that lists them stays rejected, so traffic for them
    never moves to another adapter while the first entry is broken (a deploy mid-way)."""
    clash = (
        "routes:\n"
        "  - {name: shout, adapter: %s, aliases: [loud], tasks: [shouting]}\n"
        "  - {name: json, adapter: json, aliases: [loud], tasks: [shouting]}\n"
        "  - {name: other, adapter: json, tasks: [shouting]}\n"
    )
    before = table_for(tmp_path, root, clash % "shout")
    assert before.resolve("loud").name == before.resolve(None, "shouting").name == "shout"
    assert set(before.errors) == {"json", "other"}
    after = table_for(tmp_path, root, clash % "missing")  # shout's folder gone
    assert set(after.errors) == {"shout", "json", "other"}
    assert "name already used: loud" in after.errors["json"]
    assert "task already used: shouting" in after.errors["other"]
    for model, task in (("loud", None), (None, "shouting")):
        with pytest.raises(ModelNotFound):
            after.resolve(model, task)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{% if %}broken", "chat_template does not compile: line 1"),
        ("configs/templates/gemma.jinja", "the template's Jinja text (a path is not read)"),
        # parse() alone took an unknown filter; transformers' compile (what renders) does not
        ("{% for m in messages %}{{ m.content | trim_all }}{% endfor %}", "No filter named 'trim_all'"),
    ],
)
def test_a_chat_template_that_cannot_render_the_messages_rejects_its_entry(
    tmp_path: Path, root: Path, template: str, why: str
) -> None:
    """A syntax error failed every request on the route with a 400 blaming the client; a
    path was rendered as the prompt itself, the messages dropped."""
    good = "{% for m in messages %}{{ m.content }}{% endfor %}"
    text = (
        f"routes:\n  - {{name: t, chat_template: {template!r}}}\n  - {{name: ok, chat_template: {good!r}}}\n"
    )
    table = table_for(tmp_path, root, text)
    assert why in table.errors["t"] and set(table.routes) == {"ok"}


def test_a_training_template_with_generation_blocks_is_accepted(tmp_path: Path, root: Path) -> None:
    """TRL's assistant-only-loss templates mark the answer with transformers' own
    ``{% generation %}`` tag; transformers renders them, so the entry stands."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}{% endif %}{% endfor %}"
    )
    table = table_for(tmp_path, root, f"routes:\n  - {{name: t, chat_template: {template!r}}}\n")
    assert not table.errors and table.routes["t"].chat_template == template


def test_a_catalog_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """Saved as latin-1 by an editor: a config error naming the file (it was a
    UnicodeDecodeError: a 500 on reload, a traceback at start)."""
    path = tmp_path / "adapters.yaml"
    path.write_bytes("routes:\n  - {name: base, system_prompt: caf\u00e9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="adapters.yaml: .*utf-8"):
        catalog_module.check_file(path)
    assert catalog_module.adapter_dirs(path, tmp_path) == []
