"""The language model's sizes, from its ``config.json`` (a multimodal model's ``text_config``).

``adapter_slots.slot_bytes`` sizes a GPU slot by them. ``adapters_check.model_shapes``
derives from them the dense [out, in] of the modules a checkpoint stores quantized, whose
header has no dense shape, so an adapter's shapes are checked there too: vLLM does not check
them when it loads an adapter, and a wrong one fails inside the engine step. A derived shape
that is wrong would refuse a good adapter, so only a standard decoder's modules are derived,
and only where the config leaves no doubt (``decoder_shapes``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Attention that is not q/k/v/o over heads x head_dim: DeepSeek's latent attention (MLA),
# Qwen3-Next's gated queries (a q_proj twice as wide), Nemotron-NAS's per-layer heads. Other
# head sizes (``v_head_dim``, ``linear_num_key_heads``, ``mamba_head_dim``) say the same.
_OTHER_ATTENTION = frozenset({"kv_lora_rank", "q_lora_rank", "attn_output_gate", "block_configs"})
_STANDARD_HEADS = frozenset({"head_dim", "num_attention_heads", "num_key_value_heads"})
# A mixture of experts: its ``intermediate_size`` may be an expert's (Mixtral, Llama 4).
_EXPERTS = frozenset({"num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"})


@dataclass(frozen=True)
class Attention:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


def read_config(path: Path) -> dict[str, Any] | None:
    """A ``config.json``'s object; None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part: a multimodal model's ``text_config``, else the whole."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and text else config


def attention(config: Mapping[str, Any]) -> Attention | None:
    """Hidden size, heads, KV heads and head size, with the defaults transformers and vLLM
    give (``num_key_value_heads``: the heads; ``head_dim``: hidden / heads). None when a
    size is missing or not one positive integer (a per-layer list)."""
    c = text_config(config)
    hidden, heads = _size(c, "hidden_size"), _size(c, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    kv_heads, head_dim = _size(c, "num_key_value_heads", heads), _size(c, "head_dim", hidden // heads)
    if kv_heads is None or not head_dim:
        return None
    return Attention(hidden, heads, kv_heads, head_dim)


def decoder_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Dense [out, in] of a standard decoder layer's linear modules, by their path in the
    layer (``self_attn.q_proj``, ``mlp.down_proj``). Attention is left out where the config
    has another kind too, the MLP in a mixture of experts: there the config may not say."""
    c = text_config(config)
    keys = {*c, *config}
    shapes: dict[str, tuple[int, int]] = {}
    a = attention(config)
    other_heads = any(k.endswith(("head_dim", "_heads")) for k in keys - _STANDARD_HEADS)
    if a is not None and not other_heads and not any(c.get(k) or config.get(k) for k in _OTHER_ATTENTION):
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        shapes |= {"self_attn.q_proj": (q, a.hidden), "self_attn.o_proj": (a.hidden, q)}
        shapes |= {"self_attn.k_proj": (kv, a.hidden), "self_attn.v_proj": (kv, a.hidden)}
    hidden, inter = _size(c, "hidden_size"), _size(c, "intermediate_size")
    if hidden and inter and not any(c.get(k) or config.get(k) for k in _EXPERTS):
        shapes |= {"mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden)}
        shapes["mlp.down_proj"] = (hidden, inter)
    return shapes


def _size(c: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    """``c[key]`` where it is a positive integer, ``default`` where it is missing or null,
    else None (a list, a string: not one size)."""
    value = c.get(key)
    if value is None:
        return default
    return value if type(value) is int and value > 0 else None
