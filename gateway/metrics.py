"""Prometheus metrics and the per-request record behind the access log.

Route labels come only from the catalog (anything else is ``unknown``), status labels
from a fixed set, so cardinality is bounded whatever clients send. vLLM's own metrics
(``vllm:*``) live in the same default registry and are exposed as they are.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

UNKNOWN = "unknown"
RETIRED_KEPT = 64  # route names a reload removed that keep their label (set_routes)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


@dataclass
class RequestRecord:
    """What one request did; filled in as it flows, logged and counted at its end."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    route: str | None = None
    digest: str | None = None
    response_id: str | None = None  # the ``id`` in the response body (``chatcmpl-...``, ``resp_...``)
    engine_id: str | None = None  # the engine's request id, in its own log lines and vLLM's
    stream: bool = False
    status: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of ``prompt_tokens``, those read from the engine's prefix cache
    completion_tokens: int = 0
    first_token_at: float | None = None
    adapter_state: str | None = None  # "cold" / "warm" for a LoRA route (AdapterSlots.start_state)
    disconnected: bool = False
    error: str | None = None  # why a stream that had sent its 200 ended with an error event
    prompt: Any = None
    generation: Any = None  # service.Generation, once the request reached the engine

    def attach(self, gen: Any, stream: bool) -> None:
        self.generation = gen
        self.response_id = self.engine_id = gen.id
        self.route = gen.route.name
        self.digest = gen.route.digest
        self.stream = stream

    def finish(self) -> None:
        if self.disconnected:  # however far it got, even mid-stream after a 200 (README: 499)
            self.status = 499
        gen = self.generation
        if gen is not None:
            self.prompt_tokens = gen.prompt_tokens if gen.reached_engine else 0  # left while queued: none
            self.cached_prompt_tokens = gen.cached_tokens
            self.completion_tokens = gen.completion_tokens
            self.first_token_at = gen.first_token_at
            if gen.error is not None and not self.disconnected:
                # The status line said 200, but the stream ended with an error event: count
                # and log the request as that error, not as a success.
                self.status = gen.error.status_code
                self.error = gen.error.message

    def log_fields(self) -> dict[str, Any]:
        now = time.monotonic()
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "response_id": self.response_id,
            "method": self.method,
            "path": self.path,
            "route": self.route,
            "adapter_digest": self.digest,
            "status": self.status,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": round((self.first_token_at - self.started) * 1000, 2) if self.first_token_at else None,
            "duration_ms": round((now - self.started) * 1000, 2),
            "client_disconnected": self.disconnected,
        }
        if self.engine_id is not None and self.engine_id != self.response_id:  # /v1/responses
            fields["engine_request_id"] = self.engine_id
        if self.error is not None:
            fields["error"] = self.error
        if self.prompt is not None:
            fields["prompt"] = self.prompt
        return fields


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # A registry of our own (an app per test must not clash); vLLM's metrics stay in
        # the default registry and are rendered after ours.
        self.registry = registry = registry or CollectorRegistry()
        self.requests = Counter(
            "gateway_requests",
            "Inference requests by route, status and streaming",
            ["route", "status", "stream"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens by route", ["route"], registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "gateway_cached_prompt_tokens",
            "Prompt tokens read from the engine's prefix cache, by route",
            ["route"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Completion tokens by route", ["route"], registry=registry
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time to first token",
            ["route"],
            buckets=_LATENCY,
            registry=registry,
        )
        self.itl = Histogram(
            "gateway_inter_token_latency_seconds",
            "Gap between streamed engine steps",
            ["route"],
            buckets=_GAP,
            registry=registry,
        )
        self.e2e = Histogram(
            "gateway_request_duration_seconds",
            "End-to-end request latency",
            ["route"],
            buckets=_LATENCY,
            registry=registry,
        )
        # Both read from admission at each scrape: a request holds its prompts x n sequences,
        # and limits.max_inflight bounds sequences (/admin/status shows both too).
        self.inflight = Gauge(
            "gateway_inflight_requests", "Requests admitted and not finished", registry=registry
        )
        self.inflight_sequences = Gauge(
            "gateway_inflight_sequences",
            "Sequences (prompts x n) of the requests admitted and not finished: what "
            "limits.max_inflight and a key's max_concurrency bound",
            registry=registry,
        )
        self.queued = Gauge(
            "gateway_engine_queued_requests",
            "Requests the engine holds but has not finished",
            registry=registry,
        )
        self.rejected = Counter("gateway_admission_rejected", "Requests refused with 429", registry=registry)
        self.reloads = Counter(
            "gateway_adapter_reloads", "Catalog reloads by result", ["result"], registry=registry
        )
        self.adapter_loads = Counter(
            "gateway_adapter_loads", "Adapter loads into the engine by route", ["route"], registry=registry
        )
        self.adapter_load_seconds = Histogram(
            "gateway_adapter_load_seconds",
            "Time to load an adapter into the engine",
            ["route"],
            buckets=_LATENCY,
            registry=registry,
        )
        self.adapter_ttft = Histogram(
            "gateway_adapter_time_to_first_token_seconds",
            "Time to first token on LoRA routes, by whether the adapter was loaded (warm) or not (cold)",
            ["route", "adapter_state"],
            buckets=_LATENCY,
            registry=registry,
        )
        self.adapter_wait = Histogram(
            "gateway_adapter_wait_seconds",
            "Time a LoRA request waited in the gateway for its adapter's turn (0: went at once)",
            ["route"],
            buckets=(0.0, *_LATENCY),
            registry=registry,
        )
        self.adapter_queued = Gauge(
            "gateway_adapter_queued_requests",
            "LoRA requests waiting in the gateway for their adapter's turn",
            registry=registry,
        )
        self.adapter_wait_timeouts = Counter(
            "gateway_adapter_wait_timeouts",
            "LoRA requests sent to the engine after limits.max_adapter_wait_s without their turn",
            ["route"],
            registry=registry,
        )
        # Read from the response store at each scrape; responses.max_bytes bounds the bytes.
        self.responses_stored = Gauge(
            "gateway_responses_stored", "Responses kept in the /v1/responses store", registry=registry
        )
        self.responses_stored_bytes = Gauge(
            "gateway_responses_stored_bytes",
            "Bytes (their JSON) the /v1/responses store keeps: what responses.max_bytes bounds",
            registry=registry,
        )
        # Set at each scrape from AdapterSlots.residency, as /v1/models shows it.
        self.adapters = Gauge(
            "gateway_adapters",
            "LoRA routes by residency: gpu (in a GPU slot), cpu (in the engine's CPU cache only), "
            "loaded (in the engine, slot unknown) or not loaded",
            ["residency"],
            registry=registry,
        )
        self.engine_up = Gauge("gateway_engine_up", "1 while the engine is ready", registry=registry)
        self._current: frozenset[str] = frozenset()
        self._loaded: set[str] = set()  # routes an adapter was loaded for since the last set_routes
        self._retired: dict[str, None] = {}  # names reloads removed, oldest first
        self._routes: frozenset[str] = frozenset()

    def set_routes(self, names: frozenset[str]) -> None:
        """The catalog's routes. A name a reload removed or renamed stays a label for the
        next ``RETIRED_KEPT`` removals, so a request admitted under it is counted under the
        route that served it; older ones lose their series, so weeks of renames do not grow
        ``/metrics`` (the names are the operator's, never a client's)."""
        for name in (self._current | self._loaded) - names:  # a loaded entry may have been rejected
            self._retired[name] = None
        self._loaded = set()
        for name in names:
            self._retired.pop(name, None)
        while len(self._retired) > RETIRED_KEPT:
            self._drop(next(iter(self._retired)))
        self._current = names
        self._routes = names | self._retired.keys()

    def _drop(self, route: str) -> None:
        del self._retired[route]
        if route == UNKNOWN:  # a route named so shares the label of requests no route took
            return
        for counter in (
            self.prompt_tokens,
            self.cached_prompt_tokens,
            self.completion_tokens,
            self.adapter_loads,
            self.adapter_wait_timeouts,
        ):
            counter.remove(route)
        for histogram in (self.ttft, self.itl, self.e2e, self.adapter_load_seconds, self.adapter_wait):
            histogram.remove(route)
        for state in ("cold", "warm"):
            self.adapter_ttft.remove(route, state)
        for status in (*map(str, _STATUSES), "other"):
            for stream in ("true", "false"):
                self.requests.remove(route, status, stream)

    def adapter_loaded(self, route: str, seconds: float) -> None:
        """An adapter loaded for ``route``, before its table is live (a reload's registration):
        labelled by its name, and retired with the others if that table never names it."""
        self.adapter_load_seconds.labels(route).observe(seconds)
        self.adapter_loads.labels(route).inc()
        self._loaded.add(route)

    def route_label(self, name: str | None) -> str:
        return name if name is not None and name in self._routes else UNKNOWN

    def observe(self, record: RequestRecord) -> None:
        route = self.route_label(record.route)
        status = str(record.status) if record.status in _STATUSES else "other"
        self.requests.labels(route, status, "true" if record.stream else "false").inc()
        if record.prompt_tokens:
            self.prompt_tokens.labels(route).inc(record.prompt_tokens)
        if record.cached_prompt_tokens:
            self.cached_prompt_tokens.labels(route).inc(record.cached_prompt_tokens)
        if record.completion_tokens:
            self.completion_tokens.labels(route).inc(record.completion_tokens)
        if record.first_token_at is not None:
            self.ttft.labels(route).observe(record.first_token_at - record.started)
            if record.adapter_state in ("cold", "warm"):
                self.adapter_ttft.labels(route, record.adapter_state).observe(
                    record.first_token_at - record.started
                )
        if record.status == 200:
            self.e2e.labels(route).observe(time.monotonic() - record.started)

    def render(self, queued: Mapping[str, int] | None = None, pinned: Sequence[str] = ()) -> bytes:
        """Ours, then vLLM's with the router view (``router_view``). ``queued``: route -> LoRA
        requests waiting in the gateway for their adapter's turn (None: it schedules none);
        ``pinned``: the routes whose adapter is pinned to a GPU slot."""
        engine = [newest_lora_info(family) for family in REGISTRY.collect()]
        engine += router_view(engine, queued or {}, time.time(), pinned)
        return generate_latest(self.registry) + generate_latest(_Fixed(engine))


LORA_INFO = "vllm:lora_requests_info"


def newest_lora_info(family: Metric) -> Metric:
    """``vllm:lora_requests_info`` with its newest sample only; other families as they are.
    vLLM sets it to the time under labels listing the adapters running and waiting, and never
    removes a label set: every combination of adapters seen, and every ``name@digest`` that a
    hot swap runs under, stayed a series for good (93 after 36 hot swaps in an 18-minute soak,
    one more every few swaps). Only the newest is the engine's state, the one LoRA-affinity
    routers read. The others are dropped from vLLM's gauge too, when it can be found, so its
    memory and each scrape's work stay bounded."""
    if family.name != LORA_INFO or len(family.samples) < 2:
        return family
    newest = max(family.samples, key=lambda s: s.value)
    gauge = getattr(REGISTRY, "_names_to_collectors", {}).get(LORA_INFO)
    if isinstance(gauge, Gauge):
        gauge.clear()  # vLLM updates it on this event loop too: nothing changed since the collect
        gauge.labels(**newest.labels).set(newest.value)
    kept = Metric(family.name, family.documentation, family.type, family.unit)
    kept.samples = [newest]
    return kept


def router_view(
    engine: list[Metric], queued: Mapping[str, int], now: float, pinned: Sequence[str] = ()
) -> list[Metric]:
    """vLLM's queue metrics with the gateway's own LoRA queue added, for LoRA-affinity routers
    (Gateway API Inference Extension, llm-d). Requests waiting here for their adapter's turn
    are in no engine queue, so from ``vllm:num_requests_waiting`` and
    ``vllm:lora_requests_info`` alone a router would take a replica holding them for idle and
    miss their adapters. ``gateway_num_requests_waiting`` is the engine's waiting requests
    plus those; ``gateway_lora_requests_info`` is vLLM's newest info (its value is a time)
    with their routes added to ``waiting_lora_adapters``, and the ``pinned`` routes to
    ``running_lora_adapters``: vLLM names an adapter there only while it runs requests, and
    a pinned one is in a GPU slot, ready, whether or not it does. Nothing while vLLM reports
    neither."""
    families = {family.name: family for family in engine}
    out: list[Metric] = []
    waiting = families.get("vllm:num_requests_waiting")
    if waiting is not None:
        gauge = GaugeMetricFamily(
            "gateway_num_requests_waiting",
            "Requests waiting: in the engine's queue, or in the gateway's for their adapter's turn",
        )
        gauge.add_metric([], sum(s.value for s in waiting.samples) + sum(queued.values()))
        out.append(gauge)
    info = families.get("vllm:lora_requests_info")
    newest = max(info.samples, key=lambda s: s.value, default=None) if info is not None else None
    if newest is not None:
        labels = dict(newest.labels)
        names = [n for n in labels.get("waiting_lora_adapters", "").split(",") if n]
        names += [route for route in queued if route not in names]
        labels["waiting_lora_adapters"] = ",".join(names)
        running = [n for n in labels.get("running_lora_adapters", "").split(",") if n]
        labels["running_lora_adapters"] = ",".join(running + [r for r in pinned if r not in running])
        gauge = GaugeMetricFamily(
            "gateway_lora_requests_info",
            "vLLM's LoRA info (running and waiting adapters, max_lora) with the adapters waiting here",
            labels=list(labels),
        )
        gauge.add_metric(list(labels.values()), now)
        out.append(gauge)
    return out


class _Fixed(Collector):
    """Metric families already collected, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


_STATUSES = {200, 400, 401, 403, 404, 405, 408, 413, 415, 429, 431, 499, 500, 503}
