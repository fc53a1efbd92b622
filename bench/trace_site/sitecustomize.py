"""`--lora-trace`: counts what vLLM's LoRA worker and scheduler do in each server's engine.

Put on both servers' PYTHONPATH by bench/run.py with ``BENCH_LORA_TRACE`` naming a folder.
Python imports this module at start in every process of the server; in those that import
vLLM's LoRA worker manager or its scheduler (the engine core on a GPU; the worker and the
engine core on CPU), it wraps four methods, the same on both servers, and writes cumulative
counters to ``<folder>/<pid>.json`` every 0.5 s:

- ``loads``: ``WorkerLoRAManager._load_adapter``, an adapter read from disk into host memory;
- ``activations``: ``LRUCacheLoRAModelManager.activate_adapter`` that copied an adapter into a
  GPU slot (a call for an adapter already in a slot copies nothing and is not counted);
- ``applies``: ``LRUCacheWorkerLoRAManager._apply_adapters``, once per engine step with LoRA,
  with the number of adapters that step's batch names (``adapters``);
- ``schedules``: vLLM's ``Scheduler.schedule``, once per engine step, with its time and the
  requests waiting in the engine when it began (``waiting``): the scheduler looks at each
  waiting request it cannot place (one whose adapter finds no free slot) at every step;
- ``b<i>_steps``, ``b<i>_tokens``, ``b<i>_reqs``, ``b<i>_gap_s``: the steps by the tokens they
  schedule (bucket ``i`` of the edges in ``BENCH_STEP_EDGES``, from bench/lora_trace.py:
  tokens below edge ``i``, the last bucket the rest), with their tokens, their requests and the wall time from their ``schedule`` to the
  next one (the step's length as the engine's loop sees it; a gap over ``BENCH_STEP_IDLE_S``,
  the engine waiting for work, is not counted).

Times are wall seconds in the engine's loop. An activation copies from pageable host memory,
so its time includes waiting for the GPU work queued before it.
bench/ never imports this file; it only ever runs inside a server under test.
"""

import bisect
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("BENCH_LORA_TRACE")
_T0 = time.monotonic()
_LORA = ("vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager")
_SCHEDULER = ("vllm.v1.core.sched.scheduler", "Scheduler")


STEP_EDGES = tuple(int(e) for e in os.environ.get("BENCH_STEP_EDGES", "").split(",") if e)
IDLE_S = float(os.environ.get("BENCH_STEP_IDLE_S") or 0.25)
_BUCKET_KEYS = tuple(
    f"b{i}_{what}" for i in range(len(STEP_EDGES) + 1) for what in ("steps", "tokens", "reqs", "gap_s")
)
_COUNTS = dict.fromkeys(
    (
        "loads",
        "load_s",
        "activations",
        "activation_s",
        "applies",
        "adapters",
        "schedules",
        "schedule_s",
        "waiting",
        *_BUCKET_KEYS,
    ),
    0.0,
)
_installed: set[str] = set()  # the modules wrapped in this process (a fork inherits them)


def _install_lora() -> None:
    import vllm.lora.model_manager as mm
    import vllm.lora.worker_manager as wm

    counts = _COUNTS
    load = wm.WorkerLoRAManager._load_adapter
    activate = mm.LRUCacheLoRAModelManager.activate_adapter
    apply = wm.LRUCacheWorkerLoRAManager._apply_adapters

    def _load_adapter(self, request):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return load(self, request)
        finally:
            counts["loads"] += 1
            counts["load_s"] += time.perf_counter() - t

    def activate_adapter(self, lora_id):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        copied = activate(self, lora_id)
        if copied:
            counts["activations"] += 1
            counts["activation_s"] += time.perf_counter() - t
        return copied

    def _apply_adapters(self, requests):  # type: ignore[no-untyped-def]
        counts["applies"] += 1
        counts["adapters"] += sum(1 for r in requests if r)
        return apply(self, requests)

    wm.WorkerLoRAManager._load_adapter = _load_adapter
    mm.LRUCacheLoRAModelManager.activate_adapter = activate_adapter
    wm.LRUCacheWorkerLoRAManager._apply_adapters = _apply_adapters


def _install_scheduler() -> None:
    import vllm.v1.core.sched.scheduler as sched

    counts = _COUNTS
    schedule = sched.Scheduler.schedule
    last: list = [None]  # the previous step: (its start, bucket, tokens, requests)

    def _schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["schedules"] += 1
        counts["waiting"] += len(self.waiting) + len(getattr(self, "skipped_waiting", ()))
        t = time.perf_counter()
        if last[0] is not None:
            started, bucket, tokens, reqs = last[0]
            if t - started <= IDLE_S:
                counts[f"b{bucket}_steps"] += 1
                counts[f"b{bucket}_tokens"] += tokens
                counts[f"b{bucket}_reqs"] += reqs
                counts[f"b{bucket}_gap_s"] += t - started
        out = schedule(self, *args, **kwargs)
        counts["schedule_s"] += time.perf_counter() - t
        tokens = getattr(out, "total_num_scheduled_tokens", 0)
        reqs = len(getattr(out, "num_scheduled_tokens", ()))
        last[0] = (t, bisect.bisect_right(STEP_EDGES, tokens), tokens, reqs)
        return out

    sched.Scheduler.schedule = _schedule


def _ready(module: str, attr: str) -> bool:
    """Imported, and past defining ``attr`` (not half way through its import)."""
    return getattr(sys.modules.get(module), attr, None) is not None


def _run() -> None:
    """Wrap vLLM's LoRA worker and scheduler once each is imported, and flush the counters
    as this pid. On a GPU both run in the engine core process; on CPU the worker is a process
    of its own: each writes its file, and the reader sums them."""
    path = os.path.join(_DIR or ".", f"{os.getpid()}.json")
    while True:
        for (module, attr), install in ((_LORA, _install_lora), (_SCHEDULER, _install_scheduler)):
            if module not in _installed and _ready(module, attr):
                install()
                _installed.add(module)
        # Quick while the engine starts (the first schedule comes soon after the import),
        # then no more than the flush: processes that never import both stay cheap.
        waiting_for_imports = len(_installed) < 2 and time.monotonic() - _T0 < 600
        time.sleep(0.02 if waiting_for_imports else 0.5)
        if any(_COUNTS.values()):  # the worker and the scheduler may be two processes (CPU)
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(_COUNTS, fh)
            os.replace(tmp, path)


def _start() -> None:
    threading.Thread(target=_run, name="bench-lora-trace", daemon=True).start()


if _DIR:
    # A forked engine process (vLLM forks unless CUDA is already up in the parent) has
    # no copy of this thread: start one there, on the counters the fork copied.
    os.register_at_fork(after_in_child=_start)
    _start()
