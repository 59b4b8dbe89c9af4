"""Prefill and decode, measured: the two phases of a request and how they interfere.

A request runs in two phases:

- **prefill**: one forward pass over the whole prompt, which fills the KV cache and gives
  the logits of the first new token. Its time, together with tokenizing, allocating the
  cache and choosing the first token, is the *time to first token* (TTFT);
- **decode**: one forward pass per further token, each reading the whole cache.

Chapter 9 measures both with this module::

    from labkit.experiments import prefill_decode as phases
    ids = phases.eval_prompt_ids(model.tokenizer, 4096)
    phases.ttft_curve(model, [16, 256, 4096], ids=ids)        # TTFT vs prompt length
    phases.decode_curve(model, [16, 1024, 4096], ids=ids)     # ms per token vs position
    phases.phase_shares(model, [16, 1000], [4, 64], ids=ids)  # share of each phase
    phases.two_request_timeline(model, ids[:16], ids[:2048], chunk=256)

The last one is a *preview of the scheduler of Part III*: a tiny engine loop that serves two
requests by running one forward pass at a time, round-robin, with no batching. It shows
that a long prompt's prefill, run as one pass, stalls every other request for its whole
duration (head-of-line blocking), and that prefilling the long prompt in chunks, with the
other request's decode steps interleaved, bounds the stall by one chunk's time. Our model
supports chunked prefill as it is: each call appends its tokens to the same KV cache.

Every timing of a callable goes through :func:`labkit.util.timing.measure`; the
two-request timeline is a trace (timestamps of one run), like the stage timings of
:func:`labkit.engine.loop.generate`.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

from labkit.util.compare import MIN_SAMPLES, compare
from labkit.util.timing import measure, measure_interleaved

PREFILL, DECODE = "prefill", "decode"


# -- prompts -----------------------------------------------------------------------------

def eval_prompt_ids(tokenizer, n_tokens: int, text: str | None = None) -> list[int]:
    """The first `n_tokens` token ids of the book's evaluation text (or of `text`).

    Only a prefix of the text is tokenized (about six characters per token is plenty for
    English prose); raises if the text is too short.
    """
    if text is None:
        from labkit.eval import eval_text

        text = eval_text()
    chars = 6 * n_tokens + 256
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > n_tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, {n_tokens} were asked for")
    return list(ids[:n_tokens])


def greedy(logits: torch.Tensor) -> int:
    """The id of the highest logit of the last position (the first token chosen)."""
    return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())


def default_schedule(length: int) -> tuple[int, int]:
    """(warmup, repeats) for a TTFT of `length` tokens: fewer repeats when one call is long,
    never fewer than `labkit.util.compare` needs to judge a difference."""
    if length <= 512:
        return 1, 5
    return 1, MIN_SAMPLES


# -- TTFT vs prompt length ---------------------------------------------------------------

def ttft_once(model, text: str, reply_budget: int = 64) -> dict:
    """One time to first token for a text prompt, stage by stage (seconds).

    tokenize -> allocate a KV cache for prompt + `reply_budget` tokens -> prefill -> choose
    the first token (greedy). Returns the stages' seconds, their sum `ttft_s`, the prompt's
    token count and the first token.
    """
    t0 = time.perf_counter()
    ids = model.tokenizer.encode(text)
    t1 = time.perf_counter()
    cache = model.new_cache(1, len(ids) + reply_budget)
    t2 = time.perf_counter()
    logits = model(torch.tensor([ids]), cache=cache, last_only=True)
    t3 = time.perf_counter()
    token = greedy(logits)
    t4 = time.perf_counter()
    return {"tokens": len(ids), "first_token": token, "tokenize_s": t1 - t0,
            "alloc_s": t2 - t1, "prefill_s": t3 - t2, "sample_s": t4 - t3, "ttft_s": t4 - t0}


def ttft_curve(model, lengths: Sequence[int], repeats: int | None = None, *,
               ids: Sequence[int] | None = None,
               schedule: Callable[[int], tuple[int, int]] = default_schedule,
               reply_budget: int = 64) -> list[dict]:
    """TTFT against prompt length: one record per length.

    The prompt of length n is the text of the first n token ids of `ids` (default: the
    evaluation text), so it is tokenized inside the timed call as a server would. `repeats`
    overrides the schedule's repeats (warm-up stays). Each record has the median TTFT and
    its quartiles (`measure`), the median of every stage, and `tokens` (the prompt's
    length as re-tokenized: it can differ from n by a token at the cut).
    """
    lengths = list(lengths)
    ids = list(ids) if ids is not None else eval_prompt_ids(model.tokenizer, max(lengths))
    records = []
    for n in lengths:
        text = model.tokenizer.decode(ids[:n])
        warmup, reps = schedule(n)
        reps = repeats or reps
        runs: list[dict] = []
        timing = measure(lambda: runs.append(ttft_once(model, text, reply_budget)),
                         name=f"ttft {n}", repeats=reps, warmup=warmup)
        runs = runs[warmup:]  # the timed calls only
        record = {"length": n, "tokens": runs[0]["tokens"], **timing.to_dict()}
        for stage in ("tokenize_s", "alloc_s", "prefill_s", "sample_s"):
            record[stage] = statistics.median(r[stage] for r in runs)
        records.append(record)
    return records


def loglog_slopes(lengths: Sequence[float], seconds: Sequence[float]) -> list[dict]:
    """Slope of log(time) against log(length) between neighbouring points.

    A slope of 1 is linear growth (time doubles when the length doubles), 2 is quadratic,
    near 0 is a fixed cost that the length does not change.
    """
    out = []
    for (n0, t0), (n1, t1) in zip(zip(lengths, seconds), zip(lengths[1:], seconds[1:])):
        out.append({"from": n0, "to": n1, "slope": math.log(t1 / t0) / math.log(n1 / n0)})
    return out


def fit_linear_quadratic(lengths: Sequence[float], seconds: Sequence[float]) -> dict:
    """Least-squares fit of time = a + b n + c n^2 (a, b, c >= 0 by clipping negatives
    to zero and refitting the rest). Returns a, b, c and a function-free summary: the
    quadratic term's share of the fitted time at the largest length."""
    n = torch.tensor(lengths, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    columns = {"a": torch.ones_like(n), "b": n, "c": n * n}
    active = list(columns)
    while True:
        X = torch.stack([columns[k] for k in active], dim=1)
        coef = torch.linalg.lstsq(X, t[:, None]).solution[:, 0]
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(coef.argmin()))
    fit = {k: 0.0 for k in columns} | {k: float(v) for k, v in zip(active, coef)}
    top = float(n.max())
    total = fit["a"] + fit["b"] * top + fit["c"] * top * top
    fit["quadratic_share_at_max"] = fit["c"] * top * top / total if total else float("nan")
    return fit


