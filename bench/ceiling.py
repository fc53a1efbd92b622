"""The ceiling: the same points through vLLM's engine in this process, with no HTTP.

    python -m bench.ceiling SPEC.json OUT.json

Two loops, chosen by SPEC's ``target``:

- ``ceiling``: ``AsyncLLM`` and one asyncio task per stream, as a server drives the engine;
- ``offline``: ``LLMEngine.add_request`` / ``step()`` in a plain loop that
  keeps ``c`` requests in flight, as ``LLM.generate`` drives it. No event loop, no queue per
  request. On CPU it beat the async loop (smoke profile); on the H200 it is slower than
  AsyncLLM and than the gateway (run7; why was not measured). ``run.py`` measures servers
  against the faster of the two.

Run by ``run.py`` as a subprocess (an engine spawns workers, so this has a __main__ guard).
SPEC holds the engine arguments, the prompt shape, the mixes, the concurrencies and the
number of requests per point. The engine is created exactly as the gateway creates its
own (``AsyncLLM.from_engine_args``, DELTA outputs), so the difference between this and
a server is what the server adds on top of the engine: HTTP, JSON, SSE, routing.

Metrics are those of ``client.summarize``: TTFT is the time to the first output that
carries tokens; ITL the gaps between such outputs (engine steps, possibly several tokens
when this consumer lags, as with chunks over HTTP). Both loops take DELTA outputs and
detokenize, as a server must.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.client import Job, PromptMaker, RequestResult, seed_for, summarize
from bench.servers import ProcessSampler


def _record(res: RequestResult, token_ids: Any, now: float, last: float) -> float:
    """Count one engine output of ``res`` (both loops); returns the time of its latest output
    that carried tokens (TTFT and ITL are measured between those)."""
    if not token_ids:
        return last
    res.completion_tokens += len(token_ids)
    res.chunks += 1
    if res.ttft is None:
        res.ttft = now - res.start
    else:
        res.itl.append(now - last)
    return now


async def _one(engine: Any, params: Any, job: Job, rid: str, lora: Any) -> RequestResult:
    res = RequestResult(start=time.perf_counter())
    last = res.start
    try:
        async for out in engine.generate(
            {"prompt_token_ids": job.prompt_ids}, params, rid, lora_request=lora
        ):
            last = _record(res, out.outputs[0].token_ids, time.perf_counter(), last)
        res.prompt_tokens = len(job.prompt_ids or [])
        res.end = last
        res.ok = res.ttft is not None
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        res.end = time.perf_counter()
    return res


async def _drive(
    engine: Any, params: Any, jobs: list[Job], loras: dict[str, Any], c: int, tag: str
) -> tuple[list[RequestResult], float]:
    results: list[RequestResult] = []
    it = iter(enumerate(jobs))

    async def worker() -> None:
        for i, job in it:
            results.append(await _one(engine, params, job, f"{tag}-{i}", loras.get(job.model)))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    return results, max([r.end for r in results] + [t0]) - t0


def _drive_sync(
    engine: Any, params: Any, jobs: list[Job], loras: dict[str, Any], c: int, tag: str
) -> tuple[list[RequestResult], float]:
    """A closed loop of ``c`` requests over ``LLMEngine.step()``: a finished request's slot
    goes to the next job right after the step that finished it."""
    results: list[RequestResult] = []
    live: dict[str, list[Any]] = {}  # request id -> [result, time of its last output]
    todo = iter(enumerate(jobs))

    def submit() -> None:
        for i, job in todo:
            rid = f"{tag}-{i}"
            res = RequestResult(start=time.perf_counter(), prompt_tokens=len(job.prompt_ids or []))
            live[rid] = [res, res.start]
            engine.add_request(
                rid, {"prompt_token_ids": job.prompt_ids}, params, lora_request=loras.get(job.model)
            )
            return

    t0 = time.perf_counter()
    for _ in range(c):
        submit()
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            entry = live.get(out.request_id)
            if entry is None:
                continue
            res = entry[0]
            entry[1] = _record(res, out.outputs[0].token_ids, now, entry[1])
            if out.finished:
                del live[out.request_id]
                res.end = entry[1]
                res.ok = res.ttft is not None
                results.append(res)
                submit()
    return results, max([r.end for r in results] + [t0]) - t0


class _SyncEngine:
    """``LLMEngine`` behind the two awaitables ``main_async`` uses, so both loops share it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def add_lora(self, lora: Any) -> None:
        self.engine.add_lora(lora)

    async def drive(self, *args: Any) -> tuple[list[RequestResult], float]:
        return _drive_sync(self.engine, *args)

    def shutdown(self) -> None:
        self.engine.engine_core.shutdown()  # LLMEngine has no shutdown of its own (0.25.1, 0.32)


