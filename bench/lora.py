"""The load's mixes (which model each request names), per-adapter statistics, the
starvation check, and the cold-adapter probe.

Mixes:

- ``base``: the base model only;
- ``lora4``: ``a0``..``a3`` round-robin;
- ``lora16``: ``a0``..``a15``, each request picks one at random (uniform popularity);
- ``lora16z``: the same 16 with Zipf(1.1) popularity (``a0`` the most popular,
  P(a_k) proportional to 1 / (k + 1)^1.1): a few hot adapters and a long tail.

A mix may name a request shape after a colon (``base:json_schema``, ``lora4:tools``), so one
run (one server start) can measure several shapes; a mix without one uses ``--shape``.
The random mixes draw from ``random.Random(seed)``: the same seed gives the same
sequence on both servers' passes, and each point's seed differs.

Per adapter, over one point: requests, mean and p99 TTFT. No adapter is *starved* when
every adapter's mean TTFT is within ``STARVE_FACTOR`` of the point's overall mean.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np

ADAPTERS = tuple(f"a{i}" for i in range(16))  # what make_adapters writes and both servers route
LORA_MIXES = ("lora4", "lora16", "lora16z")
MIXES = ("base", *LORA_MIXES)
MANY = ("lora16", "lora16z")  # more adapters than GPU slots: the profile's lora16_max_loras
ZIPF_S = 1.1
STARVE_FACTOR = 3.0


def split_mix(mix: str, default_shape: str) -> tuple[str, str]:
    """``lora4:tools`` -> (``lora4``, ``tools``); ``lora4`` -> (``lora4``, default_shape)."""
    models, _, shape = mix.partition(":")
    if models not in MIXES:
        raise ValueError(f"unknown mix {models!r} (one of {', '.join(MIXES)})")
    return models, shape or default_shape


def zipf_weights(n: int, s: float = ZIPF_S) -> list[float]:
    """P(rank k) for k = 1..n, proportional to 1 / k^s, summing to 1."""
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def mix_models(mix: str, n: int, seed: int, served_name: str) -> list[str]:
    """The model name of each of ``n`` requests of a point (or warm-up) of ``mix``."""
    models, _, _ = mix.partition(":")
    if models == "base":
        return [served_name] * n
    if models == "lora4":
        return [ADAPTERS[i % 4] for i in range(n)]
    rng = random.Random(seed)
    if models == "lora16":
        return [rng.choice(ADAPTERS) for _ in range(n)]
    if models == "lora16z":
        return rng.choices(ADAPTERS, weights=zipf_weights(len(ADAPTERS)), k=n)
    raise ValueError(f"unknown mix {mix!r}")


def mix_adapters(mix: str) -> tuple[str, ...]:
    """The adapters a mix can name (none for ``base``)."""
    models = mix.partition(":")[0]
    return () if models == "base" else ADAPTERS[:4] if models == "lora4" else ADAPTERS


# -- per-adapter statistics -------------------------------------------------------------
def per_adapter(results: Iterable[Any]) -> dict[str, dict[str, float | int | None]]:
    """For each model named by the results (``RequestResult.model``): requests sent, those
    that completed, mean and p99 TTFT in ms over the completed ones."""
    groups: dict[str, list[Any]] = {}
    for r in results:
        groups.setdefault(r.model, []).append(r)
    out: dict[str, dict[str, float | int | None]] = {}
    for name in sorted(groups, key=_adapter_order):
        ttft = [r.ttft for r in groups[name] if r.ok and r.ttft is not None]
        out[name] = {
            "requests": len(groups[name]),
            "completed": len(ttft),
            "ttft_ms_mean": float(np.mean(ttft)) * 1000 if ttft else None,
            "ttft_ms_p99": float(np.percentile(ttft, 99)) * 1000 if ttft else None,
        }
    return out


def starvation(stats: dict[str, dict[str, Any]], overall_mean_ms: float | None) -> dict[str, Any]:
    """Which adapters' mean TTFT exceeds ``STARVE_FACTOR`` x the point's overall mean (an
    adapter none of whose requests completed counts as starved), and the worst ratio."""
    if not stats or not overall_mean_ms:
        return {"starved": [], "worst_ttft_ratio": None, "worst_adapter": None}
    ratios = {
        name: (s["ttft_ms_mean"] / overall_mean_ms if s["ttft_ms_mean"] is not None else float("inf"))
        for name, s in stats.items()
    }
    worst = max(ratios, key=lambda k: ratios[k])
    return {
        "starved": [name for name, r in ratios.items() if r > STARVE_FACTOR],
        "worst_ttft_ratio": ratios[worst],
        "worst_adapter": worst,
    }


def adapter_fields(results: list[Any], mix: str, overall_mean_ms: float | None) -> dict[str, Any]:
    """The per-adapter part of a point's record (nothing for the base mix)."""
    if not mix_adapters(mix):
        return {}
    stats = per_adapter(results)
    return {"per_adapter": stats, **starvation(stats, overall_mean_ms)}