# -- decode time vs position -------------------------------------------------------------

def decode_curve(model, positions: Sequence[int], steps: int = 10, *,
                 ids: Sequence[int] | None = None, warmup: int = 2) -> list[dict]:
    """Time of one decode step against its position (the cache's length before the step).

    The first max(positions) + 1 tokens are prefilled into one cache, once. Because
    attention is causal, the first p entries of that cache are exactly the cache of a
    p-token prompt, so a step "at position p" rewinds the cache to length p and feeds
    token p of the text (as a real continuation would); the entry it writes equals the
    one prefill wrote there. Each position's step is timed by `measure`.
    """
    positions = sorted(positions)
    top = positions[-1]
    ids = list(ids) if ids is not None else eval_prompt_ids(model.tokenizer, top + 1)
    cache = model.new_cache(1, top + 1)
    model(torch.tensor([ids[:top + 1]]), cache=cache, last_only=True)
    records = []
    for p in positions:
        token = torch.tensor([[ids[p]]])

        def step(p=p, token=token):
            cache.length = p
            return model(token, cache=cache, last_only=True)

        timing = measure(step, name=f"decode at {p}", repeats=steps, warmup=warmup)
        records.append({"position": p, **timing.to_dict()})
    cache.length = top + 1
    return records


# -- share of each phase -----------------------------------------------------------------

def split_phases(timings) -> dict:
    """Split one request's StageTimings into the prefill phase (from the start until the
    first token is chosen: tokenize, cache allocation, prefill, first sample) and the
    decode phase (everything after). The two add up to the request's total."""
    first_sample = next(e for e in timings.events if e[0] == "sample")
    ttft = first_sample[1] + first_sample[2]
    return {"ttft_s": ttft, "decode_s": timings.total - ttft, "total_s": timings.total,
            "prefill_share": ttft / timings.total, "decode_share": 1 - ttft / timings.total}


