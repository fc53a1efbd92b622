"""adapters/train.py's saving, without training: what it writes for the same weights must not
change from run to run (the gateway's adapter digest covers adapter_config.json)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

TRAIN_PY = Path(__file__).resolve().parents[2] / "adapters" / "train.py"


@pytest.fixture(scope="module")
def train() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adapters_train", TRAIN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


class SavedByPeft:
    """Stands in for a PeftModel: ``save_pretrained`` writes what peft writes, with
    ``target_modules`` in the order given (peft keeps them as a set, so its order follows the
    interpreter's string hashing and changes from run to run)."""

    def __init__(self, target_modules: list[str]) -> None:
        self.target_modules = target_modules

    def save_pretrained(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        config = {
            "base_model_name_or_path": "/root/.cache/gateway/models/gemma-3-270m-r2",
            "lora_alpha": 16,
            "peft_type": "LORA",
            "r": 8,
            "target_modules": self.target_modules,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        (folder / "adapter_model.safetensors").write_bytes(b"same weights")
        (folder / "README.md").write_text("peft's model card")


def test_a_rerun_writes_the_same_adapter_config(train: ModuleType, tmp_path: Path) -> None:
    behaviour = train.BEHAVIOURS["shout"]
    orders = [["v_proj", "k_proj", "q_proj", "o_proj"], ["q_proj", "o_proj", "k_proj", "v_proj"]]
    written = []
    for run, order in enumerate(orders):
        out = tmp_path / f"run{run}" / "shout"
        out.parent.mkdir()
        train.save_adapter(SavedByPeft(order), out, behaviour, 60, 1.0)
        assert sorted(p.name for p in out.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
        ]
        written.append((out / "adapter_config.json").read_text())
    assert written[0] == written[1]
    config = json.loads(written[0])
    assert config["base_model_name_or_path"] == train.BASE_MODEL_NAME
    assert config["target_modules"] == sorted(train.TARGET_MODULES)
