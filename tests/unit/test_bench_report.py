"""bench/report.py's arithmetic: the ratio of means, its standard error from the passes, and
the goal lines that read them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import report


def _point(target: str, tok_s: float, n: int, mix: str = "base", c: int = 4) -> dict[str, Any]:
    return {
        "target": target,
        "mix": mix,
        "concurrency": c,
        "pass": n,
        "out_tok_per_s": tok_s,
        "ttft_ms_p50": 10.0,
        "itl_ms_p50": 1.0,
        "tpot_ms_p50": 1.0,
        "duration_s": 10.0,
    }


def _result(vllm: list[float], gateway: list[float]) -> dict[str, Any]:
    points = [_point("vllm", v, i + 1) for i, v in enumerate(vllm)]
    points += [_point("gateway", g, i + 1) for i, g in enumerate(gateway)]
    return {"meta": {"mixes": ["base"], "concurrencies": [4]}, "points": points}


def test_ratio_se_is_the_delta_method_on_the_two_means() -> None:
    gs = [_point("gateway", t, i) for i, t in enumerate([9.0, 11.0])]
    vs = [_point("vllm", t, i) for i, t in enumerate([19.0, 21.0])]
    # means 10 and 20, each with stdev sqrt(2) over 2 passes: relative se 0.1 and 0.05
    assert report.ratio_se(gs, vs) == pytest.approx(0.5 * math.hypot(0.1, 0.05))


def test_ratio_se_needs_two_passes_of_each_server() -> None:
    one = [_point("gateway", 10.0, 1)]
    two = [_point("vllm", 9.0, 1), _point("vllm", 11.0, 2)]
    assert report.ratio_se(one, two) is None
    assert report.ratio_se(two, one) is None


def test_a_shortfall_inside_the_passes_spread_passes_the_noise_goal_only() -> None:
    result = _result(vllm=[40.0, 54.0], gateway=[36.0, 54.0])  # ratio 0.957, spread of +-7-9 tok/s
    rows = report.compare(result)
    assert rows[0]["tok_ratio"] == pytest.approx(45 / 47)
    verdicts = {goal.split(" ")[0]: ok for goal, ok, _ in report.goals(result, rows)}
    assert verdicts == {"every": True, "gateway": False, "no": True}


def test_a_shortfall_beyond_the_spread_fails_both_goals() -> None:
    result = _result(vllm=[47.0, 47.2], gateway=[40.0, 40.1])
    verdicts = [ok for _, ok, _ in report.goals(result, report.compare(result))]
    assert verdicts == [True, False, False]


def test_merge_numbers_a_later_runs_passes_after_the_earlier_ones() -> None:
    first, second = _result(vllm=[40.0, 50.0], gateway=[45.0]), _result(vllm=[60.0], gateway=[55.0, 65.0])
    first["servers"] = {"vllm": {"startup_s": 1}, "gateway": {"startup_s": 2}, "vllm-2": {"startup_s": 3}}
    second["servers"] = {"gateway": {"startup_s": 4}, "vllm": {"startup_s": 5}, "gateway-2": {"startup_s": 6}}
    merged = report.merge([first, second])
    passes = sorted((p["target"], p["pass"], p["out_tok_per_s"]) for p in merged["points"])
    # One offset for every target (the first run's last pass, 2): pass k of one server stays
    # paired with pass k of the other of its own run, never with a pass of another run.
    assert passes == [
        ("gateway", 1, 45.0),
        ("gateway", 3, 55.0),
        ("gateway", 4, 65.0),
        ("vllm", 1, 40.0),
        ("vllm", 2, 50.0),
        ("vllm", 3, 60.0),
    ]
    assert {k: v["startup_s"] for k, v in merged["servers"].items()} == {
        "vllm": 1,
        "gateway": 2,
        "vllm-2": 3,
        "gateway-3": 4,
        "vllm-3": 5,
        "gateway-4": 6,
    }
    row = report.compare(merged)[0]  # over the passes both ran: 1 and 3
    assert row["tok_ratio"] == pytest.approx((45 + 55) / (40 + 60))
    assert row["unpaired"] == ["vllm pass 2", "gateway pass 4"]


def test_merge_keeps_each_pair_within_its_run() -> None:
    """Mirrored odd orders (vllm,gateway,vllm then gateway,vllm,gateway): offsetting each
    target by its own count paired a vLLM pass of one run with a gateway pass of the other."""
    first, second = (
        _result(vllm=[100.0, 50.0], gateway=[105.0]),
        _result(vllm=[200.0], gateway=[210.0, 210.0]),
    )
    row = report.compare(report.merge([first, second]))[0]
    assert row["tok_ratio_paired"][0] == pytest.approx(1.05)


def test_merge_of_runs_at_other_points_reports_every_point() -> None:
    """A run of lora16 at 256 streams, then one of base at 256 and lora16 at 64: the report
    of both has all three points (the first run's meta alone listed only its own)."""
    first = _result(vllm=[10.0], gateway=[12.0])
    first["meta"] = {"mixes": ["lora16"], "concurrencies": [256], "mix_concurrencies": {"lora16": [256]}}
    for p in first["points"]:
        p.update(mix="lora16", concurrency=256)
    second = _result(vllm=[20.0, 30.0], gateway=[24.0, 33.0])
    second["meta"] = {
        "mixes": ["base", "lora16"],
        "concurrencies": [64, 256],
        "mix_concurrencies": {"base": [256], "lora16": [64]},
    }
    for p, (mix, c) in zip(second["points"], [("base", 256), ("lora16", 64)] * 2, strict=True):
        p.update(mix=mix, concurrency=c)
    merged = report.merge([first, second])
    assert merged["meta"]["mixes"] == ["lora16", "base"] and merged["meta"]["concurrencies"] == [64, 256]
    assert merged["meta"]["mix_concurrencies"] == {"lora16": [64, 256], "base": [256]}
    rows = {(r["mix"], r["concurrency"]): r["tok_ratio"] for r in report.compare(merged)}
    assert rows == pytest.approx({("lora16", 64): 33 / 30, ("lora16", 256): 1.2, ("base", 256): 1.2})


def test_the_ratio_uses_only_the_passes_both_servers_ran() -> None:
    """--budget-s (or a failed pass) left gateway pass 2 without its vLLM pass: on a machine
    slowing 30 % between pairs, mixing it into the mean read 0.85x for equal servers."""
    result = _result(vllm=[100.0], gateway=[100.0, 70.0])
    row = report.compare(result)[0]
    assert row["tok_ratio"] == pytest.approx(1.0) and row["unpaired"] == ["gateway pass 2"]


def test_paired_ratio_cancels_drift_that_the_means_carry() -> None:
    # The machine halves its speed between pairs; within each pair the gateway is 5 % ahead.
    vs = [_point("vllm", 100.0, 1), _point("vllm", 50.0, 2), _point("vllm", 80.0, 3)]
    gs = [_point("gateway", 105.0, 1), _point("gateway", 52.5, 2), _point("gateway", 84.0, 3)]
    ratio, se = report.paired_ratio(gs, vs)
    assert ratio == pytest.approx(1.05)
    assert se == pytest.approx(0.0, abs=1e-12)
    assert report.ratio_se(gs, vs) > 0.1  # the means see the drift as noise


def test_paired_ratio_needs_the_same_passes_of_both_servers() -> None:
    vs = [_point("vllm", 100.0, 1), _point("vllm", 50.0, 2)]
    assert report.paired_ratio([_point("gateway", 100.0, 1)], vs[:1]) is None
    assert report.paired_ratio([_point("gateway", 100.0, 1), _point("gateway", 90.0, 3)], vs) is None


def test_the_gateway_is_measured_against_the_faster_no_http_loop() -> None:
    result = _result(vllm=[80.0], gateway=[93.0])
    result["points"] += [_point("ceiling", 90.0, 1), _point("offline", 100.0, 1)]
    row = report.compare(result)[0]
    assert row["ceiling_target"] == "offline"
    assert row["gateway_of_ceiling"] == pytest.approx(0.93)
    assert row["vllm_of_ceiling"] == pytest.approx(0.80)
    moonshot = [
        (goal, ok, detail) for goal, ok, detail in report.goals(result, [row]) if goal.startswith("moonshot")
    ]
    assert [(ok, detail) for _, ok, detail in moonshot] == [
        (False, "worst 0.930 (base)"),
        (True, "worst 1.033 (base)"),
    ]
    assert "offline generate" in moonshot[0][0] and "AsyncLLM" in moonshot[1][0]  # one line per bound
    result["points"] = [p for p in result["points"] if p["target"] != "offline"]
    row = report.compare(result)[0]
    assert (row["ceiling_target"], row["gateway_of_ceiling"]) == ("ceiling", pytest.approx(93 / 90))
    assert [ok for goal, ok, _ in report.goals(result, [row]) if goal.startswith("moonshot")] == [True]


def test_lora_trace_sums_the_engine_processes_and_takes_a_points_difference(tmp_path: Path) -> None:
    from bench import lora_trace

    env = lora_trace.server_env({"PYTHONPATH": "/root/site"}, tmp_path / "trace", 0.25)
    assert env["PYTHONPATH"].split(":") == [str(lora_trace.SITE), "/root/site"]
    assert lora_trace.read({}) is None and lora_trace.point_fields(None, None) == {}
    before = lora_trace.read(env)
    counts = {
        "loads": 2,
        "load_s": 0.1,
        "activations": 4,
        "activation_s": 0.02,
        "applies": 10,
        "adapters": 25,
        "schedules": 40,
        "schedule_s": 0.01,
        "waiting": 120,
    }
    (tmp_path / "trace" / "11.json").write_text(json.dumps(counts))
    (tmp_path / "trace" / "12.json").write_text(json.dumps({**counts, "loads": 0, "load_s": 0.0}))
    (tmp_path / "trace" / "13.json.tmp").write_text("{")  # a write under way: not read
    fields = lora_trace.point_fields(before, lora_trace.read(env))
    assert fields["lora_loads"] == 2 and fields["lora_load_ms_mean"] == pytest.approx(50.0)
    assert fields["lora_activations"] == 8 and fields["lora_activation_ms_mean"] == pytest.approx(5.0)
    assert fields["lora_steps"] == 20 and fields["lora_adapters_per_step"] == pytest.approx(2.5)
    assert fields["sched_ms_mean"] == pytest.approx(0.25) and fields["sched_waiting_mean"] == pytest.approx(
        3.0
    )


def test_the_report_says_where_the_gateways_adapters_were() -> None:
    result = _result([100.0], [120.0])
    result["points"][1].update(residency_gpu=4, residency_cpu=12, residency_loaded=0, residency_not_loaded=0)
    lines = report.residency(result["meta"], report.index(result["points"]))
    assert lines[-1].endswith("after each point (its `/v1/models`): base c=4: gpu 4, cpu 12.")
    plain = _result([100.0], [120.0])
    assert report.residency(plain["meta"], report.index(plain["points"])) == []


def test_the_trace_site_buckets_engine_steps_by_their_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site's wrapper of vLLM's ``Scheduler.schedule``, on a stand-in scheduler module and
    a stepped clock: each step lands in its tokens' bucket with its length (schedule to next
    schedule), and a gap over the idle bound (the engine waiting for work) is not counted."""
    import importlib.util
    import sys
    import types

    from bench import lora_trace

    env = lora_trace.server_env({}, tmp_path / "trace", 0.5)
    monkeypatch.setenv(lora_trace.VAR, "")  # no flush thread in this process
    monkeypatch.setenv(lora_trace.EDGES_VAR, env[lora_trace.EDGES_VAR])
    monkeypatch.setenv(lora_trace.IDLE_VAR, env[lora_trace.IDLE_VAR])
    spec = importlib.util.spec_from_file_location(
        "trace_site_under_test", lora_trace.SITE / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)

    class Scheduler:
        def __init__(self) -> None:
            self.waiting: list[int] = [1, 2]

        def schedule(self, tokens: int, reqs: int) -> Any:
            return types.SimpleNamespace(
                total_num_scheduled_tokens=tokens, num_scheduled_tokens=dict.fromkeys(range(reqs))
            )

    module = types.ModuleType("vllm.v1.core.sched.scheduler")
    module.Scheduler = Scheduler  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", module)
    assert site.IDLE_S == 0.5
    clock = iter([0.0, 0.0, 0.010, 0.010, 0.014, 0.014, 0.015, 0.015, 5.0, 5.0, 5.002, 5.002])
    monkeypatch.setattr(site.time, "perf_counter", lambda: next(clock))
    site._install_scheduler()
    s = Scheduler()
    for tokens, reqs in [(1200, 40), (60, 60), (0, 0), (300, 30), (1100, 30), (5, 5)]:
        s.schedule(tokens, reqs)
    before = {k: 0.0 for k in site._COUNTS}
    fields = lora_trace.point_fields(before, dict(site._COUNTS))
    names = lora_trace.bucket_names()
    big = names.index("1024-2047")
    # steps counted: 1200 (10 ms), 60 (4 ms), 0 (1 ms), 1100 (2 ms); 300 was followed by 5 s idle
    assert fields[f"step_b{big}_n"] == 2 and fields[f"step_b{big}_ms"] == pytest.approx(6.0)
    assert fields[f"step_b{big}_tokens"] == pytest.approx(1150) and fields[
        f"step_b{big}_reqs"
    ] == pytest.approx(35)
    assert fields[f"step_b{names.index('1-63')}_n"] == 1 and fields[f"step_b{names.index('0')}_n"] == 1
    assert (
        fields[f"step_b{names.index('256-511')}_n"] == 0
        and fields[f"step_b{names.index('256-511')}_ms"] is None
    )
    assert fields["step_n"] == 4 and fields["step_ms_mean"] == pytest.approx(17 / 4)
    assert fields["step_tokens_mean"] == pytest.approx(2360 / 4)
    assert fields["sched_waiting_mean"] == pytest.approx(2.0)

    result = _result([100.0], [120.0])
    result["points"][1].update(fields)
    lines = report.step_shape(result["meta"], report.passes(result["points"]))
    assert lines[-1].startswith("| gateway | base | 4 | 4 | 590.0 | 4.250 | 1.0 x 1.00 | 1.0 x 4.00 | - |")
    assert "| 2.0 x 6.00 |" in lines[-1] and len(lines[-2].split("|")) == len(lines[-1].split("|"))


def test_the_step_table_weighs_each_pass_by_its_steps() -> None:
    from bench import lora_trace

    names = lora_trace.bucket_names()
    small, big = names.index("1-63"), names.index("1024-2047")

    def steps(n_small: int, ms_small: float | None, n_big: int, ms_big: float | None) -> dict[str, Any]:
        fields: dict[str, Any] = {f"step_b{i}_n": 0 for i in range(len(names))}
        fields.update({f"step_b{small}_n": n_small, f"step_b{small}_ms": ms_small})
        fields.update({f"step_b{big}_n": n_big, f"step_b{big}_ms": ms_big})
        n = n_small + n_big
        fields["step_n"] = n
        fields["step_ms_mean"] = ((ms_small or 0) * n_small + (ms_big or 0) * n_big) / n
        fields["step_tokens_mean"] = (10 * n_small + 1500 * n_big) / n
        return fields

    result = _result([100.0], [120.0, 110.0])
    result["points"][1].update(steps(3, 2.0, 1, 50.0))  # gateway pass 1: 4 steps, 56 ms
    result["points"][2].update(steps(1, 4.0, 0, None))  # pass 2 had no big step at all
    row = report.step_shape(result["meta"], report.passes(result["points"]))[-1]
    # 5 steps over the two passes (2.5 a pass), 60 ms and 1,540 tokens in all
    assert row.startswith("| gateway | base | 4 | 2 | 308.0 | 12.000 |")
    cells = [c.strip() for c in row.split("|")[7:-1]]
    assert cells[small] == "2.0 x 2.50" and cells[big] == "0.5 x 50.00"


def test_failed_requests_fail_the_goals_whatever_the_ratio() -> None:
    """In a closed loop a failed request frees its worker at once: a gateway answering 429
    to every other request, at the same speed per answer, kept 1.0x vLLM's tok/s and passed."""
    result = _result(vllm=[100.0], gateway=[100.0])
    result["points"][1].update(failed=384, invalid=0)
    result["points"][0].update(failed=0, invalid=3, invalid_at_length=3)  # cut at max_tokens: the model's
    verdicts = report.goals(result, report.compare(result))
    line = next(v for v in verdicts if v[0].startswith("every request answered"))
    assert line[1] is False and line[2] == "gateway base c=4 pass 1: 384 failed, 0 invalid"
    result["points"][1]["failed"] = 0
    assert next(v for v in report.goals(result, report.compare(result)) if v[0].startswith("every"))[1]