class _AsyncEngine:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.add_lora = engine.add_lora
        self.shutdown = engine.shutdown

    async def drive(self, *args: Any) -> tuple[list[RequestResult], float]:
        return await _drive(self.engine, *args)


def _start(spec: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    if spec.get("target") == "offline":
        from vllm.v1.engine.llm_engine import LLMEngine

        return _SyncEngine(LLMEngine.from_engine_args(EngineArgs(**spec["engine"])))
    from vllm.v1.engine.async_llm import AsyncLLM

    return _AsyncEngine(AsyncLLM.from_engine_args(AsyncEngineArgs(**spec["engine"])))


async def main_async(spec: dict[str, Any], out_path: Path) -> None:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    target = spec.get("target", "ceiling")
    t0 = time.time()
    engine = _start(spec)
    startup = time.time() - t0
    maker = PromptMaker(spec["model"], spec["prompt_tokens"])
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["adapters"].items())}
    for lr in loras.values():
        await engine.add_lora(lr)
    n_out = spec["output_tokens"]
    params = SamplingParams(
        max_tokens=n_out, ignore_eos=True, temperature=1.0, top_p=1.0, output_kind=RequestOutputKind.DELTA
    )
    warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, output_kind=RequestOutputKind.DELTA)
    result: dict[str, Any] = {"startup_s": startup, "points": []}
    mixes: dict[str, list[str]] = spec["mixes"]
    sampler = ProcessSampler(os.getpid())
    result["rss_idle"] = {"rss_tree_mb": (sampler.sample() or (None,))[0]}
    deadline = spec.get("deadline") or float("inf")
    for mix, names in mixes.items():
        cmax = max(spec["concurrencies"])
        jobs = [
            Job(
                names[i % len(names)],
                prompt_ids=maker.token_ids(seed_for(spec["run_id"], "ceiling", mix, "warm") + i),
            )
            for i in range(cmax)
        ]
        await engine.drive(warm, jobs, loras, cmax, f"warm-{mix}")
        for c in spec["concurrencies"]:
            if time.time() > deadline:
                print(f"{target}: skipping {mix} c={c} (past the deadline)", flush=True)
                continue
            n = spec["requests"][str(c)]
            seed = seed_for(spec["run_id"], "ceiling", mix, c)  # same prompts for both loops
            jobs = [Job(names[i % len(names)], prompt_ids=maker.token_ids(seed + i)) for i in range(n)]
            with ProcessSampler(os.getpid()) as rss:
                res, duration = await engine.drive(params, jobs, loras, c, f"{mix}-c{c}")
            point = {
                "target": target,
                "mix": mix,
                "concurrency": c,
                "requests": n,
                **summarize(res, duration, n_out),
                **rss.stats(),
            }
            result["points"].append(point)
            print(
                f"{target} {mix} c={c}: {point['out_tok_per_s']:.1f} tok/s TTFT p50 {point['ttft_ms_p50']:.1f} ms "
                f"ITL p50 {point['itl_ms_p50']:.2f} ms",
                flush=True,
            )
            out_path.write_text(json.dumps(result, indent=1))
    engine.shutdown()
    out_path.write_text(json.dumps(result, indent=1))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        import uvloop

        uvloop.run(main_async(spec, Path(sys.argv[2])))
    except ImportError:
        asyncio.run(main_async(spec, Path(sys.argv[2])))


if __name__ == "__main__":
    main()
