"""Adapter compatibility by the weights: shapes against the model, base name a warning."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from gateway.adapters_check import ModelShapes, check_adapter, model_shapes, tensor_shapes
from gateway.catalog import Catalog, LoraIds, RoutingTable, load_table
from gateway.embedded import EMBEDDED_NAME, embedded_model_dir, is_prepared
from gateway.errors import ConfigError
from gateway.model_dims import decoder_shapes, read_config
from gateway.routes import model_cards
from gateway.settings import GatewaySettings
from gateway.snapshots import SnapshotDir
from gateway.state import Gateway
from tests.unit.fakes import FakeEngine

SHIPPED = Path(__file__).resolve().parents[2] / "adapters"
MODEL_DIR = embedded_model_dir(Path.home() / ".cache" / "gateway" / "models")
needs_model = pytest.mark.skipif(not is_prepared(MODEL_DIR), reason="the embedded model is not prepared")


@pytest.fixture(scope="module")
def gemma() -> ModelShapes:
    if not is_prepared(MODEL_DIR):
        pytest.skip("the embedded model is not prepared")
    shapes = model_shapes(MODEL_DIR)
    assert shapes is not None
    return shapes


def copy_adapter(tmp_path: Path, name: str = "shout", **config: object) -> Path:
    path = tmp_path / "adapters" / name
    shutil.copytree(SHIPPED / "shout", path)
    data = json.loads((path / "adapter_config.json").read_text()) | config
    (path / "adapter_config.json").write_text(json.dumps(data))
    return path


def table(
    tmp_path: Path,
    model: ModelShapes | None,
    entries: str,
    base_name: str = EMBEDDED_NAME,
    snapshots: SnapshotDir | None = None,
) -> RoutingTable:
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text("routes:\n" + entries)
    return load_table(
        catalog,
        base_name=base_name,
        adapters_root=tmp_path / "adapters",
        max_lora_rank=16,
        model_modules=model,
        lora_ids=LoraIds(),
        snapshots=snapshots,
    )


@pytest.mark.parametrize("name", ["shout", "json", "bullets"])
def test_the_shipped_adapters_fit_the_embedded_model(gemma: ModelShapes, name: str) -> None:
    info = check_adapter(SHIPPED / name, 16, EMBEDDED_NAME, gemma)
    assert info.rank == 8 and info.warnings == ()


def test_another_base_name_is_a_warning_not_a_rejection(tmp_path: Path, gemma: ModelShapes) -> None:
    copy_adapter(tmp_path, "it", base_model_name_or_path="google/gemma-3-270m-it")
    copy_adapter(tmp_path, "local", base_model_name_or_path="/data/models/my-gemma")
    t = table(
        tmp_path, gemma, "  - {name: it, adapter: it}\n  - {name: local, adapter: local}\n", "served-as"
    )
    assert set(t.routes) == {"it", "local"} and t.errors == {}
    assert (
        "trained for base model 'google/gemma-3-270m-it', this engine serves 'served-as'"
        in t.routes["it"].warnings[0]
    )
    cards = {c["id"]: c for c in model_cards(Catalog(lambda ids: t), 0)}
    assert cards["local"]["warnings"] == list(t.routes["local"].warnings)
    assert cards["served-as"].get("warnings") is None  # the base route has no adapter fields


async def test_a_base_name_warning_is_logged_once_per_version(
    tmp_path: Path, gemma: ModelShapes, caplog: pytest.LogCaptureFixture
) -> None:
    """Reloads brought on by other entries' edits do not say it again; a new version does."""
    caplog.set_level(logging.WARNING, logger="gateway.catalog")
    path = copy_adapter(tmp_path, "it", base_model_name_or_path="google/gemma-3-270m-it")
    copy_adapter(tmp_path, "other")
    entries = "  - {name: it, adapter: it}\n"
    catalog = Catalog(lambda ids: table(tmp_path, gemma, entries, "served-as"))

    def said() -> int:
        return sum("catalog entry it: trained for base model" in r.getMessage() for r in caplog.records)

    assert said() == 1
    entries += "  - {name: other, adapter: other}\n"
    assert await catalog.reload() and await catalog.reload()
    assert said() == 1 and catalog.table.routes["it"].warnings  # still on the route's card
    data = json.loads((path / "adapter_config.json").read_text()) | {"lora_alpha": 17}
    (path / "adapter_config.json").write_text(json.dumps(data))
    assert await catalog.reload()
    assert said() == 2  # a new version of the adapter: said for it


