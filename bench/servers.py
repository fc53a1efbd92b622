"""Start, probe and stop the two servers under test, and sample their memory.

Both are started as child processes in a session of their own (so the engine's worker
processes are stopped with them), from the command lines in ``vllm_command`` and
``gateway_command``: the same model, dtype, context, batch and LoRA settings, and the
same four adapter directories. The gateway gets a temporary catalog whose routes point at
those directories. ``GATEWAY_*`` variables are removed from the gateway's environment so
that only the flags and ``gateway_env`` configure it (configs/gateway.yaml still applies
under them).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.tools import TOOL_TEMPLATE_PATH

REPO = Path(__file__).resolve().parent.parent


@dataclass
class EngineSpec:
    """Engine settings shared by both servers and the no-HTTP ceiling."""

    model: str
    served_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_lora_rank: int
    # Given to both: the gateway sizes its CPU cache to the catalog when left out, vLLM's
    # server keeps max_loras; the same cache on both compares the scheduling, not the cache.
    # None (run.py --cpu-cache defaults): neither server gets the flag, each keeps its default.
    max_cpu_loras: int | None
    load_format: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # name -> directory
    gpu_memory_utilization: float | None = None  # --together: two servers share one GPU

    def engine_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=self.model,
            served_model_name=[self.served_name],
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_lora=True,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            seed=0,
        )
        if self.max_cpu_loras is not None:
            kw["max_cpu_loras"] = self.max_cpu_loras
        if self.load_format:
            kw["load_format"] = self.load_format
        if self.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        return kw


def _shared_flags(spec: EngineSpec, port: int) -> list[str]:
    """Engine flags both CLIs spell the same way: one list, so both servers get the same settings."""
    flags = [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", spec.model,
        "--served-model-name", spec.served_name,
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--max-loras", str(spec.max_loras),
        "--max-lora-rank", str(spec.max_lora_rank),
    ]  # fmt: skip
    if spec.max_cpu_loras is not None:
        flags += ["--max-cpu-loras", str(spec.max_cpu_loras)]
    if spec.load_format:
        flags += ["--load-format", spec.load_format]
    if spec.gpu_memory_utilization:
        flags += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    return flags


def vllm_command(spec: EngineSpec, port: int, tool_parser: str | None = None) -> list[str]:
    """``tool_parser``: vLLM's server (0.32) refuses ``tool_choice: "required"`` unless
    ``--enable-auto-tool-choice --tool-call-parser`` are set (any parser: under
    ``required`` it decodes with its own JSON-list grammar). With one, vLLM's server also
    gets the gateway's tool-aware template: Gemma's own drops the tools, so without it
    vLLM's prompts would be shorter than the gateway's (the template renders messages
    without tools exactly as Gemma's does)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *_shared_flags(spec, port)]
    cmd += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens), "--enable-lora", "--seed", "0"]
    if tool_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
        cmd += ["--chat-template", str(TOOL_TEMPLATE_PATH)]
    if spec.adapters:
        cmd += ["--lora-modules", *[f"{n}={p}" for n, p in spec.adapters.items()]]
    return cmd


def write_catalog(spec: EngineSpec, adapters_root: Path, path: Path) -> Path:
    """A catalog with one route per adapter; paths relative to ``adapters_root``."""
    lines = ["base:", "  aliases: []", "routes:"]
    for name, directory in spec.adapters.items():
        rel = Path(directory).resolve().relative_to(adapters_root.resolve())
        lines += [f"  - name: {name}", f"    adapter: {rel.as_posix()}"]
    if not spec.adapters:
        lines[-1] = "routes: []"
    path.write_text("\n".join(lines) + "\n")
    return path


def gateway_command(spec: EngineSpec, port: int, catalog: Path, adapters_root: Path) -> list[str]:
    # The gateway's engine seed defaults to 0, as vLLM's server is given above.
    return [
        sys.executable, "-m", "gateway", "serve", *_shared_flags(spec, port),
        "--catalog", str(catalog),
        "--adapters-root", str(adapters_root),
        "--set", f"engine.max_num_batched_tokens={spec.max_num_batched_tokens}",
        "--set", "engine.enable_lora=true",
    ]  # fmt: skip


