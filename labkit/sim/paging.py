"""How many sequences fit in a KV budget: contiguous reservation vs paged blocks.

A pure-Python, seeded, iteration-level simulator (chapter 14). Every step, every running
sequence grows by one token (the token it generates). Requests all arrive at the start
and are admitted greedily in arrival order (FCFS): the head of the queue is admitted as
long as memory allows, and admission stops at the first request that does not fit.

Two allocators share a budget of `budget` token slots:

- ``"contiguous"``: a sequence reserves `reserve` slots at admission, enough for any
  prompt plus output, and holds them until it finishes (budget // reserve sequences).
- ``"paged"``: the budget is cut into blocks of `block_size` slots. A sequence gets the
  blocks for its tokens at admission and one more block each time its last block fills.
  When a running sequence needs a block and none is free, the newest running sequence is
  preempted: it gives back all its blocks and goes to the front of the queue, to be
  recomputed (prompt plus the tokens it already generated) when it is admitted again.

Recorded per step: sequences running, tokens stored (prompt + generated, the KV that
exists), slots held (reserved or allocated) and block-table entries. Internal
fragmentation is held minus stored: slots set aside that hold no token.

The second half of the module observes the real engine (`labkit.engine`): block tables
step by step, parallel sampling with shared blocks, preemption, and the paged vs
contiguous token check. Those helpers import torch and the engine lazily.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

ALLOCATORS = ("contiguous", "paged")


@dataclass(frozen=True)
class Request:
    prompt: int  # prompt tokens
    output: int  # tokens to generate


def chat_requests(count: int = 3000, seed: int = 0, cap: int = 1024, **kw) -> list[Request]:
    """`count` chat-like requests (log-normal prompt and output lengths, total <= `cap`),
    from `labkit.bench.workloads.chat_lengths` (prompt median 160, output median 120,
    sigma 0.8 unless given in `kw`)."""
    from labkit.bench.workloads import chat_lengths

    return [Request(p, o) for p, o in chat_lengths(count, seed=seed, cap=cap, **kw)]


class _Seq:
    __slots__ = ("index", "prompt", "output", "generated", "held")

    def __init__(self, index: int, request: Request):
        self.index, self.prompt, self.output = index, request.prompt, request.output
        self.generated = 0  # tokens generated so far (kept across preemption)
        self.held = 0       # blocks (paged) or reservations (contiguous) held now

    @property
    def length(self) -> int:
        return self.prompt + self.generated


@dataclass
class SimResult:
    allocator: str
    budget: int                 # token slots
    block_size: int             # slots per block (contiguous: the reservation)
    requests: int
    steps: int = 0
    finished: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption
    tokens_computed: int = 0    # work: every prompt and output token, plus the recomputed ones
    running: list[int] = field(default_factory=list)   # per step: sequences that grew
    waiting: list[int] = field(default_factory=list)   # per step: requests left in the queue
    stored: list[int] = field(default_factory=list)    # per step: tokens in the cache
    held: list[int] = field(default_factory=list)      # per step: slots reserved/allocated
    entries: list[int] = field(default_factory=list)   # per step: block-table entries

    def _saturated(self) -> list[int]:
        """Steps at which requests were still queued: memory, not demand, set the batch."""
        steps = [i for i, w in enumerate(self.waiting) if w > 0]
        return steps or list(range(self.steps))

    def _mean(self, values: list[float]) -> float:
        idx = self._saturated()
        return statistics.fmean(values[i] for i in idx)

    @property
    def mean_running(self) -> float:
        """Mean concurrent sequences while requests were queued."""
        return self._mean(self.running)

    @property
    def max_running(self) -> int:
        return max(self.running)

    @property
    def utilisation(self) -> float:
        """Mean tokens stored / budget while requests were queued."""
        return self._mean([s / self.budget for s in self.stored])

    @property
    def fragmentation(self) -> float:
        """Mean (slots held - tokens stored) / budget while requests were queued."""
        return self._mean([(h - s) / self.budget for h, s in zip(self.held, self.stored)])

    @property
    def waste_per_sequence(self) -> float:
        """Mean held-but-empty slots per running sequence while requests were queued."""
        return self._mean([(h - s) / r for h, s, r in zip(self.held, self.stored, self.running)])

    @property
    def entries_per_sequence(self) -> float:
        """Mean block-table entries per running sequence while requests were queued."""
        return self._mean([e / r for e, r in zip(self.entries, self.running)])

    def summary(self) -> dict:
        return {"allocator": self.allocator, "block_size": self.block_size, "budget": self.budget,
                "requests": self.requests, "finished": self.finished, "steps": self.steps,
                "mean_running": self.mean_running, "max_running": self.max_running,
                "utilisation": self.utilisation, "fragmentation": self.fragmentation,
                "waste_per_sequence": self.waste_per_sequence,
                "entries_per_sequence": self.entries_per_sequence,
                "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
                "tokens_computed": self.tokens_computed}


def simulate(requests: list[Request], budget: int = 32_768, allocator: str = "paged",
             block_size: int = 16, reserve: int = 1024, max_num_seqs: int | None = None) -> SimResult:
    """Run `requests` (all queued at step 0) to completion; see the module docstring.

    `reserve` is the contiguous reservation per sequence; `block_size` the paged block.
    Raises ValueError if some request can never fit (then no allocator could finish)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    contiguous = allocator == "contiguous"
    unit = reserve if contiguous else block_size
    if unit < 1 or budget < unit:
        raise ValueError(f"a budget of {budget} slots holds no unit of {unit}")
    capacity = budget // unit  # reservations or blocks
    for i, r in enumerate(requests):
        if r.prompt < 1 or r.output < 1:
            raise ValueError(f"request {i}: prompt and output must be at least 1 token")
        need = r.prompt + r.output
        if (contiguous and need > reserve) or (not contiguous and math.ceil(need / unit) > capacity):
            raise ValueError(f"request {i} needs {need} slots, more than one sequence can get")

    result = SimResult(allocator, budget, unit, len(requests))
    waiting = deque(_Seq(i, r) for i, r in enumerate(requests))
    running: list[_Seq] = []
    free, stored = capacity, 0

    def cost(seq: _Seq) -> int:  # units to admit: room for its tokens and the next one
        return 1 if contiguous else math.ceil((seq.length + 1) / unit)

    while waiting or running:
        # admit greedily, in queue order
        while waiting and (max_num_seqs is None or len(running) < max_num_seqs):
            seq = waiting[0]
            need = cost(seq)
            if need > free:
                break
            waiting.popleft()
            free -= need
            seq.held = need
            stored += seq.length
            if seq.generated:
                result.recomputed_tokens += seq.length
            running.append(seq)
        # make room for each running sequence's next token, oldest first
        if not contiguous:
            i = 0
            while i < len(running):
                seq = running[i]
                if seq.length + 1 > seq.held * unit:
                    while free == 0:
                        victim = running.pop()
                        free += victim.held
                        stored -= victim.length
                        victim.held = 0
                        result.preemptions += 1
                        waiting.appendleft(victim)
                        if victim is seq:
                            break
                    if seq.held == 0:
                        break  # seq itself was the newest and was preempted
                    free -= 1
                    seq.held += 1
                i += 1
        # every running sequence generates one token
        for seq in running:
            seq.generated += 1
        stored += len(running)
        held_units = capacity - free
        result.running.append(len(running))
        result.waiting.append(len(waiting))
        result.stored.append(stored)
        result.held.append(held_units * unit)
        result.entries.append(len(running) if contiguous else held_units)
        result.steps += 1
        # finished sequences give their memory back
        still = []
        for seq in running:
            if seq.generated >= seq.output:
                free += seq.held
                stored -= seq.length
                seq.held = 0
                result.finished += 1
            else:
                still.append(seq)
        running = still
    result.tokens_computed = sum(r.prompt + r.output for r in requests) + result.recomputed_tokens
    return result