def _adapter_order(name: str) -> tuple[int, str]:
    return (int(name[1:]), name) if name[:1] == "a" and name[1:].isdigit() else (1 << 30, name)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- cold adapters ------------------------------------------------------------------------
COLD_ADAPTERS = ADAPTERS[:4]  # registered first: evicted from the engine's LRU cache by a4..a15


def cold_probe(
    base_url: str, api_key: str, served_name: str, maker: Any, seed: int, max_tokens: int
) -> dict[str, Any]:
    """TTFT of the first request to an adapter the server has not run yet (cold) and of the
    next request to it (warm), one request at a time, for each of ``COLD_ADAPTERS``. Run
    on a fresh server before any warm-up; one base-model request goes first, so the
    engine's own first-request costs are not counted as the adapter's.

    Both servers register every adapter at start (vLLM's ``--lora-modules``, the gateway's
    catalog), each adding it to the engine's CPU cache of ``max_cpu_loras`` (= max_loras on
    both, given explicitly: the gateway would size it to the catalog) entries, in order: a0..a3 have been evicted by the later ones, so their first request
    loads them from disk on either server. The gateway's catalog here has no ``preload``."""
    from bench.client import Job, drive, run_loop

    failed: list[str] = []  # an adapter with a failed request is left out of the medians: said here

    def one(model: str, k: int, what: str) -> float | None:
        jobs = [Job(model, maker.content(seed + k))]
        (res,), _ = run_loop(drive(base_url, jobs, 1, max_tokens, api_key, "plain"))
        if not res.ok or res.ttft is None:
            failed.append(f"{model} {what}: {res.error or 'no output'}"[:200])
            return None
        return float(res.ttft * 1000)

    one(served_name, 0, "base")
    cold: list[float] = []
    warm: list[float] = []
    for i, name in enumerate(COLD_ADAPTERS):
        c, w = one(name, 2 * i + 1, "cold"), one(name, 2 * i + 2, "warm")
        if c is not None and w is not None:
            cold.append(c)
            warm.append(w)
    return {
        "adapters": list(COLD_ADAPTERS),
        "cold_ttft_ms": cold,
        "warm_ttft_ms": warm,
        "cold_ttft_ms_median": median(cold),
        "warm_ttft_ms_median": median(warm),
        "failed": failed,
        "preload": False,
    }