def phase_shares(model, prompt_lens: Sequence[int], reply_lens: Sequence[int], *,
                 ids: Sequence[int] | None = None, repeats: int = 3,
                 warmup: int = 0) -> list[dict]:
    """Share of a request's time in prefill and in decode, for every (prompt, reply) pair.

    Each request is a real `generate` call (greedy, EOS ignored so the reply has exactly
    the asked length) on a text prompt cut from the evaluation text, timed by `measure`;
    the record keeps the run whose total is the median one, split by `split_phases`.
    """
    from labkit.engine.loop import generate
    from labkit.sampling import SamplingParams

    ids = list(ids) if ids is not None else eval_prompt_ids(model.tokenizer, max(prompt_lens))
    records = []
    for p in prompt_lens:
        text = model.tokenizer.decode(ids[:p])
        for r in reply_lens:
            params = SamplingParams(temperature=0.0, max_tokens=r, ignore_eos=True)
            runs = []
            timing = measure(lambda: runs.append(generate(model, text, params)),
                             name=f"prompt {p}, reply {r}", repeats=repeats, warmup=warmup)
            runs = sorted(runs[warmup:], key=lambda g: g.timings.total)
            run = runs[len(runs) // 2]
            steps = run.timings.decode_steps
            records.append({"prompt": p, "prompt_tokens": len(run.prompt_token_ids),
                            "reply": r, "reply_tokens": len(run.token_ids),
                            **split_phases(run.timings),
                            "decode_ms_per_token": 1e3 * statistics.median(steps) if steps else None,
                            "median_s": timing.median, "spread": timing.spread,
                            "repeats": len(runs)})
    return records


# -- two requests, one engine loop (a preview of Part III's scheduler) -------------------

def chunked_prefill(model, ids: Sequence[int], chunk: int, cache=None,
                    last_only: bool = False) -> torch.Tensor:
    """Prefill `ids` in pieces of `chunk` tokens into one cache; logits of every position
    ([1, len(ids), vocab]), or of the last one only. Equal to one-shot prefill up to
    rounding: each chunk attends to the cache the earlier chunks wrote."""
    cache = cache if cache is not None else model.new_cache(1, len(ids))
    outs = [model(torch.tensor([list(ids[i:i + chunk])]), cache=cache, last_only=last_only)
            for i in range(0, len(ids), chunk)]
    return outs[-1] if last_only else torch.cat(outs, dim=1)


class _Request:
    """One request of the toy engine: a prompt to prefill (in pieces) then tokens to make."""

    def __init__(self, name: str, model, prompt_ids: Sequence[int], max_tokens: int,
                 chunk: int | None):
        self.name, self.model = name, model
        self.prompt = list(prompt_ids)
        self.max_tokens = max_tokens
        self.chunk = chunk or len(self.prompt)
        self.cache = model.new_cache(1, len(self.prompt) + max_tokens)
        self.prefilled = 0
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.last_logits: torch.Tensor | None = None
        self.step_logits: list[torch.Tensor] = []  # the scores each token was chosen from

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_tokens

    def step(self) -> tuple[str, int]:
        """Run this request's next forward pass: a prefill chunk or one decode step.
        Returns (kind, tokens processed); a pass that yields a token records it."""
        if self.prefilled < len(self.prompt):
            piece = self.prompt[self.prefilled:self.prefilled + self.chunk]
            logits = self.model(torch.tensor([piece]), cache=self.cache, last_only=True)
            self.prefilled += len(piece)
            kind, n = PREFILL, len(piece)
            if self.prefilled < len(self.prompt):
                return kind, n  # a middle chunk: no token yet
            self.last_logits = logits[0, -1]
        else:
            logits = self.model(torch.tensor([[self.tokens[-1]]]), cache=self.cache)
            kind, n = DECODE, 1
        self.step_logits.append(logits.reshape(-1, logits.shape[-1])[-1])
        self.tokens.append(greedy(logits))
        return kind, n


def position_agreement(reference_logits: torch.Tensor, candidate_logits: torch.Tensor,
                       tolerance: float | None = None):
    """Do two numerical paths pick the same token at every position of one pass (e.g. a
    prompt prefilled in one pass and in chunks)? The near-tie rule of
    :mod:`labkit.util.near_tie`, position by position: the positions read the same input, so
    a divergence at one does not end the comparison. A position where the argmaxes differ is
    excused when the reference's gap between its token and the candidate's is within
    `tolerance`, and fails otherwise.

    Pass a stated tolerance (:func:`labkit.experiments.path_agreement.tolerance`, twice the
    book's float32 logit error) wherever the check must be able to fail, and hold the
    paths' measured difference to that error yourself. The default, kept for callers that
    only count near-ties, is :func:`~labkit.util.near_tie.flip_tolerance` of the largest
    |logit difference| of these two tensors: a flip needs the reference's gap to be within
    the two paths' differences at that position, so that default excuses every flip.

    `*_logits` are [positions, vocab] (a leading batch of 1 is dropped). Returns the
    :class:`~labkit.util.near_tie.AgreementSummary` (one one-token sequence per position):
    ``.ok``, ``.exact`` positions, ``.excused`` positions, ``.describe()``."""
    from labkit.util.near_tie import compare_greedy, flip_tolerance

    ref = reference_logits.detach().float().reshape(-1, reference_logits.shape[-1])
    cand = candidate_logits.detach().float().reshape(-1, candidate_logits.shape[-1])
    if ref.shape != cand.shape:
        raise ValueError(f"logits of different shapes: {tuple(ref.shape)} and {tuple(cand.shape)}")
    if tolerance is None:
        tolerance = flip_tolerance(float((ref - cand).abs().max()))
    return compare_greedy([[int(t)] for t in ref.argmax(-1)], [[int(t)] for t in cand.argmax(-1)],
                          [[row] for row in ref], tolerance)


def two_request_timeline(model, short_prompt: Sequence[int], long_prompt: Sequence[int],
                         chunk: int | None = None, *, short_tokens: int = 32,
                         long_tokens: int = 4, arrive_after: int = 8) -> dict:
    """Serve two requests with one engine loop that runs one forward pass at a time.

    A preview of the scheduler of Part III, reduced to its core: no batching, two requests,
    round-robin. The short request (prompt `short_prompt`, `short_tokens` greedy tokens)
    starts alone. When it has produced `arrive_after` tokens, the long request arrives
    (prompt `long_prompt`, `long_tokens` tokens; it arrives at the latest when the short
    request is done). From then on the loop alternates: one
    pass of the long request (its whole prompt as one pass when `chunk` is None, else its
    next `chunk` tokens, then its decode steps), one decode step of the short request, and
    so on, until both are done.

    Returns a dict: per request ("short", "long") its token ids, token timestamps (seconds
    since the loop started), the last prefill logits and the logits each token was chosen
    from ("step_logits"); "arrival" (seconds); "passes", a
    list of (request, kind, start, seconds, tokens) for every forward pass; and "chunk".
    """
    short = _Request("short", model, short_prompt, short_tokens, None)
    long = _Request("long", model, long_prompt, long_tokens, chunk)
    passes: list[tuple[str, str, float, float, int]] = []
    arrival = None
    start = time.perf_counter()

    def run(req: _Request) -> None:
        t0 = time.perf_counter()
        kind, n = req.step()
        t1 = time.perf_counter()
        passes.append((req.name, kind, t0 - start, t1 - t0, n))
        if len(req.token_times) < len(req.tokens):
            req.token_times.append(t1 - start)

    turn = 0  # alternate: the newcomer first, then the short request
    while not (short.done and long.done):
        if arrival is None and (len(short.tokens) >= arrive_after or short.done):
            arrival = time.perf_counter() - start
            turn = 0
        active = [r for r in ((long,) if arrival is not None else ()) + (short,) if not r.done]
        run(active[turn % len(active)])
        turn += 1
    if arrival is None:
        arrival = float("nan")
    out = {"chunk": chunk, "arrival": arrival, "passes": passes}
    for req in (short, long):
        out[req.name] = {"prompt_tokens": len(req.prompt), "token_ids": req.tokens,
                         "token_times": req.token_times, "last_logits": req.last_logits,
                         "step_logits": req.step_logits}
    return out


def long_request_times(timeline: dict) -> dict:
    """The long request's time to first token (from its arrival) and the sum of its prefill
    passes, in seconds."""
    return {"ttft_s": timeline["long"]["token_times"][0] - timeline["arrival"],
            "prefill_s": sum(d for name, kind, _, d, _ in timeline["passes"]
                             if name == "long" and kind == PREFILL)}


def schedules_in_turns(model, short_prompt: Sequence[int], long_prompt: Sequence[int],
                       schedules: dict[str, int | None], rounds: int, **kwargs) -> dict:
    """Run `two_request_timeline` for each schedule (name -> chunk, None for one pass),
    `rounds` times in turns (A, B, A, B, ...), so that a slow spell of the machine falls on
    both. Returns per schedule its last timeline ("timeline"), every round's ("timelines"),
    the round whose long-request TTFT is the median one ("median_timeline": the run to draw
    and to quote, never a slow or fast outlier) and, from every round, the long request's
    TTFT and prefill seconds and the short request's worst gap ("ttft_s", "prefill_s",
    "worst_gap_s": lists)."""
    out = {name: {"ttft_s": [], "prefill_s": [], "worst_gap_s": [], "timelines": []}
           for name in schedules}
    for _ in range(rounds):
        for name, chunk in schedules.items():
            timeline = two_request_timeline(model, short_prompt, long_prompt, chunk=chunk, **kwargs)
            for key, value in long_request_times(timeline).items():
                out[name][key].append(value)
            out[name]["worst_gap_s"].append(gap_summary(timeline)["worst_gap_s"])
            out[name]["timeline"] = timeline
            out[name]["timelines"].append(timeline)
    for got in out.values():
        got["median_timeline"] = got["timelines"][median_index(got["ttft_s"])]
    return out


def median_index(values: Sequence[float]) -> int:
    """The index of the median of `values` (of the lower middle one when their number is
    even): which round to show as the typical one."""
    if not values:
        raise ValueError("no values")
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(values) - 1) // 2]


