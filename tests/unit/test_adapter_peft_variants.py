"""Adapter checks against what PEFT writes and vLLM loads beyond the plain case: tied and
quantized base checkpoints, suffix targets, per-module ranks, malformed configs, hub ids.

The model is a tiny Llama-shaped checkpoint with tied embeddings (no ``lm_head.weight``, as
transformers saves it); tensor names are those PEFT's ``save_pretrained`` writes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from gateway import adapters_check
from gateway.adapters_check import ModelShapes, adapter_digest, check_adapter, local_model_dir, model_shapes
from gateway.catalog import Catalog, LoraIds, RoutingTable, load_table
from gateway.errors import ConfigError

H, INTER, VOCAB, KV = 32, 48, 64, 16
LAYER = "base_model.model.model.layers.0."
DIMS = {
    "self_attn.q_proj": (H, H),
    "self_attn.k_proj": (KV, H),
    "self_attn.v_proj": (KV, H),
    "self_attn.o_proj": (H, H),
    "mlp.gate_proj": (INTER, H),
    "mlp.up_proj": (INTER, H),
    "mlp.down_proj": (H, INTER),
}
# Its config.json: 4 heads of 8 (hidden / heads), 2 KV heads.
CONFIG = {"hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 1}
CONFIG |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}


def zeros(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(shape, dtype)


def llama(tmp_path: Path, quantized: str | None = None, config: dict[str, Any] | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": zeros(VOCAB, H), "model.norm.weight": zeros(H)}
    for module, (out, inp) in DIMS.items():
        key = f"model.layers.0.{module}"
        if quantized == "gptq":  # 4-bit GPTQ: packed, [in / 8, out]
            tensors[f"{key}.qweight"] = zeros(inp // 8, out, dtype=np.int32)
            tensors[f"{key}.scales"] = zeros(1, out, dtype=np.float16)
        elif quantized == "awq":  # 4-bit AWQ: packed, [in, out / 8]
            tensors[f"{key}.qweight"] = zeros(inp, out // 8, dtype=np.int32)
            tensors[f"{key}.scales"] = zeros(1, out, dtype=np.float16)
        elif quantized == "compressed-tensors":  # W4A16 pack-quantized
            tensors[f"{key}.weight_packed"] = zeros(out, inp // 8, dtype=np.int32)
            tensors[f"{key}.weight_shape"] = np.array([out, inp], np.int64)
        elif quantized == "bitsandbytes":  # nf4: a packed 2-D uint8 .weight of another shape
            tensors[f"{key}.weight"] = zeros(out * inp // 2, 1, dtype=np.uint8)
        else:
            tensors[f"{key}.weight"] = zeros(out, inp)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def adapter(tmp_path: Path, tensors: dict[str, np.ndarray], name: str = "a", **config: Any) -> Path:
    folder = tmp_path / "adapters" / name
    folder.mkdir(parents=True, exist_ok=True)
    base = {"r": 8, "lora_alpha": 16, "base_model_name_or_path": "llama", "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(base | config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


Q = {
    LAYER + "self_attn.q_proj.lora_A.weight": zeros(8, H),
    LAYER + "self_attn.q_proj.lora_B.weight": zeros(H, 8),
}


def beside_a_good_one(tmp_path: Path, bad: str, model: ModelShapes | None) -> RoutingTable:
    """The table of a catalog with route ``bad`` on the adapter folder ``bad`` and a route
    ``good`` on a valid adapter."""
    adapter(tmp_path, Q, name="good")
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text(f"routes:\n  - {{name: bad, adapter: {bad}}}\n  - {{name: good, adapter: good}}\n")
    return load_table(
        catalog,
        base_name="llama",
        adapters_root=tmp_path / "adapters",
        max_lora_rank=16,
        model_modules=model,
        lora_ids=LoraIds(),
    )


@pytest.fixture
def model(tmp_path: Path) -> ModelShapes:
    shapes = model_shapes(llama(tmp_path))
    assert shapes is not None
    return shapes


def test_lm_head_lora_on_tied_embeddings_is_checked_against_them(tmp_path: Path, model: ModelShapes) -> None:
    head = {
        "base_model.model.lm_head.lora_A.weight": zeros(8, H),
        "base_model.model.lm_head.lora_B.weight": zeros(VOCAB, 8),
    }
    path = adapter(tmp_path, Q | head, target_modules=["q_proj", "lm_head"])
    assert check_adapter(path, 16, "llama", model).rank == 8
    wrong = head | {"base_model.model.lm_head.lora_B.weight": zeros(VOCAB + 1, 8)}
    path = adapter(tmp_path, Q | wrong, name="b", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match=r"lm_head.lora_B.weight has shape \[65, 8\], expected \[64, 8\]"):
        check_adapter(path, 16, "llama", model)


@pytest.mark.parametrize("targets", [["self_attn.q_proj"], ["model.layers.0.self_attn.q_proj"]])
def test_targets_match_module_paths_by_suffix_as_peft_does(
    tmp_path: Path, model: ModelShapes, targets: list[str]
) -> None:
    check_adapter(adapter(tmp_path, Q, target_modules=targets), 16, "llama", model)


def test_a_target_no_module_ends_in_is_still_refused(tmp_path: Path, model: ModelShapes) -> None:
    with pytest.raises(ConfigError, match="target modules not in the model: attn.q_proj"):
        check_adapter(adapter(tmp_path, Q, target_modules=["attn.q_proj"]), 16, "llama", model)


@pytest.mark.parametrize("quantized", ["gptq", "compressed-tensors", "bitsandbytes"])
def test_on_a_quantized_checkpoint_modules_are_checked_but_not_their_shapes(
    tmp_path: Path, quantized: str
) -> None:
    """The header has no dense [out, in] for a quantized weight and there is no config.json to
    derive it from: only that the module exists is checked."""
    shapes = model_shapes(llama(tmp_path, quantized))
    assert shapes is not None and shapes.has("layers.0.self_attn.q_proj")
    assert shapes.get("layers.0.self_attn.q_proj") is None
    check_adapter(adapter(tmp_path, Q), 16, "llama", shapes)
    stray = {LAYER + "self_attn.qq_proj.lora_A.weight": zeros(8, H)}
    with pytest.raises(
        ConfigError, match="targets layers.0.self_attn.qq_proj, which the model does not have"
    ):
        check_adapter(adapter(tmp_path, Q | stray, name="b"), 16, "llama", shapes)


@pytest.mark.parametrize("quantized", ["gptq", "awq", "compressed-tensors", "bitsandbytes"])
def test_on_a_quantized_checkpoint_shapes_come_from_its_config(tmp_path: Path, quantized: str) -> None:
    """vLLM loads a wrong-shaped adapter without a check, then fails inside the engine step
    when a request first uses it: the dense shapes follow from config.json, so it is refused."""
    shapes = model_shapes(llama(tmp_path, quantized, CONFIG))
    assert shapes is not None
    assert {module: shapes.get(f"layers.0.{module}") for module in DIMS} == DIMS
    kv = {
        LAYER + "self_attn.k_proj.lora_A.weight": zeros(8, H),
        LAYER + "self_attn.k_proj.lora_B.weight": zeros(KV, 8),
    }
    check_adapter(adapter(tmp_path, Q | kv, target_modules=["q_proj", "k_proj"]), 16, "llama", shapes)
    wrong = kv | {LAYER + "self_attn.k_proj.lora_B.weight": zeros(H, 8)}  # a model without GQA's
    with pytest.raises(ConfigError) as raised:
        check_adapter(adapter(tmp_path, Q | wrong, name="b", target_modules=["k_proj"]), 16, "llama", shapes)
    assert str(raised.value) == (
        f"b: tensor {LAYER}self_attn.k_proj.lora_B.weight has shape [32, 8], expected [16, 8] "
        "(the model's layers.0.self_attn.k_proj is [16, 32])"
    )


@pytest.mark.parametrize(
    ("config", "unchecked"),
    [
        (CONFIG | {"num_key_value_heads": 4}, {"self_attn.k_proj", "self_attn.v_proj"}),  # the header's 16
        (CONFIG | {"kv_lora_rank": 8, "v_head_dim": 8}, {m for m in DIMS if m.startswith("self_attn.")}),
        (CONFIG | {"num_local_experts": 4}, {m for m in DIMS if m.startswith("mlp.")}),
        (CONFIG | {"intermediate_size": [INTER]}, {m for m in DIMS if m.startswith("mlp.")}),
    ],
    ids=["contradicted-by-the-header", "latent-attention", "experts", "per-layer-sizes"],
)
def test_shapes_the_config_leaves_in_doubt_stay_unchecked(
    tmp_path: Path, config: dict[str, Any], unchecked: set[str]
) -> None:
    """A derived shape that is wrong would refuse a good adapter: where the config does not
    say the shape for sure, or the header says another, the module is only checked to exist."""
    shapes = model_shapes(llama(tmp_path, "gptq", config))
    assert shapes is not None
    got = {module: shapes.get(f"layers.0.{module}") for module in DIMS}
    assert got == {module: None if module in unchecked else shape for module, shape in DIMS.items()}


@pytest.mark.parametrize(("a_rank", "b_rank"), [(4, 2), (2, 2)], ids=["a-and-b-differ", "not-the-pattern"])
def test_rank_pattern_ranks_are_checked_per_module(
    tmp_path: Path, model: ModelShapes, a_rank: int, b_rank: int
) -> None:
    """With ``rank_pattern {v_proj: 4}``, v_proj's lora_A is [4, in] and its lora_B [out, 4]:
    vLLM copies each by its own shape and scales by the pattern's rank, so anything else
    would load and answer wrong."""
    v = {
        LAYER + "self_attn.v_proj.lora_A.weight": zeros(a_rank, H),
        LAYER + "self_attn.v_proj.lora_B.weight": zeros(KV, b_rank),
    }
    path = adapter(tmp_path, Q | v, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 4})
    with pytest.raises(
        ConfigError, match=r"v_proj.lora_[AB].weight has rank 2 .*expected rank 4 \(rank_pattern\)"
    ):
        check_adapter(path, 16, "llama", model)


def test_rank_pattern_ranks_that_fit_are_accepted_and_capped(tmp_path: Path, model: ModelShapes) -> None:
    """Up to and including ``engine.max_lora_rank``, as vLLM loads it: an adapter at exactly
    the engine's limit is not refused."""
    v = {
        LAYER + "self_attn.v_proj.lora_A.weight": zeros(4, H),
        LAYER + "self_attn.v_proj.lora_B.weight": zeros(KV, 4),
    }
    path = adapter(tmp_path, Q | v, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 4})
    check_adapter(path, 16, "llama", model)
    at_limit = {
        LAYER + "self_attn.v_proj.lora_A.weight": zeros(16, H),
        LAYER + "self_attn.v_proj.lora_B.weight": zeros(KV, 16),
    }
    path = adapter(
        tmp_path, Q | at_limit, name="c", target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 16}
    )
    check_adapter(path, 16, "llama", model)
    path = adapter(tmp_path, Q, name="b", rank_pattern={"v_proj": 32})
    with pytest.raises(ConfigError, match="rank 32 is above engine.max_lora_rank=16"):
        check_adapter(path, 16, "llama", model)