def test_the_lora4_goal_fails_when_the_gateway_completes_nothing() -> None:
    """A 0.0x ratio read as false and dropped the lora4 line instead of failing it."""
    points = [_point("vllm", 100.0, 1, mix="lora4", c=256), _point("gateway", 0.0, 1, mix="lora4", c=256)]
    result = {"meta": {"mixes": ["lora4"], "concurrencies": [256], "gpu": "H100"}, "points": points}
    lines = [g for g in report.goals(result, report.compare(result)) if g[0].startswith("lora4")]
    assert [ok for _, ok, _ in lines] == [False]


def test_a_point_past_the_budget_runs_no_pass_at_all() -> None:
    """--together judged the budget before each pass: running out mid-point kept vLLM pass 1
    and gateway passes 1 and 2, an unpaired pass. It is judged once a point now."""
    from argparse import Namespace

    from bench import run as bench_run

    bench = bench_run.Bench.__new__(bench_run.Bench)
    bench.args = Namespace(budget_s=1.0)
    bench.mixes, bench.plan = ["lora16"], {"lora16": [64, 256]}
    bench.result = {"notes": [], "points": []}
    bench.p = {"start_timeout_s": 1}
    bench.save = lambda png=False: None  # type: ignore[method-assign]

    class Server:
        def launch(self) -> None: ...
        def stop(self) -> None: ...
        def wait_log(self, *_: Any) -> bool:
            return True

    def point(server: Any, target: str, mix: str, c: int, n_pass: int = 1) -> None:
        bench.result["points"].append({"target": target, "mix": mix, "concurrency": c, "pass": n_pass})

    bench.make_server = lambda target, label: Server()  # type: ignore[method-assign,assignment,return-value]
    bench.ready = lambda server, label: None  # type: ignore[method-assign]
    bench.prepare = lambda server, label: None  # type: ignore[method-assign]
    bench.point = point  # type: ignore[method-assign]
    bench.past_budget = lambda: len(bench.result["points"]) >= 3  # type: ignore[method-assign]
    bench.run_together(["vllm", "gateway", "gateway", "vllm"])
    assert [(p["concurrency"], p["target"], p["pass"]) for p in bench.result["points"]] == [
        (64, "vllm", 1),
        (64, "gateway", 1),
        (64, "gateway", 2),
        (64, "vllm", 2),
    ]
    assert bench.result["notes"] == ["lora16 c=256 skipped: past --budget-s"]