def block_size_sweep(requests: list[Request], sizes=(1, 8, 16, 32, 64, 128), budget: int = 32_768) -> list[dict]:
    """`simulate` with the paged allocator at each block size: one summary row each."""
    return [simulate(requests, budget, "paged", block_size=b).summary() for b in sizes]


# -- observing the real engine ---------------------------------------------------------------

def trace_block_table(engine, prompt, params, steps: int) -> list[dict]:
    """Add one request to `engine` and step it `steps` times (or until it finishes),
    recording after each step: the sequence's tokens, its block table (physical block ids)
    and the pool's used and free blocks from `engine.stats()`."""
    request_id = engine.add_request(prompt, params)
    seq = engine.requests[request_id].seqs[0]
    rows = []
    for step in range(steps):
        engine.step()
        stats = engine.stats()
        rows.append({"step": step + 1, "tokens": seq.num_tokens, "computed": seq.num_computed_tokens,
                     "block_table": list(seq.block_table), "blocks_used": stats.blocks_used,
                     "blocks_free": stats.blocks_free, "status": seq.status.value})
        if seq.status.done:
            break
    return rows


def parallel_sampling_blocks(model, prompt_ids: list[int], n: int, params, kv_tokens: int = 4096,
                             block_size: int = 16) -> dict:
    """Peak KV blocks used by one request with `n` samples (forked samples share the prompt's
    blocks) vs `n` separate requests of the same prompt, prefix caching off in both so that
    only the fork shares. Also returns copies on write and each sample's tokens."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine

    def run(requests: int, samples: int):
        engine = LLMEngine(model, EngineConfig(block_size=block_size, kv_cache_tokens=kv_tokens,
                                               prefix_caching=False))
        ids = [engine.add_request(prompt_ids, params, n=samples) for _ in range(requests)]
        peak = 0
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
            peak = max(peak, engine.stats().blocks_used)
        stats = engine.stats()
        outs = [engine.release(i) for i in ids]
        return peak, stats, [s.token_ids for o in outs for s in o.samples]

    shared_peak, shared_stats, shared_tokens = run(1, n)
    separate_peak, separate_stats, separate_tokens = run(n, 1)
    return {"n": n, "prompt_tokens": len(prompt_ids), "block_size": block_size,
            "peak_blocks_shared": shared_peak, "peak_blocks_separate": separate_peak,
            "copies_on_write_shared": shared_stats.copies_on_write,
            "copies_on_write_separate": separate_stats.copies_on_write,
            "samples_shared": shared_tokens, "samples_separate": separate_tokens}


def preemption_trace(model, prompts: list, params, kv_tokens: int, block_size: int = 16):
    """Run `prompts` to completion in an engine whose pool holds only `kv_tokens` slots.
    Returns (outputs, transitions with times relative to the first, engine stats)."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(block_size=block_size, kv_cache_tokens=kv_tokens,
                                           prefix_caching=False))
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    t0 = engine.transitions[0][0] if engine.transitions else 0.0
    transitions = [(t - t0, rid, sample, old, new) for t, rid, sample, old, new in engine.transitions]
    return outs, transitions, engine.stats()


