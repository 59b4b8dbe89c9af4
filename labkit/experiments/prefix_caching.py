"""Prefix caching, measured: what the block hashes share, how often a cache of a given size
hits, how much faster a hit is, and what a second tenant can learn from that speed.

Chapter 16 runs these against :class:`labkit.engine.block_manager.BlockManager` (the prefix
cache itself) and :class:`labkit.engine.llm_engine.LLMEngine` (the engine around it):

* :func:`block_hashes`: the chained hash of every full block of a prompt.
* :func:`shared_prefix_workload`: many requests that begin with one of a handful of shared
  prefixes (system prompts, few-shot examples), chosen by a Zipf law, each followed by a
  unique suffix.
* :func:`simulate_hit_rate` / :func:`hit_rate_sweep`: replay a workload on a bare
  ``BlockManager`` (no model) at a given pool size and count the prompt tokens served from
  the cache.
* :func:`cached_after_shared_prefix`: how many tokens a follow-up finds cached when it
  shares ``n`` tokens with an earlier prompt (only full blocks are cached).
* :func:`prefix_ttft`: time to first token of a follow-up after a cached prefix vs the same
  prompt on an engine that caches nothing.
* :func:`probe_trials`: the timing side channel. Tenant A sends a secret prefix; tenant B
  times a probe that starts with the right guess and one that starts with a wrong guess.
* :func:`prob_slower`, :func:`pairwise_wins`: the probe statistics; :func:`sign_test_p` and
  :func:`paired_reading`: the paired count read as a sign test.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence as Seq

from labkit.util.timing import Timing, measure
from labkit.engine.block_manager import BlockManager, chain_hash
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams


# -- the hashes -------------------------------------------------------------------------------

def block_hashes(token_ids: Seq[int], block_size: int = 16, salt: str | None = None) -> list[str]:
    """Hex digests of the chained hashes of the full blocks of ``token_ids`` (a trailing
    partial block has none), computed with the block manager's own ``chain_hash``."""
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size]), salt)
        out.append(parent.hex())
    return out


# -- workloads and the hit-rate simulation ------------------------------------------------------

@dataclass(frozen=True)
class PrefixWorkload:
    prompts: list[list[int]]
    prefix_index: list[int]        # which shared prefix each request starts with
    prefix_lengths: list[int]      # tokens of each shared prefix
    tenants: list[int]             # which tenant sent each request

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self) -> dict:
        lengths = [len(p) for p in self.prompts]
        return {"requests": len(self), "prefixes": len(self.prefix_lengths),
                "prefix_tokens": list(self.prefix_lengths), "prompt_tokens_total": sum(lengths),
                "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
                "tenants": len(set(self.tenants))}


