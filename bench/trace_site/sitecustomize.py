"""`--lora-trace`: counts what vLLM's LoRA worker does in each server's engine process.

Put on both servers' PYTHONPATH by bench/run.py with ``BENCH_LORA_TRACE`` naming a folder.
Python imports this module at start in every process of the server; in the one that imports
vLLM's LoRA worker manager (the engine core), it wraps three methods, the same on both
servers, and writes cumulative counters to ``<folder>/<pid>.json`` every 0.5 s:

- ``loads``: ``WorkerLoRAManager._load_adapter``, an adapter read from disk into host memory;
- ``activations``: ``LRUCacheLoRAModelManager.activate_adapter`` that copied an adapter into a
  GPU slot (a call for an adapter already in a slot copies nothing and is not counted);
- ``applies``: ``LRUCacheWorkerLoRAManager._apply_adapters``, once per engine step with LoRA,
  with the number of adapters that step's batch names (``adapters``).

Times are wall seconds in the engine's loop. An activation copies from pageable host memory,
so its time includes waiting for the GPU work queued before it.
bench/ never imports this file; it only ever runs inside a server under test.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("BENCH_LORA_TRACE")
_MODULE = "vllm.lora.worker_manager"


def _install(counts: dict[str, float]) -> None:
    import vllm.lora.model_manager as mm
    import vllm.lora.worker_manager as wm

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


def _run() -> None:
    while _MODULE not in sys.modules:
        time.sleep(0.02)
    while getattr(sys.modules[_MODULE], "LRUCacheWorkerLoRAManager", None) is None:
        time.sleep(0.02)  # the module is still being imported
    counts = dict.fromkeys(("loads", "load_s", "activations", "activation_s", "applies", "adapters"), 0.0)
    _install(counts)
    path = os.path.join(_DIR or ".", f"{os.getpid()}.json")
    while True:
        time.sleep(0.5)
        if counts["applies"] or counts["loads"]:
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(counts, fh)
            os.replace(tmp, path)


if _DIR:
    threading.Thread(target=_run, name="bench-lora-trace", daemon=True).start()
