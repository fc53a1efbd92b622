"""Adapter checks at registration: is this directory an adapter this engine may load?

Reads files only (``adapter_config.json``, the weights' shapes), never touches the engine:
the catalog calls it for every entry at every reload. The weights file is the one vLLM
loads: ``adapter_model.safetensors`` (shapes from its header, no tensor read), else
``adapter_model.bin`` or ``.pt`` (``torch.load(weights_only=True)`` as vLLM does, mapped
rather than read where the file is in torch's zip format).

Compatibility is judged by the weights, not by names: every ``lora_A``/``lora_B`` tensor
must have its other half and target a module the model has, with shapes that fit it
(``lora_A`` is ``[r, in]``, ``lora_B`` is ``[out, r]`` for a module of weight ``[out, in]``)
at the module's rank (``r``, or its ``rank_pattern`` entry, matched as PEFT and vLLM match
it). A module whose weight the checkpoint stores quantized has no dense shape in its
header: a standard decoder module's comes from ``config.json`` (``model_dims``), as vLLM
does not check shapes when it loads an adapter (a wrong one fails inside the engine step);
any other such module is only checked to exist. The base model named in
``adapter_config.json`` is only a warning unless the entry asks for ``strict_base_model``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from gateway.errors import ConfigError
from gateway.model_dims import decoder_shapes, read_config

# Leading path parts that only wrap the language model (PEFT's ``base_model.model``,
# Gemma 3's ``model.language_model``, ``language_model.model``): module paths are compared
# without them, so a text-only checkpoint and its multimodal twin name the same module.
_WRAPPERS = frozenset({"base_model", "model", "language_model", "text_model"})
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Dense weights: a 2-D ``.weight`` in one of these has the module's [out, in] in its header.
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# Tensors that stand for a quantized module's weight (GPTQ/AWQ, compressed-tensors).
_QUANTIZED_WEIGHTS = frozenset({"qweight", "weight_packed"})
# A standard decoder layer's module (its path, wrappers stripped): ``model_dims.decoder_shapes``
# has its dense shape by its path in the layer. Anchored: a vision tower's layers are not it.
_DECODER_MODULE = re.compile(r"^layers\.\d+\.(?P<name>(?:self_attn|mlp)\.\w+)$")
# The adapter's weights, in the order vLLM's ``LoRAModel.from_local_checkpoint`` looks.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def safe_adapter_path(raw: str, adapters_root: Path) -> Path:
    """Resolve an adapter path, refusing anything that leaves the adapters root."""
    if not raw or raw.startswith(("/", "~", "\\")) or "://" in raw or ".." in Path(raw).parts:
        raise ConfigError(f"adapter path must be relative and inside the adapters root: {raw!r}")
    try:
        root = adapters_root.resolve()
        path = (root / raw).resolve()  # follows symlinks, so a link out of the root is caught
        is_dir = path.is_dir()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop (3.11); a NUL byte
        raise ConfigError(f"adapter path {raw!r} cannot be resolved: {one_line(exc)}") from None
    if not path.is_relative_to(root):
        raise ConfigError(f"adapter path escapes the adapters root: {raw!r}")
    if not is_dir:
        raise ConfigError(f"adapter directory not found: {raw!r}")
    return path


@dataclass(frozen=True)
class ModelShapes:
    """The base model's weights: module path (wrappers stripped) -> (out, in), or None for a
    module stored quantized whose dense shape neither its header nor ``config.json`` gives."""

    shapes: dict[str, tuple[int, int] | None]

    def _key(self, module: str) -> str | None:
        key = module_key(module)
        if key in self.shapes:
            return key
        if key.rsplit(".", 1)[-1] == "lm_head" and "embed_tokens" in self.shapes:  # tied
            return "embed_tokens"
        return None

    def has(self, module: str) -> bool:
        return self._key(module) is not None

    def get(self, module: str) -> tuple[int, int] | None:
        """The module's [out, in]; None when it is missing or stored quantized (``has``)."""
        key = self._key(module)
        return None if key is None else self.shapes[key]

    def has_target(self, target: str) -> bool:
        """PEFT's ``target_modules`` rule: a name targets each module whose path is the name or
        ends in ``.`` + the name (``q_proj``, ``self_attn.q_proj``)."""
        key = module_key(target)
        if self.has(key):
            return True
        suffix = "." + key
        return any(path.endswith(suffix) for path in self.shapes)


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