def test_together_probes_no_server_while_another_is_still_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    """--together launches the gateway once vLLM has sized its KV cache; vLLM's cold-adapter
    probe and warm-ups then ran as soon as vLLM was ready, while the gateway's engine was still
    loading on the same cores and GPU. Every server is ready before any is probed."""
    from argparse import Namespace

    from bench import run as bench_run

    events: list[tuple[str, str]] = []
    bench = bench_run.Bench.__new__(bench_run.Bench)
    bench.args = Namespace(budget_s=0, cold=True, cold_tokens=8)
    bench.mixes, bench.plan = ["lora16"], {"lora16": [64]}
    bench.result = {"notes": [], "points": [], "servers": {}}
    bench.p = {"start_timeout_s": 1, "served_name": "base"}
    bench.run_id, bench.maker, bench.api_key = "r", None, "k"
    bench.save = lambda png=False: None  # type: ignore[method-assign]

    class Proc:
        pid = 1

    class Server:
        def __init__(self, label: str) -> None:
            self.label, self.base_url, self.proc, self.startup_s = label, label, Proc(), 1.0

        def launch(self) -> None:
            events.append(("launch", self.label))

        def stop(self) -> None: ...

        def wait_log(self, *_: Any) -> bool:
            return True

        def wait_ready(self, *_: Any) -> None:
            events.append(("ready", self.label))

    class Sampler:
        def __init__(self, pid: int) -> None: ...

        def sample(self) -> None:
            return None

    def make_server(target: str, label: str) -> Server:
        bench.result["servers"][label] = {}
        return Server(label)

    def probe(url: str, *_: Any) -> dict[str, Any]:
        events.append(("probe", url))
        return {
            "cold_ttft_ms_median": 1.0,
            "warm_ttft_ms_median": 1.0,
            "cold_ttft_ms": [],
            "warm_ttft_ms": [],
        }

    monkeypatch.setattr(bench_run, "cold_probe", probe)
    monkeypatch.setattr(bench_run, "ProcessSampler", Sampler)
    bench.make_server = make_server  # type: ignore[method-assign,assignment]
    bench.warm_up = lambda server, label, mix: events.append(("warm", label))  # type: ignore[method-assign]
    bench.point = lambda *a, **k: None  # type: ignore[method-assign]
    bench.run_together(["vllm", "gateway", "gateway", "vllm"])
    assert not bench.result["notes"]
    assert events == [
        ("launch", "vllm"),
        ("launch", "gateway"),
        ("ready", "vllm"),
        ("ready", "gateway"),
        ("probe", "vllm"),
        ("warm", "vllm"),
        ("probe", "gateway"),
        ("warm", "gateway"),
    ]
    assert bench.result["servers"]["gateway"]["startup_s"] == 1.0


