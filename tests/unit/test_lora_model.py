"""bench/lora_model.py: the step model's orders keep their promises."""

from __future__ import annotations

import pytest

from bench.lora_model import ORDERS, Engine, Load, simulate

SMALL = Load(streams=32, requests=96, adapters=16, prompt=64, output=16)


@pytest.mark.parametrize("order", ORDERS)
def test_every_request_gets_its_first_token(order: str) -> None:
    result = simulate(order, Engine(), SMALL)
    assert sum(len(ttfts) for ttfts in result.ttft_by_adapter.values()) == SMALL.requests
    assert result.tok_s > 0


def test_with_a_slot_per_adapter_the_gateway_holds_nothing_back() -> None:
    load = Load(streams=16, requests=64, adapters=4, prompt=64, output=16)
    straight = simulate("vllm", Engine(slots=4), load)
    gated = simulate("gateway", Engine(slots=4), load)
    assert gated.tok_s == straight.tok_s
    assert gated.ttft_by_adapter == straight.ttft_by_adapter


def test_the_bound_is_above_both_servers_orders() -> None:
    engine = Engine(host_cache=16)
    bound = simulate("bound", engine, SMALL).tok_s
    assert bound >= simulate("vllm", engine, SMALL).tok_s
    assert bound >= simulate("gateway", engine, SMALL).tok_s


def test_disk_reads_slow_vllms_default_cache() -> None:
    small_cache = simulate("vllm", Engine(host_cache=4), SMALL)
    every_adapter = simulate("vllm", Engine(host_cache=16), SMALL)
    assert small_cache.tok_s < every_adapter.tok_s


def test_unknown_order() -> None:
    with pytest.raises(ValueError, match="unknown order"):
        simulate("lifo")
