"""Results JSON -> markdown table and PNG plot; also checks the issue's goals.

python -m bench.report bench/results/DATE-MACHINE/results.json   (rewrites .md and .png)
python -m bench.report --merge OUT_DIR A/results.json B/results.json   (one report over several runs'
    passes, e.g. two runs of the same profile in opposite orders; the meta is A's)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.lora import adapter_lines, cold_lines, lora_goals
from bench.lora_trace import bucket_names
from bench.servers import RESIDENCIES, residency_key

TARGETS = ("vllm", "gateway", "ceiling", "offline")
BOUNDS = ("ceiling", "offline")  # the engine with no HTTP: AsyncLLM tasks, LLMEngine.step() loop
MOONSHOT_BOUNDS = (  # the bound is offline generate; AsyncLLM is the stricter one on a GPU
    ("offline", "offline generate (LLMEngine.step(), as LLM.generate drives the engine)"),
    ("ceiling", "AsyncLLM with no HTTP (stricter where it is the faster)"),
)


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _cpu_cache(engine: dict[str, Any]) -> str:
    if "max_cpu_loras" not in engine:  # runs before the setting was recorded
        return ""
    if engine["max_cpu_loras"] is None:
        return (
            ", max_cpu_loras each server's default (vLLM's server: max_loras; the gateway: "
            "sized to its catalog)"
        )
    return f", max_cpu_loras {engine['max_cpu_loras']} (both)"


def passes(points: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """The points of each (target, mix, concurrency): one per pass of that server."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["target"], p["mix"], p["concurrency"]), []).append(p)
    return groups


