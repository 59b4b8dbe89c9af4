"""Prefill/decode disaggregation: a discrete-event simulator of two ways to serve requests.

- **Colocated**: `workers` identical engines. A request goes to the engine with the fewest
  unfinished requests and stays there. Each engine runs continuous batching with chunked
  prefill under a token budget, as `labkit.engine.scheduler` does: running sequences first,
  in admission order (one token for a decoding sequence, a chunk of the rest of the prompt
  for a prefilling one), then waiting ones while budget and sequence slots last. A step
  that carries prefill tokens takes longer, so every decode in it waits longer for its token.
- **Disaggregated**: `prefill_workers` engines that only prefill (the step that completes a
  prompt samples the first token, then the request leaves) and `decode_workers` engines that
  only decode. Between them the KV cache of the prompt crosses a link: each prefill worker
  sends over its own link, one transfer at a time (FIFO), and a transfer of `n` bytes takes
  `n / bandwidth` on the link plus `latency` in flight. The request joins the least loaded
  decode worker, in that worker's next step.

A step's duration comes from a `StepTime` model of (prefill tokens in the step, decoding
sequences in the step), fitted to step times of the real engine (`measure_step_times`,
`fit_step_time`). The first token is the one the completing prefill step samples; by
default a client sees it at once (it streams from the prefill worker), so the transfer
shows up in the gap before the second token. With `first_token="after_transfer"` the
prefill worker holds it back until the cache has landed, and the transfer is part of TTFT.

Per request the simulator records every token's time: TTFT (first token - arrival), the
inter-token latencies (ITL, the gaps between consecutive tokens), and whether it met an
`SLO` on both. Goodput is the offered rate times the share of requests that met it.

The real engine's side (step times on a grid of compositions, a saturated run to set
against the simulator) is in `labkit.experiments.engine_steps`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from labkit.util.timing import quantile

FIRST_TOKEN = ("prefill", "after_transfer")


# -- the step-time model ----------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """Seconds of one engine step: base + prefill_token * P + decode_seq * D."""
    base_s: float
    prefill_token_s: float
    decode_seq_s: float

    def __call__(self, prefill_tokens: int, decode_seqs: int) -> float:
        if prefill_tokens < 0 or decode_seqs < 0 or prefill_tokens + decode_seqs == 0:
            raise ValueError(f"a step runs at least one token, not ({prefill_tokens}, {decode_seqs})")
        return self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs


@dataclass(frozen=True)
class StepSample:
    """Measured seconds of steps with `prefill_tokens` prompt tokens and `decode_seqs`
    decoding sequences (every repeat kept)."""
    prefill_tokens: int
    decode_seqs: int
    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def best_s(self) -> float:
        return min(self.samples_s)

    def value(self, statistic: str) -> float:
        return {"best": self.best_s, "median": self.median_s}[statistic]


@dataclass(frozen=True)
class StepFit:
    model: StepTime
    samples: tuple[StepSample, ...]
    statistic: str = "best"

    @property
    def relative_residuals(self) -> list[float]:
        """(model - measured) / measured, one per grid point (the fitted statistic)."""
        return [self.model(s.prefill_tokens, s.decode_seqs) / s.value(self.statistic) - 1
                for s in self.samples]

    @property
    def max_abs_relative(self) -> float:
        return max(abs(r) for r in self.relative_residuals)

    @property
    def rms_relative(self) -> float:
        r = self.relative_residuals
        return math.sqrt(sum(x * x for x in r) / len(r))


def fit_step_time(samples: Sequence[StepSample], statistic: str = "best") -> StepFit:
    """Least squares of the step times on (1, P, D), each point weighted by 1 / its time, so
    that a 20 ms decode step counts as much as a 1 s prefill (relative error).

    `statistic` is what stands for a grid point's repeats: "best" (the fastest; on a machine
    shared with other work the slower repeats are that work, as `labkit.sim.roofline`
    argues for its ceilings) or "median"."""
    import numpy as np

    if len(samples) < 3:
        raise ValueError("three coefficients need at least three grid points")
    t = np.array([s.value(statistic) for s in samples])
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs] for s in samples])
    coef, *_ = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)
    return StepFit(StepTime(*map(float, coef)), tuple(samples), statistic)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache per token: a key and a value vector per KV head per layer."""
    return layers * 2 * kv_heads * head_dim * dtype_bytes