def test_rank_pattern_keys_match_whole_module_names(tmp_path: Path, model: ModelShapes) -> None:
    """As PEFT and vLLM match a ``rank_pattern`` key: the module's path ends in it at a ``.``
    boundary. ``{proj: 4}`` names no module here, so q_proj keeps ``r`` (8); matching any
    ending would refuse this adapter, which vLLM loads, as having the wrong rank."""
    check_adapter(adapter(tmp_path, Q, rank_pattern={"proj": 4}), 16, "llama", model)
    path = adapter(tmp_path, Q, name="b", rank_pattern={"self_attn.q_proj": 4})
    with pytest.raises(ConfigError, match=r"expected rank 4 \(rank_pattern\)"):
        check_adapter(path, 16, "llama", model)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"r": float("inf")}, "'r' must be a positive integer"),
        ({"r": True}, "'r' must be a positive integer"),
        ({"r": "8"}, "'r' must be a positive integer"),
        ({"target_modules": ["q_proj", None]}, "'target_modules' must be"),
        ({"target_modules": [["q_proj"]]}, "'target_modules' must be"),
        ({"rank_pattern": {"v_proj": 0}}, "'rank_pattern' must map"),
        ({"rank_pattern": {"(": 4}}, "'rank_pattern' key '(' is not a regex"),
        # valid alone, not inside the pattern PEFT and vLLM match with: it raised out of the
        # reload (a 500) and stopped the gateway's start
        ({"rank_pattern": {"(?i)q_proj": 4}}, "'rank_pattern' key '(?i)q_proj' is not a regex"),
        ({"alpha_pattern": {"(?i)q_proj": 4}}, "'alpha_pattern' key '(?i)q_proj' is not a regex"),
    ],
)
def test_a_malformed_config_rejects_its_entry_only(
    tmp_path: Path, model: ModelShapes, config: dict[str, Any], why: str
) -> None:
    adapter(tmp_path, Q, name="bad", **config)
    table = beside_a_good_one(tmp_path, "bad", model)
    assert set(table.routes) == {"good"}
    assert "adapter_config.json is invalid" in table.errors["bad"] and why in table.errors["bad"]