def contiguous_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from a plain loop over the model's contiguous KVCache (one sequence,
    no EOS stop): the reference the paged engine must match."""
    return contiguous_reference(model, prompt_ids, max_tokens)[0]


def contiguous_reference(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list]:
    """`contiguous_greedy`'s tokens and, for each, the log-probabilities [vocab] that chose it
    (the reference's scores for the near-tie rule)."""
    from labkit.engine.loop import greedy_decode
    from labkit.experiments.path_agreement import log_probs

    run = greedy_decode(model, prompt_ids, max_tokens, keep_logits=True)
    return run.token_ids, log_probs(run.logits)


def against_contiguous(model, prompts: list[list[int]], outputs: list, max_tokens: int,
                       logit_error: float | None = None):
    """Compare the engine's greedy `outputs` (asked with logprobs) for `prompts` with
    `contiguous_reference` under the near-tie rule (`labkit.experiments.path_agreement`):
    two numerical paths (paged kernels, batched rows, recomputation after preemption against
    a one-sequence loop), so a divergence at a near-tie is excused and counted. Returns the
    `AgreementSummary` (not checked: see `path_agreement.check`)."""
    from labkit.experiments import path_agreement as pa

    return _against(pa, [contiguous_reference(model, p, max_tokens) for p in prompts], outputs,
                    logit_error)


def _against(pa, refs: list, outputs: list, logit_error: float | None):
    return pa.compare([t for t, _ in refs], [o.token_ids for o in outputs], [s for _, s in refs],
                      [pa.engine_scores(o) for o in outputs],
                      pa.LOGIT_ERROR if logit_error is None else logit_error)


def paged_matches_contiguous(model, prompts: list[list[int]], max_tokens: int, kv_tokens: int = 4096,
                             block_size: int = 16, logit_error: float | None = None) -> list[dict]:
    """Generate greedily for all `prompts` in ONE batch of the paged engine and for each
    prompt alone with `contiguous_greedy`; one row per prompt: whether the tokens are equal
    (`same`), the first position where they differ (None if none), and the near-tie rule's
    verdict (`agree`: equal, or parted where the reference's gap was within the tolerance;
    `excused`, the reference's `gap` there, the largest log-probability `error` between the
    paths before it, and the `agreement` itself)."""
    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.experiments import path_agreement as pa
    from labkit.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(block_size=block_size, kv_cache_tokens=kv_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = engine.generate(prompts, params)
    refs = [contiguous_reference(model, p, max_tokens) for p in prompts]
    summary = _against(pa, refs, outs, logit_error)
    rows = []
    for prompt, out, (ref, _), agreement in zip(prompts, outs, refs, summary.sequences):
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), None)
        rows.append({"prompt_tokens": len(prompt), "paged": out.token_ids, "contiguous": ref,
                     "same": out.token_ids == ref, "first_difference": first,
                     "agree": agreement.ok, "excused": agreement.excused, "gap": agreement.margin,
                     "error": agreement.max_score_error, "agreement": agreement})
    return rows