def _runs_apart(chunked: Sequence[float], one_pass: Sequence[float]):
    """The comparison of two schedules' runs (`labkit.util.compare`, one pass over chunked)
    and the direction it may claim: "shorter" (chunked took less) or "longer" only when the
    bootstrap interval excludes 1 *and* every run of one schedule lies beyond every run of
    the other (with a few runs a side, a percentile bootstrap alone claims too much: three
    runs against three, completely apart, is a one-sided chance of 1 in 20); else None."""
    c = compare(chunked, one_pass, name_a="chunked", name_b="one pass")
    if c.verdict == "faster" and max(chunked) < min(one_pass):
        return c, "shorter"
    if c.verdict == "slower" and min(chunked) > max(one_pass):
        return c, "longer"
    return c, None


def _runs_text(chunked: Sequence[float], one_pass: Sequence[float]) -> str:
    n = min(len(chunked), len(one_pass))
    return f"{n} runs of each" if len(chunked) == len(one_pass) else "the runs"


def chunking_verdict(chunked_ttft: Sequence[float], one_pass_ttft: Sequence[float]) -> str:
    """Did the long request pay for being prefilled in chunks? In words the runs support
    (the rule of :func:`_runs_apart`)."""
    c, direction = _runs_apart(chunked_ttft, one_pass_ttft)
    each = _runs_text(chunked_ttft, one_pass_ttft)
    detail = f"one-pass / chunked time {c.ratio:.2f}, bootstrap interval {c.low:.2f}-{c.high:.2f}"
    if direction == "shorter":
        return f"chunking did not cost it, its first token came sooner chunked in all {each} ({detail})"
    if direction == "longer":
        return f"chunking cost it, its first token came later chunked in all {each} ({detail})"
    return (f"its first token came at the same time either way within the noise, the runs of "
            f"the two schedules overlapping ({detail})")