def test_strict_base_model_makes_the_name_a_rejection(tmp_path: Path, gemma: ModelShapes) -> None:
    copy_adapter(tmp_path, "it", base_model_name_or_path="google/gemma-3-270m-it")
    t = table(tmp_path, gemma, "  - {name: it, adapter: it, strict_base_model: true}\n")
    assert t.routes == {}
    assert "trained for base model 'google/gemma-3-270m-it'" in t.errors["it"]
    assert "strict_base_model" in t.errors["it"]


@pytest.mark.parametrize(
    "model, model_path, trained_on",
    [
        ("/models/gemma-3-270m-it", "/models/gemma-3-270m-it", "google/gemma-3-270m-it"),
        (None, str(MODEL_DIR), EMBEDDED_NAME),  # the embedded model, by its own name
    ],
    ids=["model-path", "embedded"],
)
def test_a_base_model_served_under_an_alias_matches_by_its_path(
    make_settings: Callable[..., GatewaySettings],
    model: str | None,
    model_path: str,
    trained_on: str,
) -> None:
    """Served as ``base``: the adapter names the model it was loaded from, not the alias.
    Strict, it is accepted; not strict, no warning says it was trained for another model."""
    settings = make_settings(**({"engine__model": model} if model else {}))
    for name in ("shout", "json"):
        config = settings.adapters_root / name / "adapter_config.json"
        config.write_text(
            json.dumps(json.loads(config.read_text()) | {"base_model_name_or_path": trained_on})
        )
    settings.catalog.write_text(
        "routes:\n  - {name: shout, adapter: shout, strict_base_model: true}\n  - {name: json, adapter: json}\n"
    )
    engine = FakeEngine(served_model_name="base")
    engine.model_path = model_path
    t = Gateway(settings, engine).build_table(LoraIds())
    assert t.errors == {}
    assert t.routes["shout"].warnings == () and t.routes["json"].warnings == ()


def test_a_shape_mismatch_names_the_tensor_its_shape_and_the_expected_one(
    tmp_path: Path, gemma: ModelShapes
) -> None:
    path = copy_adapter(tmp_path)
    weights = path / "adapter_model.safetensors"
    tensors = {name: np.zeros(shape, dtype=np.float32) for name, shape in tensor_shapes(weights).items()}
    bad = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"
    assert tensors[bad].shape == (1024, 8)
    tensors[bad] = np.zeros((2048, 8), dtype=np.float32)  # a model with twice the heads
    save_file(tensors, str(weights))
    t = table(tmp_path, gemma, "  - {name: shout, adapter: shout}\n")
    assert t.routes == {}
    assert t.errors["shout"] == (
        f"shout: tensor {bad} has shape [2048, 8], expected [1024, 8] "
        "(the model's layers.3.self_attn.q_proj is [1024, 640])"
    )