def gateway_env(base: dict[str, str], api_key: str, max_inflight: int) -> dict[str, str]:
    """The gateway's environment: no inherited GATEWAY_* settings, one bench API key
    (the gateway denies by default), and an admission bound that the load never reaches
    (vLLM's server has none; the gateway's default would answer 429 above it)."""
    env = {k: v for k, v in base.items() if not k.startswith("GATEWAY_")}
    env["GATEWAY_AUTH__KEYS"] = json.dumps([{"name": "bench", "key": api_key}])
    env["GATEWAY_LIMITS__MAX_INFLIGHT"] = str(max_inflight)
    return env


class Server:
    """One server process (and its process group) with a readiness probe."""

    def __init__(
        self, name: str, cmd: list[str], port: int, ready_path: str, env: dict[str, str], log: Path
    ) -> None:
        self.name, self.cmd, self.port, self.ready_path, self.log = name, cmd, port, ready_path, log
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self.t0 = 0.0

    def start(self, timeout_s: float) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        self.t0 = time.time()
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                self.cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True
            )

    def wait_log(self, needle: str, timeout_s: float) -> bool:
        """Wait until the server's log has ``needle`` (or it exits, or is ready); whether it has."""
        assert self.proc is not None
        deadline = time.time() + timeout_s
        while time.time() < deadline and self.proc.poll() is None:
            if needle in self.log.read_text(errors="replace"):
                return True
            if self._ready():
                return False
            time.sleep(1.0)
        return False

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        t0 = self.t0
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log}\n{tail(self.log)}"
                )
            if self._ready():
                self.startup_s = time.time() - t0
                return
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log}\n{tail(self.log)}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.ready_path, timeout=2) as r:
                return bool(r.status == 200)
        except Exception:
            return False

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        try:
            os.killpg(pgid, signal.SIGINT)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        # whatever is left of the group (engine workers)
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class ProcessSampler:
    """Resident memory of a process tree, sampled in a thread (psutil), in MB; and the CPU
    time the front process (HTTP, API layer, detokenizing; not the engine core, which is
    a child) spent between enter and exit."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.tree: list[float] = []
        self.front: list[float] = []
        self.front_cpu_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, float] | None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        try:
            front = root.memory_info().rss
        except psutil.Error:
            front = 0
        return total / 2**20, front / 2**20

    def _cpu(self) -> float | None:
        import psutil

        try:
            t = psutil.Process(self.pid).cpu_times()
        except psutil.Error:
            return None
        return float(t.user + t.system)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.sample()
            if s:
                self.tree.append(s[0])
                self.front.append(s[1])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ProcessSampler:
        self._cpu0 = self._cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        cpu1 = self._cpu()
        if self._cpu0 is not None and cpu1 is not None:
            self.front_cpu_s = cpu1 - self._cpu0

    def stats(self) -> dict[str, float | None]:
        def agg(xs: list[float], f: Any) -> float | None:
            return float(f(xs)) if xs else None

        return {
            "rss_tree_mb_max": agg(self.tree, max),
            "rss_tree_mb_mean": agg(self.tree, lambda v: sum(v) / len(v)),
            "rss_front_mb_max": agg(self.front, max),
            "front_cpu_s": self.front_cpu_s,
        }


# The engine's own per-request latency histograms, which both servers export on /metrics
# (vLLM's server natively, the gateway from the same registry). Their means over a point
# split a server's TTFT and latency into what the engine saw and what the front end added.
ENGINE_HISTOGRAMS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",  # AsyncLLM arrival -> first token
    "engine_queue": "vllm:request_queue_time_seconds",  # queued in the scheduler
    "engine_prefill": "vllm:request_prefill_time_seconds",  # scheduled -> first token
    "engine_e2e": "vllm:e2e_request_latency_seconds",  # AsyncLLM arrival -> finished
    "engine_tpot": "vllm:request_time_per_output_token_seconds",  # first -> last token / (n - 1), engine clock
}


# Two counters that check the load itself: prompt tokens per request as the engine saw
# them (both servers must get the same prompt length), and how many of those came from the
# prefix cache (the bench's prompts are all different, so this should stay near zero).
ENGINE_COUNTERS = {
    "engine_prompt_tokens": "vllm:prompt_tokens_total",
    "engine_cached_tokens": "vllm:prompt_tokens_cached_total",
}

# Tokens per engine step (prefill and decode together): its count is the engine's steps in
# the point, its mean how full they ran; two servers on one load that differ here scheduled
# differently (bursts of prefill, smaller batches), not just ran slower.
ENGINE_STEP_TOKENS = "vllm:iteration_tokens_total"


def engine_histograms(base_url: str, api_key: str) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of each of ENGINE_HISTOGRAMS and (value, 0) of each of ENGINE_COUNTERS,
    summed over labels; None if /metrics is unreadable."""
    req = urllib.request.Request(f"{base_url}/metrics", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out = {key: [0.0, 0.0] for key in (*ENGINE_HISTOGRAMS, *ENGINE_COUNTERS, "engine_step_tokens")}
    wanted = {
        metric + suffix: (key, slot)
        for key, metric in (*ENGINE_HISTOGRAMS.items(), ("engine_step_tokens", ENGINE_STEP_TOKENS))
        for slot, suffix in enumerate(("_sum", "_count"))
    }
    wanted.update({metric: (key, 0) for key, metric in ENGINE_COUNTERS.items()})
    for line in text.splitlines():
        hit = wanted.get(re.split(r"[{ ]", line, maxsplit=1)[0])
        if hit is not None:
            out[hit[0]][hit[1]] += float(line.rsplit(" ", 1)[1])
    return {key: (s, c) for key, (s, c) in out.items()}


RESIDENCIES = ("gpu", "cpu", "loaded", "not loaded")  # the gateway's ``adapter_slots.Residency``


def residency_key(where: str) -> str:
    """A point's field for the adapters at ``where``: ``residency_not_loaded``, ..."""
    return "residency_" + where.replace(" ", "_")


def adapter_residency(base_url: str, api_key: str) -> dict[str, int]:
    """How many of the gateway's adapters ``/v1/models`` shows at each residency now, as
    ``residency_gpu``, ``residency_cpu``, ...; {} from a server that does not say (vLLM's)."""
    req = urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            cards = json.load(resp)["data"]
    except (OSError, ValueError, KeyError):
        return {}
    seen = [c["residency"] for c in cards if c.get("residency") in RESIDENCIES and not c.get("alias_of")]
    if not seen:
        return {}
    return {residency_key(where): seen.count(where) for where in RESIDENCIES}


def engine_means_ms(
    before: dict[str, tuple[float, float]] | None, after: dict[str, tuple[float, float]] | None
) -> dict[str, float | None]:
    """Mean of each engine histogram over the requests between two scrapes, in ms."""
    means: dict[str, float | None] = {}
    for key in ENGINE_HISTOGRAMS:
        if before is None or after is None or after[key][1] <= before[key][1]:
            means[f"{key}_ms_mean"] = None
            continue
        (s0, c0), (s1, c1) = before[key], after[key]
        means[f"{key}_ms_mean"] = (s1 - s0) / (c1 - c0) * 1000
    requests = None if before is None or after is None else after["engine_e2e"][1] - before["engine_e2e"][1]
    if requests:
        assert before is not None and after is not None
        prompt = after["engine_prompt_tokens"][0] - before["engine_prompt_tokens"][0]
        cached = after["engine_cached_tokens"][0] - before["engine_cached_tokens"][0]
        means["engine_prompt_tokens_mean"] = prompt / requests
        means["engine_cached_share"] = cached / prompt if prompt else None
    if before is not None and after is not None:
        steps = after["engine_step_tokens"][1] - before["engine_step_tokens"][1]
        tokens = after["engine_step_tokens"][0] - before["engine_step_tokens"][0]
        means["engine_steps"] = steps
        means["engine_tokens_per_step"] = tokens / steps if steps > 0 else None
    return means