# -- requests, systems, traces ----------------------------------------------------------------
@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_requests(count: int, rate: float, seed: int = 0, **lengths) -> list[SimRequest]:
    """`count` requests with chat-like log-normal lengths (`labkit.bench.workloads.chat_lengths`;
    `lengths` are its keyword arguments) and Poisson arrivals at `rate` per second. The
    lengths depend on the seed only, so every rate serves the same requests, and the arrival
    pattern is the same one stretched or compressed in time."""
    from labkit.bench.workloads import chat_lengths, poisson_arrivals

    pairs = chat_lengths(count, seed=seed, **lengths)
    arrivals = poisson_arrivals(count, rate, seed=seed + 1)
    return [SimRequest(a, p, o) for a, (p, o) in zip(arrivals, pairs)]


@dataclass(frozen=True)
class Batching:
    """Per engine: tokens per step (prefill chunks + decodes) and sequences running at once."""
    max_batched_tokens: int = 512
    max_num_seqs: int = 64


@dataclass(frozen=True)
class Link:
    bandwidth_bytes_s: float = math.inf
    latency_s: float = 0.0

    def occupancy_s(self, nbytes: float) -> float:
        """How long `nbytes` keep the link busy (the next transfer waits that long)."""
        return nbytes / self.bandwidth_bytes_s if nbytes else 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds from the start of a transfer on an idle link to its arrival."""
        return self.occupancy_s(nbytes) + self.latency_s


@dataclass(frozen=True)
class Colocated:
    workers: int = 4
    batching: Batching = field(default_factory=Batching)

    @property
    def name(self) -> str:
        return f"colocated, {self.workers} workers, {self.batching.max_batched_tokens}-token steps"


@dataclass(frozen=True)
class Disaggregated:
    prefill_workers: int = 2
    decode_workers: int = 2
    kv_bytes_per_token: int = 46_080
    link: Link = field(default_factory=Link)
    prefill_batching: Batching = field(default_factory=Batching)
    decode_batching: Batching = field(default_factory=Batching)
    first_token: str = "prefill"

    def __post_init__(self) -> None:
        if self.first_token not in FIRST_TOKEN:
            raise ValueError(f"first_token must be one of {FIRST_TOKEN}, got {self.first_token!r}")

    @property
    def name(self) -> str:
        return f"disaggregated, {self.prefill_workers} prefill + {self.decode_workers} decode"


@dataclass
class RequestTrace:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    token_s: list[float] = field(default_factory=list)  # when the client sees each token
    transfer_s: float = 0.0                              # prefill end to KV landed (queue incl.)

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.arrival_s

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]

    @property
    def max_itl_s(self) -> float:
        gaps = self.itls_s
        return max(gaps) if gaps else 0.0


@dataclass(frozen=True)
class StepRecord:
    worker: str
    start_s: float
    prefill_tokens: int
    decode_seqs: int
    seconds: float


@dataclass
class SimResult:
    system: str
    traces: list[RequestTrace]
    steps: list[StepRecord]

    @property
    def makespan_s(self) -> float:
        return max(t.token_s[-1] for t in self.traces) - min(t.arrival_s for t in self.traces)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(t.output_tokens for t in self.traces) / self.makespan_s


# -- the event loop ---------------------------------------------------------------------------
class _Seq:
    __slots__ = ("index", "prompt", "output", "computed", "emitted")

    def __init__(self, index: int, request: SimRequest):
        self.index, self.prompt, self.output = index, request.prompt_tokens, request.output_tokens
        self.computed = 0  # prompt tokens whose KV exists
        self.emitted = 0   # tokens sampled

    @property
    def pending(self) -> int:
        """Tokens to run before the next token can be sampled (1 once decoding)."""
        return self.prompt - self.computed if self.computed < self.prompt else 1


class _Engine:
    """One worker's continuous-batching scheduler (the rules of labkit.engine.scheduler,
    chunked prefill, no preemption: the KV pool is assumed large enough)."""

    def __init__(self, name: str, batching: Batching):
        self.name, self.batching = name, batching
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.incoming = 0  # requests on their way here (a KV transfer in flight)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + self.incoming

    def plan(self) -> list[tuple[_Seq, int]]:
        budget, plan = self.batching.max_batched_tokens, []
        for seq in self.running:
            if budget <= 0:
                break
            n = min(seq.pending, budget)
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.batching.max_num_seqs:
            seq = self.waiting.popleft()
            n = min(seq.pending, budget)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan


def simulate(system: Colocated | Disaggregated, requests: Sequence[SimRequest],
             step_time: StepTime) -> SimResult:
    """Serve `requests` with `system`; every step's duration from `step_time`."""
    for r in requests:
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ValueError("every request needs at least one prompt and one output token")
    disagg = isinstance(system, Disaggregated)
    if disagg:
        prefill = [_Engine(f"P{i}", system.prefill_batching) for i in range(system.prefill_workers)]
        decode = [_Engine(f"D{i}", system.decode_batching) for i in range(system.decode_workers)]
        link_free = [0.0] * len(prefill)
    else:
        prefill = decode = [_Engine(f"W{i}", system.batching) for i in range(system.workers)]
    engines = prefill + decode if disagg else prefill
    traces = [RequestTrace(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests]
    steps: list[StepRecord] = []
    events: list = []
    order = itertools.count()
    for i, r in enumerate(requests):
        heapq.heappush(events, (r.arrival_s, next(order), "arrive", i, None))
    plans: dict[int, list[tuple[_Seq, int]]] = {}

    def least_loaded(pool: list[_Engine]) -> int:
        return min(range(len(pool)), key=lambda k: (pool[k].load, k))

    def hand_off(now: float, w: int, seq: _Seq) -> None:
        d = least_loaded(decode)
        decode[d].incoming += 1
        nbytes = system.kv_bytes_per_token * seq.prompt
        start = max(now, link_free[w])
        link_free[w] = start + system.link.occupancy_s(nbytes)
        landed = link_free[w] + system.link.latency_s
        traces[seq.index].transfer_s = landed - now
        if system.first_token == "after_transfer":
            traces[seq.index].token_s[0] = landed
        heapq.heappush(events, (landed, next(order), "landed", d, seq))

    def finish_step(now: float, e: int) -> None:
        engine = engines[e]
        engine.busy = False
        is_prefill_worker = disagg and e < len(prefill)
        for seq, n in plans.pop(e):
            if seq.computed < seq.prompt:
                seq.computed += n
                if seq.computed < seq.prompt:
                    continue  # a chunk: no token yet
            seq.emitted += 1
            traces[seq.index].token_s.append(now)
            if seq.emitted >= seq.output:
                engine.running.remove(seq)
            elif is_prefill_worker:
                engine.running.remove(seq)
                hand_off(now, e, seq)

    def start_idle(now: float) -> None:
        for e, engine in enumerate(engines):
            if engine.busy or not (engine.running or engine.waiting):
                continue
            plan = engine.plan()
            p = sum(n for seq, n in plan if seq.computed < seq.prompt)
            d = sum(1 for seq, _ in plan if seq.computed >= seq.prompt)
            took = step_time(p, d)
            steps.append(StepRecord(engine.name, now, p, d, took))
            plans[e] = plan
            engine.busy = True
            heapq.heappush(events, (now + took, next(order), "step", e, None))

    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # everything that happens at `now`, then steps
            _, _, kind, key, seq = heapq.heappop(events)
            if kind == "arrive":
                prefill[least_loaded(prefill)].waiting.append(_Seq(key, requests[key]))
            elif kind == "step":
                finish_step(now, key)
            else:  # landed: the KV is in the decode worker's pool
                decode[key].incoming -= 1
                decode[key].waiting.append(seq)
        start_idle(now)
    return SimResult(system.name, traces, steps)


def solo_token_times(system: Colocated | Disaggregated, prompt_tokens: int, output_tokens: int,
                     step_time: StepTime) -> list[float]:
    """Closed form for one request alone in an idle system, from its arrival: the prompt in
    chunks of the token budget, then one decode step of one sequence per further token (plus
    the transfer, once, in the disaggregated system)."""
    batching = system.prefill_batching if isinstance(system, Disaggregated) else system.batching
    chunk, left, t = batching.max_batched_tokens, prompt_tokens, 0.0
    while left > 0:
        t += step_time(min(chunk, left), 0)
        left -= chunk
    times = [t]
    if isinstance(system, Disaggregated) and output_tokens > 1:
        t += system.link.transfer_s(system.kv_bytes_per_token * prompt_tokens)
        if system.first_token == "after_transfer":
            times[0] = t
    for _ in range(output_tokens - 1):
        t += step_time(0, 1)
        times.append(t)
    return times



def solo_check(system: Colocated | Disaggregated, prompt_tokens: int, output_tokens: int,
               step_time: StepTime, rel: float = 1e-9) -> dict:
    """One request through `simulate` against `solo_token_times`: TTFT and mean time per
    later token from each, and whether every token time agrees (to `rel`)."""
    got = simulate(system, [SimRequest(0.0, prompt_tokens, output_tokens)], step_time).traces[0]
    want = solo_token_times(system, prompt_tokens, output_tokens, step_time)
    per = (lambda ts: (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else 0.0)
    return {"system": system.name, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "ttft_sim_s": got.ttft_s, "ttft_closed_s": want[0],
            "per_token_sim_s": per(got.token_s), "per_token_closed_s": per(want),
            "equal": len(got.token_s) == len(want) and all(
                math.isclose(a, b, rel_tol=rel) for a, b in zip(got.token_s, want))}

# -- objectives and goodput -------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """Per request: TTFT <= ttft_s and its largest inter-token gap <= itl_s."""
    ttft_s: float
    itl_s: float

    def met(self, trace: RequestTrace) -> bool:
        return trace.ttft_s <= self.ttft_s and trace.max_itl_s <= self.itl_s

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and every gap between tokens <= {1e3 * self.itl_s:g} ms"


def summarize(result: SimResult, slo: SLO, rate: float, **extra) -> dict:
    """One row: latency quantiles, the share that met `slo`, and goodput = rate x that share."""
    traces = result.traces
    met = sum(slo.met(t) for t in traces)
    gaps = [g for t in traces for g in t.itls_s]
    return {**extra, "system": result.system, "rate_rps": rate, "requests": len(traces),
            "ttft_p50_s": quantile([t.ttft_s for t in traces], 0.5),
            "ttft_p99_s": quantile([t.ttft_s for t in traces], 0.99),
            "itl_p50_s": quantile(gaps, 0.5), "itl_p99_s": quantile(gaps, 0.99),
            "max_itl_p50_s": quantile([t.max_itl_s for t in traces], 0.5),
            "transfer_p50_s": quantile([t.transfer_s for t in traces], 0.5),
            "slo_met": met, "attainment": met / len(traces), "goodput_rps": rate * met / len(traces)}


def rate_sweep(systems: Sequence[Colocated | Disaggregated], rates: Sequence[float],
               count: int, step_time: StepTime, slo: SLO, seed: int = 0, **lengths) -> list[dict]:
    """`summarize` for every system at every rate, on the same requests (`poisson_requests`)."""
    rows = []
    for rate in rates:
        requests = poisson_requests(count, rate, seed, **lengths)
        rows += [summarize(simulate(s, requests, step_time), slo, rate) for s in systems]
    return rows


def best_rate(rows: Sequence[dict], system: str, attainment: float = 0.9) -> float:
    """The highest swept rate at which `system` met the SLO for at least `attainment` of its
    requests (0 if none): the per-system goodput of a service that promises `attainment`."""
    ok = [r["rate_rps"] for r in rows if r["system"] == system and r["attainment"] >= attainment]
    return max(ok, default=0.0)



def scaled_slo(step_time: StepTime, itl_steps: float = 3.0, ttft_prompt: int = 512,
               ttft_steps: float = 4.0) -> SLO:
    """An SLO in this machine's own units: every gap at most `itl_steps` decode steps of one
    sequence, TTFT at most `ttft_steps` prefill steps of a `ttft_prompt`-token prompt
    (rounded to the millisecond and the tenth of a second)."""
    return SLO(ttft_s=round(ttft_steps * step_time(ttft_prompt, 0), 1),
               itl_s=round(itl_steps * step_time(0, 1), 3))


def link_sweep(base: Disaggregated, requests: Sequence[SimRequest], rate: float,
               step_time: StepTime, slo: SLO, bandwidths: Sequence[float]) -> list[dict]:
    """`summarize` of `base` with its link at every bandwidth (latency kept) and each way
    of releasing the first token, on the same requests."""
    from dataclasses import replace

    rows = []
    for first in FIRST_TOKEN:
        for bw in bandwidths:
            system = replace(base, link=replace(base.link, bandwidth_bytes_s=bw), first_token=first)
            rows.append(summarize(simulate(system, requests, step_time), slo, rate,
                                  bandwidth_bytes_s=bw, first_token=first))
    return rows


def slowest_winning_link(rows: Sequence[dict], first_token: str, floor: float) -> float | None:
    """The lowest swept bandwidth at which, and at every faster one, goodput stayed above
    `floor` (a colocated pool's goodput): how slow a link may get before the split stops
    paying. None if even the fastest link does not beat `floor`."""
    ok = None
    for row in sorted((r for r in rows if r["first_token"] == first_token),
                      key=lambda r: -r["bandwidth_bytes_s"]):
        if row["goodput_rps"] <= floor:
            break
        ok = row["bandwidth_bytes_s"]
    return ok

def saturation_requests(prompts: Sequence[Sequence[int]], outputs: Sequence[int]) -> list[SimRequest]:
    """The same workload for the simulator: every request arrives at 0."""
    return [SimRequest(0.0, len(p), o) for p, o in zip(prompts, outputs)]