def gptq_twin(gemma: ModelShapes, folder: Path) -> Path:
    """The embedded model as a 4-bit GPTQ checkpoint: its headers hold ``qweight`` [in / 8, out]
    and ``scales`` [1, out] for each decoder module, no dense shape; its config.json as is."""
    folder.mkdir()
    tensors = {}
    for key, shape in gemma.shapes.items():
        assert shape is not None
        out, inp = shape
        if key.startswith("layers."):
            tensors[f"model.{key}.qweight"] = np.zeros((inp // 8, out), np.int32)
            tensors[f"model.{key}.scales"] = np.zeros((1, out), np.float16)
        else:
            tensors[f"model.{key}.weight"] = np.zeros(shape, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(MODEL_DIR / "config.json", folder)
    return folder


def test_on_a_gptq_checkpoint_the_shapes_come_from_its_config(tmp_path: Path, gemma: ModelShapes) -> None:
    """vLLM loads a wrong-shaped adapter without a check and fails inside the engine step when
    a request first uses it (every client's engine dies): the dense shapes of a quantized
    checkpoint's decoder modules follow from config.json and are checked as a dense one's."""
    config = read_config(MODEL_DIR / "config.json")
    assert config is not None and len(decoder_shapes(config)) == 7  # q, k, v, o, gate, up, down
    quantized = model_shapes(gptq_twin(gemma, tmp_path / "gptq"))
    assert quantized is not None and quantized.shapes == gemma.shapes
    path = copy_adapter(tmp_path)
    assert check_adapter(path, 16, EMBEDDED_NAME, quantized).rank == 8
    weights = path / "adapter_model.safetensors"
    tensors = {name: np.zeros(shape, dtype=np.float32) for name, shape in tensor_shapes(weights).items()}
    bad = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"
    tensors[bad] = np.zeros((2048, 8), dtype=np.float32)  # a model with twice the heads
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError) as raised:
        check_adapter(path, 16, EMBEDDED_NAME, quantized)
    assert str(raised.value) == (
        f"shout: tensor {bad} has shape [2048, 8], expected [1024, 8] "
        "(the model's layers.3.self_attn.q_proj is [1024, 640])"
    )


def test_a_tensor_for_a_module_the_model_lacks_is_rejected(tmp_path: Path, gemma: ModelShapes) -> None:
    path = copy_adapter(tmp_path)
    name = "base_model.model.model.layers.40.self_attn.q_proj.lora_A.weight"  # 18 layers only
    save_file({name: np.zeros((8, 640), dtype=np.float32)}, str(path / "adapter_model.safetensors"))
    with pytest.raises(
        ConfigError, match="targets layers.40.self_attn.q_proj, which the model does not have"
    ):
        check_adapter(path, 16, EMBEDDED_NAME, gemma)


@pytest.mark.parametrize("half, other", [("lora_A", "lora_B"), ("lora_B", "lora_A")])
def test_a_module_with_one_half_of_its_lora_pair_is_rejected(tmp_path: Path, half: str, other: str) -> None:
    """vLLM registers such an adapter, then fails an assertion when it first activates it,
    inside the engine step: the engine dies. The registration check refuses it."""
    path = copy_adapter(tmp_path)
    weights = path / "adapter_model.safetensors"
    tensors = {name: np.zeros(shape, dtype=np.float32) for name, shape in tensor_shapes(weights).items()}
    module = "base_model.model.model.layers.3.self_attn.o_proj"
    del tensors[f"{module}.{other}.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError) as raised:
        check_adapter(path, 16, EMBEDDED_NAME, None)  # no model needed: the pair is the adapter's own
    assert str(raised.value) == f"shout: tensor {module}.{half}.weight has no {other}"


def test_the_tensor_rank_must_match_the_config(tmp_path: Path, gemma: ModelShapes) -> None:
    path = copy_adapter(tmp_path, r=4)  # the tensors are rank 8
    with pytest.raises(ConfigError, match=r"has rank 8 \(shape \[8, 640\]\), expected rank 4"):
        check_adapter(path, 16, EMBEDDED_NAME, gemma)
    path = copy_adapter(tmp_path, "liar", r=2)  # a config under the limit does not hide rank 8
    with pytest.raises(ConfigError, match="expected rank <= engine.max_lora_rank=4"):
        check_adapter(path, 4, EMBEDDED_NAME, gemma)


def test_without_model_weights_only_the_adapter_itself_is_checked(tmp_path: Path) -> None:
    path = copy_adapter(tmp_path, target_modules=["not_in_any_model"])
    assert check_adapter(path, 16, EMBEDDED_NAME, None).rank == 8  # dummy weights: nothing to compare
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ConfigError, match="adapter_model.safetensors is not readable"):
        check_adapter(path, 16, EMBEDDED_NAME, None)


def test_multimodal_checkpoint_prefixes_match_text_only_adapters(tmp_path: Path) -> None:
    """Gemma 3 multimodal checkpoints say model.language_model.layers...; PEFT adapters
    trained on the text model say base_model.model.model.layers...: the same module."""
    save_file(
        {
            "model.language_model.layers.0.self_attn.q_proj.weight": np.zeros((1024, 640), np.float32),
            "model.language_model.embed_tokens.weight": np.zeros((10, 640), np.float32),
            "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight": np.zeros(
                (3, 3), np.float32
            ),
        },
        str(tmp_path / "model.safetensors"),
    )
    shapes = model_shapes(tmp_path)
    assert shapes is not None
    assert shapes.get("base_model.model.model.layers.0.self_attn.q_proj") == (1024, 640)
    assert shapes.get("base_model.model.language_model.model.layers.0.self_attn.q_proj") == (1024, 640)
    assert shapes.get("base_model.model.lm_head") == (10, 640)  # tied to the embeddings
    assert shapes.get("base_model.model.model.layers.1.self_attn.q_proj") is None


def test_pinned_or_preload_on_a_preset_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "adapters").mkdir()
    t = table(tmp_path, None, "  - {name: p, system_prompt: hi, pinned: true, preload: true}\n")
    assert t.errors["p"] == "pinned, preload need an adapter"


async def test_the_engine_loads_a_content_addressed_copy(tmp_path: Path) -> None:
    """Files edited in place never change what an engine LoRA id (or name and path,
    vLLM's prefix-cache key) stands for: the engine reads a copy named by its digest."""
    original = copy_adapter(tmp_path)
    snapshots = SnapshotDir(tmp_path / "cache" / "adapters")
    catalog = tmp_path / "adapters.yaml"
    catalog.write_text("routes:\n  - {name: shout, adapter: shout}\n")

    def build(ids: LoraIds) -> RoutingTable:
        return load_table(
            catalog,
            base_name=EMBEDDED_NAME,
            adapters_root=tmp_path / "adapters",
            max_lora_rank=16,
            model_modules=None,
            lora_ids=ids,
            snapshots=snapshots,
        )

    live = Catalog(build)
    first = live.table.routes["shout"]
    assert first.lora is not None and first.digest is not None
    assert first.lora.path == str(snapshots.path / first.digest) and first.lora.name == "shout"
    assert "manifest.json" in {p.name for p in original.iterdir()}  # the engine reads it not: no copy
    assert sorted(p.name for p in Path(first.lora.path).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    (original / "adapter_config.json").write_text((SHIPPED / "json" / "adapter_config.json").read_text())
    weights = (SHIPPED / "json" / "adapter_model.safetensors").read_bytes()
    (original / "adapter_model.safetensors").write_bytes(weights)  # in place, same path
    assert await live.reload()
    second = live.table.routes["shout"]
    assert second.lora is not None and second.lora.path != first.lora.path
    assert (Path(first.lora.path) / "adapter_model.safetensors").read_bytes() != weights  # the old copy
    assert (Path(second.lora.path) / "adapter_model.safetensors").read_bytes() == weights
    assert {p.name for p in snapshots.path.iterdir()} == {first.digest, second.digest, ".lock"}  # no staging
    snapshots.close()
    assert not snapshots.path.exists()  # the process's copies go with it


def test_the_copy_takes_only_the_files_the_engine_reads(tmp_path: Path) -> None:
    """A trainer's output folder holds checkpoints (many times the adapter's size, copied
    again for each version) and links that need not resolve here (``runs -> /scratch/...``,
    which failed the whole copy: a valid adapter rejected)."""
    original = copy_adapter(tmp_path)
    (original / "runs").symlink_to("/scratch/tensorboard/run-17")  # not on this host
    (original / "checkpoint-500").mkdir()
    (original / "checkpoint-500" / "optimizer.pt").write_bytes(b"\0" * 1024)
    snapshots = SnapshotDir(tmp_path / "cache" / "adapters")
    try:
        t = table(tmp_path, None, "  - {name: shout, adapter: shout}\n", snapshots=snapshots)
        assert t.errors == {}
        lora = t.routes["shout"].lora
        assert lora is not None and Path(lora.path).parent == snapshots.path
        assert sorted(p.name for p in Path(lora.path).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    finally:
        snapshots.close()


def test_files_changed_between_the_check_and_the_copy_are_checked_in_the_copy(
    tmp_path: Path, gemma: ModelShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory replaced while the catalog loads: the engine reads the copy, so the copy
    is what must fit the model. A wrong shape there would pass vLLM's load and fail when the
    engine copies it into a GPU slot."""
    import gateway.catalog as catalog_module

    path = copy_adapter(tmp_path)
    weights = path / "adapter_model.safetensors"
    tensors = {name: np.zeros(shape, dtype=np.float32) for name, shape in tensor_shapes(weights).items()}
    bad = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    tensors[bad] = np.zeros((257, 8), dtype=np.float32)
    checked = []

    def check_then_replace(adapter: Path, *args: object, **kwargs: object) -> object:
        info = check_adapter(adapter, *args, **kwargs)  # type: ignore[arg-type]
        if not checked:  # the first check sees good files; then a deploy replaces them
            checked.append(adapter)
            save_file(tensors, str(weights))
        return info

    monkeypatch.setattr(catalog_module, "check_adapter", check_then_replace)
    snapshots = SnapshotDir(tmp_path / "cache" / "adapters")
    t = table(tmp_path, gemma, "  - {name: shout, adapter: shout}\n", snapshots=snapshots)
    assert checked == [path]
    assert t.routes == {}  # the copy holds the new, misshapen tensors
    assert t.errors["shout"].startswith(f"shout: tensor {bad} has shape [257, 8], expected [256, 8]")
    assert [p.name for p in snapshots.path.iterdir() if p.is_dir()] == []  # no version reads it
    snapshots.close()
