"""A step-level model of many adapters over few GPU slots, for reasoning about admission
order without a GPU.

The bench's ``lora16`` point, played on a model of vLLM's engine: ``streams`` closed-loop
clients, each sending ``requests / streams`` requests one after another, each request for
an adapter drawn uniformly (or Zipf(1.1)) from ``adapters``, ``prompt`` tokens in and
``output`` tokens out (ignore_eos). Three orders feed the same engine:

- ``vllm``: requests go straight to the engine (vLLM's server);
- ``gateway``: through the gateway's own ``LoraScheduler`` (``gateway/lora_scheduler.py``,
  the code that runs in production), on a virtual clock;
- ``bound``: not a server. Each step runs every request of the ``slots`` adapters with the
  most requests in flight, as if running requests could be paused and adapters swapped for
  free. No order that keeps vLLM's rule (at most ``max_loras`` adapters per batch) beats it.

The engine is vLLM v1's scheduler as far as adapters go: running requests keep running;
waiting ones are taken first come, first served within ``max_num_seqs`` and the step's
token budget, skipping a request whose adapter would make the batch's adapters exceed
``slots``. Each step takes ``step_ms + seq_ms * batch + prefill_ms_per_token * prompt
tokens`` plus ``load_ms`` per adapter brought into a GPU slot, and ``disk_ms`` more when
the adapter is not in the engine's host cache (``host_cache`` adapters, LRU; vLLM's
server's default keeps ``max_loras``, the gateway's every adapter of its catalog).

The defaults are the H200 point (1B-shaped model, 4 slots, 512 / 128 tokens): the step
costs are set so that vLLM's order gives what vLLM's server measured at 64 streams
(3,084-3,436 tok/s), and ``disk_ms`` is the cold-adapter probe's cold minus warm TTFT
(65 - 30 ms). At 64 streams the model gives the gateway 1.22x vLLM's server with each
server's default cache, as measured (1.27x); at 256 it has vLLM's server slower than
measured (5,900 against 7,300 tok/s), so its ratios there are too kind to the gateway.
Use it for directions (which knob moves what), and the bench for numbers.

    python -m bench.lora_model --streams 64 256 --seeds 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from bench.lora import zipf_weights
from gateway.lora_scheduler import LoraScheduler, Ticket

ORDERS = ("vllm", "gateway", "bound")


@dataclass(frozen=True)
class Engine:
    slots: int = 4  # max_loras
    max_num_seqs: int = 256
    token_budget: int = 8192  # max_num_batched_tokens
    step_ms: float = 3.3
    seq_ms: float = 0.08
    prefill_ms_per_token: float = 0.004
    load_ms: float = 1.0  # host memory -> GPU slot
    disk_ms: float = 35.0  # disk -> host memory, on a host-cache miss
    host_cache: int = 4  # adapters kept in host memory (vLLM's server: max_loras)


@dataclass(frozen=True)
class Load:
    streams: int = 64
    requests: int = 384
    adapters: int = 16
    prompt: int = 512
    output: int = 128
    zipf: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Gateway:
    quantum_s: float = 0.5  # limits.lora_quantum_s
    max_wait_s: float = 5.0  # limits.max_adapter_wait_s


@dataclass
class Result:
    order: str
    tok_s: float
    ttft_p50: float
    ttft_p99: float
    mean_batch: float
    ttft_by_adapter: dict[int, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class _Request:
    adapter: int
    sent: float
    left: int
    ticket: Ticket | None = None


class _EngineModel:
    """vLLM v1's waiting/running queues with the max_loras rule, stepped on a virtual clock."""

    def __init__(self, engine: Engine, load: Load) -> None:
        self.engine = engine
        self.load = load
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.now = 0.0
        self.tokens = 0
        self.batch_time = 0.0

    def step(self) -> tuple[list[_Request], list[_Request]]:
        """One engine step: returns (requests that got their first token, that finished)."""
        engine, load = self.engine, self.load
        adapters = {r.adapter for r in self.running}
        budget = engine.token_budget - len(self.running)
        new: list[_Request] = []
        skipped: deque[_Request] = deque()
        while self.waiting and len(self.running) + len(new) < engine.max_num_seqs and budget >= load.prompt:
            request = self.waiting.popleft()
            if len(adapters) >= engine.slots and request.adapter not in adapters:
                skipped.append(request)
                continue
            adapters.add(request.adapter)
            new.append(request)
            budget -= load.prompt
        self.waiting.extendleft(reversed(skipped))
        return self._advance(new, self._load_ms(adapters))

    def run_only(self, adapters: set[int], requests: list[_Request]) -> tuple[list[_Request], list[_Request]]:
        """The bound's step: the requests of ``adapters`` run, the others pause."""
        chosen = [r for r in requests if r.adapter in adapters]
        new = [r for r in chosen if r.left == self.load.output]
        self.running = [r for r in chosen if r.left < self.load.output]
        return self._advance(new, 0.0)

    def _load_ms(self, adapters: set[int]) -> float:
        engine, ms = self.engine, 0.0
        for adapter in adapters:
            if adapter in self.gpu:
                self.gpu.move_to_end(adapter)
                continue
            if len(self.gpu) >= engine.slots:
                idle = next(a for a in self.gpu if a not in adapters)
                del self.gpu[idle]
            self.gpu[adapter] = None
            ms += engine.load_ms
            if adapter in self.host:
                self.host.move_to_end(adapter)
            else:
                ms += engine.disk_ms
                if len(self.host) >= engine.host_cache:
                    self.host.popitem(last=False)
                self.host[adapter] = None
        return ms

    def _advance(self, new: list[_Request], extra_ms: float) -> tuple[list[_Request], list[_Request]]:
        engine = self.engine
        batch = self.running + new
        seconds = (
            engine.step_ms
            + engine.seq_ms * len(batch)
            + engine.prefill_ms_per_token * self.load.prompt * len(new)
            + extra_ms
        ) / 1000.0
        self.now += seconds
        self.batch_time += len(batch) * seconds
        self.tokens += len(batch)
        done: list[_Request] = []
        self.running = []
        for request in batch:
            request.left -= 1
            (done if request.left <= 0 else self.running).append(request)
        return new, done


