"""Random PEFT LoRA adapters for the benchmark, shaped for a model directory.

    python -m bench.make_adapters --model MODEL_DIR --out ROOT --base-name NAME [--n 16] [--rank 8]

Writes ROOT/a0 .. ROOT/a{n-1}, each ``adapter_config.json`` + ``adapter_model.safetensors``
with keys ``base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight``.
The weights are N(0, 0.01^2): they change the logits a little and cost what a trained
adapter of the same rank costs. run.py makes 16 (``a0``..``a3`` serve lora4, all of them
lora16 and lora16z) with ``base_model_name_or_path`` ``random-test-adapter``: the gateway
judges an adapter by its tensor shapes against the model, and a base name that differs
from the served one is a warning, not a rejection.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_adapters(
    model_dir: Path, out: Path, base_name: str, n: int = 16, rank: int = 8, dtype: str = "float32"
) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {  # (in, out) of each projection
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    tdtype = getattr(torch, dtype)
    dirs = []
    for k in range(n):
        gen = torch.Generator().manual_seed(1234 + k)
        tensors = {}
        for i in range(layers):
            for module, (d_in, d_out) in shapes.items():
                pre = f"base_model.model.model.layers.{i}.self_attn.{module}"
                tensors[f"{pre}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) * 0.01).to(tdtype)
                tensors[f"{pre}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) * 0.01).to(tdtype)
        d = Path(out) / f"a{k}"
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        config = {
            "base_model_name_or_path": base_name,
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "target_modules": list(TARGETS),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
        }
        (d / "adapter_config.json").write_text(json.dumps(config, indent=2))
        dirs.append(d)
    return dirs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--base-name", required=True, help="served base model name")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    a = p.parse_args()
    dirs = make_adapters(a.model, a.out, a.base_name, a.n, a.rank, a.dtype)
    print("wrote", ", ".join(str(d) for d in dirs))


if __name__ == "__main__":
    main()
