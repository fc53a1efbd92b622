"""bench/servers.py: both servers' command lines carry the same engine settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.servers import EngineSpec, gateway_command, vllm_command


def _spec(max_cpu_loras: int | None) -> EngineSpec:
    return EngineSpec(
        model="/m",
        served_name="base",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=max_cpu_loras,
    )


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.parametrize("max_cpu_loras", [2, 16])
def test_a_cpu_cache_size_reaches_both_servers_and_the_ceiling(max_cpu_loras: int) -> None:
    spec = _spec(max_cpu_loras)
    vllm = vllm_command(spec, 8801)
    gateway = gateway_command(spec, 8802, Path("/c.yaml"), Path("/a"))
    assert _flag(vllm, "--max-cpu-loras") == _flag(gateway, "--max-cpu-loras") == str(max_cpu_loras)
    assert spec.engine_kwargs()["max_cpu_loras"] == max_cpu_loras


def test_with_no_cpu_cache_size_each_server_keeps_its_default() -> None:
    spec = _spec(None)
    assert "--max-cpu-loras" not in vllm_command(spec, 8801)
    assert "--max-cpu-loras" not in gateway_command(spec, 8802, Path("/c.yaml"), Path("/a"))
    assert "max_cpu_loras" not in spec.engine_kwargs()
    assert _flag(vllm_command(spec, 8801), "--max-loras") == "2"


def test_engine_means_count_the_steps_and_their_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two scrapes of /metrics around a point: per-request means in ms, and the engine's
    steps in between with their mean tokens (vllm:iteration_tokens_total)."""
    import io

    from bench import servers

    pages = iter(
        [
            'vllm:e2e_request_latency_seconds_sum{engine="0"} 1.0\n'
            'vllm:e2e_request_latency_seconds_count{engine="0"} 2.0\n'
            'vllm:iteration_tokens_total_sum{engine="0"} 100.0\n'
            'vllm:iteration_tokens_total_count{engine="0"} 10.0\n'
            'vllm:prompt_tokens_total{engine="0"} 40.0\n',
            'vllm:e2e_request_latency_seconds_sum{engine="0"} 4.0\n'
            'vllm:e2e_request_latency_seconds_count{engine="0"} 5.0\n'
            'vllm:iteration_tokens_total_sum{engine="0"} 700.0\n'
            'vllm:iteration_tokens_total_count{engine="0"} 30.0\n'
            'vllm:prompt_tokens_total{engine="0"} 100.0\n',
        ]
    )
    monkeypatch.setattr(
        servers.urllib.request, "urlopen", lambda req, timeout: io.BytesIO(next(pages).encode())
    )
    before = servers.engine_histograms("http://x", "k")
    after = servers.engine_histograms("http://x", "k")
    means = servers.engine_means_ms(before, after)
    assert means["engine_e2e_ms_mean"] == pytest.approx(1000.0)  # 3 s over 3 requests
    assert means["engine_prompt_tokens_mean"] == pytest.approx(20.0)
    assert means["engine_steps"] == 20 and means["engine_tokens_per_step"] == pytest.approx(30.0)


def test_adapter_residency_counts_the_gateways_adapters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import json

    from bench import servers

    cards = [
        {"id": "base"},
        {"id": "a0", "residency": "gpu"},
        {"id": "loud", "residency": "gpu", "alias_of": "a0"},  # an alias: the same adapter
        {"id": "a1", "residency": "cpu"},
        {"id": "a2", "residency": "not loaded"},
    ]
    pages = iter([json.dumps({"data": cards}), json.dumps({"data": [{"id": "base"}]})])
    monkeypatch.setattr(
        servers.urllib.request, "urlopen", lambda req, timeout: io.BytesIO(next(pages).encode())
    )
    assert servers.adapter_residency("http://x", "k") == {
        "residency_gpu": 1,
        "residency_cpu": 1,
        "residency_loaded": 0,
        "residency_not_loaded": 1,
    }
    assert servers.adapter_residency("http://x", "k") == {}  # vLLM's server does not say


def test_the_bench_knows_every_residency_the_gateway_reports() -> None:
    from typing import get_args

    from bench.servers import RESIDENCIES
    from gateway.adapter_slots import Residency

    assert get_args(Residency) == RESIDENCIES