# -- report: per-adapter tables, cold TTFT, goal lines -----------------------------------
def _by_point(points: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for p in points:
        if p.get("per_adapter"):
            groups.setdefault((p["target"], p["mix"], p["concurrency"]), []).append(p)
    return groups


def adapter_means(ps: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per adapter, over the passes of one (target, mix, c): requests summed, mean TTFT and
    p99 TTFT averaged over the passes that completed some of its requests."""
    out: dict[str, dict[str, float | None]] = {}
    names = sorted({a for p in ps for a in p["per_adapter"]}, key=_adapter_order)
    for name in names:
        stats = [p["per_adapter"][name] for p in ps if name in p["per_adapter"]]
        means = [s["ttft_ms_mean"] for s in stats if s["ttft_ms_mean"] is not None]
        p99s = [s["ttft_ms_p99"] for s in stats if s["ttft_ms_p99"] is not None]
        out[name] = {
            "requests": float(sum(s["requests"] for s in stats)),
            "ttft_ms_mean": statistics.fmean(means) if means else None,
            "ttft_ms_p99": statistics.fmean(p99s) if p99s else None,
        }
    return out


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def adapter_lines(result: dict[str, Any]) -> list[str]:
    """Per adapter at each LoRA point: requests, mean and p99 TTFT of each server (mean of
    its passes), the p99 ratio, and each pass's starvation check."""
    groups = _by_point(result["points"])
    keys = sorted({(m, c) for (_, m, c) in groups}, key=lambda k: (result["meta"]["mixes"].index(k[0]), k[1]))
    if not keys:
        return []
    lines = [
        "",
        f"Per adapter (TTFT ms; mean over passes; starved = an adapter whose mean TTFT is over "
        f"{STARVE_FACTOR:g}x the point's mean):",
    ]
    for mix, c in keys:
        v = adapter_means(groups.get(("vllm", mix, c), []))
        g = adapter_means(groups.get(("gateway", mix, c), []))
        lines += [
            "",
            f"{mix} c={c}: "
            + "; ".join(
                f"{p['target']} pass {p.get('pass', 1)}: worst {_f(p.get('worst_ttft_ratio'), '{:.2f}')}x "
                f"({p.get('worst_adapter')}), starved {', '.join(p.get('starved') or []) or 'none'}"
                for t in ("vllm", "gateway")
                for p in groups.get((t, mix, c), [])
            ),
            "",
            "| adapter | requests vLLM / gw | mean vLLM | mean gw | p99 vLLM | p99 gw | p99 gw/vLLM |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in sorted(set(v) | set(g), key=_adapter_order):
            a, b = v.get(name, {}), g.get(name, {})
            ratio = (
                b["ttft_ms_p99"] / a["ttft_ms_p99"]
                if a.get("ttft_ms_p99") and b.get("ttft_ms_p99") is not None
                else None
            )
            lines.append(
                f"| {name} | {_f(a.get('requests'))} / {_f(b.get('requests'))} | {_f(a.get('ttft_ms_mean'))} | "
                f"{_f(b.get('ttft_ms_mean'))} | {_f(a.get('ttft_ms_p99'))} | {_f(b.get('ttft_ms_p99'))} | "
                f"{_f(ratio, '{:.2f}')} |"
            )
    return lines


def cold_lines(result: dict[str, Any]) -> list[str]:
    """The cold-adapter probe of each server start: median TTFT cold and warm."""
    rows = [
        f"| {label} | {', '.join(c['adapters'])} | {_f(c['cold_ttft_ms_median'], '{:.1f}')} | "
        f"{_f(c['warm_ttft_ms_median'], '{:.1f}')} | {' / '.join(f'{x:.0f}' for x in c['cold_ttft_ms'])} | "
        f"{' / '.join(f'{x:.0f}' for x in c['warm_ttft_ms'])} |"
        for label, info in result.get("servers", {}).items()
        if (c := info.get("cold"))
    ]
    if not rows:
        return []
    failed = [
        f"{label}: {'; '.join(c['failed'])}"
        for label, info in result.get("servers", {}).items()
        if (c := info.get("cold")) and c.get("failed")
    ]
    return [
        "",
        "Cold adapters (each fresh server, before any warm-up, one request at a time: a base request, then "
        "per adapter its first request (cold: loaded from disk) and its second (warm); no `preload` in the "
        "gateway's catalog):",
        "",
        "| server | adapters | cold TTFT median ms | warm TTFT median ms | cold each | warm each |",
        "|---|---|---|---|---|---|",
        *rows,
        *(
            [
                "",
                "Cold probe requests that failed (their adapter is left out of the medians): "
                + "; ".join(failed),
            ]
            if failed
            else []
        ),
    ]


def lora_goals(
    result: dict[str, Any], rows: list[dict[str, Any]], gpu: bool, paired: list[dict[str, Any]] | None = None
) -> list[tuple[str, bool | None, str]]:
    """Issue 17's goals for the 16-adapter mixes (and lora4 at the top concurrency). ``paired``:
    the points of the passes both servers ran (``report.matched``), for the comparisons; the
    starvation line judges every gateway pass."""
    out: list[tuple[str, bool | None, str]] = []
    many = [r for r in rows if r["mix"].partition(":")[0] in MANY and r.get("tok_ratio") is not None]
    if many and gpu:
        worst = min(many, key=lambda r: r["tok_ratio"])
        detail = f"worst {worst['tok_ratio']:.3f} ({worst['mix']} c={worst['concurrency']})"
        # The goal fixes max_loras on both servers; a gateway given its own slots is another row.
        meta = result["meta"]
        own = [kv for kv in meta.get("gateway_set", []) if kv.startswith("engine.max_loras=")]
        if meta.get("max_loras_set") and meta["max_loras_set"] != meta.get("lora16_max_loras"):
            own.insert(0, f"--max-loras {meta['max_loras_set']} on both servers")
        out.append(
            (
                "lora16 mixes: gateway tok/s >= 1.5x vLLM at every point",
                None if own else all(r["tok_ratio"] >= 1.5 for r in many),
                f"{detail}; not judged: the run set {' and '.join(own)}, the goal's mix fixes max_loras "
                "on both servers at the profile's"
                if own
                else detail,
            )
        )
    groups = _by_point(result["points"] if paired is None else paired)
    worse: list[tuple[float, str]] = []
    compared = 0
    for (t, mix, c), ps in groups.items():
        if t != "gateway" or mix.partition(":")[0] not in MANY:
            continue
        v, g = adapter_means(groups.get(("vllm", mix, c), [])), adapter_means(ps)
        for name, b in g.items():
            a = v.get(name, {})
            if a.get("ttft_ms_p99") and b["ttft_ms_p99"] is not None:
                compared += 1
                worse.append((b["ttft_ms_p99"] / a["ttft_ms_p99"], f"{name} {mix} c={c}"))
    if worse:
        top = max(worse)
        out.append(
            (
                "lora16 mixes: every adapter's TTFT p99 no worse than vLLM's",
                top[0] <= 1.0,
                f"{sum(r > 1.0 for r, _ in worse)} of {compared} worse; worst {top[0]:.2f}x ({top[1]})",
            )
        )
    mine = [
        p
        for (t, m, _), ps in _by_point(result["points"]).items()
        if t == "gateway" and m.partition(":")[0] in MANY
        for p in ps
    ]
    if mine:
        starved = [
            f"{p['mix']} c={p['concurrency']} pass {p.get('pass', 1)}: {p['starved']}"
            for p in mine
            if p["starved"]
        ]
        out.append(
            (
                f"lora16 mixes: no adapter starved on the gateway (mean TTFT within {STARVE_FACTOR:g}x the point's)",
                not starved,
                "; ".join(starved)
                or f"worst {max(p['worst_ttft_ratio'] or 0 for p in mine):.2f}x over {len(mine)} points",
            )
        )
    cmax = max(result["meta"]["concurrencies"])
    top4 = [
        r for r in rows if r["mix"] == "lora4" and r["concurrency"] == cmax and r.get("tok_ratio") is not None
    ]
    if top4 and gpu:
        r = top4[0]
        itl = r.get("itl_p50_delta_ms")
        out.append(
            (
                f"lora4 at c={cmax}: gateway tok/s >= 1.0x vLLM and ITL p50 at most +0.3 ms",
                r["tok_ratio"] >= 1.0 and itl is not None and itl <= 0.3,
                f"{r['tok_ratio']:.3f}x, ITL p50 {_f(itl, '{:+.2f}')} ms",
            )
        )
    return out
