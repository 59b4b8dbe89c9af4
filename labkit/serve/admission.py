"""Admission control: which requests the service takes, and which it turns away at once.

    --queue-policy unbounded          take everything (the foil: every request waits its turn)
                   bounded            refuse (503) when --max-queue requests already wait (the
                                      default; --max-queue defaults to --max-num-seqs)
                   drop-expired       bounded, and drop a waiting request (503) once it can no
                                      longer finish by its deadline
                   admit-by-estimate  refuse at arrival (503) a request that the service's own
                                      estimate says cannot finish by its deadline

"Waiting" means admitted and not yet given its first token. A request's deadline is its
`deadline_ms` field or `X-Deadline-Ms` header (milliseconds from arrival), or
`--default-deadline-ms`; without one, no deadline applies to it. Refusals happen before any
work and carry `Retry-After`, the estimated time for the queue to drain.

The estimate is learned from the requests the service finishes, on the engine's own clock:
seconds per prompt token of prefill and per output token of decode (moving averages), so a
request's service time is `prefill * prompt + decode * max_tokens`; the queue ahead is the
remaining work of every open request, spread over the engine's concurrent sequences. Under a
change of load it lags (a stale estimate), which chapter 26 measures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

QUEUE_POLICIES = ("unbounded", "bounded", "drop-expired", "admit-by-estimate")


@dataclass
class ServiceEstimator:
    """Moving averages of the engine's prefill and decode times per token."""

    prefill_s_per_token: float = 1e-3
    decode_s_per_token: float = 2e-2
    weight: float = 0.2            # of each new observation
    observed: int = 0

    def observe(self, output) -> None:
        """Learn from a finished `RequestOutput` (engine clock)."""
        start, first, end = output.first_scheduled_time, output.first_token_time, output.finish_time
        if None in (start, first, end):
            return
        prompt = len(output.prompt_token_ids) - output.cached_prompt_tokens
        tokens = max(len(s.token_ids) for s in output.samples)
        w = self.weight if self.observed else 1.0
        if prompt > 0:
            self.prefill_s_per_token += w * ((first - start) / prompt - self.prefill_s_per_token)
        if tokens > 1:
            self.decode_s_per_token += w * ((end - first) / (tokens - 1) - self.decode_s_per_token)
        self.observed += 1

    def service_s(self, prompt_tokens: int, max_tokens: int) -> float:
        return self.prefill_s_per_token * prompt_tokens + self.decode_s_per_token * max_tokens


@dataclass
class Admitted:
    prompt_tokens: int
    max_tokens: int
    arrival: float
    deadline: float | None         # perf_counter time, or None
    tokens_received: int = 0
    started: bool = False


@dataclass
class Refusal:
    status: int                    # 503
    code: str
    message: str
    retry_after: float


@dataclass
class AdmissionControl:
    policy: str = "unbounded"
    max_queue: int = 8
    concurrency: int = 64          # sequences the engine runs at once
    default_deadline_s: float | None = None
    estimator: ServiceEstimator = field(default_factory=ServiceEstimator)
    open: dict[str, Admitted] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {self.policy!r}")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")

    @property
    def waiting(self) -> int:
        return sum(not a.started for a in self.open.values())

    def work_ahead_s(self) -> float:
        """Seconds until the engine gets to a request that arrives now (estimate)."""
        e = self.estimator
        remaining = sum((0 if a.started else e.prefill_s_per_token * a.prompt_tokens)
                        + e.decode_s_per_token * max(0, a.max_tokens - a.tokens_received)
                        for a in self.open.values())
        return remaining / max(1, min(self.concurrency, len(self.open) or 1))

    def deadline_of(self, arrival: float, deadline_s: float | None) -> float | None:
        chosen = deadline_s if deadline_s is not None else self.default_deadline_s
        return None if chosen is None else arrival + chosen

    def consider(self, prompt_tokens: int, max_tokens: int, deadline: float | None,
                 now: float | None = None) -> Refusal | None:
        """A refusal for a request arriving now, or None to admit it."""
        now = time.perf_counter() if now is None else now
        drain = self.work_ahead_s()
        if self.policy in ("bounded", "drop-expired") and self.waiting >= self.max_queue:
            # 503, not 429: the server is full, whoever asks (429 is for a key's own limit)
            return Refusal(503, "queue_full", f"{self.waiting} requests already wait (limit {self.max_queue})",
                           drain)
        if self.policy == "admit-by-estimate" and deadline is not None:
            finish = now + drain + self.estimator.service_s(prompt_tokens, max_tokens)
            if finish > deadline:
                return Refusal(503, "deadline_unreachable",
                               f"estimated to finish {finish - now:.2f} s from now, after its deadline "
                               f"({deadline - now:.2f} s)", drain)
        return None

    def admit(self, request_id: str, prompt_tokens: int, max_tokens: int, deadline: float | None,
              now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.open[request_id] = Admitted(prompt_tokens, max_tokens, now, deadline)

    def token(self, request_id: str) -> None:
        admitted = self.open.get(request_id)
        if admitted is not None:
            admitted.started = True
            admitted.tokens_received += 1

    def done(self, request_id: str, output=None) -> None:
        self.open.pop(request_id, None)
        if output is not None:
            self.estimator.observe(output)

    def older_than(self, seconds: float, now: float | None = None) -> list[str]:
        """Open requests that arrived more than `seconds` ago (--request-timeout)."""
        now = time.perf_counter() if now is None else now
        return [rid for rid, a in self.open.items() if now - a.arrival > seconds]

    def expired(self, now: float | None = None) -> list[str]:
        """Waiting requests that can no longer finish by their deadlines (drop-expired only)."""
        if self.policy != "drop-expired":
            return []
        now = time.perf_counter() if now is None else now
        e = self.estimator
        return [rid for rid, a in self.open.items()
                if not a.started and a.deadline is not None
                and now + e.service_s(a.prompt_tokens, a.max_tokens) > a.deadline]
