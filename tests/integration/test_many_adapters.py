"""Many adapters on a live engine: validation by weights, watcher re-validation,
pinned and preloaded adapters, residency, load and cold/warm metrics, route-named LoRAs."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

from gateway.embedded import EMBEDDED_DIMS, embedded_model_dir
from gateway.settings import load_settings
from tests.helpers import chat_body, eventually, still_serves
from tests.integration.conftest import LiveGateway

SWAP_DEADLINE_S = 2.0


def cards(gw: LiveGateway) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in gw.client().get("/v1/models").json()["data"]}


def residency(gw: LiveGateway) -> dict[str, object]:
    """Each LoRA route's residency (gpu, cpu, not loaded) as /v1/models shows it."""
    return {name: card["residency"] for name, card in cards(gw).items() if card.get("residency")}


def admin(gw: LiveGateway) -> dict[str, object]:
    return gw.admin().get("/admin/adapters").json()  # type: ignore[no-any-return]


def metrics(gw: LiveGateway) -> str:
    return gw.client().get("/metrics").text


def variant(root: Path, name: str, source: str = "shout", **config: object) -> Path:
    """A copy of a shipped adapter with ``config`` changed (so a digest of its own)."""
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(root / source, path)
    data = json.loads((path / "adapter_config.json").read_text()) | config
    (path / "adapter_config.json").write_text(json.dumps(data))
    return path


def test_rejected_entries_go_live_when_their_files_are_fixed(gateway: LiveGateway) -> None:
    original = gateway.catalog.read_text()
    root = gateway.adapters_root
    broken = variant(root, "fixme")
    (broken / "adapter_config.json").write_text("{not json")
    try:
        gateway.catalog.write_text(
            original + "\n  - {name: fixme, adapter: fixme}\n  - {name: arrives, adapter: arrives}\n"
        )
        eventually(lambda: {"fixme", "arrives"} <= set(admin(gateway)["rejected"]), 10, "both rejected")  # type: ignore[arg-type]
        assert "adapter_config.json is invalid" in admin(gateway)["rejected"]["fixme"]  # type: ignore[index]
        variant(root, "fixme", lora_alpha=17)  # fixed in place: no SIGHUP, no catalog edit
        eventually(lambda: "fixme" in cards(gateway), SWAP_DEADLINE_S, "the fixed entry live")
        staging = root.parent / "arrives-staging"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(root / "json", staging)
        staging.rename(root / "arrives")  # the directory appears later
        eventually(lambda: "arrives" in cards(gateway), SWAP_DEADLINE_S, "the late directory live")
        assert admin(gateway)["rejected"] == {}
        still_serves(gateway, "fixme")
    finally:
        gateway.catalog.write_text(original)
        gateway.admin().post("/admin/adapters/reload")
        shutil.rmtree(root / "fixme", ignore_errors=True)
        shutil.rmtree(root / "arrives", ignore_errors=True)


def test_pinned_preloaded_and_foreign_adapters(gateway: LiveGateway) -> None:
    original = gateway.catalog.read_text()
    root = gateway.adapters_root
    variant(root, "warm", lora_alpha=15)
    variant(root, "foreign", source="bullets", base_model_name_or_path="google/gemma-3-270m-it")
    try:
        gateway.catalog.write_text(
            original
            + "\n  - {name: warm, adapter: warm, pinned: true, preload: true}"
            + "\n  - {name: foreign, adapter: foreign}\n"
        )
        # A route is listed once the table swaps; its adapter is loaded, warmed and pinned next.
        eventually(lambda: cards(gateway).get("warm", {}).get("residency") == "gpu", 30, "warm pinned")
        listed = cards(gateway)
        assert listed["warm"]["pinned"] is True and listed["warm"]["preload"] is True
        assert listed["foreign"]["residency"] in ("gpu", "cpu")
        assert "google/gemma-3-270m-it" in str(listed["foreign"]["warnings"])  # accepted, with a warning
        assert listed["shout"]["warnings"] == []
        text = metrics(gateway)
        assert re.search(r'^gateway_adapter_loads_total\{route="warm"\} 1\.0$', text, re.M)
        assert re.search(r'^gateway_adapter_load_seconds_count\{route="foreign"\} 1\.0$', text, re.M)
        assert "preloaded" in gateway.log.read_text() and "pinned to a GPU slot" in gateway.log.read_text()
        for name in ("warm", "foreign"):
            still_serves(gateway, name)
        text = metrics(gateway)
        warm = (
            r'^gateway_adapter_time_to_first_token_seconds_count\{adapter_state="warm",route="warm"\} (\S+)$'
        )
        match = re.search(warm, text, re.M)
        assert match and float(match[1]) >= 1  # preloaded: its first user request was warm
        # The engine's CPU cache was sized to the catalog (3 adapters + max_loras 4): all five
        # stay loaded, where vLLM's default (max_loras) would have evicted one of them.
        assert "engine.max_cpu_loras=7" in gateway.log.read_text()
        assert "engine.max_loras=4 (auto): the catalog names 3 adapters" in gateway.log.read_text()
        assert admin(gateway)["slots"] == {"gpu": 4, "cpu": 7}
        # Five adapters for four GPU slots, all in the CPU cache. vLLM gives a batch's adapter
        # a free slot, or the least recently used unpinned adapter's: after one request to
        # each in turn, shout (the first) is the one left in the CPU cache, whatever the
        # slots held before. The engine's workers say so, and /metrics counts it.
        order = ["shout", "json", "bullets", "warm", "foreign"]
        for name in order:
            still_serves(gateway, name)

        def placed() -> dict[str, object]:
            return {name: residency(gateway).get(name) for name in order}

        def expect(outside: str) -> dict[str, object]:
            return {name: "cpu" if name == outside else "gpu" for name in order}

        eventually(lambda: placed() == expect("shout"), 12, "shout outside", lambda: str(placed()))
        counted = r'^gateway_adapters\{residency="(gpu|cpu)"\} (\S+)$'
        eventually(
            lambda: dict(re.findall(counted, metrics(gateway), re.M)) == {"gpu": "4.0", "cpu": "1.0"},
            12,
            "the metric counting them",
        )
        still_serves(gateway, "shout")  # takes the slot of json, now the least recently used
        eventually(lambda: placed() == expect("json"), 12, "json outside", lambda: str(placed()))
    finally:
        gateway.catalog.write_text(original)
        gateway.admin().post("/admin/adapters/reload")
        shutil.rmtree(root / "warm", ignore_errors=True)
        shutil.rmtree(root / "foreign", ignore_errors=True)


