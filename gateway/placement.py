"""CPU placement: keep the gateway and the engine core off the cores vLLM's CPU workers own.

On CPU, vLLM binds each model worker's OpenMP threads to a set of cores and leaves the
rest "reserved" for the serving process (``reserved_cpus`` in its log), but it pins nothing
else: the front process (HTTP, detokenizing, tokenizing) and the engine core, which polls
its workers in a busy loop, float over every core, including the workers'. Each time the
scheduler puts one of them on a worker's core, that core's share of the forward pass
waits. This moves every thread of the gateway process and of its unpinned engine
processes to the cores no worker is bound to. New threads inherit the mask.

Nothing happens where no descendant is pinned to a strict subset of our cores (GPU
workers, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) or where no core would be left over.
Linux only (``/proc`` and ``os.sched_setaffinity``); elsewhere it does nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")


def spare_cores(own: set[int], descendants: Mapping[int, set[int]]) -> tuple[set[int], list[int]] | None:
    """(cores no pinned descendant is bound to, pids to move there), or None to leave all as is.

    A descendant is pinned when its affinity is a strict subset of ``own``; the others
    (affinity = ``own``) float and are the ones to move, with this process."""
    pinned = {pid: cores for pid, cores in descendants.items() if cores and cores < own}
    if not pinned:
        return None
    spare = own - set().union(*pinned.values())
    if not spare:
        return None
    floating = [pid for pid, cores in descendants.items() if pid not in pinned and cores == own]
    return spare, floating


def descendants(root: int, proc: Path = PROC) -> list[int]:
    """Pids of every live process below ``root`` (from each /proc/PID/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _threads(pid: int, proc: Path) -> Iterable[int]:
    try:
        return [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    except OSError:
        return []


def keep_off_worker_cores(proc: Path = PROC) -> set[int] | None:
    """Move this process and its floating descendants to the spare cores; the cores, or None."""
    if not hasattr(os, "sched_getaffinity") or not proc.is_dir():
        return None
    me = os.getpid()
    own = set(os.sched_getaffinity(0))
    masks: dict[int, set[int]] = {}
    for pid in descendants(me, proc):
        try:
            masks[pid] = set(os.sched_getaffinity(pid))
        except OSError:  # gone, or not ours to read
            continue
    plan = spare_cores(own, masks)
    if plan is None:
        return None
    spare, floating = plan
    moved = 0
    for pid in [me, *floating]:
        for tid in _threads(pid, proc):
            try:
                os.sched_setaffinity(tid, spare)
                moved += 1
            except OSError:
                continue
    log.info(
        "CPU placement: %d thread(s) of the gateway and %d engine process(es) moved to cores %s, "
        "off the engine workers' cores",
        moved,
        len(floating),
        ",".join(map(str, sorted(spare))),
    )
    return spare