def weights_file(path: Path, label: str) -> Path:
    """The adapter's weights file vLLM loads; ``ConfigError`` (naming ``label``) when it has
    none."""
    found = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if found is None:
        raise ConfigError(f"{label}: missing adapter_model.safetensors (or adapter_model.bin)")
    return found


def engine_files(path: Path) -> tuple[str, str]:
    """The files of an adapter vLLM reads: ``adapter_config.json`` and the weights file it
    loads. Its digest covers them, and its copy holds them and nothing else."""
    return ("adapter_config.json", weights_file(path, path.name).name)


def tensor_shapes(file: Path, label: str | None = None) -> dict[str, list[int]]:
    """Tensor name -> shape: from the safetensors header (no tensor is loaded), or from a
    ``torch.save``d dict of tensors. ``label`` names the adapter in errors (default: the
    file's folder)."""
    if file.suffix != ".safetensors":
        return _pickled_shapes(file, label or file.parent.name)
    return {name: shape for name, (shape, _) in _header(file, label).items()}


def _pickled_shapes(file: Path, adapter: str) -> dict[str, list[int]]:
    import torch  # loaded with the engine already; only adapters without safetensors need it

    def load(mmap: bool) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on the legacy format
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            data = load(mmap=True)
        except Exception:  # the legacy (pre-zip) format cannot be mapped: read it
            data = load(mmap=False)
    except Exception as exc:  # torch.load raises many kinds for a bad file; each is the entry's
        raise ConfigError(f"{adapter}: {file.name} is not readable: {one_line(exc)}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise ConfigError(f"{adapter}: {file.name} is not a state dict (tensor names -> tensors)")
    return {name: list(tensor.shape) for name, tensor in data.items()}


def _header(file: Path, label: str | None = None) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, dtype) from the safetensors header."""
    try:
        with safe_open(str(file), framework="numpy") as fh:
            names: list[str] = fh.keys()  # a safe_open handle is not iterable
            slices = {name: fh.get_slice(name) for name in names}
            return {name: (list(t.get_shape()), t.get_dtype()) for name, t in slices.items()}
    except (OSError, SafetensorError) as exc:
        adapter = label or file.parent.name
        raise ConfigError(f"{adapter}: {file.name} is not readable: {one_line(exc)}") from None


def local_model_dir(model: str) -> Path | None:
    """Where ``model``'s files are: the folder it names, or the Hugging Face cache's copy of a
    repo id (vLLM downloads it there when it starts); None when neither is on this machine."""
    if not model:
        return None
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not a repo id, or not in the cache: no shapes to check against
        return None


def model_shapes(model: str | Path) -> ModelShapes | None:
    """The model's weight shapes from its safetensors headers (``model``: a folder, or a repo
    id in the Hugging Face cache). ``None`` when the model has no weight files here (dummy
    weights): then adapters are checked without the model."""
    model_dir = local_model_dir(str(model))
    if model_dir is None:
        return None
    shapes: dict[str, tuple[int, int] | None] = {}
    outs: dict[str, int] = {}  # a quantized module's out features, where its format says them
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, (shape, dtype) in _header(file).items():
            module, _, kind = name.rpartition(".")
            if kind == "weight" and len(shape) == 2 and dtype in _FLOAT_DTYPES:
                shapes[module_key(module)] = (shape[0], shape[1])
            elif kind in _QUANTIZED_WEIGHTS or (kind == "weight" and dtype not in _FLOAT_DTYPES):
                shapes.setdefault(module_key(module), None)  # e.g. bitsandbytes' packed .weight
            if len(shape) == 2 and kind in ("scales", "weight_packed"):
                # GPTQ's and AWQ's scales are [in / group, out]; compressed-tensors packs [out, in / pack]
                outs[module_key(module)] = shape[1] if kind == "scales" else shape[0]
    if None in shapes.values() and (config := read_config(model_dir / "config.json")) is not None:
        _derive_quantized(shapes, outs, decoder_shapes(config))
    return ModelShapes(shapes) if shapes else None


def _derive_quantized(
    shapes: dict[str, tuple[int, int] | None], outs: dict[str, int], derived: dict[str, tuple[int, int]]
) -> None:
    """Give the quantized decoder modules their shape from ``config.json``, unless a header
    contradicts it for any layer (a dense copy of another shape, a quantized module of other
    out features): then the config does not describe these weights, and they stay unchecked."""
    roles = {key: m["name"] for key in shapes if (m := _DECODER_MODULE.match(key)) and m["name"] in derived}
    wrong = {
        role
        for key, role in roles.items()
        if shapes[key] not in (None, derived[role]) or outs.get(key, derived[role][0]) != derived[role][0]
    }
    for key, role in roles.items():
        if shapes[key] is None and role not in wrong:
            shapes[key] = derived[role]


def check_adapter(
    path: Path,
    max_lora_rank: int,
    base_name: str,
    model: ModelShapes | None,
    *,
    strict_base_model: bool = False,
    label: str | None = None,
    model_names: tuple[str, ...] = (),
) -> AdapterInfo:
    """``label`` names the adapter in errors (default: its folder's name; a copy's folder is
    named by its digest). ``model_names``: what else the served model is known by (its path
    or repo id), since ``base_name`` may be an alias."""
    name = label or path.name
    if not (path / "adapter_config.json").is_file():
        raise ConfigError(f"{name}: missing adapter_config.json")
    weights = weights_file(path, name)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name}: adapter_config.json is invalid: {one_line(exc)}") from None
    rank, targets, ranks = _read_config(name, config)
    if (top := max([rank, *ranks.values()])) > max_lora_rank:
        raise ConfigError(f"{name}: rank {top} is above engine.max_lora_rank={max_lora_rank}")
    if model is not None and isinstance(targets, list):  # a string is a regex (or "all-linear")
        missing = sorted(t for t in set(targets) if not model.has_target(t))
        if missing:
            raise ConfigError(f"{name}: target modules not in the model: {', '.join(missing)}")
    tensors = tensor_shapes(weights, name)
    if not any(_LORA_TENSOR.match(tensor) for tensor in tensors):
        raise ConfigError(f"{name}: {weights.name} has no lora_A/lora_B tensors")
    _check_tensors(name, tensors, model, rank, max_lora_rank, ranks)
    warnings: list[str] = []
    base = str(config.get("base_model_name_or_path") or "")
    if base and not _same_model(base, (base_name, *model_names)):
        message = f"trained for base model '{base}', this engine serves '{base_name}'"
        if strict_base_model:
            raise ConfigError(f"{name}: {message} (strict_base_model)")
        why = "because its weights fit the model" if model is not None else "(no model here to check it)"
        warnings.append(f"{message}; accepted {why}")
    return AdapterInfo(config, rank, tuple(warnings))


def _same_model(base: str, names: tuple[str, ...]) -> bool:
    """``base`` names one of ``names``: the same string, or the same last path part
    (``google/gemma-3-270m`` and ``/data/gemma-3-270m`` are ``gemma-3-270m``)."""
    return any(base == name or Path(base).name in (name, Path(name).name) for name in names if name)


def _read_config(adapter: str, config: object) -> tuple[int, list[str] | str, dict[str, int]]:
    """``r``, ``target_modules`` and ``rank_pattern``, checked for what vLLM reads of them: a
    value of the wrong type is this entry's rejection, never the whole catalog's failure."""

    def invalid(why: str) -> ConfigError:
        return ConfigError(f"{adapter}: adapter_config.json is invalid: {why}")

    if not isinstance(config, dict):
        raise invalid("expected a JSON object")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:  # JSON true, 8.5, Infinity and "8" are not ranks
        raise invalid(f"'r' must be a positive integer, got {rank!r}")
    targets = config.get("target_modules") or []
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise invalid(f"'target_modules' must be a module name, a list of them or a regex, got {targets!r}")
    ranks = config.get("rank_pattern") or {}
    if not isinstance(ranks, dict) or not all(type(r) is int and r >= 1 for r in ranks.values()):
        raise invalid(f"'rank_pattern' must map module patterns to positive integers, got {ranks!r}")
    alphas = config.get("alpha_pattern") or {}
    for field, keys in (
        ("rank_pattern", ranks),
        ("alpha_pattern", alphas if isinstance(alphas, dict) else {}),
    ):
        for key in keys:
            try:  # as PEFT and vLLM match it: a flag like (?i) is valid alone, not there
                _pattern(key)
            except re.error as exc:
                raise invalid(f"'{field}' key {key!r} is not a regex: {exc}") from None
    return rank, targets, ranks


def _pattern(key: str) -> re.Pattern[str]:
    """A ``rank_pattern`` / ``alpha_pattern`` key as PEFT and vLLM match it: the module's
    path ends in it at a ``.`` boundary."""
    return re.compile(rf"(.*\.)?({key})$")


def _module_rank(module: str, rank: int, ranks: dict[str, int]) -> int:
    """The rank PEFT gave ``module`` (its path in the checkpoint, ``base_model.model.``
    stripped): the first ``rank_pattern`` key it ends in at a ``.`` boundary, else ``r``.
    vLLM matches the same way."""
    name = module.removeprefix("base_model.model.")
    for key, value in ranks.items():
        if _pattern(key).match(name):
            return value
    return rank


def _check_tensors(
    adapter: str,
    tensors: dict[str, list[int]],
    model: ModelShapes | None,
    rank: int,
    max_lora_rank: int,
    ranks: dict[str, int],
) -> None:
    """Each lora_A [r, in] / lora_B [out, r] against the module it targets, at its rank."""
    for name, shape in sorted(tensors.items()):
        m = _LORA_TENSOR.match(name)
        if m is None:
            continue
        is_a = m["ab"] == "A"
        if len(shape) != 2:
            raise ConfigError(f"{adapter}: tensor {name} has shape {shape}, expected 2 dimensions")
        r = shape[0] if is_a else shape[1]
        want = _module_rank(m["module"], rank, ranks)
        if r > max_lora_rank or r != want:
            expected = (
                f"rank {want}" if r <= max_lora_rank else f"rank <= engine.max_lora_rank={max_lora_rank}"
            )
            origin = " (rank_pattern)" if want != rank else ""
            raise ConfigError(
                f"{adapter}: tensor {name} has rank {r} (shape {shape}), expected {expected}{origin}"
            )
        if model is None:
            continue
        if not model.has(m["module"]):
            module = module_key(m["module"])
            raise ConfigError(f"{adapter}: tensor {name} targets {module}, which the model does not have")
        target = model.get(m["module"])
        if target is None:  # stored quantized, and no shape for it in config.json: unchecked
            continue
        out_features, in_features = target
        fits = [r, in_features] if is_a else [out_features, r]
        if shape != fits:
            raise ConfigError(
                f"{adapter}: tensor {name} has shape {shape}, expected {fits} "
                f"(the model's {module_key(m['module'])} is [{out_features}, {in_features}])"
            )
    _check_pairs(adapter, tensors)


def _check_pairs(adapter: str, tensors: dict[str, list[int]]) -> None:
    """Every module has both halves: vLLM registers an adapter with one missing, then fails
    an assertion when it first activates it, inside the engine step (the engine dies)."""
    halves: dict[str, dict[str, str]] = {}
    for name in sorted(tensors):
        if (m := _LORA_TENSOR.match(name)) is not None:
            halves.setdefault(m["module"], {})[m["ab"]] = name
    for found in halves.values():
        if len(found) == 1:
            ((ab, name),) = found.items()
            raise ConfigError(f"{adapter}: tensor {name} has no lora_{'B' if ab == 'A' else 'A'}")


# (folder, its files' stat) -> digest: a reload rereads only the adapters whose files changed
# (any write moves a file's mtime and ctime), not every adapter's weights each time.
_digests: dict[tuple[str, tuple[tuple[int, ...], ...]], str] = {}
_DIGESTS_KEPT = 4096


def adapter_digest(path: Path) -> str:
    """The adapter's content digest. A file removed or replaced since it was checked is the
    entry's ``ConfigError``, not the whole catalog's failure."""
    digested = engine_files(path)
    stats = []
    for name in digested:
        try:
            stats.append(_identity((path / name).stat()))
        except OSError as exc:
            raise ConfigError(f"{path.name}: {name} is not readable: {one_line(exc)}") from None
    key = (str(path), tuple(stats))
    if (known := _digests.get(key)) is not None:
        return known
    h = hashlib.sha256()
    for name in digested:
        h.update(name.encode())
        try:
            with (path / name).open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
        except OSError as exc:
            raise ConfigError(f"{path.name}: {name} is not readable: {one_line(exc)}") from None
    if len(_digests) >= _DIGESTS_KEPT:
        _digests.clear()
    _digests[key] = digest = h.hexdigest()
    return digest


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
