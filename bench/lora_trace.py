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
# Engine steps by the tokens they schedule: bucket i holds steps of fewer than STEP_EDGES[i]
# tokens (and at least the edge before), the last bucket the rest.
STEP_EDGES = (1, 64, 256, 512, 1024, 2048, 4096)
EDGES_VAR = "BENCH_STEP_EDGES"
IDLE_VAR = "BENCH_STEP_IDLE_S"  # a gap between steps over this is the engine idle, not a step


def server_env(env: dict[str, str], folder: Path, idle_s: float) -> dict[str, str]:
    """``env`` with the trace on: trace_site first on PYTHONPATH, counters into ``folder``;
    ``idle_s``: the longest gap between two engine steps that is still a step."""
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    edges = ",".join(map(str, STEP_EDGES))
    return {**env, "PYTHONPATH": path, VAR: str(folder), EDGES_VAR: edges, IDLE_VAR: str(idle_s)}


def bucket_names() -> list[str]:
    """The step buckets' labels: "0", "1-63", ..., "4096+"."""
    lows = (0, *STEP_EDGES)
    return [
        f"{lo}+"
        if i == len(STEP_EDGES)
        else (str(lo) if STEP_EDGES[i] == lo + 1 else f"{lo}-{STEP_EDGES[i] - 1}")
        for i, lo in enumerate(lows)
    ]


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
        **_step_fields(d),
    }


def _step_fields(d: defaultdict[str, float]) -> dict[str, float | None]:
    """The point's engine steps by size: per bucket the steps, their mean tokens and requests
    and their mean length (ms, schedule to schedule), and the same over all steps."""
    fields: dict[str, float | None] = {}
    steps = tokens = gap_s = 0.0
    for i in range(len(STEP_EDGES) + 1):
        n = d[f"b{i}_steps"]
        fields[f"step_b{i}_n"] = n
        fields[f"step_b{i}_tokens"] = d[f"b{i}_tokens"] / n if n else None
        fields[f"step_b{i}_reqs"] = d[f"b{i}_reqs"] / n if n else None
        fields[f"step_b{i}_ms"] = d[f"b{i}_gap_s"] / n * 1000 if n else None
        steps, tokens, gap_s = steps + n, tokens + d[f"b{i}_tokens"], gap_s + d[f"b{i}_gap_s"]
    fields["step_n"] = steps
    fields["step_tokens_mean"] = tokens / steps if steps else None
    fields["step_ms_mean"] = gap_s / steps * 1000 if steps else None
    return fields