def test_a_check_that_fails_unexpectedly_rejects_its_entry_only(
    tmp_path: Path, model: ModelShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a check (an error it does not expect, on one adapter's files) must not fail
    the whole reload (a 500) or the gateway's start: that entry is rejected, and logged."""
    from gateway import catalog

    real = catalog.check_adapter

    def check(path: Path, *args: Any, **kw: Any) -> Any:
        if path.name == "bad":
            raise KeyError("something unforeseen")
        return real(path, *args, **kw)

    monkeypatch.setattr(catalog, "check_adapter", check)
    adapter(tmp_path, Q, name="bad")
    table = beside_a_good_one(tmp_path, "bad", model)
    assert set(table.routes) == {"good"}
    assert (
        table.errors["bad"].startswith("could not be checked: ")
        and "something unforeseen" in table.errors["bad"]
    )


def test_a_config_that_is_not_an_object_is_invalid(tmp_path: Path) -> None:
    path = adapter(tmp_path, Q)
    (path / "adapter_config.json").write_text("[8]")
    with pytest.raises(ConfigError, match="adapter_config.json is invalid: expected a JSON object"):
        check_adapter(path, 16, "llama", None)


def as_torch_file(path: Path, name: str = "adapter_model.bin", **save: Any) -> Path:
    """The adapter with its safetensors rewritten as ``torch.save`` writes a state dict."""
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(path / "adapter_model.safetensors")), path / name, **save)
    (path / "adapter_model.safetensors").unlink()
    return path