def test_the_failure_line_names_each_points_own_counts() -> None:
    """A point with failed requests first, and one with invalid answers before another that failed:
    each is reported with its own counts (the first crashed the report, the second borrowed them)."""
    points = [
        {**_point("vllm", 100.0, 1), "failed": 0, "invalid": 5, "invalid_at_length": 0},
        {**_point("gateway", 50.0, 1), "failed": 3, "invalid": 0},
    ]
    result = {"meta": {"mixes": ["base"], "concurrencies": [4]}, "points": points}
    line = next(g for g in report.goals(result, report.compare(result)) if g[0].startswith("every request"))
    assert line[1] is False
    assert (
        line[2] == "vllm base c=4 pass 1: 0 failed, 5 invalid; gateway base c=4 pass 1: 3 failed, 0 invalid"
    )


def test_a_starved_adapter_fails_its_goal_on_a_pass_without_a_twin() -> None:
    """Starvation is the gateway's own, not a comparison: a pass vLLM has no twin of still counts."""
    per = {"a0": {"requests": 4, "ttft_ms_mean": 10.0, "ttft_ms_p99": 12.0}}
    lora: dict[str, Any] = {"per_adapter": per, "worst_ttft_ratio": 1.0, "starved": ""}
    points = [
        {**_point("vllm", 100.0, 1, mix="lora16", c=64), **lora},
        {**_point("gateway", 150.0, 1, mix="lora16", c=64), **lora},
        {
            **_point("gateway", 150.0, 2, mix="lora16", c=64),
            **lora,
            "worst_ttft_ratio": 9.0,
            "starved": "a0 (9.0x)",
        },
    ]
    result = {"meta": {"mixes": ["lora16"], "concurrencies": [64], "gpu": None}, "points": points}
    line = next(g for g in report.goals(result, report.compare(result)) if "starved" in g[0])
    assert line[1] is False and "pass 2: a0 (9.0x)" in line[2]