def scaled_chat_requests(count: int, reserve: int, seed: int = 0) -> list[Request]:
    """The chat-like distribution of `chat_requests` scaled to a context of `reserve`
    tokens: medians 160 * reserve / 1024 (prompt) and 120 * reserve / 1024 (output),
    totals capped at `reserve`. At reserve=1024 it is `chat_requests` itself."""
    scale = reserve / 1024
    return chat_requests(count, seed=seed, cap=reserve, prompt_median=max(4, round(160 * scale)),
                         output_median=max(4, round(120 * scale)))


def engine_concurrency(model, prompts: list[list[int]], outputs: list[int], budget: int,
                       reserve: int | None, block_size: int = 16, logprobs: int | None = None,
                       clock=None) -> dict:
    """Run all `prompts` (queued at once, greedy, exactly `outputs[i]` tokens each) through
    an `LLMEngine` with a KV pool of `budget` token slots, reserving `reserve` slots per
    sequence at admission (contiguous style) or none (paged, grow on demand). Records the
    running and waiting sequences and the blocks used after every step. With `logprobs`,
    `scores` holds each request's per-token `top_logprobs` (for the near-tie rule).

    Also the time: `step_s` (each step's wall time from `clock`, `time.perf_counter` by
    default) and `wall_s` (the whole loop). And the work preemption adds: a preempted
    sequence loses the keys and values of every token it had computed and computes them
    again when it comes back. `recomputed_tokens` counts them directly (the computed tokens
    each sequence held just before the step that preempted it), `recomputed_per_step` where
    they were computed again, and `recompute_s` the share of each step's time that its
    recomputed tokens were of its tokens, summed: an attribution by token count (every token
    of a step goes through the same weight products), not a separate measurement."""
    import time

    from labkit.engine.llm_engine import EngineConfig, LLMEngine
    from labkit.engine.scheduler import SchedulerConfig
    from labkit.sampling import SamplingParams

    clock = clock or time.perf_counter
    sched = SchedulerConfig(max_num_seqs=256, max_batched_tokens=512, reserve_tokens=reserve)
    engine = LLMEngine(model, EngineConfig(block_size=block_size, kv_cache_tokens=budget,
                                           prefix_caching=False, scheduler=sched))
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True,
                                                logprobs=logprobs))
           for p, o in zip(prompts, outputs)]
    seqs = [engine.requests[i].seqs[0] for i in ids]
    owed = [0] * len(seqs)  # tokens a preempted sequence has still to compute again
    running, waiting, used, step_s, step_tokens, recomputed = [], [], [], [], [], []
    start = clock()
    while engine.has_unfinished():
        before = [(s.num_computed_tokens, s.preemptions) for s in seqs]
        computed_before = engine.tokens_computed
        t0 = clock()
        engine.step()
        step_s.append(clock() - t0)
        step_tokens.append(engine.tokens_computed - computed_before)
        again = 0
        for k, (seq, (done, preempted)) in enumerate(zip(seqs, before)):
            if seq.preemptions > preempted:
                owed[k] += done  # lost: computed again when it is admitted again
            elif owed[k] and seq.num_computed_tokens > done:
                paid = min(owed[k], seq.num_computed_tokens - done)
                owed[k] -= paid
                again += paid
        recomputed.append(again)
        stats = engine.stats()
        running.append(stats.running)
        waiting.append(stats.waiting)
        used.append(stats.blocks_used)
    wall = clock() - start
    engine.check_invariants()
    stats = engine.stats()
    released = [engine.release(i) for i in ids]
    tokens = [r.token_ids for r in released]
    scores = [list(r.samples[0].top_logprobs) for r in released] if logprobs is not None else None
    queued = [r for r, w in zip(running, waiting) if w > 0] or running
    return {"reserve": reserve, "budget": budget, "block_size": block_size, "steps": stats.steps,
            "running": running, "waiting": waiting, "blocks_used": used,
            "mean_running": statistics.fmean(queued), "max_running": max(running),
            "preemptions": stats.preemptions, "tokens_computed": stats.tokens_computed,
            "recomputed_tokens": sum(recomputed), "recomputed_per_step": recomputed,
            "wall_s": wall, "step_s": step_s, "step_tokens": step_tokens,
            "recompute_s": sum(t * r / n for t, r, n in zip(step_s, recomputed, step_tokens) if n),
            "tokens": tokens, "scores": scores}