class _Client:
    """The bench client's closed loop: ``streams`` at once, ``requests`` in all."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self._rng = random.Random(load.seed)
        self._weights = zipf_weights(load.adapters) if load.zipf else [1.0] * load.adapters
        self.sent = 0
        self.ttfts: dict[int, list[float]] = {}

    def next(self, now: float) -> _Request | None:
        if self.sent >= self.load.requests:
            return None
        self.sent += 1
        adapter = self._rng.choices(range(self.load.adapters), self._weights)[0]
        return _Request(adapter, now, self.load.output)

    def first_token(self, request: _Request, now: float) -> None:
        self.ttfts.setdefault(request.adapter, []).append(now - request.sent)


def simulate(
    order: str, engine: Engine = Engine(), load: Load = Load(), gateway: Gateway = Gateway()
) -> Result:
    """Play one point; ``order`` is one of ``ORDERS``."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r} (one of {', '.join(ORDERS)})")
    model, client = _EngineModel(engine, load), _Client(load)
    if order == "gateway":
        asyncio.run(_through_gateway(model, client, gateway))
    elif order == "bound":
        _bound(model, client)
    else:
        _straight(model, client)
    return _result(order, model, client)


def _straight(model: _EngineModel, client: _Client) -> None:
    model.waiting.extend(r for r in (client.next(0.0) for _ in range(client.load.streams)) if r)
    while model.waiting or model.running:
        new, done = model.step()
        for request in new:
            client.first_token(request, model.now)
        model.waiting.extend(r for r in (client.next(model.now) for _ in done) if r)


def _bound(model: _EngineModel, client: _Client) -> None:
    inflight = [r for r in (client.next(0.0) for _ in range(client.load.streams)) if r]
    while inflight:
        counts: dict[int, int] = {}
        for request in inflight:
            counts[request.adapter] = counts.get(request.adapter, 0) + 1
        top = set(sorted(counts, key=lambda a: -counts[a])[: model.engine.slots])
        new, done = model.run_only(top, inflight)
        for request in new:
            client.first_token(request, model.now)
        finished = {id(r) for r in done}
        inflight = [r for r in inflight if id(r) not in finished]
        inflight.extend(r for r in (client.next(model.now) for _ in done) if r)


