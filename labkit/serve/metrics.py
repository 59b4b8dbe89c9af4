"""`GET /metrics`: the service's state and its latencies in Prometheus' text format, named
and shaped like vLLM's (v1) metrics under a `labkit:` prefix, so a vLLM dashboard needs only
the prefix changed (labkit/serve/README.md, "Metrics", maps each one to its vLLM name).

The engine's gauges and counters (queue, running sequences, KV-cache use, prefix-cache
lookups, preemptions, steps) are read from the engine's newest stats snapshot when Prometheus
scrapes, so they cost nothing between scrapes; while the engine worker restarts they are
absent, not the dead worker's last values, and they start again from 0 with a new worker
(Prometheus' `rate` reads that as a counter reset). Everything else is counted in the front
end, once per request, when the request ends (`Call.finish`, `RequestRecord`): tokens,
finish reasons, and the request's times, the engine's own (queue, prefill, decode: the
numbers Server-Timing reports) and the client's (time to first token, gaps between tokens,
end to end). Each service has its own registry, so several can run in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "labkit:"
OUTCOMES = ("ok", "client_error", "refused", "dropped", "cancelled", "failed")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings
# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so quantiles compare bucket for bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """What the engine's stats snapshot says, read at scrape time."""

    def __init__(self, client, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self):
        stats, labels, model = self.client.stats(), ["model_name"], [self.model_name]
        gauges = {"num_requests_running": ("sequences in the engine's running batch (vLLM counts each of n "
                                           "samples as a request too)", lambda s: s.running),
                  "num_requests_waiting": ("sequences waiting for the engine (queued or preempted)",
                                           lambda s: s.waiting),
                  "kv_cache_usage_perc": ("fraction of the KV pool's blocks in use, 0 to 1",
                                          lambda s: s.blocks_used / s.blocks_total if s.blocks_total else 0.0),
                  "kv_blocks_used": ("KV-cache blocks in use", lambda s: s.blocks_used),
                  "kv_blocks_free": ("KV-cache blocks free", lambda s: s.blocks_free)}
        counters = {"prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                                             lambda s: s.prefix_query_tokens),
                    "prefix_cache_hits": ("prompt tokens found in the prefix cache", lambda s: s.prefix_hit_tokens),
                    "num_preemptions": ("sequences preempted for lack of KV blocks", lambda s: s.preemptions),
                    "engine_steps": ("engine steps run", lambda s: s.steps)}
        for name, (text, read) in gauges.items():
            family = GaugeMetricFamily(PREFIX + name, text, labels=labels)
            if stats is not None:
                family.add_metric(model, read(stats))
            yield family
        for name, (text, read) in counters.items():
            family = CounterMetricFamily(PREFIX + name, text + " (since the engine worker started)", labels=labels)
            if stats is not None:
                family.add_metric(model, read(stats))
            yield family
        restarts = CounterMetricFamily(PREFIX + "engine_restarts", "engine workers started after the first",
                                       labels=labels)
        restarts.add_metric(model, self.client.restarts)
        yield restarts
        hangs = CounterMetricFamily(PREFIX + "engine_hangs", "engine workers killed because they had work "
                                    "and sent nothing for --hang-timeout seconds", labels=labels)
        hangs.add_metric(model, getattr(self.client, "hangs", 0))
        yield hangs


@dataclass
class FinishedRequest:
    """One engine request (one prompt with its n samples) whose output reached the front end."""

    prompt_tokens: int
    generation_tokens: int      # all its samples' tokens
    longest_sample: int         # tokens of its longest sample
    n: int
    max_tokens: int
    e2e: float                  # front-end arrival to the front end holding its output
    queue: float | None         # the engine's times (RequestOutput), as Server-Timing reports them
    prefill: float | None
    decode: float | None


class ServiceMetrics:
    def __init__(self, client, model_name: str = "", max_model_len: int = 1 << 20):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(client, model_name))
        r, m = self.registry, ["model_name"]
        token_buckets = one_two_five(max_model_len)
        self.requests = Counter(PREFIX + "requests", "HTTP requests to the completion routes, by route and "
                                "outcome", m + ["route", "outcome"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of the requests whose prompt was "
                                     "computed (once per prompt, whatever n)", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated and received by the "
                                         "front end", m, registry=r)
        self.success = Counter(PREFIX + "request_success", "samples (choices) ended, by finish reason",
                               m + ["finished_reason"], registry=r)

        def histogram(name, text, buckets):
            return Histogram(PREFIX + name, text, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "front-end arrival to the request's first token",
                              TTFT_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds", "gap between two tokens of one sample, "
                                     "as the front end receives them", TOKEN_GAP_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "a request's decode time / (tokens of "
                              "its longest sample - 1); 0 for one token", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "front-end arrival to the request's output",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "reaching the engine to first being scheduled",
                               REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "first scheduled to first token",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "first token to the last sample's end",
                                REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "first scheduled to the last sample's end "
                                   "(prefill + decode)", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "a request's prompt tokens", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "tokens a request generated "
                                                   "(all its samples)", token_buckets)
        self.params_n = histogram("request_params_n", "a request's n", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "a request's max_tokens", token_buckets)
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        for route in ("completions", "chat", "responses"):
            for outcome in OUTCOMES:
                self.requests.labels(model_name, route, outcome)

    def count(self, route: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.requests.labels(self.model_name, route, outcome).inc()

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.labels(self.model_name).inc(prompt)
        if generated:
            self.generation_tokens.labels(self.model_name).inc(generated)

    def ended(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        self.success.labels(self.model_name, reason).inc()

    def finished(self, r: FinishedRequest) -> None:
        self.e2e.observe(r.e2e)
        self.request_prompt_tokens.observe(r.prompt_tokens)
        self.request_generation_tokens.observe(r.generation_tokens)
        self.params_n.observe(r.n)
        self.params_max_tokens.observe(r.max_tokens)
        queue, prefill, decode = (max(0.0, t) if t is not None else 0.0 for t in (r.queue, r.prefill, r.decode))
        self.queue.observe(queue)
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(prefill + decode)
        self.tpot.observe(decode / (r.longest_sample - 1) if r.longest_sample > 1 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