def timed_engine_runs(model, prompts: list[list[int]], outputs: list[int], budget: int,
                      reserves: dict, repeats: int, block_size: int = 16,
                      logprobs: int | None = None) -> dict[str, list[dict]]:
    """`engine_concurrency` for each named reservation (name -> `reserve`, None for paged)
    `repeats` times, interleaved (A B A B ...) so that a slow spell of the machine falls on
    both: name -> one result per repeat, in order. Every run asks for the same `logprobs`,
    so that every run does the same work."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs: dict[str, list[dict]] = {name: [] for name in reserves}
    for _ in range(repeats):
        for name, reserve in reserves.items():
            runs[name].append(engine_concurrency(model, prompts, outputs, budget, reserve, block_size,
                                                 logprobs))
    return runs


def timed_summary(name: str, runs: list[dict]) -> dict:
    """One table row for the repeats of one allocator from `timed_engine_runs`: the steps and
    tokens of its first run (every repeat runs the same steps), and the wall time over the
    repeats (median, fastest, slowest), the mean step and the time attributed to recomputed
    tokens (medians)."""
    first, walls = runs[0], [run["wall_s"] for run in runs]
    return {"allocator": name, "steps": first["steps"], "running_while_queued": first["mean_running"],
            "preemptions": first["preemptions"], "tokens_computed": first["tokens_computed"],
            "recomputed_tokens": first["recomputed_tokens"],
            "wall_median_s": statistics.median(walls), "wall_fastest_s": min(walls),
            "wall_slowest_s": max(walls),
            "step_mean_ms": statistics.median(1e3 * run["wall_s"] / run["steps"] for run in runs),
            "recompute_median_s": statistics.median(run["recompute_s"] for run in runs)}