def zipf_weights(k: int, alpha: float) -> list[float]:
    """Probabilities of ranks 1..k under a Zipf law with exponent ``alpha`` (0: uniform)."""
    raw = [1.0 / (r ** alpha) for r in range(1, k + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def shared_prefix_workload(num_requests: int, prefix_lengths: Seq[int], suffix_range: tuple[int, int],
                           *, alpha: float = 1.0, tenants: int = 1, vocab: int = 49_152,
                           seed: int = 0) -> PrefixWorkload:
    """``num_requests`` prompts, each one of the shared prefixes (random token ids of the given
    lengths; prefix ``r`` is drawn with Zipf probability of rank ``r + 1``) followed by a unique
    random suffix of ``suffix_range`` tokens (inclusive); each request's tenant is uniform in
    ``range(tenants)``. Random ids stand in for text: the cache only compares ids."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in prefix_lengths]
    weights = zipf_weights(len(prefixes), alpha)
    prompts, index, owners = [], [], []
    for _ in range(num_requests):
        k = rng.choices(range(len(prefixes)), weights)[0]
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(*suffix_range))]
        prompts.append(prefixes[k] + suffix)
        index.append(k)
        owners.append(rng.randrange(tenants))
    return PrefixWorkload(prompts, index, list(prefix_lengths), owners)


@dataclass
class HitRate:
    num_blocks: int
    block_size: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    did_not_fit: int = 0          # prompts larger than the whole pool (served without the cache)
    evictions: int = 0
    per_request: list[int] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("per_request")
        d["hit_rate"] = self.hit_rate
        return d


_PARAMS = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def simulate_hit_rate(prompts: Seq[Seq[int]], num_blocks: int, block_size: int = 16, *,
                      salts: Seq[str | None] | None = None, output_tokens: int = 0,
                      in_flight: int = 1, seed: int = 0) -> HitRate:
    """Replay ``prompts`` in order on a ``BlockManager`` of ``num_blocks`` blocks, the way the
    engine drives it, without running a model: look up the prompt's cached full blocks
    (``allocate_prompt``), take blocks for the rest, mark the prompt computed and register its
    full blocks, append ``output_tokens`` unique generated tokens (also registered, as the
    engine does), and release the request when it finishes.

    Up to ``in_flight`` requests hold their blocks at once (the oldest finishes when a new one
    arrives, or earlier if the pool cannot hold the newcomer). A prompt that needs more blocks
    than the whole pool cannot run in this pool: it is counted in ``did_not_fit`` with no hit.
    ``num_blocks == 0`` means no cache at all: every prompt is a miss. ``salts[i]`` scopes
    request ``i`` (None: the shared scope)."""
    total = sum(len(p) for p in prompts)
    result = HitRate(num_blocks, block_size, len(prompts), total, 0)
    if num_blocks == 0:
        result.did_not_fit = len(prompts)
        result.per_request = [0] * len(prompts)
        return result
    rng = random.Random(seed)
    manager = BlockManager(num_blocks, block_size, prefix_caching=True)
    held: list[Sequence] = []
    for i, prompt in enumerate(prompts):
        while len(held) >= in_flight:
            manager.free(held.pop(0))
        need = -(-(len(prompt) + output_tokens) // block_size)
        if need > num_blocks:
            result.did_not_fit += 1
            result.per_request.append(0)
            continue
        seq = Sequence(i, str(i), list(prompt), _PARAMS, cache_salt=salts[i] if salts else None)
        hit = manager.allocate_prompt(seq)
        while not manager.can_grow(seq, len(prompt)) and held:
            manager.free(held.pop(0))
        manager.grow(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        manager.register_full_blocks(seq)
        if output_tokens:
            # generated tokens: ids beyond any vocabulary, so they never match a prompt
            seq.token_ids += [1_000_000 + rng.randrange(1 << 30) for _ in range(output_tokens)]
            while not manager.can_grow(seq, seq.num_tokens) and held:
                manager.free(held.pop(0))
            manager.grow(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens - 1  # the last token is never run
            manager.register_full_blocks(seq)
        held.append(seq)
        result.cached_tokens += hit
        result.per_request.append(hit)
    for seq in held:
        manager.free(seq)
    manager.check([])
    result.evictions = manager.counters.evictions
    return result


def hit_rate_sweep(workload: PrefixWorkload, sizes: Seq[int], block_size: int = 16, *,
                   scoped: bool = False, output_tokens: int = 0, in_flight: int = 1) -> list[HitRate]:
    """:func:`simulate_hit_rate` of ``workload`` at every pool size in ``sizes``; with
    ``scoped`` each tenant gets its own cache scope (salt ``"tenant-<n>"``)."""
    salts = [f"tenant-{t}" for t in workload.tenants] if scoped else None
    return [simulate_hit_rate(workload.prompts, n, block_size, salts=salts, output_tokens=output_tokens,
                              in_flight=in_flight) for n in sizes]


def ideal_hit_rate(workload: PrefixWorkload, block_size: int = 16, *, scoped: bool = False) -> float:
    """The hit rate of an unbounded cache: every request after the first with the same prefix
    (and, with ``scoped``, the same tenant) finds the full blocks of that prefix, but never its
    own last prompt token (the engine always computes at least one token)."""
    seen: set = set()
    cached = 0
    for prompt, k, t in zip(workload.prompts, workload.prefix_index, workload.tenants):
        key = (k, t) if scoped else k
        if key in seen:
            cached += min(workload.prefix_lengths[k], len(prompt) - 1) // block_size * block_size
        seen.add(key)
    return cached / sum(len(p) for p in workload.prompts)


def cached_after_shared_prefix(shared: int, total: int, block_size: int = 16, vocab: int = 1000) -> int:
    """Tokens a second ``total``-token prompt finds cached when its first ``shared`` tokens equal
    those of a first ``total``-token prompt that has run (the rest differs)."""
    rng = random.Random(shared * 7919 + total)
    first = [rng.randrange(vocab) for _ in range(total)]
    second = first[:shared] + [vocab + rng.randrange(vocab) for _ in range(total - shared)]
    return simulate_hit_rate([first, second], num_blocks=4 * (-(-total // block_size)),
                             block_size=block_size).per_request[1]


# -- the engine: time to first token ----------------------------------------------------------

def first_token_seconds(engine, prompt: Seq[int], cache_salt: str | None = None) -> tuple[float, int]:
    """(seconds from submitting ``prompt`` to its first token, prompt tokens found cached)
    for one greedy one-token request on ``engine`` (which must be idle)."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    request_id = engine.add_request(list(prompt), params, cache_salt=cache_salt)
    while not engine.requests[request_id].done:
        engine.step()
    seconds = time.perf_counter() - t0
    return seconds, engine.release(request_id).cached_prompt_tokens


def _slices(ids: Seq[int], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` non-overlapping slices of ``length`` tokens of ``ids``, in random order."""
    starts = list(range(0, len(ids) - length + 1, length))
    if len(starts) < count:
        raise ValueError(f"{len(ids)} tokens hold only {len(starts)} slices of {length}")
    random.Random(seed).shuffle(starts)
    return [list(ids[s:s + length]) for s in starts[:count]]


@dataclass
class PrefixTTFT:
    warm: Timing          # follow-up after the prefix was cached
    cold: Timing          # the same prompts on an engine that caches nothing
    prefix_tokens: int
    follow_tokens: int
    cached_tokens: list[int]

    @property
    def ratio(self) -> float:
        return self.warm.median / self.cold.median

    def to_dict(self) -> dict:
        return {"warm": self.warm.to_dict(), "cold": self.cold.to_dict(), "ratio": self.ratio,
                "prefix_tokens": self.prefix_tokens, "follow_tokens": self.follow_tokens,
                "cached_tokens": self.cached_tokens}


def prefix_ttft(model, ids: Seq[int], *, prefix_tokens: int = 512, follow_tokens: int = 32,
                trials: int = 10, warmup: int = 2, kv_cache_tokens: int = 4096, seed: int = 0) -> PrefixTTFT:
    """Time to first token of ``prefix + follow-up`` with ``prefix`` cached, vs the same
    prompts on an engine without prefix caching (an empty cache: the whole prompt is computed).

    The prefix is cut from ``ids`` and sent once (untimed) to the caching engine; every timed
    call then uses a fresh ``follow_tokens`` follow-up, so it hits the prefix's full blocks and
    nothing more. Both engines take the whole prompt in one step (``max_batched_tokens`` is
    larger than the prompt). Timed with :func:`labkit.util.timing.measure`."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.engine.scheduler import SchedulerConfig

    sched = SchedulerConfig(max_batched_tokens=max(512, 2 * (prefix_tokens + follow_tokens)))
    pieces = _slices(ids, 1 + warmup + trials, max(prefix_tokens, follow_tokens), seed)
    prefix, follows = pieces[0][:prefix_tokens], [p[:follow_tokens] for p in pieces[1:]]
    prompts = [prefix + f for f in follows]
    results = {}
    for name, caching in (("cold", False), ("warm", True)):
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=kv_cache_tokens, prefix_caching=caching,
                                               scheduler=sched))
        if caching:
            first_token_seconds(engine, prefix)
        queue, cached = iter(prompts), []
        results[name] = measure(lambda: cached.append(first_token_seconds(engine, next(queue))[1]),
                                name=f"{name} TTFT", repeats=trials, warmup=warmup)
        results[name + "_cached"] = cached[warmup:]
        del engine
    return PrefixTTFT(results["warm"], results["cold"], prefix_tokens, follow_tokens, results["warm_cached"])


# -- the side channel ---------------------------------------------------------------------------

@dataclass
class ProbeTrials:
    right: Timing         # B's probe that starts with A's secret
    wrong: Timing         # B's probe that starts with a document nobody sent
    right_cached: list[int]
    wrong_cached: list[int]
    scoped: bool

    def to_dict(self) -> dict:
        return {"right": self.right.to_dict(), "wrong": self.wrong.to_dict(), "scoped": self.scoped,
                "right_cached": self.right_cached, "wrong_cached": self.wrong_cached,
                "pairwise_wins": pairwise_wins(self.wrong.samples, self.right.samples),
                "prob_wrong_slower": prob_slower(self.wrong.samples, self.right.samples)}


def probe_trials(model, ids: Seq[int], *, trials: int = 40, warmup: int = 2, secret_tokens: int = 512,
                 question_tokens: int = 32, scoped: bool = False, kv_cache_tokens: int = 4096,
                 seed: int = 1) -> ProbeTrials:
    """Tenant A and tenant B share one engine. In each trial A sends a fresh secret document
    followed by its own question; then B sends two probes, each a candidate document followed by
    B's question: the right guess (A's document) and a wrong one (a document nobody has sent),
    in an order that alternates between trials. Each probe's time to first token is one
    sample (a probe changes the cache, so it cannot be repeated: the repetition is over trials;
    the first ``warmup`` trials are dropped). With ``scoped`` each tenant has its own cache
    scope (``cache_salt`` "tenant-A" / "tenant-B"), otherwise both share the default scope."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.engine.scheduler import SchedulerConfig

    import torch

    n = warmup + trials
    docs = _slices(ids, 2 * n, secret_tokens, seed)
    questions = _slices(ids[::-1], 2 * n, question_tokens, seed + 1)   # reversed text: never a document
    sched = SchedulerConfig(max_batched_tokens=max(512, 2 * (secret_tokens + question_tokens)))
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=kv_cache_tokens, scheduler=sched))
    salt_a, salt_b = ("tenant-A", "tenant-B") if scoped else (None, None)
    right, wrong, right_cached, wrong_cached = [], [], [], []
    for i in range(n):
        secret, decoy = docs[2 * i], docs[2 * i + 1]
        first_token_seconds(engine, secret + questions[2 * i], salt_a)           # tenant A
        order = [("right", secret), ("wrong", decoy)]
        if i % 2:
            order.reverse()
        for kind, doc in order:
            seconds, cached = first_token_seconds(engine, doc + questions[2 * i + 1], salt_b)
            if i >= warmup:
                (right if kind == "right" else wrong).append(seconds)
                (right_cached if kind == "right" else wrong_cached).append(cached)
    threads = torch.get_num_threads()
    return ProbeTrials(Timing("probe, right guess", right, warmup, threads),
                       Timing("probe, wrong guess", wrong, warmup, threads), right_cached, wrong_cached, scoped)


def prob_slower(a: Seq[float], b: Seq[float]) -> float:
    """P(a sample of ``a`` is slower than a sample of ``b``) over all pairs, ties counting
    one half (the Mann-Whitney statistic U / (len(a) len(b)); 0.5: indistinguishable,
    1.0: every ``a`` is slower than every ``b``)."""
    if not a or not b:
        raise ValueError("both samples must be non-empty")
    wins = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    return wins / (len(a) * len(b))


def prob_slower_interval(a: Seq[float], b: Seq[float], confidence: float = 0.95,
                         resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of :func:`prob_slower`: resample each set of samples
    with replacement (seeded, so the same samples give the same interval) and take the
    central `confidence` share of the resampled probabilities."""
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1)")
    rng = random.Random(seed)
    values = sorted(prob_slower(rng.choices(list(a), k=len(a)), rng.choices(list(b), k=len(b)))
                    for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = values[int(tail * (resamples - 1))]
    high = values[int(round((1.0 - tail) * (resamples - 1)))]
    return low, high


def coin_toss_reading(low: float, high: float) -> str:
    """Words for an interval of :func:`prob_slower` (wrong-guess probe against right-guess
    probe): whether it contains 0.5 (the two kinds of probe indistinguishable), and if not,
    on which side it lies."""
    if low <= 0.5 <= high:
        return "consistent with a coin toss"
    if low > 0.5:
        return "above a coin toss: the right guess was still the faster probe"
    return "below a coin toss: the right guess was the slower probe"


def pairwise_wins(a: Seq[float], b: Seq[float]) -> int:
    """Trials ``i`` in which ``a[i]`` is slower than ``b[i]`` (paired samples of one trial)."""
    if len(a) != len(b):
        raise ValueError("paired samples must have equal lengths")
    return sum(x > y for x, y in zip(a, b))


def sign_test_p(a: Seq[float], b: Seq[float]) -> float:
    """Two-sided exact sign test of paired samples ``a[i]``, ``b[i]`` (one trial each): the
    probability, were each trial's pair equally likely to fall either way round, of a count
    of "``a`` slower" at least as far from half the trials as the one seen. Ties are dropped
    (they say nothing about the direction); 1.0 when every pair ties."""
    if len(a) != len(b):
        raise ValueError("paired samples must have equal lengths")
    slower = sum(x > y for x, y in zip(a, b))
    faster = sum(x < y for x, y in zip(a, b))
    n = slower + faster
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(max(slower, faster), n + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)


def paired_reading(wrong: Seq[float], right: Seq[float], level: float = 0.05) -> str:
    """Words for :func:`sign_test_p` of paired probes (``wrong[i]``, ``right[i]``: the two
    probes of trial ``i``), a clause that follows the count: whether the count is
    consistent with a coin toss at ``level``, and if not, which probe was the slower more
    often than chance alone would make it."""
    p = sign_test_p(wrong, right)
    head = f"a two-sided sign test of that count gives p = {p:.2g}"
    if p >= level:
        return (f"{head}, consistent with a coin toss: the pairs, which cancel the drift "
                f"between trials, see no difference beyond chance")
    slower = "wrong" if pairwise_wins(wrong, right) > pairwise_wins(right, wrong) else "right"
    return (f"{head}, below {level:g}: the pairs, which cancel the drift between trials "
            f"that the all-pairs figure cannot, see the {slower} guess slower more often "
            f"than chance alone would make it")


def threshold_accuracy(slow: Seq[float], fast: Seq[float]) -> tuple[float, float]:
    """(threshold, accuracy) of the best single-threshold rule "slower than t: not cached" over
    the pooled samples (fit and scored on the same samples, so an optimistic figure)."""
    values = sorted(set(slow) | set(fast))
    candidates = [values[0] - 1.0] + [(x + y) / 2 for x, y in zip(values, values[1:])] + [values[-1] + 1.0]
    best = (candidates[0], -1.0)
    for t in candidates:
        correct = sum(x > t for x in slow) + sum(y <= t for y in fast)
        acc = correct / (len(slow) + len(fast))
        if acc > best[1]:
            best = (t, acc)
    return best