def matched(points: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The points of the passes both servers ran at their point, and the points left out.
    A pass one server lacks (``--budget-s`` ran out, or that pass failed) would leave the
    other's pass unpaired: the ratio of means would then weigh the machine's drift on one
    side only, so the comparison uses the pass numbers both have (all, if they share none)."""
    kept: list[dict[str, Any]] = []
    dropped: list[dict[str, Any]] = []
    numbers: dict[tuple[str, str, int], set[Any]] = {}
    for p in points:
        numbers.setdefault((p["target"], p["mix"], p["concurrency"]), set()).add(p.get("pass", 1))
    for p in points:
        mine, other = p["target"], {"vllm": "gateway", "gateway": "vllm"}.get(p["target"])
        theirs = numbers.get((other, p["mix"], p["concurrency"]), set()) if other else set()
        common = theirs & numbers[(mine, p["mix"], p["concurrency"])]
        (dropped if other and common and p.get("pass", 1) not in common else kept).append(p)
    return kept, dropped


def index(points: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """One point per (target, mix, concurrency). A target run in several passes (``--targets
    vllm,gateway,gateway,vllm``) gets the mean of its passes, so the server order evens out."""
    return {key: ps[0] if len(ps) == 1 else mean_point(ps) for key, ps in passes(points).items()}


def mean_point(ps: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(ps[0])
    for key, value in ps[0].items():
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key not in ("concurrency", "pass", "seed")
        ):
            values = [p.get(key) for p in ps]
            merged[key] = None if None in values else sum(values) / len(values)  # type: ignore[arg-type]
    merged["pass"] = "mean"
    return merged


def ratio_se(gs: list[dict[str, Any]], vs: list[dict[str, Any]], key: str = "out_tok_per_s") -> float | None:
    """Standard error of mean(gateway) / mean(vLLM) over the passes (delta method): how far
    the ratio of means moves with the pass-to-pass spread of each server. None with fewer
    than two passes of either."""
    if len(gs) < 2 or len(vs) < 2:
        return None
    a, b = [p[key] for p in gs], [p[key] for p in vs]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if not ma or not mb:
        return None
    rel_a = statistics.stdev(a) / math.sqrt(len(a)) / ma
    rel_b = statistics.stdev(b) / math.sqrt(len(b)) / mb
    return ma / mb * math.hypot(rel_a, rel_b)


def paired_ratio(
    gs: list[dict[str, Any]], vs: list[dict[str, Any]], key: str = "out_tok_per_s"
) -> tuple[float, float] | None:
    """Geometric mean of gateway/vLLM over passes paired by number, and its standard error.
    With the orders run.py is given (vllm,gateway,gateway,vllm,...) pass k of one server runs
    next to pass k of the other, so the machine's drift between passes cancels in each pair.
    None without at least two complete pairs."""
    g = {p.get("pass"): p[key] for p in gs}
    v = {p.get("pass"): p[key] for p in vs}
    if len(g) < 2 or g.keys() != v.keys() or not all(g.values()) or not all(v.values()):
        return None
    logs = [math.log(g[k] / v[k]) for k in g]
    ratio = math.exp(statistics.fmean(logs))
    return ratio, ratio * statistics.stdev(logs) / math.sqrt(len(logs))


def compare(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Gateway against vLLM's server (and the ceiling) at each mix and concurrency, over the
    passes both servers ran (``matched``; a row's ``unpaired`` lists the passes left out)."""
    points, dropped = matched(result["points"])
    pts = index(points)
    groups = passes(points)
    rows = []
    for mix in result["meta"]["mixes"]:
        for c in result["meta"]["concurrencies"]:
            if not any((t, mix, c) in pts for t in TARGETS):
                continue  # a mix run at some of the concurrencies only
            v, g, e = pts.get(("vllm", mix, c)), pts.get(("gateway", mix, c)), bound(pts, mix, c)
            row: dict[str, Any] = {"mix": mix, "concurrency": c}
            if unpaired := [p for p in dropped if (p["mix"], p["concurrency"]) == (mix, c)]:
                row["unpaired"] = [f"{p['target']} pass {p.get('pass', 1)}" for p in unpaired]
            if v and g:
                row.update(
                    tok_ratio=g["out_tok_per_s"] / v["out_tok_per_s"] if v["out_tok_per_s"] else None,
                    tok_ratio_se=ratio_se(groups[("gateway", mix, c)], groups[("vllm", mix, c)]),
                    tok_ratio_paired=paired_ratio(groups[("gateway", mix, c)], groups[("vllm", mix, c)]),
                    ttft_p50_delta_ms=_sub(g["ttft_ms_p50"], v["ttft_ms_p50"]),
                    itl_p50_delta_ms=_sub(g["itl_ms_p50"], v["itl_ms_p50"]),
                    tpot_p50_delta_ms=_sub(g["tpot_ms_p50"], v["tpot_ms_p50"]),
                    rss_tree_delta_mb=_sub(g.get("rss_tree_mb_max"), v.get("rss_tree_mb_max")),
                    rss_front_delta_mb=_sub(g.get("rss_front_mb_max"), v.get("rss_front_mb_max")),
                    front_cpu_us_delta=_sub(front_cpu_us_per_token(g), front_cpu_us_per_token(v)),
                )
            if e and e["out_tok_per_s"]:
                row["ceiling_target"] = e["target"]
                if v:
                    row["vllm_of_ceiling"] = v["out_tok_per_s"] / e["out_tok_per_s"]
                if g:
                    row["gateway_of_ceiling"] = g["out_tok_per_s"] / e["out_tok_per_s"]
            if g:  # each bound on its own, for the goal lines
                row["gateway_of"] = {
                    t: g["out_tok_per_s"] / b["out_tok_per_s"]
                    for t in BOUNDS
                    if (b := pts.get((t, mix, c))) and b["out_tok_per_s"]
                }
            rows.append(row)
    return rows


def bound(pts: dict[tuple[str, str, int], dict[str, Any]], mix: str, c: int) -> dict[str, Any] | None:
    """The engine-with-no-HTTP point a server is measured against: the faster of the two loops
    where both ran (the higher throughput is the firmer upper bound)."""
    found = [pts[(t, mix, c)] for t in BOUNDS if (t, mix, c) in pts]
    return max(found, key=lambda p: p["out_tok_per_s"], default=None)


def front_cpu_us_per_token(p: dict[str, Any]) -> float | None:
    """CPU time of the front process (HTTP, API layer, detokenizing) per output token."""
    tokens = p["out_tok_per_s"] * p["duration_s"]
    cpu = p.get("front_cpu_s")
    return None if cpu is None or not tokens else cpu / tokens * 1e6


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def goals(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """The issue's goals: (goal, passed, detail). None = not measured."""
    gpu = result["meta"].get("gpu") is not None
    need = 1.0 if gpu else 0.97
    out: list[tuple[str, bool | None, str]] = []
    # A failed request frees its client worker at once (closed loop), so a server that fails
    # some can keep its tok/s, and its TTFT counts the answered only: no verdict stands on that.
    # An invalid answer cut at max_tokens is the model's (dummy weights), any other the server's.
    served = [p for p in result["points"] if p["target"] in ("vllm", "gateway")]
    if served:
        bad = [
            f"{p['target']} {p['mix']} c={p['concurrency']} pass {p.get('pass', 1)}: "
            f"{p.get('failed') or 0:.0f} failed, {_wrong(p):.0f} invalid"
            for p in served
            if p.get("failed") or _wrong(p)
        ]
        out.append(
            (
                "every request answered at every point, and no invalid answer but those cut at max_tokens",
                not bad,
                "; ".join(bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
                or f"{len(served)} points",
            )
        )
    ratios = [(r["mix"], r["concurrency"], r["tok_ratio"]) for r in rows if r.get("tok_ratio") is not None]
    if ratios:
        worst = min(ratios, key=lambda t: t[2])
        out.append(
            (
                f"gateway tok/s >= {need:.2f}x vLLM at every point",
                all(t[2] >= need for t in ratios),
                f"worst {worst[2]:.3f} ({worst[0]} c={worst[1]})",
            )
        )
        # With several passes per server: is each shortfall larger than the passes' spread?
        # Paired passes (drift cancels) where there are, the two means' spread otherwise.
        noisy = [
            (r["mix"], r["concurrency"], *(r.get("tok_ratio_paired") or (r["tok_ratio"], r["tok_ratio_se"])))
            for r in rows
            if r.get("tok_ratio_paired") or r.get("tok_ratio_se")
        ]
        if noisy:
            below = [t for t in noisy if t[2] + 2 * t[3] < need]
            worst = min(noisy, key=lambda t: t[2] + 2 * t[3])
            out.append(
                (
                    f"no point's tok/s ratio is below {need:.2f} by more than 2 standard errors of the passes",
                    not below,
                    f"closest {worst[2]:.3f} ± {worst[3]:.3f} ({worst[0]} c={worst[1]})",
                )
            )
    if gpu:
        for key, limit, label in (
            ("itl_p50_delta_ms", 0.3, "ITL p50"),
            ("ttft_p50_delta_ms", 5.0, "TTFT p50"),
        ):
            vals = [(r["mix"], r["concurrency"], r[key]) for r in rows if r.get(key) is not None]
            if vals:
                worst = max(vals, key=lambda t: t[2])
                out.append(
                    (
                        f"{label} at most +{limit} ms over vLLM",
                        all(t[2] <= limit for t in vals),
                        f"worst {worst[2]:+.2f} ms ({worst[0]} c={worst[1]})",
                    )
                )
    cmax = max(result["meta"]["concurrencies"])
    for target, what in MOONSHOT_BOUNDS:
        of_bound = [
            (r["mix"], r["gateway_of"][target])
            for r in rows
            if r["concurrency"] == cmax and target in r.get("gateway_of", {})
        ]
        if of_bound:
            worst = min(of_bound, key=lambda t: t[1])
            out.append(
                (
                    f"moonshot: gateway tok/s at c={cmax} at least 0.95x {what}",
                    worst[1] >= 0.95,
                    f"worst {worst[1]:.3f} ({worst[0]})",
                )
            )
    out += lora_goals(result, rows, gpu, paired=matched(result["points"])[0])
    rss = [
        r["rss_tree_delta_mb"]
        for r in rows
        if r["concurrency"] == cmax and r.get("rss_tree_delta_mb") is not None
    ]
    if rss:
        out.append(
            (
                f"gateway RSS at most +150 MB over vLLM at c={cmax}",
                max(rss) <= 150,
                f"{max(rss):+.0f} MB (process tree, max over the point)",
            )
        )
    return out


def _wrong(p: dict[str, Any]) -> float:
    """A point's invalid answers that were not cut at ``max_tokens``: the server's, not the model's."""
    return float((p.get("invalid") or 0) - (p.get("invalid_at_length") or 0))


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    rows = compare(result)
    groups = passes(result["points"])
    pts = index(result["points"])
    lines = [
        f"# Gateway vs vLLM's server: {m['date']} on {m['machine']}",
        "",
        f"- versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}",
        f"- machine: {m['host']}" + (f"; GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- model: {m['engine']['model']} (served as `{m['engine']['served_name']}`), dtype {m['engine']['dtype']}, "
        f"load_format {m['engine']['load_format'] or 'weights'}, max_num_seqs {m['engine']['max_num_seqs']}, "
        f"max_num_batched_tokens {m['engine']['max_num_batched_tokens']}, max_model_len {m['engine']['max_model_len']}, "
        f"max_loras {m['engine']['max_loras']}"
        + _cpu_cache(m["engine"])
        + f", {len(m['engine']['adapters'])} random rank-{m['adapter_rank']} adapters",
        f"- shape: {shape_line(m.get('shape', 'plain'))}",
        (
            f"- load: streaming /v1/completions, {m['prompt_tokens']} random prompt tokens, "
            if m.get("client", "").startswith("vllm bench serve")
            else f"- load: streaming /v1/chat/completions, {m['prompt_tokens']} prompt tokens (chat template included), "
        )
        + f"{m['output_tokens']} output tokens"
        f"{' (ignore_eos)' if m.get('shape', 'plain') == 'plain' else ' at most (max_tokens, no ignore_eos)'}, "
        "closed loop at each concurrency; "
        f"requests per point {', '.join(f'c={k}: {v}' for k, v in m['requests'].items())}; {MIX_LINE}",
        f"- client: {m['client']}",
        "",
        "| target | mix | conc | req/s | out tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | TPOT p50 ms | tok/chunk | RSS tree max MB | front CPU µs/tok | fail | invalid (of which cut at max_tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mix in m["mixes"]:
        for c in m["concurrencies"]:
            for t in TARGETS:
                runs = groups.get((t, mix, c), [])
                for p in runs + ([pts[(t, mix, c)]] if len(runs) > 1 else []):
                    name = t if len(runs) == 1 else f"{t} ({p.get('pass', '?')})"
                    lines.append(
                        f"| {name} | {mix} | {c} | {p['req_per_s']:.2f} | {p['out_tok_per_s']:.1f} | "
                        f"{_f(p['ttft_ms_p50'])}/{_f(p['ttft_ms_p99'])} | {_f(p['itl_ms_p50'], '{:.2f}')}/{_f(p['itl_ms_p99'], '{:.2f}')} | "
                        f"{_f(p['tpot_ms_p50'], '{:.2f}')} | {_f(p.get('tokens_per_chunk'), '{:.2f}')} | {_f(p.get('rss_tree_mb_max'), '{:.0f}')} | "
                        f"{_f(front_cpu_us_per_token(p), '{:.0f}')} | {p['failed']:.0f} | {_invalid(p)} |"
                    )
    if any(":" in mix for mix in m["mixes"]):
        at = next(i for i, line in enumerate(lines) if line.startswith("- shape:")) + 1
        shapes = ", ".join(f"{k}: {v}" for k, v in m.get("mix_shapes", {}).items())
        lines.insert(at, f"- shape per mix: {shapes}")
    if m.get("gateway_set"):
        at = next(i for i, line in enumerate(lines) if line.startswith("- model:")) + 1
        lines.insert(at, "- gateway settings: " + ", ".join(f"`--set {kv}`" for kv in m["gateway_set"]))
    lines += ttft_split(m, pts)
    lines += lora_work(m, pts)
    lines += step_shape(m, groups)
    lines += residency(m, pts)
    lines += [
        "",
        "Gateway against vLLM's server (ratio = gateway / vLLM out tok/s; deltas = gateway - vLLM; "
        "ceiling = the faster of the no-HTTP targets that ran):",
        "",
        "| mix | conc | tok/s ratio | ± se (passes) | paired ratio ± se | TTFT p50 Δ ms | ITL p50 Δ ms | TPOT p50 Δ ms | RSS tree Δ MB | RSS front Δ MB | front CPU Δ µs/tok | vLLM/ceiling | gateway/ceiling | ceiling from |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pr = r.get("tok_ratio_paired")
        lines.append(
            f"| {r['mix']} | {r['concurrency']} | {_f(r.get('tok_ratio'), '{:.3f}')} | {_f(r.get('tok_ratio_se'), '{:.3f}')} | "
            f"{'-' if pr is None else f'{pr[0]:.3f} ± {pr[1]:.3f}'} | {_f(r.get('ttft_p50_delta_ms'), '{:+.2f}')} | "
            f"{_f(r.get('itl_p50_delta_ms'), '{:+.3f}')} | {_f(r.get('tpot_p50_delta_ms'), '{:+.3f}')} | "
            f"{_f(r.get('rss_tree_delta_mb'), '{:+.0f}')} | {_f(r.get('rss_front_delta_mb'), '{:+.0f}')} | "
            f"{_f(r.get('front_cpu_us_delta'), '{:+.0f}')} | {_f(r.get('vllm_of_ceiling'), '{:.3f}')} | {_f(r.get('gateway_of_ceiling'), '{:.3f}')} | "
            f"{r.get('ceiling_target', '-')} |"
        )
    if unpaired := [
        f"{r['mix']} c={r['concurrency']}: {', '.join(r['unpaired'])}" for r in rows if r.get("unpaired")
    ]:
        lines += [
            "",
            "Left out of the comparison (the other server ran no such pass): " + "; ".join(unpaired),
        ]
    servers = result.get("servers", {})
    if servers:
        lines += ["", "| target | startup s | RSS after warm-up MB (tree / front) |", "|---|---|---|"]
        for t, s in servers.items():
            idle = s.get("rss_idle") or {}
            lines.append(
                f"| {t} | {_f(s.get('startup_s'), '{:.0f}')} | {_f(idle.get('rss_tree_mb'), '{:.0f}')} / {_f(idle.get('rss_front_mb'), '{:.0f}')} |"
            )
    lines += adapter_lines(result) + cold_lines(result)
    g = goals(result, rows)
    if g:
        lines += ["", "Goals (issue 6):", ""]
        lines += [
            f"- {'PASS' if ok else 'FAIL' if ok is not None else 'n/a'}: {goal} ({detail})"
            for goal, ok, detail in g
        ]
    if result.get("notes"):
        lines += ["", *[f"- note: {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"


MIX_LINE = (
    "mixes: base = base model only, lora4 = a0..a3 round-robin, lora16 = a0..a15 uniformly at random, "
    "lora16z = a0..a15 with Zipf(1.1) popularity (a0 the most popular); MIX:SHAPE = that shape"
)

SHAPE_LINES = {
    "plain": "plain (free text, ignore_eos)",
    "json_schema": "json_schema (response_format json_schema, strict, a 5-field object; "
    "invalid = answers whose content is not that object)",
    "tools": 'tools (one function tool with a 5-field object as parameters, tool_choice "required"; '
    "invalid = answers whose arguments are not that object)",
}


def _invalid(p: dict[str, Any]) -> str:
    if p.get("invalid") is None:
        return "-"
    return f"{p['invalid']:.0f} ({p.get('invalid_at_length', 0):.0f})" if p["invalid"] else "0"


def shape_line(shape: str) -> str:
    return SHAPE_LINES.get(shape, shape)


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def ttft_split(meta: dict[str, Any], pts: dict[tuple[str, str, int], dict[str, Any]]) -> list[str]:
    """Where each server's TTFT and latency go, from the engine's own histograms (means over
    the point): before the engine (HTTP, parsing, templating, tokenizing, the client), then
    the engine (AsyncLLM arrival -> first token, of which scheduler queue and prefill); of
    the whole request, what lies outside the engine's arrival -> finish; and the time per
    output token as the client saw it and as the engine core's clock had it; and the engine's
    steps in the point with their mean tokens (prefill and decode), how full they ran."""
    rows = []
    for mix in meta["mixes"]:
        for c in meta["concurrencies"]:
            for t in ("vllm", "gateway"):
                p = pts.get((t, mix, c))
                if p and p.get("engine_ttft_ms_mean") is not None:
                    rows.append(
                        f"| {t} | {mix} | {c} | {_f(p['ttft_ms_mean'], '{:.2f}')} | "
                        f"{_f(_sub(p['ttft_ms_mean'], p['engine_ttft_ms_mean']), '{:.2f}')} | "
                        f"{_f(p['engine_ttft_ms_mean'], '{:.2f}')} | {_f(p.get('engine_queue_ms_mean'), '{:.2f}')} | "
                        f"{_f(p.get('engine_prefill_ms_mean'), '{:.2f}')} | {_f(p.get('e2e_ms_mean'), '{:.1f}')} | "
                        f"{_f(_sub(p.get('e2e_ms_mean'), p.get('engine_e2e_ms_mean')), '{:.2f}')} | "
                        f"{_f(p.get('tpot_ms_mean'), '{:.3f}')} | {_f(p.get('engine_tpot_ms_mean'), '{:.3f}')} | "
                        f"{_f(p.get('engine_prompt_tokens_mean'), '{:.1f}')} | "
                        f"{_f(_pct(p.get('engine_cached_share')), '{:.1f}')} | "
                        f"{_f(p.get('engine_steps'), '{:.0f}')} | {_f(p.get('engine_tokens_per_step'), '{:.1f}')} |"
                    )
    if not rows:
        return []
    return [
        "",
        "TTFT and latency split (means, ms; the engine's part from its own `vllm:` histograms on /metrics):",
        "",
        "| target | mix | conc | TTFT (client) | before the engine | engine: arrival -> first token | of which queue | of which prefill | latency (client) | outside the engine | TPOT (client) | TPOT (engine) | prompt tokens (engine) | prefix-cached % | engine steps | tokens / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def lora_work(meta: dict[str, Any], pts: dict[tuple[str, str, int], dict[str, Any]]) -> list[str]:
    """`--lora-trace`: what each engine's LoRA worker did in a point (means over passes)."""
    rows = []
    for mix in meta["mixes"]:
        for c in meta["concurrencies"]:
            for t in ("vllm", "gateway"):
                p = pts.get((t, mix, c))
                if p and p.get("lora_steps"):
                    rows.append(
                        f"| {t} | {mix} | {c} | {_f(p['lora_steps'], '{:.0f}')} | "
                        f"{_f(p.get('lora_adapters_per_step'), '{:.2f}')} | {_f(p['lora_activations'], '{:.0f}')} | "
                        f"{_f(p.get('lora_activation_ms_mean'), '{:.2f}')} | {_f(p['lora_activation_s'], '{:.2f}')} | "
                        f"{_f(p['lora_loads'], '{:.0f}')} | {_f(p.get('lora_load_ms_mean'), '{:.2f}')} | "
                        f"{_f(p['lora_load_s'], '{:.2f}')} | {_f(p.get('sched_ms_mean'), '{:.3f}')} | "
                        f"{_f(p.get('sched_waiting_mean'), '{:.1f}')} |"
                    )
    if not rows:
        return []
    return [
        "",
        "LoRA work in the engine (`--lora-trace`; wall time in the engine's loop, an activation's including its wait for queued GPU work):",
        "",
        "| target | mix | conc | steps with LoRA | adapters / step | copies into a GPU slot | ms each | s in all "
        "| loads from disk | ms each | s in all | scheduler ms / step | waiting in the engine / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def step_shape(meta: dict[str, Any], groups: dict[tuple[str, str, int], list[dict[str, Any]]]) -> list[str]:
    """`--lora-trace`: each engine's steps by the tokens they scheduled. Counts are means over
    the passes; lengths and tokens per step are over every step of the passes (each pass's
    mean weighted by its steps), so a size one pass never scheduled still has its length."""
    names = bucket_names()
    rows = []
    for mix in meta["mixes"]:
        for c in meta["concurrencies"]:
            for t in ("vllm", "gateway"):
                ps = [p for p in groups.get((t, mix, c), []) if p.get("step_n")]
                if not ps:
                    continue
                cells = []
                for i in range(len(names)):
                    n = sum(p.get(f"step_b{i}_n") or 0 for p in ps)
                    ms = _weighted(ps, f"step_b{i}_ms", f"step_b{i}_n")
                    mean_n = n / len(ps)  # steps a pass: a size seldom scheduled keeps its fraction
                    cells.append(f"{mean_n:.{0 if mean_n >= 10 else 1}f} x {_f(ms, '{:.2f}')}" if n else "-")
                steps = sum(p["step_n"] for p in ps) / len(ps)
                tokens = _weighted(ps, "step_tokens_mean", "step_n")
                ms = _weighted(ps, "step_ms_mean", "step_n")
                rows.append(
                    f"| {t} | {mix} | {c} | {_f(steps, '{:.0f}')} | {_f(tokens, '{:.1f}')} "
                    f"| {_f(ms, '{:.3f}')} | " + " | ".join(cells) + " |"
                )
    if not rows:
        return []
    return [
        "",
        "Engine steps by the tokens they schedule (`--lora-trace`; a step's length is the wall time from its "
        "schedule to the next one; per bucket: steps x mean ms):",
        "",
        "| target | mix | conc | steps | tokens / step | ms / step | "
        + " | ".join(f"{n} tokens" for n in names)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(names),
        *rows,
    ]


def _weighted(ps: list[dict[str, Any]], key: str, weight: str) -> float | None:
    """The mean of ``key`` over the passes, each weighted by its ``weight`` (a per-pass mean
    over ``weight`` items is then the mean over all of them); None where none has one."""
    pairs = [(p[key], p[weight]) for p in ps if p.get(key) is not None and p.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def residency(meta: dict[str, Any], pts: dict[tuple[str, str, int], dict[str, Any]]) -> list[str]:
    """Where the gateway's adapters were after each point, as its ``/v1/models`` said."""
    rows = []
    for mix in meta["mixes"]:
        for c in meta["concurrencies"]:
            p = pts.get(("gateway", mix, c))
            if p and p.get(residency_key("gpu")) is not None:
                counts = [
                    f"{where} {_f(p[residency_key(where)], '{:.0f}')}"
                    for where in RESIDENCIES
                    if p.get(residency_key(where))
                ]
                rows.append(f"{mix} c={c}: {', '.join(counts) or 'none'}")
    if not rows:
        return []
    return ["", "Gateway adapters by residency after each point (its `/v1/models`): " + "; ".join(rows) + "."]


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    m = result["meta"]
    pts = index(result["points"])
    panels = (
        ("out_tok_per_s", "output tok/s"),
        ("ttft_ms_p50", "TTFT p50 (ms)"),
        ("itl_ms_p50", "ITL p50 (ms)"),
        ("tpot_ms_p50", "TPOT p50 (ms)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    colors = {"vllm": "tab:blue", "gateway": "tab:orange", "ceiling": "tab:gray", "offline": "tab:green"}
    for ax, (key, label) in zip(axes, panels, strict=False):
        for t in TARGETS:
            for mix, style in zip(m["mixes"], ("-", "--"), strict=False):
                xs = [
                    c
                    for c in m["concurrencies"]
                    if (t, mix, c) in pts and pts[(t, mix, c)].get(key) is not None
                ]
                if xs:
                    ax.plot(
                        xs,
                        [pts[(t, mix, c)][key] for c in xs],
                        style,
                        marker="o",
                        color=colors[t],
                        label=f"{t} {mix}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xticks(m["concurrencies"], [str(c) for c in m["concurrencies"]])
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"gateway vs vLLM server vs engine (no HTTP): {m['machine']}, {m['date']}, "
        f"{m['prompt_tokens']}/{m['output_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_reports(result: dict[str, Any], out_dir: Path, png: bool = True) -> None:
    result["comparison"] = compare(result)
    result["goals"] = [
        {"goal": g, "passed": ok, "detail": d} for g, ok, d in goals(result, result["comparison"])
    ]
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    (out_dir / "results.md").write_text(markdown(result))
    if png and not plot(result, out_dir / "results.png"):
        print(
            "matplotlib is missing: no PNG (pip install matplotlib, then run python -m bench.report)",
            flush=True,
        )


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The passes of several runs as one run's: each later run's passes are numbered after
    every pass of the earlier runs (points, and the per-pass server info), the same offset for
    every target, so pass k of one server stays paired with pass k of the other of its run."""
    merged: dict[str, Any] = {**results[0], "points": [], "servers": {}, "notes": []}
    offset = 0  # the highest pass number of any target so far
    for i, r in enumerate(results):
        top = offset
        for p in r["points"]:
            n = p.get("pass", 1) + offset
            merged["points"].append({**p, "pass": n})
            top = max(top, n)
        for label, info in r.get("servers", {}).items():
            target, _, k = label.partition("-")
            n = int(k or 1) + offset
            merged["servers"][target if n == 1 else f"{target}-{n}"] = info
            top = max(top, n)
        offset = top
        merged["notes"] += [f"run {i + 1} ({r['meta'].get('date')}): {n}" for n in r.get("notes", [])]
    merged["meta"] = _merged_meta([r["meta"] for r in results])
    merged["notes"].append(f"merged from {len(results)} runs; meta (versions, gateway sha) of the first")
    merged.pop("comparison", None)
    merged.pop("goals", None)
    return merged


def _merged_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's meta, with every run's mixes, concurrencies and their requests and
    shapes: runs of different points make one report of them all."""
    meta = {**metas[0]}
    mixes = list(dict.fromkeys(mix for m in metas for mix in m.get("mixes", ())))
    meta["mixes"] = mixes
    meta["concurrencies"] = sorted({c for m in metas for c in m.get("concurrencies", ())})
    for key in ("requests", "mix_shapes"):
        meta[key] = {k: v for m in metas for k, v in (m.get(key) or {}).items()}
    per_mix: dict[str, list[int]] = {}
    for m in metas:
        for mix, cs in (m.get("mix_concurrencies") or {}).items():
            per_mix[mix] = sorted({*per_mix.get(mix, []), *cs})
    meta["mix_concurrencies"] = per_mix
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Rewrite results.{md,png} from a results.json, or merge several runs' results into one report."
    )
    parser.add_argument(
        "results", nargs="+", type=Path, help="results.json file(s); with --merge, the runs to merge"
    )
    parser.add_argument("--merge", type=Path, metavar="OUT", help="merge the given runs into OUT/results.*")
    args = parser.parse_args(argv)
    if args.merge:
        out = args.merge
        out.mkdir(parents=True, exist_ok=True)
        write_reports(merge([json.loads(p.read_text()) for p in args.results]), out)
    else:
        if len(args.results) != 1:
            parser.error("one results.json at a time (or --merge OUT A B ...)")
        out = args.results[0].parent
        write_reports(json.loads(args.results[0].read_text()), out)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
