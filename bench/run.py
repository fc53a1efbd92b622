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
import datetime as dt
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import lora_trace, vllm_client
from bench.client import Job, PromptMaker, drive, run_loop, seed_for, summarize
from bench.lora import ADAPTERS, MANY, adapter_fields, cold_probe, mix_adapters, mix_models, split_mix
from bench.machine import EMBEDDED, PROFILES, child_env, client_cpus, gpu_name, host_info, versions
from bench.make_adapters import make_adapters
from bench.report import write_reports
from bench.servers import (
    REPO,
    EngineSpec,
    ProcessSampler,
    Server,
    adapter_residency,
    engine_histograms,
    engine_means_ms,
    gateway_command,
    gateway_env,
    tail,
    vllm_command,
    write_catalog,
)
from bench.shapes import SHAPES, STRUCTURED

MIXES = ("base", "lora4")  # the default --mixes; bench/lora.py has them all
# vLLM's GPU worker logs this once it has sized its KV cache (--together launches the
# second server then; on CPU the line differs and the second waits for the first's /health)
KV_SIZED = "Available KV cache memory"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.p = dict(PROFILES[args.profile])
        self.shape = args.shape
        for key in ("model", "prompt_tokens", "output_tokens"):
            if getattr(args, key) is not None:
                self.p[key] = getattr(args, key)
        if args.output_tokens is not None:
            self.p["structured_output_tokens"] = args.output_tokens
        self.plan = self.mix_plan(args.mixes, args.concurrencies)
        self.mixes = list(self.plan)
        self.p["concurrencies"] = sorted({c for cs in self.plan.values() for c in cs})
        self.p["requests"] = {
            c: max(c, int(round(self.p["requests"].get(c, 4 * c) * args.scale)))
            for c in self.p["concurrencies"]
        }
        if not self.p["model"]:
            sys.exit("--model DIR is required for this profile")
        self.t0 = time.time()
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
                "output_tokens": self.p[
                    "structured_output_tokens" if self.shape in STRUCTURED else "output_tokens"
                ],
                "concurrencies": self.p["concurrencies"],
                "requests": self.p["requests"],
                "mixes": self.mixes,
                "mix_concurrencies": self.plan,
                "mix_shapes": {m: self.shape_of(m) for m in self.mixes},
                "together": bool(args.together),
                "gateway_set": list(args.gateway_set),
                "max_loras_set": args.max_loras,
                "lora16_max_loras": self.p["lora16_max_loras"],  # the goal's slots for a lora16 mix
                "adapter_rank": self.p["adapter_rank"],
                "client": (
                    "vllm bench serve (vllm.benchmarks.serve in run.py's process; /v1/completions, "
                    "random dataset, ignore_eos; bench/vllm_client.py)"
                    if args.client == "vllm"
                    else "bench/client.py (aiohttp, own SSE parsing; metrics as vllm bench serve, "
                    "TTFT to first text event)"
                )
                + (f", pinned to cores {self.args.client_cpus}" if self.args.client_cpus else ""),
            },
            "servers": {},
            "points": [],
            "notes": [],
        }

    def mix_plan(self, mixes: str, concurrencies: str | None) -> dict[str, list[int]]:
        """``--mixes``: each ``MIX[:SHAPE][@C/C...]`` -> its concurrencies (default: the
        profile's, or its structured ones for a structured shape; ``--concurrencies``)."""
        plan: dict[str, list[int]] = {}
        for item in mixes.split(","):
            mix, _, cs = item.partition("@")
            try:
                shape = split_mix(mix, self.shape)[1]
            except ValueError as exc:
                sys.exit(str(exc))
            if shape not in SHAPES:
                sys.exit(f"unknown shape {shape!r} in --mixes {item!r}")
            default = self.p["structured_concurrencies" if shape in STRUCTURED else "concurrencies"]
            given = cs.replace("/", ",") or concurrencies
            plan[mix] = [int(c) for c in given.split(",")] if given else list(default)
            why = vllm_client.supported(mix, shape) if self.args.client == "vllm" else None
            if why is not None:
                sys.exit(f"--client vllm cannot run --mixes {item!r}: {why}")
        return plan

    def shape_of(self, mix: str) -> str:
        return split_mix(mix, self.shape)[1]

    def max_tokens(self, mix: str) -> int:
        structured = self.shape_of(mix) in STRUCTURED
        return int(self.p["structured_output_tokens" if structured else "output_tokens"])

    def jobs(self, mix: str, n: int, seed: int, models_seed: int | None = None) -> list[Job]:
        """Prompts from ``seed`` (per server and pass: no prefix-cache hits across passes);
        the adapter sequence from ``models_seed`` (per pass, the same for both servers)."""
        models = mix_models(mix, n, seed if models_seed is None else models_seed, self.p["served_name"])
        return [Job(m, self.maker.content(seed + i)) for i, m in enumerate(models)]

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
        names = list(ADAPTERS)  # a0..a3 for lora4, all 16 for lora16 and lora16z
        dirs = make_adapters(
            model,
            self.adapters_root,
            "random-test-adapter",  # the gateway judges adapters by shapes, not this name
            n=len(names),
            rank=p["adapter_rank"],
            dtype=p["adapter_dtype"],
        )
        many = any(m.partition(":")[0] in MANY for m in self.mixes)
        max_loras = self.args.max_loras or p["lora16_max_loras" if many else "max_loras"]
        self.spec = EngineSpec(
            model=str(model),
            served_name=p["served_name"],
            dtype=p["dtype"],
            max_model_len=p["max_model_len"],
            max_num_seqs=p["max_num_seqs"],
            max_num_batched_tokens=p["max_num_batched_tokens"],
            max_loras=max_loras,
            max_lora_rank=p["max_lora_rank"],
            # vLLM's default, on both servers; or neither is told (each keeps its own default)
            max_cpu_loras=max_loras if self.args.cpu_cache == "same" else None,
            load_format=p["load_format"],
            adapters={n: str(d) for n, d in zip(names, dirs, strict=True)},
            gpu_memory_utilization=self.args.gpu_memory_utilization,
        )
        self.result["meta"]["engine"] = {**self.spec.__dict__}
        log(f"building prompts ({p['prompt_tokens']} tokens, chat template included)")
        self.maker = PromptMaker(model, p["prompt_tokens"])

    def past_budget(self) -> bool:
        return bool(self.args.budget_s) and time.time() - self.t0 > self.args.budget_s

    # -- one HTTP server --------------------------------------------------------------
    def make_server(self, target: str, label: str) -> Server:
        port = self.args.port + (0 if target == "vllm" else 1)
        if target == "vllm":
            tools = any(self.shape_of(m) == "tools" for m in self.mixes)
            cmd, ready = vllm_command(self.spec, port, "pythonic" if tools else None), "/health"
        else:
            catalog = write_catalog(self.spec, self.adapters_root, self.work / "catalog.yaml")
            cmd, ready = gateway_command(self.spec, port, catalog, self.adapters_root), "/ready"
            cmd += [arg for kv in self.args.gateway_set for arg in ("--set", kv)]
        env = (
            self.env
            if target == "vllm"
            else gateway_env(self.env, self.api_key, 16 * max(self.p["concurrencies"]) + 64)
        )
        if self.args.lora_trace:
            env = lora_trace.server_env(env, self.out / "logs" / f"lora-trace-{label}", self.p["step_idle_s"])
        self.result["servers"][label] = {"cmd": cmd}
        log(f"starting {target}: {' '.join(cmd)}")
        return Server(target, cmd, port, ready, env, self.out / "logs" / f"{label}.log")

    def ready(self, server: Server, label: str) -> None:
        """Wait for a launched server and record its startup time."""
        server.wait_ready(self.p["start_timeout_s"])
        self.result["servers"][label]["startup_s"] = server.startup_s
        log(f"{label} ready in {server.startup_s:.0f} s")

    def prepare(self, server: Server, label: str) -> None:
        """On a ready server: the cold-adapter probe, the warm-ups, idle RSS."""
        info = self.result["servers"][label]
        if self.args.cold:
            info["cold"] = cold_probe(
                server.base_url,
                self.api_key,
                self.p["served_name"],
                self.maker,
                seed_for(self.run_id, label, "cold"),
                self.args.cold_tokens,
            )
            c = info["cold"]
            log(
                f"{label} cold adapters: TTFT median {_ms(c['cold_ttft_ms_median'])} ms cold, "
                f"{_ms(c['warm_ttft_ms_median'])} ms warm ({c['cold_ttft_ms']} / {c['warm_ttft_ms']})"
            )
        for mix in self.mixes:
            self.warm_up(server, label, mix)
        assert server.proc is not None
        s = ProcessSampler(server.proc.pid).sample()
        info["rss_idle"] = {"rss_tree_mb": s[0], "rss_front_mb": s[1]} if s else None

    def run_server(self, target: str, n: int = 1) -> None:
        """Pass ``n`` of ``target`` (``--targets`` may name a server twice, for both orders)."""
        label = pass_label(target, n)
        if self.past_budget():
            self.note(f"{label} not started: past --budget-s")
            return
        server = self.make_server(target, label)
        try:
            server.launch()
            self.ready(server, label)
            self.prepare(server, label)
            for mix in self.mixes:
                for c in self.plan[mix]:
                    if self.past_budget():
                        self.note(f"{target} {mix} c={c} skipped: past --budget-s")
                        continue
                    self.point(server, target, mix, c, n)
            if self.args.pyspy and n == 1 and not self.past_budget():
                self.profile_front(server, target)
        except Exception as exc:  # keep what was measured; say what failed
            self.note(f"{target} failed: {type(exc).__name__}: {str(exc)[:2000]}")
            log(f"ERROR {target}: {exc}")
        finally:
            server.stop()
            log(f"{target} stopped")

    def run_together(self, order: list[str]) -> None:
        """``--together``: both servers up at once (on a GPU each with its share of memory,
        ``--gpu-memory-utilization``), and at every point each pass of ``order`` in turn
        (``vllm,gateway,gateway,vllm``: pass 1 of each, then pass 2 in the other order), so
        the two are measured minutes apart on one machine. The second server is launched once
        the first has sized its KV cache, so neither counts the other's memory as its own."""
        servers: dict[str, Server] = {}
        try:
            for target in dict.fromkeys(order):
                servers[target] = server = self.make_server(target, target)
                server.launch()
                if len(servers) < len(set(order)):
                    server.wait_log(KV_SIZED, self.p["start_timeout_s"])
            # Every server is up before any is probed or warmed: a server still starting takes
            # the cores (and the GPU) that the other's cold-adapter probe is timed on.
            for target, server in servers.items():
                self.ready(server, target)
            for target, server in servers.items():
                self.prepare(server, target)
            for mix in self.mixes:
                for c in self.plan[mix]:
                    # The budget is judged once a point, before its first pass: all of its passes
                    # run, or none (a pass cut off would leave the other server's unpaired).
                    if self.past_budget():
                        self.note(f"{mix} c={c} skipped: past --budget-s")
                        continue
                    seen: dict[str, int] = {}
                    for target in order:
                        seen[target] = seen.get(target, 0) + 1
                        self.point(servers[target], target, mix, c, seen[target])
        except Exception as exc:  # keep what was measured; say what failed
            self.note(f"together failed: {type(exc).__name__}: {str(exc)[:2000]}")
            log(f"ERROR together: {exc}")
        finally:
            for target, server in servers.items():
                server.stop()
                log(f"{target} stopped")

    def warm_up(self, server: Server, target: str, mix: str) -> None:
        """One round at the mix's top concurrency; every adapter of the mix at least once."""
        names = mix_adapters(mix) or (self.p["served_name"],)
        n = max(max(self.plan[mix]), len(names))
        seed = seed_for(self.run_id, target, mix, "warm")
        jobs = [Job(names[i % len(names)], self.maker.content(seed + i)) for i in range(n)]
        res, dur = run_loop(
            drive(server.base_url, jobs, max(self.plan[mix]), 8, self.api_key, self.shape_of(mix))
        )
        failed = [r.error for r in res if not r.ok]
        log(f"{target} warm-up {mix}: {len(res) - len(failed)}/{len(res)} ok in {dur:.1f} s")
        if failed:
            raise RuntimeError(f"warm-up failed: {failed[0]}")

    def point(self, server: Server, target: str, mix: str, c: int, n_pass: int = 1) -> None:
        n = self.p["requests"][c]
        # The same prompts for every target in the same pass: like for like (and no prefix
        # cache hits between one server's passes, which get other prompts).
        seed = seed_for(self.run_id, "pass", n_pass, mix, c)
        max_tokens = self.max_tokens(mix)
        hist0 = engine_histograms(server.base_url, self.api_key)
        trace0 = lora_trace.read(server.env)
        assert server.proc is not None
        res: list[Any] = []
        with ProcessSampler(server.proc.pid) as rss, client_cpus(self.args.client_cpus):
            if self.args.client == "vllm":
                argv = vllm_client.bench_argv(
                    server.base_url, mix, self.spec.model, self.p["served_name"], n, c,
                    self.p["prompt_tokens"], max_tokens, seed,
                )  # fmt: skip
                summary, report = vllm_client.run_point(argv, self.api_key, n, max_tokens)
                (self.out / "logs" / f"vllm-client-{target}-{mix}-c{c}-{n_pass}.txt").write_text(report)
            else:
                jobs = self.jobs(mix, n, seed, seed_for(self.run_id, "models", mix, c, n_pass))
                res, duration = run_loop(
                    drive(server.base_url, jobs, c, max_tokens, self.api_key, self.shape_of(mix))
                )
                summary = summarize(res, duration, max_tokens)
        engine = engine_means_ms(hist0, engine_histograms(server.base_url, self.api_key))
        trace = lora_trace.point_fields(trace0, lora_trace.read(server.env, settle=True))
        point = {
            "target": target,
            "pass": n_pass,
            "mix": mix,
            "concurrency": c,
            "requests": n,
            "seed": seed,
            **summary,
            **rss.stats(),
            **engine,
            **trace,
            **(adapter_fields(res, mix, summary["ttft_ms_mean"]) if res else {}),
            **adapter_residency(server.base_url, self.api_key),
        }
        self.result["points"].append(point)
        self.save()
        log(
            f"{target} {mix} c={c} n={n}: {point['req_per_s']:.2f} req/s {point['out_tok_per_s']:.1f} tok/s "
            f"TTFT p50 {_ms(point['ttft_ms_p50'])} ITL p50 {_ms(point['itl_ms_p50'], 2)} "
            f"RSS {_ms(point['rss_tree_mb_max'], 0)} MB fail {point['failed']} "
            f"invalid {point['invalid']} (at max_tokens {point['invalid_at_length']})"
            + (f" ({point['first_error']})" if point["failed"] else "")
            + (
                f"; {len(point['per_adapter'])} adapters, worst mean TTFT {point['worst_ttft_ratio']:.2f}x "
                f"({point['worst_adapter']}), starved {point['starved'] or 'none'}"
                if point.get("per_adapter") and point.get("worst_ttft_ratio") is not None
                else ""
            )
        )
        if point["failed"] == n:
            raise RuntimeError(f"every request failed: {point['first_error']}")

    def profile_front(self, server: Server, target: str) -> None:
        """An extra, unmeasured pass of the first mix at its top concurrency with py-spy
        sampling the server's front-end process (HTTP + API layer; the engine core is
        another process)."""
        mix = self.mixes[0]
        c = max(self.plan[mix])
        n = max(c, self.p["requests"][c] // 2)
        seed = seed_for(self.run_id, target, "pyspy", c)
        jobs = self.jobs(mix, n, seed)
        assert server.proc is not None
        pid = server.proc.pid
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
            drive(server.base_url, jobs, c, self.max_tokens(mix), self.api_key, self.shape_of(mix))
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
            # plain base and lora4 only: the ceiling names adapters round-robin
            "mixes": {
                m: list(mix_adapters(m)) or [self.p["served_name"]]
                for m in self.mixes
                if m in ("base", "lora4") and self.shape_of(m) == "plain"
            },
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
        targets = self.args.targets.split(",")
        if self.args.together:
            self.run_together([t for t in targets if t in ("vllm", "gateway")])
        for target in targets:
            passes[target] = passes.get(target, 0) + 1
            if target in ("vllm", "gateway"):
                if not self.args.together:
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
    ap.add_argument(
        "--mixes",
        default=",".join(MIXES),
        help="MIX[:SHAPE][@C/C...], comma-separated: base, lora4 (a0..a3 round-robin), lora16 (a0..a15, "
        "uniform at random), lora16z (a0..a15, Zipf(1.1)); e.g. base:tools@1/64/256,lora16@64/256 "
        "(bench/lora.py). A lora16 mix sets max_loras to the profile's lora16_max_loras",
    )
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
        "--budget-s",
        type=float,
        default=0,
        help="skip points that would start after this many seconds from run.py's start (server starts included)",
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
        "--gateway-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gateway setting for the whole run, passed as `--set KEY=VALUE` (repeatable; e.g. "
        "limits.lora_quantum_s=2 to measure a knob against vLLM's server)",
    )
    ap.add_argument(
        "--max-loras",
        type=int,
        help="both servers' GPU slots (default: the profile's max_loras, or lora16_max_loras with a lora16 "
        "mix); the lora16 ratio goal, which fixes the profile's, is then reported, not judged",
    )
    ap.add_argument(
        "--cpu-cache",
        choices=("same", "defaults"),
        default="same",
        help="the engines' CPU cache of adapters (max_cpu_loras): 'same' gives both servers max_loras "
        "(vLLM's default: the comparison is of the scheduling); 'defaults' gives neither the flag, so "
        "vLLM's server keeps max_loras and the gateway sizes it to its catalog (out of the box)",
    )
    ap.add_argument(
        "--pyspy", help="path of a py-spy binary: profile each server's front end in an extra pass"
    )
    ap.add_argument(
        "--together",
        action="store_true",
        help="start vLLM's server and the gateway once, side by side, and run every point on each in the "
        "order of --targets (vllm,gateway,gateway,vllm: two passes each); on a GPU with "
        "--gpu-memory-utilization 0.42",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, help="both servers' (default: vLLM's 0.9)")
    ap.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cold-adapter TTFT probe on each fresh server (default: on when a lora16 mix runs)",
    )
    ap.add_argument(
        "--lora-trace",
        action="store_true",
        help="count each engine's LoRA loads from disk, copies into GPU slots and adapters per step "
        "(bench/trace_site, on both servers' PYTHONPATH)",
    )
    ap.add_argument("--cold-tokens", type=int, default=8, help="max_tokens of the probe's requests")
    ap.add_argument(
        "--client",
        choices=("own", "vllm"),
        default="own",
        help="who sends each point's requests: bench/client.py (chat, every shape and mix, per-adapter "
        "statistics) or vLLM's `vllm bench serve` (completions, plain, base/lora4/lora16; bench/vllm_client.py)",
    )
    args = ap.parse_args()
    if args.cold is None:
        args.cold = any(m.partition(":")[0].partition("@")[0] in MANY for m in args.mixes.split(","))
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
