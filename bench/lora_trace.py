"""`--lora-trace`: both servers run with bench/trace_site on their PYTHONPATH, whose
sitecustomize counts what vLLM's LoRA worker does in the engine process (its docstring says
what and how). This side sets the environment and turns the counters into a point's fields."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

SITE = Path(__file__).resolve().parent / "trace_site"
VAR = "BENCH_LORA_TRACE"
FLUSH_S = 0.5  # how often the engine process writes its counters


def server_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` with the trace on: trace_site first on PYTHONPATH, counters into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, VAR: str(folder)}


def read(env: dict[str, str], settle: bool = False) -> dict[str, float] | None:
    """The counters (trace_site's ``_COUNTS``) summed over the server's engine processes;
    None without the trace. ``settle``: wait out one flush first, so that a point's last steps
    are counted."""
    folder = env.get(VAR)
    if not folder:
        return None
    if settle:
        time.sleep(2 * FLUSH_S)
    total: dict[str, float] = {}
    for f in Path(folder).glob("*.json"):
        try:
            counts = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k, v in counts.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def point_fields(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """A point's LoRA work: loads from disk and copies into GPU slots (count, mean ms), steps
    with LoRA, and mean adapters in such a step's batch; and the engine scheduler's mean time
    per step and the requests waiting in the engine at each."""
    if before is None or after is None:
        return {}
    d: defaultdict[str, float] = defaultdict(float, {k: v - before.get(k, 0.0) for k, v in after.items()})
    return {
        "lora_loads": d["loads"],
        "lora_load_ms_mean": d["load_s"] / d["loads"] * 1000 if d["loads"] else None,
        "lora_activations": d["activations"],
        "lora_activation_ms_mean": d["activation_s"] / d["activations"] * 1000 if d["activations"] else None,
        "lora_activation_s": d["activation_s"],
        "lora_load_s": d["load_s"],
        "lora_steps": d["applies"],
        "lora_adapters_per_step": d["adapters"] / d["applies"] if d["applies"] else None,
        "sched_ms_mean": d["schedule_s"] / d["schedules"] * 1000 if d["schedules"] else None,
        "sched_waiting_mean": d["waiting"] / d["schedules"] if d["schedules"] else None,
    }
