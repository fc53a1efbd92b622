"""Adapter checks at registration: is this directory an adapter this engine may load?

Reads files only (``adapter_config.json``, safetensors headers), never tensors, and never
touches the engine: the catalog calls it for every entry at every reload.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError


def safe_adapter_path(raw: str, adapters_root: Path) -> Path:
    """Resolve an adapter path, refusing anything that leaves the adapters root."""
    if not raw or raw.startswith(("/", "~", "\\")) or "://" in raw or ".." in Path(raw).parts:
        raise ConfigError(f"adapter path must be relative and inside the adapters root: {raw!r}")
    root = adapters_root.resolve()
    path = (root / raw).resolve()  # follows symlinks, so a link out of the root is caught
    if not path.is_relative_to(root):
        raise ConfigError(f"adapter path escapes the adapters root: {raw!r}")
    if not path.is_dir():
        raise ConfigError(f"adapter directory not found: {raw!r}")
    return path


def check_adapter(
    path: Path, max_lora_rank: int, base_name: str, model_modules: set[str] | None
) -> dict[str, Any]:
    for required in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / required).is_file():
            raise ConfigError(f"{path.name}: missing {required}")
    try:
        config: dict[str, Any] = json.loads((path / "adapter_config.json").read_text())
        rank = int(config["r"])
        targets = config.get("target_modules") or []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path.name}: adapter_config.json is invalid: {one_line(exc)}") from None
    base = str(config.get("base_model_name_or_path") or "")
    if base and Path(base).name != base_name:
        raise ConfigError(f"{path.name}: trained for base model '{base}', this engine serves '{base_name}'")
    if rank > max_lora_rank:
        raise ConfigError(f"{path.name}: rank {rank} is above engine.max_lora_rank={max_lora_rank}")
    if isinstance(targets, str):
        targets = [targets]
    if model_modules is not None:
        missing = sorted(set(targets) - model_modules)
        if missing:
            raise ConfigError(f"{path.name}: target modules not in the model: {', '.join(missing)}")
    return config


def adapter_digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update(name.encode())
        h.update((path / name).read_bytes())
    return h.hexdigest()


def model_module_names(model_dir: str | Path) -> set[str] | None:
    """Leaf module names that carry weights, read from safetensors headers (no tensors
    loaded). ``None`` when the model has no weight files (dummy weights)."""
    names: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for file in files:
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for key in header:
            parts = key.split(".")
            if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
                names.add(parts[-2])
    return names or None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
