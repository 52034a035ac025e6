"""Prometheus metrics of one server, in the app's own CollectorRegistry (no global state).

Two sources:
- what the server sees: requests by route and status (an ASGI middleware), prompt and generated
  tokens, time to first token and inter-token latency (fed by `Generation`), and each stage of
  every request's timeline up to its first token (`timeline.py`, fed by its middleware);
- what the engine knows: prefix-cache queried / hit / evicted tokens, the hit rate, running and
  waiting requests and the KV slot split, the seconds spent in forward passes and in steps (the
  served efficiency: forward seconds over wall seconds), and with an L2 tier its hit tokens,
  bytes written and read, load latency, tokens its write filter turned away and page split; with
  speculation, draft tokens verified and kept per source. A scrape takes a fresh
  `EngineSnapshot` (in the engine thread) and `EngineCollector` exposes it, so engine-side
  values are never stale or racy.

Rule: a scrape that may not see lengths exactly (`--report-cached-tokens` page or none, and no
admin key) gets no family that counts cached or prefilled tokens (their difference over one
request is that request's cached length) and the slot gauges in whole pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.server.snapshot import EngineSnapshot

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# a stage of a timeline lasts from microseconds (a cache match) to seconds (a long prefill)
_STAGE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.015, 0.03, 0.06, 0.125,
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0,
)  # fmt: skip


class ServerMetrics:
    """The metrics of one app. Feed it with the observe_* methods, read it with `render`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "radixlm_requests", "HTTP requests by route and status code",
            ["route", "status"], registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "radixlm_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "radixlm_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.ttft = Histogram(
            "radixlm_time_to_first_token_seconds", "Request arrival to its first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.itl = Histogram(
            "radixlm_inter_token_latency_seconds", "Time between two tokens of one stream",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.stages = Histogram(
            "radixlm_request_stage_seconds",
            "Each stage of a request's timeline up to its first token (server/timeline.py)",
            ["stage"], buckets=_STAGE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.cache_reports = Counter(
            "radixlm_cache_reports", "Requests explained (return_cache_report) by reason",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.cache_lost_tokens = Counter(
            "radixlm_cache_lost_tokens", "Prefill a perfect client would have saved, by reason",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.engine = EngineCollector()
        self.registry.register(self.engine)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    def observe_stages(self, stages: dict[str, float | None]) -> None:
        for stage, seconds in stages.items():
            if seconds is not None:
                self.stages.labels(stage).observe(max(seconds, 0.0))

    def observe_cache_report(self, reason: str, lost_tokens: int) -> None:
        self.cache_reports.labels(reason).inc()
        self.cache_lost_tokens.labels(reason).inc(lost_tokens)

    def render(self, snapshot: EngineSnapshot | None, exact: bool = True, page: int = 1) -> bytes:
        """The text exposition format, with the engine's values as of `snapshot`; without
        `exact`, cached-token families left out and slot counts in whole `page`s."""
        self.engine.snapshot, self.engine.exact, self.engine.page = snapshot, exact, page
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Exposes the latest EngineSnapshot (nothing before the first scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.exact = True  # cached-token families shown, slot counts exact
        self.page = 1

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        stats = s.engine_stats
        round_ = (lambda n: n) if self.exact else (lambda n: n // self.page * self.page)
        if self.exact:
            yield from _hit_metrics(s)
        yield _counter("radixlm_engine_steps", "Forward passes", stats.get("steps", 0))
        yield _counter(
            "radixlm_engine_forward_seconds", "Wall time in forward passes", stats["forward_s"]
        )
        yield _counter(
            "radixlm_engine_step_seconds",
            "Wall time in engine steps (forwards, scheduling, sampling, output)", stats["step_s"],
        )  # fmt: skip
        yield _gauge("radixlm_num_requests_running", "Requests running", s.num_running)
        yield _gauge("radixlm_num_requests_waiting", "Requests waiting", s.num_waiting)
        yield _gauge("radixlm_kv_slots_used", "KV slots not free", round_(s.num_used))
        yield _gauge("radixlm_kv_slots_capacity", "KV slots in the pool", s.capacity)
        slots = GaugeMetricFamily("radixlm_kv_slots", "KV slots by owner", labels=["owner"])
        slots.add_metric(["free"], round_(s.num_free))
        slots.add_metric(["tree"], round_(s.num_tree_tokens))
        slots.add_metric(["in_flight"], round_(s.num_in_flight))
        yield slots
        if s.l2 is not None and self.exact:
            yield from _l2_metrics(s.l2)
        if s.speculation is not None:
            yield from _speculation_metrics(stats, s.speculation)


class RequestCounterMiddleware:
    """Counts every HTTP response by route and status (a pure ASGI middleware: streaming and
    client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"  # bounded label values

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _hit_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """The families that count cached (and so prefilled) tokens."""
    stats = s.engine_stats
    queried, hit = stats.get("prompt_tokens", 0), stats.get("cached_prompt_tokens", 0)
    yield _counter("radixlm_prefix_cache_queried_tokens", "Prompt tokens looked up", queried)
    yield _counter("radixlm_prefix_cache_hit_tokens", "Prompt tokens served from cache", hit)
    yield _gauge(
        "radixlm_prefix_cache_hit_rate", "hit / queried prompt tokens", hit / max(queried, 1)
    )
    evicted = s.cache_stats.get("evicted_tokens")
    if isinstance(evicted, int):
        yield _counter("radixlm_prefix_cache_evicted_tokens", "Tokens evicted", evicted)
    yield _counter("radixlm_prefill_tokens", "Tokens computed in prefill", stats["prefill_tokens"])


def _l2_metrics(l2: dict[str, Any]) -> Iterator[Metric]:
    """The L2 tier's families, from TieredRadixCache.l2_stats()."""
    for key, name, doc in (
        ("hit_tokens", "radixlm_l2_hit_tokens", "Prompt tokens loaded from L2 instead of computed"),
        ("written_bytes", "radixlm_l2_written_bytes", "KV bytes written to L2 pages"),
        ("read_bytes", "radixlm_l2_read_bytes", "KV bytes read back from L2 pages"),
        ("rejected_tokens", "radixlm_l2_rejected_tokens", "Evicted tokens L2 did not write"),
        ("bad_extents", "radixlm_l2_bad_pages", "Pages that failed their check (recomputed)"),
        ("read_timeouts", "radixlm_l2_read_timeouts", "Loads cut short by a slow read"),
        ("evicted_extents", "radixlm_l2_evicted_pages", "Pages L2 evicted to make room"),
    ):
        yield _counter(name, doc, l2[key])
    pages = GaugeMetricFamily("radixlm_l2_pages", "L2 pages by state", labels=["state"])
    pages.add_metric(["free"], l2["num_free_extents"])
    pages.add_metric(["held"], l2["num_tree_extents"])
    yield pages
    buckets, total = [], 0
    for bound, count in l2["load_seconds_buckets"].items():
        total += count
        buckets.append((bound, total))
    hist = HistogramMetricFamily(
        "radixlm_l2_load_seconds", "Time to load a prefix's pages from L2 (read + copy)"
    )
    hist.add_metric([], buckets, sum_value=l2["load_seconds_sum"])
    yield hist


def _speculation_metrics(
    stats: dict[str, int], sources: dict[str, dict[str, int]]
) -> Iterator[Metric]:
    """Draft tokens verified and kept, per source (engine/speculate.py), and the tokens
    sampled: output tokens per engine step is what speculation raises."""
    for key, name, doc in (
        ("drafted", "radixlm_spec_draft_tokens", "Draft tokens verified, by source"),
        ("accepted", "radixlm_spec_accepted_tokens", "Draft tokens the model kept, by source"),
    ):
        family = CounterMetricFamily(name, doc, labels=["source"])
        for source, counts in sources.items():
            family.add_metric([source], counts[key])
        yield family
    yield _counter("radixlm_output_tokens", "Tokens sampled", stats.get("output_tokens", 0))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
