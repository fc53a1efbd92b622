"""vLLM's own benchmark client (``vllm bench serve``) as a second client for a point.

``--client vllm`` (bench/run.py) measures each point with ``vllm.benchmarks.serve``,
imported once in run.py's process, instead of bench/client.py: /v1/completions, its
``random`` dataset (``--prompt-tokens`` random ids, ``--output-tokens`` with ignore_eos),
``--max-concurrency`` streams, and for the LoRA mixes ``--lora-modules a0..`` with
``--lora-assignment`` round-robin (lora4) or random (lora16). It is the client vLLM's
maintainers use, so a ratio that holds under both clients is not an artefact of ours.

What it cannot do: chat requests, request shapes other than plain text, Zipf popularity
(lora16z), and per-adapter statistics (it reports the point as a whole). The prompts of
one pass are the same on both servers (the same ``--seed``), as with bench/client.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from typing import Any

from bench.lora import mix_adapters

ASSIGNMENT = {"base": None, "lora4": "round-robin", "lora16": "random"}


def supported(mix: str, shape: str) -> str | None:
    """Why vLLM's client cannot run this mix / shape; None when it can."""
    models = mix.partition(":")[0]
    if shape != "plain":
        return f"vLLM's client sends plain completions only (not {shape})"
    if models not in ASSIGNMENT:
        return f"vLLM's client has no {models} popularity (round-robin or uniform only)"
    return None


def bench_argv(
    base_url: str,
    mix: str,
    model_dir: str,
    served_name: str,
    n: int,
    c: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
) -> list[str]:
    """The ``vllm bench serve`` arguments of one point."""
    argv = [
        "--backend", "openai",
        "--endpoint", "/v1/completions",
        "--base-url", base_url,
        "--model", served_name,
        "--tokenizer", model_dir,
        "--dataset-name", "random",
        "--random-input-len", str(prompt_tokens),
        "--random-output-len", str(output_tokens),
        "--ignore-eos",
        "--num-prompts", str(n),
        "--max-concurrency", str(c),
        "--num-warmups", "0",  # run.py warmed every adapter already
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--seed", str(seed % 2**31),
        "--disable-tqdm",
    ]  # fmt: skip
    assignment = ASSIGNMENT[mix.partition(":")[0]]
    if assignment is not None:
        argv += ["--lora-modules", *mix_adapters(mix), "--lora-assignment", assignment]
    return argv


def summary_of(result: dict[str, Any], n: int, output_tokens: int) -> dict[str, Any]:
    """vLLM's result as the point fields bench/client.py's ``summarize`` writes (the ones it has)."""

    def get(key: str) -> float | None:
        value = result.get(key)
        return float(value) if value is not None else None

    completed = int(result.get("completed") or 0)
    errors = [e for e in result.get("errors") or [] if e]
    return {
        "completed": completed,
        "failed": n - completed,
        "invalid": 0,
        "invalid_at_length": 0,
        "first_error": errors[0][:500] if errors else None,
        "duration_s": get("duration"),
        "req_per_s": get("request_throughput"),
        "out_tok_per_s": get("output_throughput"),
        "total_tok_per_s": get("total_token_throughput"),
        "ttft_ms_mean": get("mean_ttft_ms"),
        "ttft_ms_p50": get("median_ttft_ms"),
        "ttft_ms_p99": get("p99_ttft_ms"),
        "itl_ms_mean": get("mean_itl_ms"),
        "itl_ms_p50": get("median_itl_ms"),
        "itl_ms_p99": get("p99_itl_ms"),
        "tpot_ms_mean": get("mean_tpot_ms"),
        "tpot_ms_p50": get("median_tpot_ms"),
        "tpot_ms_p99": get("p99_tpot_ms"),
        "e2e_ms_mean": get("mean_e2el_ms"),
        "e2e_ms_p50": get("median_e2el_ms"),
        "e2e_ms_p99": get("p99_e2el_ms"),
        "tokens_per_chunk": None,
        "output_tokens_short": sum(1 for k in result.get("output_lens") or [] if k != output_tokens),
        "client": "vllm bench serve",
    }


def run_point(argv: list[str], api_key: str, n: int, output_tokens: int) -> tuple[dict[str, Any], str]:
    """Run one point with vLLM's client; (point fields, its printed report)."""
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    out = io.StringIO()
    previous = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = api_key  # its request functions send it as the bearer token
    try:
        with contextlib.redirect_stdout(out):
            result = main(args)
    finally:
        if previous is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = previous
    return summary_of(result, n, output_tokens), out.getvalue()