def gap_verdict(chunked_gaps: Sequence[float], one_pass_gaps: Sequence[float]) -> str:
    """Was the short request's worst gap shorter with the long prompt chunked? In words the
    runs support (the rule of :func:`_runs_apart`), to follow "its worst gap was"."""
    c, direction = _runs_apart(chunked_gaps, one_pass_gaps)
    each = _runs_text(chunked_gaps, one_pass_gaps)
    detail = (f"one-pass / chunked worst gap {c.ratio:.1f}, bootstrap interval "
              f"{c.low:.1f}-{c.high:.1f}, {each}")
    if direction == "shorter":
        return f"{c.ratio:.1f} times shorter chunked, in every run ({detail})"
    if direction == "longer":
        return f"longer chunked, in every run ({detail})"
    return f"not clearly shorter chunked: the runs of the two schedules overlap ({detail})"


def prefill_scores(length: int, chunk: int | None = None) -> int:
    """Attention scores one query head hands to SDPA to prefill `length` tokens, in one pass
    (`chunk` None) or in chunks of `chunk`, as labkit's attention
    (:func:`labkit.models.llama.grouped_attention`) hands the work over (the kernel itself
    computes whole blocks, so it may compute more; see :func:`scored_share`):

    - a pass with no cached positions (a whole prompt, or a first chunk) passes
      `is_causal`: the kernel skips the masked upper half and scores the lower triangle with
      its diagonal, T (T + 1) / 2 for T tokens (up to the kernel's block edges);
    - a chunk after cached positions passes a [T, S] mask, S the keys up to its last token:
      the kernel scores that whole rectangle, T x S, the chunk's own masked corner included.
    """
    if length < 1 or (chunk is not None and chunk < 1):
        raise ValueError("a prefill has at least one token and chunks of at least one")
    chunk = chunk or length
    scored = 0
    for start in range(0, length, chunk):
        steps = min(chunk, length - start)
        scored += steps * (steps + 1) // 2 if start == 0 else steps * (start + steps)
    return scored