async def _through_gateway(model: _EngineModel, client: _Client, gateway: Gateway) -> None:
    """Each request awaits ``LoraScheduler.turn`` as the gateway's service does, then joins
    the engine's waiting queue; a finished request releases its ticket."""
    scheduler = LoraScheduler(
        model.engine.slots,
        quantum_s=gateway.quantum_s,
        max_wait_s=gateway.max_wait_s,
        clock=lambda: model.now,
    )
    routes = [
        SimpleNamespace(name=f"a{i}", weight=1.0, lora=SimpleNamespace(lora_id=i + 1))
        for i in range(client.load.adapters)
    ]
    tasks: set[asyncio.Task[None]] = set()

    async def send(request: _Request) -> None:
        request.ticket = await scheduler.turn(routes[request.adapter])  # type: ignore[arg-type]
        model.waiting.append(request)

    def start(request: _Request | None) -> None:
        if request is not None:
            task = asyncio.create_task(send(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def settle() -> None:  # let woken requests reach the engine's queue
        for _ in range(3):
            await asyncio.sleep(0)

    for _ in range(client.load.streams):
        start(client.next(0.0))
    await settle()
    while tasks or model.waiting or model.running:
        scheduler.expire()  # the timer's job, on the virtual clock
        await settle()
        new, done = model.step()
        for request in new:
            client.first_token(request, model.now)
        for request in done:
            assert request.ticket is not None
            request.ticket.release()
            start(client.next(model.now))
        await settle()
    scheduler.close()


def _result(order: str, model: _EngineModel, client: _Client) -> Result:
    ttfts = sorted(t for values in client.ttfts.values() for t in values)
    return Result(
        order=order,
        tok_s=model.tokens / model.now,
        ttft_p50=ttfts[len(ttfts) // 2],
        ttft_p99=ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        mean_batch=model.batch_time / model.now,
        ttft_by_adapter=client.ttfts,
    )


def _mean(results: list[Result], attr: Callable[[Result], float]) -> float:
    return statistics.fmean(attr(r) for r in results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--requests-per-stream", type=int, default=None, help="default: the bench's (6 at 64, 3 at 256)"
    )
    parser.add_argument("--seeds", type=int, default=4, help="points per row, seeds 0..n-1 (means)")
    parser.add_argument("--zipf", action="store_true", help="Zipf(1.1) popularity (lora16z)")
    parser.add_argument("--slots", type=int, default=Engine.slots)
    parser.add_argument("--quantum-s", type=float, default=Gateway.quantum_s)
    parser.add_argument("--max-wait-s", type=float, default=Gateway.max_wait_s)
    parser.add_argument("--load-ms", type=float, default=Engine.load_ms, help="host memory -> GPU slot")
    parser.add_argument("--disk-ms", type=float, default=Engine.disk_ms, help="disk -> host memory")
    args = parser.parse_args(argv)
    gateway = Gateway(args.quantum_s, args.max_wait_s)
    every = Engine(slots=args.slots, host_cache=1 << 20, load_ms=args.load_ms, disk_ms=args.disk_ms)
    cases: list[tuple[str, str, Engine]] = [
        ("vllm", "vLLM's server (host cache max_loras)", replace(every, host_cache=args.slots)),
        ("vllm", "vLLM's order, every adapter in host memory", every),
        ("gateway", "gateway (every adapter in host memory)", every),
        ("bound", "bound (free pauses and swaps)", every),
    ]
    rows: list[tuple[str, ...]] = []
    for streams in args.streams:
        per_stream = args.requests_per_stream or (6 if streams <= 64 else 3)
        load = Load(streams=streams, requests=streams * per_stream, zipf=args.zipf)
        baseline = 0.0
        for order, label, engine in cases:
            results = [simulate(order, engine, replace(load, seed=s), gateway) for s in range(args.seeds)]
            tok_s = _mean(results, lambda r: r.tok_s)
            baseline = baseline or tok_s
            rows.append(
                (
                    label,
                    str(streams),
                    f"{tok_s:.0f}",
                    f"{tok_s / baseline:.2f}x",
                    f"{_mean(results, lambda r: r.ttft_p50):.2f} / {_mean(results, lambda r: r.ttft_p99):.2f}",
                    f"{_mean(results, lambda r: r.mean_batch):.1f}",
                )
            )
    header = ("order", "streams", "tok/s", "vs vLLM's server", "TTFT p50 / p99 s", "mean batch")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
