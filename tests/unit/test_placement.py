"""gateway/placement.py: which cores are spare, which processes move, and the /proc walk."""

from __future__ import annotations

from pathlib import Path

from gateway.placement import descendants, spare_cores


def test_a_pinned_worker_leaves_the_other_cores_to_the_floating_processes() -> None:
    # engine core 11 floats, worker 12 is bound to core 0, the resource tracker 13 floats
    plan = spare_cores({0, 1}, {11: {0, 1}, 12: {0}, 13: {0, 1}})
    assert plan == ({1}, [11, 13])


def test_several_workers_leave_what_none_of_them_holds() -> None:
    plan = spare_cores(set(range(8)), {20: set(range(8)), 21: {0, 1, 2}, 22: {3, 4, 5}})
    assert plan == ({6, 7}, [20])


def test_nothing_moves_without_a_pinned_worker_or_without_a_spare_core() -> None:
    assert spare_cores({0, 1}, {11: {0, 1}, 12: {0, 1}}) is None  # GPU: nothing pinned
    assert spare_cores({0, 1}, {11: {0, 1}, 12: {0}, 14: {1}}) is None  # every core taken
    assert spare_cores({0, 1}, {}) is None


def _fake_proc(root: Path, parents: dict[int, int], comms: dict[int, str]) -> Path:
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({comms.get(pid, 'python')}) S {ppid} 1 1 0 -1\n")
    (root / "self").mkdir()  # not a pid: skipped
    return root


def test_descendants_walks_the_whole_tree_below_the_root(tmp_path: Path) -> None:
    # 100 = gateway; 101 = engine core (comm with a space and a parenthesis); 102 = its worker;
    # 200 = another process tree
    proc = _fake_proc(
        tmp_path,
        {100: 1, 101: 100, 102: 101, 103: 100, 200: 1, 201: 200},
        {101: "VLLM::Engine (x)", 102: "VLLM::Worker"},
    )
    assert sorted(descendants(100, proc)) == [101, 102, 103]
    assert descendants(102, proc) == []