def scored_share(length: int, chunk: int) -> float:
    """Attention scores handed to SDPA by a prefill of `length` tokens in chunks of `chunk`,
    as a share of one pass's (:func:`prefill_scores`). Above 1 once there are two chunks: the
    whole prompt is handed over as the causal triangle, a later chunk as its whole rectangle.
    What the kernel computes differs from both: it works in blocks of queries and keys and
    computes a block whole once any of it is needed, so :func:`attention_prefill_times`
    measures the calls themselves."""
    return prefill_scores(length, chunk) / prefill_scores(length)


def prefill_attention_inputs(config, length: int, seed: int = 0):
    """Seeded (q, k, v) of one layer's attention over `length` tokens in the model's layout
    (:func:`labkit.models.llama.grouped_attention`): q [1, kv_heads, group, T, D], k and v
    [1, kv_heads, T, D]."""
    g = torch.Generator().manual_seed(seed)
    kv, group, dim = config.num_kv_heads, config.group_size, config.head_dim
    return (torch.randn(1, kv, group, length, dim, generator=g),
            torch.randn(1, kv, length, dim, generator=g), torch.randn(1, kv, length, dim, generator=g))


def prefill_attention_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            chunk: int | None = None) -> None:
    """One layer's attention calls of a prefill, as the model makes them: one
    `grouped_attention` over the whole prompt (`chunk` None), or one per chunk, each chunk's
    queries against the keys up to its end, starting at its first position."""
    from labkit.models.llama import grouped_attention

    length = q.shape[3]
    chunk = chunk or length
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        grouped_attention(q[:, :, :, start:end], k[:, :, :end], v[:, :, :end], start)


def attention_prefill_times(config, length: int, chunk: int, *, rounds: int, warmup: int = 1,
                            seed: int = 0) -> dict[str, list[float]]:
    """Seconds of one layer's attention calls to prefill `length` tokens in one pass and in
    chunks of `chunk` (:func:`prefill_attention_calls`, labkit's own attention path on
    seeded inputs of the model's shape), timed in turns (one pass, chunked, one pass, ...) so
    that a slow spell falls on both: {"one pass": samples, "chunked": samples}. This is what
    the kernel does with what it is handed, where :func:`scored_share` only counts it."""
    q, k, v = prefill_attention_inputs(config, length, seed)
    runners = {"one pass": lambda: prefill_attention_calls(q, k, v),
               "chunked": lambda: prefill_attention_calls(q, k, v, chunk)}
    timings = measure_interleaved(runners, rounds=rounds, warmup=warmup)
    return {name: list(t.samples) for name, t in timings.items()}


def slope_dips(slopes: Sequence[dict]) -> list[dict]:
    """Where a curve's log-log slope fell from one interval to the next (:func:`loglog_slopes`'
    records, in order): each dip as {"from", "to"} of the interval whose slope is lower
    than the one before it, with "before" and "slope". Empty when the slope never fell."""
    return [{"from": b["from"], "to": b["to"], "before": a["slope"], "slope": b["slope"]}
            for a, b in zip(slopes, slopes[1:]) if b["slope"] < a["slope"]]