def test_the_engine_reports_running_adapters_under_route_names(gateway: LiveGateway) -> None:
    """LoRA-affinity routers read vllm:lora_requests_info and match names to `model`."""
    seen: list[str] = []
    done = threading.Event()

    def long_request() -> None:
        body = chat_body("shout", "Count to fifty.", max_tokens=200, ignore_eos=True, stream=True)
        with gateway.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            digest = r.headers.get("x-adapter-digest", "")
            seen.append(digest)
            for _ in r.iter_lines():
                pass
        done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:

        def running() -> bool:
            lines = [
                line for line in metrics(gateway).splitlines() if line.startswith("vllm:lora_requests_info{")
            ]
            return any('running_lora_adapters="shout"' in line for line in lines) or done.is_set()

        eventually(running, 60, "shout running in vllm:lora_requests_info")
        assert not done.is_set(), "the request ended before the engine reported it"
    finally:
        worker.join(120)
    assert seen and len(seen[0]) == 64  # the digest stays in x-adapter-digest
    assert cards(gateway)["shout"]["digest"] == seen[0]


def test_an_adapter_that_does_not_fit_the_model_is_rejected_by_shape(gateway: LiveGateway) -> None:
    from safetensors.numpy import load_file, save_file

    original = gateway.catalog.read_text()
    root = gateway.adapters_root
    path = variant(root, "misfit")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[name] = tensors[name].repeat(2, axis=0)  # [2048, 8] where the model has [1024, 640]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    try:
        gateway.catalog.write_text(original + "\n  - {name: misfit, adapter: misfit}\n")
        r = gateway.admin().post("/admin/adapters/reload")
        assert r.status_code == 200
        why = admin(gateway)["rejected"]["misfit"]  # type: ignore[index]
        assert f"tensor {name} has shape [2048, 8], expected [1024, 8]" in why
    finally:
        gateway.catalog.write_text(original)
        gateway.admin().post("/admin/adapters/reload")
        shutil.rmtree(path, ignore_errors=True)


def test_a_bin_adapter_is_served_as_its_safetensors_twin(gateway: LiveGateway) -> None:
    """Older PEFT writes ``adapter_model.bin``; vLLM loads it, so the gateway accepts it."""
    import torch
    from safetensors.torch import load_file

    original = gateway.catalog.read_text()
    root = gateway.adapters_root
    path = variant(root, "pickled", source="bullets")
    torch.save(load_file(str(path / "adapter_model.safetensors")), path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    try:
        gateway.catalog.write_text(original + "\n  - {name: pickled, adapter: pickled}\n")
        assert gateway.admin().post("/admin/adapters/reload").status_code == 200
        assert "pickled" in cards(gateway), admin(gateway)["rejected"]

        def greedy(model: str) -> str:
            body = {"model": model, "prompt": "Three colours:", "max_tokens": 12, "temperature": 0}
            with gateway.client() as http:
                r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        assert greedy("pickled") == greedy("bullets") != greedy("base")
    finally:
        gateway.catalog.write_text(original)
        gateway.admin().post("/admin/adapters/reload")
        shutil.rmtree(path, ignore_errors=True)


def test_the_embedded_models_sizes_are_those_of_its_prepared_config(gateway: LiveGateway) -> None:
    """``engine.max_loras: auto`` sizes the slots from these before the first start has
    prepared the model; once prepared, its config.json must say the same."""
    config = json.loads(
        (embedded_model_dir(load_settings({}).cache_dir / "models") / "config.json").read_text()
    )
    assert {key: config.get(key) for key in EMBEDDED_DIMS} == EMBEDDED_DIMS
