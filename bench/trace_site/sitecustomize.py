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


_COUNTS = dict.fromkeys(("loads", "load_s", "activations", "activation_s", "applies", "adapters"), 0.0)
_installed = False


def _install() -> None:
    global _installed
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
    _installed = True


def _run() -> None:
    """Wrap once vLLM's LoRA worker is imported, then flush the counters as this pid."""
    if not _installed:
        while _MODULE not in sys.modules:
            time.sleep(0.02)
        while getattr(sys.modules[_MODULE], "LRUCacheWorkerLoRAManager", None) is None:
            time.sleep(0.02)  # the module is still being imported
        _install()
    path = os.path.join(_DIR or ".", f"{os.getpid()}.json")
    while True:
        time.sleep(0.5)
        if _COUNTS["applies"] or _COUNTS["loads"]:
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