@pytest.mark.parametrize(
    ("name", "save"),
    [
        ("adapter_model.bin", {}),
        ("adapter_model.bin", {"_use_new_zipfile_serialization": False}),  # legacy: read, not mapped
        ("adapter_model.pt", {}),
    ],
)
def test_torch_saved_weights_are_checked_as_vllm_loads_them(
    tmp_path: Path, model: ModelShapes, name: str, save: dict[str, Any]
) -> None:
    path = as_torch_file(adapter(tmp_path, Q), name, **save)
    info = check_adapter(path, 16, "llama", model)
    assert info.rank == 8 and info.warnings == ()
    wrong = Q | {LAYER + "self_attn.q_proj.lora_B.weight": zeros(H + 1, 8)}
    path = as_torch_file(adapter(tmp_path, wrong, name="b"), name, **save)
    with pytest.raises(ConfigError, match=r"q_proj.lora_B.weight has shape \[33, 8\], expected \[32, 8\]"):
        check_adapter(path, 16, "llama", model)


def test_safetensors_win_over_a_bin_beside_them_as_in_vllm(tmp_path: Path, model: ModelShapes) -> None:
    import torch

    path = adapter(tmp_path, Q)
    torch.save({"junk": torch.zeros(1)}, path / "adapter_model.bin")  # vLLM never reads it
    assert check_adapter(path, 16, "llama", model).rank == 8
    digest = adapter_digest(path)
    torch.save({"other junk": torch.zeros(2)}, path / "adapter_model.bin")
    assert adapter_digest(path) == digest


