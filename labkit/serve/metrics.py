"""`GET /metrics`: the service's state and its latencies in Prometheus' text format.

The engine's gauges and counters (queue, running sequences, KV blocks, prefix-cache hits,
preemptions) are read from the engine's newest stats snapshot when Prometheus scrapes, so
they cost nothing between scrapes. Latencies are measured in the front end, where the
client's clock would be: time to first token from the request's arrival at the route, the
gaps between streamed tokens, and the whole request. Each service has its own registry, so
several can run in one process (tests, notebooks).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OUTCOMES = ("ok", "client_error", "refused", "dropped", "cancelled", "failed")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _EngineCollector:
    def __init__(self, client):
        self.client = client

    def collect(self):
        stats = self.client.stats()
        gauges = {"queue_length": ("requests waiting for the engine", lambda s: s.waiting),
                  "running_sequences": ("sequences the engine is running", lambda s: s.running),
                  "kv_blocks_used": ("KV-cache blocks in use", lambda s: s.blocks_used),
                  "kv_blocks_free": ("KV-cache blocks free", lambda s: s.blocks_free)}
        counters = {"prefix_cache_queries": ("prompt blocks looked up in the prefix cache",
                                             lambda s: s.prefix_queries),
                    "prefix_cache_hits": ("prompt blocks found in the prefix cache", lambda s: s.prefix_hits),
                    "preemptions": ("sequences preempted for lack of KV blocks", lambda s: s.preemptions),
                    "engine_steps": ("engine steps run", lambda s: s.steps)}
        for name, (text, read) in gauges.items():
            family = GaugeMetricFamily(f"labkit_{name}", text)
            if stats is not None:
                family.add_metric([], read(stats))
            yield family
        for name, (text, read) in counters.items():
            family = CounterMetricFamily(f"labkit_{name}", text + " (since the engine worker started)")
            if stats is not None:
                family.add_metric([], read(stats))
            yield family
        restarts = CounterMetricFamily("labkit_engine_restarts", "engine workers restarted after dying")
        restarts.add_metric([], self.client.restarts)
        yield restarts


class ServiceMetrics:
    def __init__(self, client):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(client))
        self.requests = Counter("labkit_requests", "requests answered, by route and outcome",
                                ["route", "outcome"], registry=self.registry)
        self.ttft = Histogram("labkit_time_to_first_token_seconds", "arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("labkit_inter_token_latency_seconds", "gap between a stream's tokens",
                                     buckets=GAP_BUCKETS, registry=self.registry)
        self.e2e = Histogram("labkit_e2e_request_latency_seconds", "arrival to the last byte",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        for route in ("completions", "chat"):
            for outcome in OUTCOMES:
                self.requests.labels(route, outcome)

    def count(self, route: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.requests.labels(route, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
