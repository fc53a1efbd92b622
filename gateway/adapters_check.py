"""Adapter checks at registration: is this directory an adapter this engine may load?

Reads files only (``adapter_config.json``, safetensors headers), never tensors, and never
touches the engine: the catalog calls it for every entry at every reload.

Compatibility is judged by the weights, not by names: every ``lora_A``/``lora_B`` tensor
must target a module the model has, with shapes that fit it (``lora_A`` is ``[r, in]``,
``lora_B`` is ``[out, r]`` for a module of weight ``[out, in]``). The base model named in
``adapter_config.json`` is only a warning unless the entry asks for ``strict_base_model``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from gateway.errors import ConfigError

# Leading path parts that only wrap the language model (PEFT's ``base_model.model``,
# Gemma 3's ``model.language_model``, ``language_model.model``): module paths are compared
# without them, so a text-only checkpoint and its multimodal twin name the same module.
_WRAPPERS = frozenset({"base_model", "model", "language_model", "text_model"})
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def safe_adapter_path(raw: str, adapters_root: Path) -> Path:
    """Resolve an adapter path, refusing anything that leaves the adapters root."""
    if not raw or raw.startswith(("/", "~", "\\")) or "://" in raw or ".." in Path(raw).parts:
        raise ConfigError(f"adapter path must be relative and inside the adapters root: {raw!r}")
    try:
        root = adapters_root.resolve()
        path = (root / raw).resolve()  # follows symlinks, so a link out of the root is caught
        is_dir = path.is_dir()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        raise ConfigError(f"adapter path {raw!r} cannot be resolved: {one_line(exc)}") from None
    if not path.is_relative_to(root):
        raise ConfigError(f"adapter path escapes the adapters root: {raw!r}")
    if not is_dir:
        raise ConfigError(f"adapter directory not found: {raw!r}")
    return path


@dataclass(frozen=True)
class ModelShapes:
    """The base model's 2-D weights: module path (wrappers stripped) -> (out, in)."""

    shapes: dict[str, tuple[int, int]]

    def leaf_names(self) -> set[str]:
        return {path.rsplit(".", 1)[-1] for path in self.shapes}

    def get(self, module: str) -> tuple[int, int] | None:
        key = module_key(module)
        shape = self.shapes.get(key)
        if shape is None and key.rsplit(".", 1)[-1] == "lm_head":  # tied to the embeddings
            shape = self.shapes.get("embed_tokens")
        return shape


@dataclass(frozen=True)
class AdapterInfo:
    config: dict[str, Any]
    rank: int
    warnings: tuple[str, ...] = ()


def module_key(path: str) -> str:
    parts = path.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPERS:
        parts = parts[1:]
    return ".".join(parts)


def tensor_shapes(file: Path, label: str | None = None) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header (no tensor is loaded). ``label``
    names the adapter in errors (default: the file's folder)."""
    try:
        with safe_open(str(file), framework="numpy") as fh:
            names: list[str] = fh.keys()  # a safe_open handle is not iterable
            return {name: list(fh.get_slice(name).get_shape()) for name in names}
    except (OSError, SafetensorError) as exc:
        adapter = label or file.parent.name
        raise ConfigError(f"{adapter}: {file.name} is not readable: {one_line(exc)}") from None


def model_shapes(model_dir: str | Path) -> ModelShapes | None:
    """The model's weight shapes from its safetensors headers. ``None`` when the model has
    no weight files (dummy weights): then adapters are checked without the model."""
    shapes: dict[str, tuple[int, int]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, shape in tensor_shapes(file).items():
            if name.endswith(".weight") and len(shape) == 2:
                shapes[module_key(name.removesuffix(".weight"))] = (shape[0], shape[1])
    return ModelShapes(shapes) if shapes else None


def check_adapter(
    path: Path,
    max_lora_rank: int,
    base_name: str,
    model: ModelShapes | None,
    *,
    strict_base_model: bool = False,
    label: str | None = None,
) -> AdapterInfo:
    """``label`` names the adapter in errors (default: its folder's name; a copy's folder is
    named by its digest)."""
    name = label or path.name
    for required in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / required).is_file():
            raise ConfigError(f"{name}: missing {required}")
    try:
        config: dict[str, Any] = json.loads((path / "adapter_config.json").read_text())
        rank = int(config["r"])
        targets = config.get("target_modules") or []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{name}: adapter_config.json is invalid: {one_line(exc)}") from None
    if rank > max_lora_rank:
        raise ConfigError(f"{name}: rank {rank} is above engine.max_lora_rank={max_lora_rank}")
    if model is not None and isinstance(targets, list):  # a string is a regex (or "all-linear")
        missing = sorted(set(targets) - model.leaf_names())
        if missing:
            raise ConfigError(f"{name}: target modules not in the model: {', '.join(missing)}")
    tensors = tensor_shapes(path / "adapter_model.safetensors", name)
    _check_tensors(name, tensors, model, rank, max_lora_rank, bool(config.get("rank_pattern")))
    warnings: list[str] = []
    base = str(config.get("base_model_name_or_path") or "")
    if base and Path(base).name != base_name:
        message = f"trained for base model '{base}', this engine serves '{base_name}'"
        if strict_base_model:
            raise ConfigError(f"{name}: {message} (strict_base_model)")
        warnings.append(f"{message}; accepted because its weights fit the model")
    return AdapterInfo(config, rank, tuple(warnings))


def _check_tensors(
    adapter: str,
    tensors: dict[str, list[int]],
    model: ModelShapes | None,
    rank: int,
    max_lora_rank: int,
    per_module_ranks: bool,
) -> None:
    """Each lora_A [r, in] / lora_B [out, r] against the module it targets."""
    found = 0
    for name, shape in sorted(tensors.items()):
        m = _LORA_TENSOR.match(name)
        if m is None:
            continue
        found += 1
        is_a = m["ab"] == "A"
        if len(shape) != 2:
            raise ConfigError(f"{adapter}: tensor {name} has shape {shape}, expected 2 dimensions")
        r = shape[0] if is_a else shape[1]
        if r > max_lora_rank or (r != rank and not per_module_ranks):
            want = f"rank {rank}" if r <= max_lora_rank else f"rank <= engine.max_lora_rank={max_lora_rank}"
            raise ConfigError(f"{adapter}: tensor {name} has rank {r} (shape {shape}), expected {want}")
        if model is None:
            continue
        target = model.get(m["module"])
        if target is None:
            module = module_key(m["module"])
            raise ConfigError(f"{adapter}: tensor {name} targets {module}, which the model does not have")
        out_features, in_features = target
        expected = [r, in_features] if is_a else [out_features, r]
        if shape != expected:
            raise ConfigError(
                f"{adapter}: tensor {name} has shape {shape}, expected {expected} "
                f"(the model's {module_key(m['module'])} is [{out_features}, {in_features}])"
            )
    if found == 0:
        raise ConfigError(f"{adapter}: adapter_model.safetensors has no lora_A/lora_B tensors")


def adapter_digest(path: Path) -> str:
    """The adapter's content digest. A file removed or replaced since it was checked is the
    entry's ``ConfigError``, not the whole catalog's failure."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update(name.encode())
        try:
            h.update((path / name).read_bytes())
        except OSError as exc:
            raise ConfigError(f"{path.name}: {name} is not readable: {one_line(exc)}") from None
    return h.hexdigest()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
