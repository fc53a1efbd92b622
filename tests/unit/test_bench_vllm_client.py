"""bench/vllm_client.py: the arguments vLLM's own benchmark client gets for a point, and
its result read back as the point fields bench/client.py writes."""

from __future__ import annotations

import argparse

import pytest

from bench.lora import ADAPTERS
from bench.vllm_client import bench_argv, summary_of, supported


def parsed(mix: str) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(bench_argv("http://h:1", mix, "/m", "base", 96, 16, 512, 128, 2**40 + 5))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("mix", "modules", "assignment"),
    [
        ("lora16", list(ADAPTERS), "random"),
        ("lora4", list(ADAPTERS[:4]), "round-robin"),
        ("base", None, None),
    ],
)
def test_a_point_is_vllms_client_with_the_mixs_adapters(
    mix: str, modules: list[str] | None, assignment: str | None
) -> None:
    args = parsed(mix)
    assert (args.base_url, args.endpoint, args.model, args.tokenizer) == (
        "http://h:1",
        "/v1/completions",
        "base",
        "/m",
    )
    assert (args.num_prompts, args.max_concurrency, args.random_input_len, args.random_output_len) == (
        96,
        16,
        512,
        128,
    )
    assert args.ignore_eos and args.num_warmups == 0 and 0 <= args.seed < 2**31
    assert args.lora_modules == modules
    if assignment is not None:
        assert args.lora_assignment == assignment


def test_what_vllms_client_cannot_send_is_named() -> None:
    assert supported("lora16", "plain") is None and supported("base", "plain") is None
    assert "lora16z" in (supported("lora16z", "plain") or "")
    assert "json_schema" in (supported("base:json_schema", "json_schema") or "")


def test_vllms_result_becomes_the_point_fields() -> None:
    result = {
        "completed": 94,
        "errors": ["", "", "boom"],
        "duration": 10.0,
        "request_throughput": 9.4,
        "output_throughput": 1203.2,
        "total_token_throughput": 6000.0,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 300.0,
        "mean_ttft_ms": 120.0,
        "median_itl_ms": 4.0,
        "output_lens": [128] * 93 + [7],
    }
    point = summary_of(result, 96, 128)
    assert point["failed"] == 2 and point["first_error"] == "boom"
    assert (
        point["out_tok_per_s"] == 1203.2 and point["ttft_ms_p50"] == 100.0 and point["ttft_ms_p99"] == 300.0
    )
    assert point["itl_ms_p50"] == 4.0 and point["itl_ms_p99"] is None  # not reported: None, not 0
    assert point["output_tokens_short"] == 1 and point["client"] == "vllm bench serve"