def test_a_bin_adapters_digest_follows_its_weights(tmp_path: Path) -> None:
    import torch

    path = as_torch_file(adapter(tmp_path, Q))
    digest = adapter_digest(path)
    state = torch.load(path / "adapter_model.bin", weights_only=True)
    state[LAYER + "self_attn.q_proj.lora_A.weight"] += 1
    torch.save(state, path / "adapter_model.bin")
    assert adapter_digest(path) != digest


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"not a pickle", "adapter_model.bin is not readable"),
        (b"", "adapter_model.bin is not readable"),
        ("state", "adapter_model.bin is not a state dict"),
        ("code", "adapter_model.bin is not readable: Weights only load failed"),
    ],
)
def test_an_unreadable_bin_rejects_its_entry_only(tmp_path: Path, content: bytes | str, why: str) -> None:
    import torch

    path = as_torch_file(adapter(tmp_path, Q))
    target = path / "adapter_model.bin"
    if content == "state":
        torch.save({"a.lora_A.weight": [1, 2]}, target)  # not tensors
    elif content == "code":
        torch.save({"a.lora_A.weight": Path("x")}, target)  # an object weights_only refuses
    else:
        assert isinstance(content, bytes)
        target.write_bytes(content)
    with pytest.raises(ConfigError, match=why):
        check_adapter(path, 16, "llama", None)
    table = beside_a_good_one(tmp_path, "a", None)
    assert set(table.routes) == {"good"} and why in table.errors["bad"]


def test_an_adapter_without_weights_names_both_files(tmp_path: Path) -> None:
    path = adapter(tmp_path, Q)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"missing adapter_model.safetensors \(or adapter_model.bin\)"):
        check_adapter(path, 16, "llama", None)


@pytest.mark.parametrize("served", ["meta-llama/Llama-3.2-1B", "Llama-3.2-1B"])
def test_a_served_name_with_its_org_matches_the_base_model(tmp_path: Path, served: str) -> None:
    path = adapter(tmp_path, Q, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    assert check_adapter(path, 16, served, None, strict_base_model=True).warnings == ()
    with pytest.raises(ConfigError, match="strict_base_model"):
        check_adapter(path, 16, "meta-llama/Llama-3.2-3B", None, strict_base_model=True)


def test_a_hub_repo_id_is_found_in_the_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine.model: org/tiny``: vLLM downloaded it to the cache, and the checks read its
    weights there (a relative folder of that name does not exist)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    llama(tmp_path).rename(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    folder = local_model_dir("org/tiny")
    assert folder is not None and folder.resolve() == snapshot.resolve()
    assert model_shapes(folder) is not None
    assert local_model_dir("org/absent") is None and local_model_dir("") is None


def test_digests_are_reread_only_for_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = adapter(tmp_path, Q)
    first = adapter_digest(path)
    opened: list[Path] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kw: Any) -> Any:
        opened.append(self)
        return real_open(self, *args, **kw)

    monkeypatch.setattr(Path, "open", counting_open)
    assert adapter_digest(path) == first and opened == []
    time.sleep(0.01)
    save_file(
        Q | {LAYER + "self_attn.q_proj.lora_A.weight": np.ones((8, H), np.float32)},
        str(path / "adapter_model.safetensors"),
    )
    assert adapter_digest(path) != first and len(opened) == 2
    monkeypatch.setattr(adapters_check, "_digests", {})
    assert adapter_digest(path) != first


def test_a_reload_builds_its_table_off_the_event_loop(tmp_path: Path) -> None:
    """The build reads, hashes and copies adapter files (GBs for a large one): meanwhile the
    event loop keeps serving."""
    adapter(tmp_path, Q, name="a")
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text("routes:\n  - {name: a, adapter: a}\n")
    ticks = 0

    def slow_build(ids: LoraIds) -> Any:
        time.sleep(0.2)
        return load_table(
            catalog,
            base_name="m",
            adapters_root=tmp_path / "adapters",
            max_lora_rank=16,
            model_modules=None,
            lora_ids=ids,
        )

    async def main() -> bool:
        nonlocal ticks
        cat = Catalog(slow_build)
        done = asyncio.ensure_future(cat.reload())
        while not done.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return done.result()

    assert asyncio.run(main()) and ticks >= 5