def _median(values: torch.Tensor) -> torch.Tensor:
    """Medians along the last axis, statistics.median's convention (mean of the middle two)."""
    ordered = values.sort(dim=-1).values
    n = values.shape[-1]
    return (ordered[..., (n - 1) // 2] + ordered[..., n // 2]) / 2


def decode_line(positions: Sequence[int], samples: Sequence[Sequence[float]], *,
                confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict:
    """A straight line, step time = a + b x position, fitted by least squares to the median
    decode step at each position (:func:`decode_curve`'s records: `positions` and each one's
    `samples`), and the growth it gives from the first position to the last:
    ``ratio`` = (a + b p_last) / (a + b p_first). Every position carries the line, so one noisy
    step at either end moves it less than it moves a ratio of the two end medians. The
    interval is a percentile bootstrap: each position's samples resampled (seeded), their
    medians refitted. Returns a_s, b_s (seconds per position), first_s, last_s, ratio, low,
    high, confidence."""
    if len(positions) != len(samples) or len(set(positions)) < 2:
        raise ValueError("a line needs samples at two or more distinct positions")
    if min(len(s) for s in samples) < MIN_SAMPLES:
        raise ValueError(f"each position needs at least {MIN_SAMPLES} samples")
    p = torch.tensor([float(x) for x in positions], dtype=torch.float64)
    design = torch.stack([torch.ones_like(p), p], dim=1)  # [P, 2]
    generator = torch.Generator().manual_seed(seed)
    medians = [_median(torch.tensor(list(s), dtype=torch.float64)) for s in samples]
    drawn = []
    for s in samples:
        values = torch.tensor(list(s), dtype=torch.float64)
        picks = torch.randint(0, len(values), (resamples, len(values)), generator=generator)
        drawn.append(_median(values[picks]))
    observed = torch.stack(medians)[None, :]  # [1, P]
    every = torch.cat([observed, torch.stack(drawn, dim=1)])  # [1 + resamples, P]
    coef = torch.linalg.lstsq(design, every.T).solution  # [2, 1 + resamples]
    first, last = coef[0] + coef[1] * p.min(), coef[0] + coef[1] * p.max()
    ratios = last / first
    tail = (1 - confidence) / 2
    low, high = torch.quantile(ratios[1:], torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return {"a_s": float(coef[0, 0]), "b_s": float(coef[1, 0]), "first_s": float(first[0]),
            "last_s": float(last[0]), "ratio": float(ratios[0]), "low": float(low),
            "high": float(high), "confidence": confidence}


def decode_growth_words(line: dict, bytes_ratio: float, margin: float = 0.0) -> str:
    """How a decode step's time grew from the first position to the last (a fitted
    :func:`decode_line`), against the growth of the bytes it reads (all the weights plus the
    cache), in words for the prose: "more than" or "less than" only when the line's whole
    bootstrap interval lies on that side of the bytes' ratio by more than `margin` (a share
    of it: a practical difference, beyond the drift of the same work between two parts of a
    run, which the interval of one run does not see), else "about as". Under
    time = a x weight bytes + b x cache bytes, growing faster than the bytes means b > a (a
    cache byte cost more than a weight byte), slower means the opposite or a fixed cost."""
    head = (f"grew {line['ratio']:.2f} times ({line['confidence']:.0%} interval "
            f"{line['low']:.2f}-{line['high']:.2f})")
    bytes_text = f"{bytes_ratio:.2f} times: all the weights plus the cache"
    if line["low"] > bytes_ratio * (1 + margin):
        return (f"{head}, more than the bytes a step reads ({bytes_text}): counted per byte, "
                "the work that grows with the position (reading the cache and attending over "
                "it) cost more than reading the weights")
    if line["high"] < bytes_ratio * (1 - margin):
        return (f"{head}, less than the bytes a step reads ({bytes_text}): counted per byte, "
                "the weights cost more than the cache, or part of a step's time does not "
                "depend on its bytes at all")
    within = f"within {margin:.0%} of it" if margin else "within the noise"
    return f"{head}, about as the bytes a step reads grew ({bytes_text}), {within}"


def decode_bend_words(positions: Sequence[int], medians_ms: Sequence[float],
                      steeper: float = 1.5) -> str:
    """Does a decode curve bend? The median step's growth per cached position (µs) over its
    first stretch (first position to the last one at or below half the longest) and its
    last (from there to the longest), in words: "steepens" only when both growths are
    positive and the second is more than `steeper` times the first; else no bend is
    claimed. A line fitted to a bent curve reads one slope for two."""
    pairs = sorted(zip(positions, medians_ms))
    first, last = pairs[0], pairs[-1]
    mid = max(p for p in pairs if p[0] <= last[0] // 2)
    if mid[0] == first[0]:
        raise ValueError("a bend needs a position between the first and half the last")
    early = (mid[1] - first[1]) / (mid[0] - first[0]) * 1e3
    late = (last[1] - mid[1]) / (last[0] - mid[0]) * 1e3
    bend = (f"the median step grew {early:.1f} µs per cached position from {first[0]:,} to "
            f"{mid[0]:,} and {late:.1f} µs from {mid[0]:,} to {last[0]:,}")
    if early > 0 and late > steeper * early:
        return (f"The line hides a bend: {bend}, so the growth steepens past about "
                f"{mid[0]:,} positions and a per-byte reading depends on the range chosen.")
    return f"Read by its two stretches, {bend}: no bend of more than {steeper:g} times."


def gap_summary(timeline: dict) -> dict:
    """The short request's inter-token gaps (seconds) before the long request arrived,
    while its prompt was being prefilled, and after: median and maximum of each, and the
    worst gap overall. A gap belongs to the phase in which it ends."""
    times = timeline["short"]["token_times"]
    arrival = timeline["arrival"]
    prefill_end = max(s + d for name, kind, s, d, _ in timeline["passes"]
                      if name == "long" and kind == PREFILL)
    phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for t0, t1 in zip(times, times[1:]):
        # a gap that began before the long prefill ended waited for (part of) it: "during"
        key = "before" if t1 <= arrival else "during" if t0 < prefill_end else "after"
        phases[key].append(t1 - t0)
    out = {"prefill_end": prefill_end, "worst_gap_s": max(b - a for a, b in zip(times, times[1:]))}
    for key, gaps in phases.items():
        out[f"{key}_median_s"] = statistics.median(gaps) if gaps else float("nan")
        out[f"{key}_max_s"] = max(gaps) if gaps else float("nan")
        out[f"{key}_gaps"] = len(gaps)
    return out


def plot_timeline(ax, timeline: dict, unit: float = 1.0, unit_label: str = "s") -> None:
    """Draw a two-request timeline on `ax`: each forward pass as a bar in its request's
    row (prefill passes dark, decode passes light), each token of the short request as a
    tick above its row, and the long request's arrival as a dashed line."""
    rows = {"short": 0, "long": 1}
    colors = {PREFILL: "#0072B2", DECODE: "#E69F00"}
    for name, kind, start, took, _ in timeline["passes"]:
        ax.broken_barh([(start / unit, took / unit)], (rows[name] - 0.3, 0.6),
                       facecolors=colors[kind], edgecolor="white", linewidth=0.3)
    times = [t / unit for t in timeline["short"]["token_times"]]
    ax.plot(times, [0.45] * len(times), "|", color="black", markersize=7)
    ax.axvline(timeline["arrival"] / unit, color="grey", linestyle="--", linewidth=0.8)
    ax.set_yticks([0, 1], ["short", "long"])
    ax.set_ylim(-0.6, 2.2)  # the band above the long row holds the legend, clear of the bars
    ax.set_xlabel(f"time since the loop started ({unit_label})")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=f"{k} pass") for k, c in colors.items()]
    ax.legend(handles=handles, loc="upper right", ncol=2, fontsize="small")


# -- the GPU path: the library reference on CUDA -----------------------------------------

def _rewind(cache, length: int) -> None:
    """Crop a transformers KV cache back to `length` positions, in either API: transformers
    4 takes the new length, transformers 5 the number of positions to drop, negated."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        drop = cache.get_seq_length() - length
        if drop:
            cache.crop(-drop)
    else:
        cache.crop(length)


def reference_phase_times(ref, ids: Sequence[int], lengths: Sequence[int], *,
                          device: str = "cuda", repeats: int = 5, steps: int = 20) -> list[dict]:
    """TTFT (prefill + first greedy token) and one decode step's time of a `transformers`
    causal LM (the library reference, already on `device`), for prompts of each length.

    labkit's own model runs on the CPU only; this is the path the chapter runs when CUDA is
    present. The decode step rewinds the reference's KV cache (`crop`) before every call,
    so every timed step is at the same position.
    """
    records = []
    with torch.no_grad():
        for n in lengths:
            x = torch.tensor([list(ids[:n])], device=device)

            def prefill():
                return int(ref(x, use_cache=True).logits[0, -1].argmax())

            ttft = measure(prefill, name=f"ref ttft {n}", repeats=repeats, warmup=1, device=device)
            out = ref(x, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)

            def decode():
                logits = ref(token, past_key_values=cache, use_cache=True).logits
                _rewind(cache, n)
                return logits

            step = measure(decode, name=f"ref decode {n}", repeats=steps, warmup=2, device=device)
            records.append({"length": n, "ttft_s": ttft.median, "decode_s": step.median,
                            "device": str(device)})
    return records


__all__ = [
    "PREFILL", "DECODE", "eval_prompt_ids", "greedy", "default_schedule", "ttft_once",
    "ttft_curve", "loglog_slopes", "fit_linear_quadratic", "decode_curve", "split_phases",
    "phase_shares", "chunked_prefill", "position_agreement", "two_request_timeline",
    "long_request_times", "schedules_in_turns",
    "chunking_verdict", "gap_verdict", "prefill_scores", "scored_share", "decode_line",
    "prefill_attention_inputs", "prefill_attention_calls", "attention_prefill_times",
    "slope_dips", "median_index", "decode_bend_words",
    "decode_growth_words", "gap_summary",
    "reference_phase_times", "plot_timeline",
]
