"""bench/lora.py: which adapter each request of a mix names (round-robin, uniform, Zipf;
deterministic from the seed), the per-adapter statistics, the starvation check, and the
goal lines and tables the report builds from them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from bench import report
from bench.client import RequestResult
from bench.lora import (
    ADAPTERS,
    adapter_fields,
    adapter_lines,
    cold_lines,
    cold_probe,
    lora_goals,
    mix_models,
    per_adapter,
    split_mix,
    starvation,
    zipf_weights,
)


def test_base_and_lora4_need_no_randomness() -> None:
    assert mix_models("base", 3, 1, "m") == ["m", "m", "m"]
    assert mix_models("lora4", 6, 1, "m") == ["a0", "a1", "a2", "a3", "a0", "a1"]
    assert mix_models("lora4:tools", 2, 9, "m") == ["a0", "a1"]


@pytest.mark.parametrize("mix", ["lora16", "lora16z"])
def test_random_mixes_are_deterministic_from_the_seed(mix: str) -> None:
    a, b = mix_models(mix, 200, 42, "m"), mix_models(mix, 200, 42, "m")
    assert a == b and set(a) <= set(ADAPTERS)
    assert mix_models(mix, 200, 43, "m") != a  # another point's seed, another sequence


def test_lora16_is_uniform_over_the_sixteen() -> None:
    counts = Counter(mix_models("lora16", 16_000, 7, "m"))
    assert set(counts) == set(ADAPTERS)
    assert all(800 < n < 1200 for n in counts.values()), counts  # 1000 expected each


def test_zipf_weights_follow_one_over_k_to_the_s() -> None:
    w = zipf_weights(16, 1.1)
    assert sum(w) == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2**1.1) and w[0] / w[15] == pytest.approx(16**1.1)


def test_lora16z_draws_with_zipf_popularity() -> None:
    n = 20_000
    counts = Counter(mix_models("lora16z", n, 7, "m"))
    w = zipf_weights(16)
    for k, name in enumerate(ADAPTERS):
        assert counts[name] / n == pytest.approx(w[k], abs=0.01), name
    assert counts["a0"] > counts["a1"] > counts["a3"] > counts["a15"]


def test_a_mix_may_name_a_shape_and_unknown_mixes_are_refused() -> None:
    assert split_mix("lora16z:json_schema", "plain") == ("lora16z", "json_schema")
    assert split_mix("base", "tools") == ("base", "tools")
    with pytest.raises(ValueError, match="unknown mix"):
        split_mix("lora8", "plain")


def _r(model: str, ttft: float | None, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, ttft=ttft, model=model, start=0.0, end=1.0, completion_tokens=4)


def test_per_adapter_counts_requests_and_ttft_of_completed_ones() -> None:
    res = [_r("a1", 0.1), _r("a1", 0.3), _r("a1", None, ok=False), _r("a10", 0.2), _r("a2", 0.5)]
    stats = per_adapter(res)
    assert list(stats) == ["a1", "a2", "a10"]  # by adapter number
    assert stats["a1"]["requests"] == 3 and stats["a1"]["completed"] == 2
    assert stats["a1"]["ttft_ms_mean"] == pytest.approx(200.0)
    assert stats["a1"]["ttft_ms_p99"] == pytest.approx(298.0)  # numpy's linear percentile
    assert stats["a10"]["ttft_ms_p99"] == pytest.approx(200.0)


def test_an_adapter_over_three_times_the_mean_is_starved() -> None:
    stats: dict[str, dict[str, Any]] = {"a0": {"ttft_ms_mean": 100.0}, "a1": {"ttft_ms_mean": 310.0}}
    s = starvation(stats, 100.0)
    assert s["starved"] == ["a1"] and s["worst_adapter"] == "a1"
    assert s["worst_ttft_ratio"] == pytest.approx(3.1)
    assert starvation({"a0": {"ttft_ms_mean": 299.0}}, 100.0)["starved"] == []


def test_an_adapter_with_no_completed_request_is_starved() -> None:
    assert starvation({"a0": {"ttft_ms_mean": 100.0}, "a5": {"ttft_ms_mean": None}}, 100.0)["starved"] == [
        "a5"
    ]


def test_the_base_mix_has_no_per_adapter_fields() -> None:
    assert adapter_fields([_r("m", 0.1)], "base", 100.0) == {}
    fields = adapter_fields([_r("a0", 0.1), _r("a1", 0.5)], "lora16", 300.0)
    assert set(fields["per_adapter"]) == {"a0", "a1"} and fields["starved"] == []


def _point(target: str, mix: str, c: int, tok: float, p99: dict[str, float], n: int = 1) -> dict[str, Any]:
    stats = {
        a: {"requests": 10, "completed": 10, "ttft_ms_mean": v / 2, "ttft_ms_p99": v} for a, v in p99.items()
    }
    return {
        "target": target,
        "pass": n,
        "mix": mix,
        "concurrency": c,
        "out_tok_per_s": tok,
        "ttft_ms_p50": 1.0,
        "itl_ms_p50": 1.0,
        "tpot_ms_p50": 1.0,
        "duration_s": 1.0,
        **{"per_adapter": stats, **starvation(stats, sum(p99.values()) / len(p99) / 2)},
    }


def _result(points: list[dict[str, Any]], servers: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"mixes": ["lora16", "lora4"], "concurrencies": [64, 256], "gpu": "H200"}
    return {"meta": meta, "points": points, "servers": servers or {}}


def test_lora16_goals_pass_when_faster_and_no_adapter_worse() -> None:
    points = [
        _point("vllm", "lora16", 64, 100.0, {"a0": 50.0, "a1": 60.0}),
        _point("gateway", "lora16", 64, 160.0, {"a0": 40.0, "a1": 60.0}),
    ]
    result = _result(points)
    goals = lora_goals(result, report.compare(result), gpu=True)
    assert [(g[0][:30], g[1]) for g in goals] == [
        ("lora16 mixes: gateway tok/s >=", True),
        ("lora16 mixes: every adapter's ", True),
        ("lora16 mixes: no adapter starv", True),
    ]


def test_lora16_goals_fail_on_a_slow_point_or_a_worse_adapter() -> None:
    points = [
        _point("vllm", "lora16", 256, 100.0, {"a0": 50.0, "a1": 60.0}),
        _point("gateway", "lora16", 256, 140.0, {"a0": 40.0, "a1": 90.0}),
    ]
    result = _result(points)
    goals = {g[0][:30]: g for g in lora_goals(result, report.compare(result), gpu=True)}
    assert goals["lora16 mixes: gateway tok/s >="][1] is False
    worse = goals["lora16 mixes: every adapter's "]
    assert worse[1] is False and "1 of 2 worse" in worse[2] and "a1 lora16 c=256" in worse[2]


def test_the_lora16_ratio_is_not_judged_when_the_gateway_sets_its_own_slots() -> None:
    """The goal gives both servers the mix's max_loras: a run that gives the gateway its own
    (``--gateway-set engine.max_loras=auto``) is reported, not judged."""
    points = [
        _point("vllm", "lora16", 64, 100.0, {"a0": 50.0}),
        _point("gateway", "lora16", 64, 220.0, {"a0": 40.0}),
    ]
    result = _result(points)
    result["meta"] |= {"gateway_set": ["engine.max_loras=auto"]}
    goal = lora_goals(result, report.compare(result), gpu=True)[0]
    assert goal[1] is None
    assert goal[2] == (
        "worst 2.200 (lora16 c=64); not judged: the run set engine.max_loras=auto, the goal's mix fixes "
        "max_loras on both servers at the profile's"
    )
    result["meta"] |= {"gateway_set": [], "max_loras_set": 17, "lora16_max_loras": 4}
    goal = lora_goals(result, report.compare(result), gpu=True)[0]
    assert goal[1] is None and "the run set --max-loras 17 on both servers, the goal's" in goal[2]
    result["meta"] |= {"max_loras_set": 4}  # the goal's own slots, named: judged
    goal = lora_goals(result, report.compare(result), gpu=True)[0]
    assert goal[1] is True and goal[2] == "worst 2.200 (lora16 c=64)"


def test_a_starved_adapter_fails_its_goal_and_shows_in_the_table() -> None:
    points = [
        _point("vllm", "lora16z", 64, 100.0, {"a0": 50.0, "a1": 60.0}),
        _point(
            "gateway", "lora16z", 64, 100.0, {"a0": 10.0, "a1": 10.0, "a2": 10.0, "a3": 10.0, "a15": 200.0}
        ),
    ]
    result = _result(points)
    result["meta"]["mixes"] = ["lora16z"]
    goals = {g[0][:30]: g for g in lora_goals(result, report.compare(result), gpu=False)}
    assert "lora16 mixes: gateway tok/s >=" not in goals  # a GPU goal
    assert goals["lora16 mixes: no adapter starv"][1] is False
    text = "\n".join(adapter_lines(result))
    assert "gateway pass 1: worst 4.17x (a15), starved a15" in text
    assert "| a15 | - / 10 | - | 100 | - | 200 | - |" in text


def test_cold_lines_report_each_servers_medians() -> None:
    cold = {
        "adapters": ["a0", "a1"],
        "cold_ttft_ms": [300.0, 340.0],
        "warm_ttft_ms": [30.0, 32.0],
        "cold_ttft_ms_median": 320.0,
        "warm_ttft_ms_median": 31.0,
    }
    text = "\n".join(cold_lines({"servers": {"vllm": {"cold": cold}, "gateway": {}}}))
    assert "| vllm | a0, a1 | 320.0 | 31.0 | 300 / 340 | 30 / 32 |" in text and "| gateway |" not in text


def test_a_failed_cold_probe_request_is_reported_not_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold request that failed left its adapter out of the medians, and the report said nothing:
    a server failing its slowest (cold) request showed a better median."""
    from bench import client

    def drive(url: str, jobs: list[Any], *_: Any) -> tuple[list[RequestResult], float]:
        fail = jobs[0].model == "a0" and "a0" not in seen
        seen.add(jobs[0].model)
        res = RequestResult(ok=not fail, ttft=None if fail else 0.05, model=jobs[0].model)
        res.error = "HTTP 503: busy" if fail else ""
        return [res], 0.0

    class Maker:
        def content(self, seed: int) -> str:
            return "x"

    seen: set[str] = set()
    monkeypatch.setattr(client, "drive", drive)
    monkeypatch.setattr(client, "run_loop", lambda x: x)
    cold = cold_probe("http://x", "k", "base", Maker(), 0, 8)
    assert (len(cold["cold_ttft_ms"]), cold["failed"]) == (3, ["a0 cold: HTTP 503: busy"])
    text = "\n".join(cold_lines({"servers": {"gateway": {"cold": cold}}}))
    assert text.endswith("left out of the medians): gateway: a0 cold: HTTP 503: busy")


def test_compare_skips_concurrencies_a_mix_did_not_run() -> None:
    result = _result(
        [_point("vllm", "lora4", 256, 1.0, {"a0": 1.0}), _point("gateway", "lora4", 256, 1.0, {"a0": 1.0})]
    )
    assert [(r["mix"], r["concurrency"]) for r in report.compare(result)] == [("lora4", 256)]
