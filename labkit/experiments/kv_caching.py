"""The KV cache, put to the test: exact, faster, how many bytes, and how it fails silently.

Chapter 10 runs these against :class:`labkit.models.llama.KVCache`, the contiguous cache
that ``model(ids, cache=cache)`` writes and reads:

* :func:`cache_equivalence`: greedy generation with the cache beside the same generation
  without it (every step re-runs the whole prefix, as
  :func:`labkit.experiments.naive_generation.generate_naive` does), comparing the tokens and the logits of
  every step.
* :func:`speedup_curve`: time of cached vs uncached greedy generation, for a list of
  (prompt length, output length) cases.
* :func:`kv_bytes_per_token`: ``2 x layers x kv_heads x head_dim x bytes per element``.
* :func:`fill_cache`: fill a large cache chunk by chunk (for a memory measurement).
* :func:`stale_cache_trials`: a cache filled for prompt A continued as if it held prompt B.
* :func:`perturbed_cache_trials`: a cache filled with one layer's K/V weights perturbed,
  then continued with the correct weights.
* :func:`spot_check_reading`: what a check of the next token says about a stale cache,
  read from the trials' count with its interval.

Every trial reports the largest absolute difference between the next-token logits the
faulty cache gives and the correct ones (``max_abs_err``) and whether the greedy token is
still the right one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import torch

from labkit.engine.loop import greedy_decode
from labkit.experiments.naive_generation import generate_naive
from labkit.util.compare import MIN_SAMPLES, compare
from labkit.experiments.path_agreement import LOGIT_ERROR, tolerance as near_tie_tolerance
from labkit.util.near_tie import greedy_agreement
from labkit.util.timing import measure_interleaved


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([[int(t) for t in tokens]])


def generate_cached(model, prompt_ids: Sequence[int], steps: int,
                    keep_logits: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation with a KV cache: one prefill, then one-token decode steps.

    Returns ``(token_ids, logits)``; ``logits[k]`` (float32, [vocab]) are the scores that
    chose token ``k`` when ``keep_logits`` is true, else the list is empty.
    """
    run = greedy_decode(model, list(prompt_ids), steps, keep_logits=keep_logits)
    return run.token_ids, run.logits


def generate_uncached(model, prompt_ids: Sequence[int],
                      steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation with no cache, keeping every step's logits.

    The loop of :func:`labkit.experiments.naive_generation.generate_naive`: step ``k`` runs the model over
    the prompt and the ``k`` tokens chosen so far and keeps the last position's scores.
    """
    sequence = [int(t) for t in prompt_ids]
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    for _ in range(steps):
        logits = model(_ids(sequence), last_only=True)[0, -1]
        kept.append(logits.float().clone())
        tokens.append(int(torch.argmax(logits)))
        sequence.append(tokens[-1])
    return tokens, kept


def cache_equivalence(model, prompt_ids: Sequence[int], steps: int,
                      logit_error: float = LOGIT_ERROR) -> dict:
    """Generate ``steps`` greedy tokens with and without the KV cache and compare.

    Returns a dict with ``cached`` and ``uncached`` (token ids), ``identical`` (bool),
    ``step_max_abs_diff`` (per step, the largest |logit difference| over the vocabulary;
    steps after the first differing token are left out, since their prefixes differ),
    ``max_abs_diff`` (the largest of those) and ``agreement``: the two token lists under the
    near-tie rule (:func:`labkit.util.near_tie.greedy_agreement`, the uncached path as the
    reference), whose ``.ok`` is the check (equal tokens, or a first divergence at a gap
    rounding can close) and ``.excused`` says whether a near-tie was excused.

    The tolerance is twice the *stated* ``logit_error`` (the book's float32 bound,
    :data:`labkit.experiments.path_agreement.LOGIT_ERROR`), never twice this run's own
    ``max_abs_diff``: the reference's gap at a flip is at most the two paths' differences
    there, so a tolerance taken from them would excuse every flip. The caller asserts
    ``max_abs_diff <= logit_error``, the bound the tolerance stands on.
    """
    cached, cached_logits = generate_cached(model, prompt_ids, steps, keep_logits=True)
    uncached, uncached_logits = generate_uncached(model, prompt_ids, steps)
    diffs = []
    for a, b, ta, tb in zip(cached_logits, uncached_logits, cached, uncached):
        diffs.append(float((a - b).abs().max()))
        if ta != tb:
            break
    agreement = greedy_agreement(uncached, cached, uncached_logits, near_tie_tolerance(logit_error))
    return {"prompt_tokens": len(prompt_ids), "steps": steps, "cached": cached,
            "uncached": uncached, "identical": cached == uncached,
            "step_max_abs_diff": diffs, "max_abs_diff": max(diffs), "logit_error": logit_error,
            "agreement": agreement}


def loop_work(prompt_tokens: int, new_tokens: int) -> dict:
    """The forward passes of the two greedy loops and the token positions they process.

    The cached loop (:func:`generate_cached`) prefills the prompt, then feeds each chosen
    token but the last: ``new_tokens`` passes over ``prompt + new - 1`` positions in all.
    The uncached loop (:func:`labkit.experiments.naive_generation.generate_naive`) runs step
    ``k`` over the prompt and ``k`` tokens: as many passes, over ``new x prompt +
    new (new - 1) / 2`` positions."""
    if prompt_tokens < 1 or new_tokens < 1:
        raise ValueError("a prompt of at least one token and at least one new token")
    return {"passes": new_tokens, "cached_positions": prompt_tokens + new_tokens - 1,
            "uncached_positions": new_tokens * prompt_tokens + new_tokens * (new_tokens - 1) // 2}


def rate_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a rate of ``successes`` in ``trials`` (95% for z = 1.96):
    the rates that ``trials`` draws would not tell apart from the one seen."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"{successes} successes in {trials} trials")
    p, z2 = successes / trials, z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def spot_check_reading(right: int, trials: int) -> str:
    """What a check of the next token alone says about a stale cache, in a sentence for the
    prose, from the count of trials in which the stale cache still gave the right token.

    The direction comes from the Wilson 95% interval of the miss rate (``right / trials``,
    :func:`rate_interval`): a check that passes the stale cache in under half the trials,
    beyond the noise of the count, usually catches it; over half, usually misses it; an
    interval that holds one half cannot tell. No trial passed is said as such, with the miss
    rate the trials cannot rule out."""
    low, high = rate_interval(right, trials)
    caught = trials - right
    seen = (f"A check of the next token alone caught the wrong cache in {caught} of {trials} "
            f"trials and passed it in {right}")
    if right == 0:
        return (f"{seen}: it caught every one, yet {trials} trials cannot rule out a check that "
                f"passes a stale cache up to {high:.0%} of the time.")
    rate = f" (95% interval of how often it passes: {low:.0%} to {high:.0%})"
    if high < 0.5:
        return (f"{seen}{rate}: one spot check would usually catch this bug, but not every "
                "time, so a server cannot rely on it.")
    if low > 0.5:
        return (f"{seen}{rate}: a spot check of the next token would miss this bug more often "
                "than it caught it.")
    return (f"{seen}{rate}: the trials cannot tell whether a spot check of the next token "
            "catches this bug more often than it misses it.")


def speedup_curve(model, source_ids: Sequence[int], cases: Iterable[tuple[int, int]], *,
                  repeats: int = 3, warmup: int = 1) -> list[dict]:
    """Time cached vs uncached greedy generation for each ``(prompt_tokens, new_tokens)``.

    The prompt of a case is ``source_ids[:prompt_tokens]``. The cached path is
    :func:`generate_cached` (prefill, then one-token steps); the uncached path is
    :func:`labkit.experiments.naive_generation.generate_naive` (every step re-runs the whole
    prefix). The two are timed in turns (:func:`labkit.util.timing.measure_interleaved`), so a
    slow spell of the machine falls on both; ``warmup`` untimed calls of both paths are made
    once, on the first case. Returns one record per case: medians, spreads, ``speedup`` =
    uncached median / cached median and, with at least three repeats, its bootstrap interval
    (``speedup_low``, ``speedup_high``) and ``verdict`` (:func:`labkit.util.compare.compare`).
    """
    records = []
    for index, (prompt_tokens, new_tokens) in enumerate(cases):
        if prompt_tokens > len(source_ids):
            raise ValueError(f"source has {len(source_ids)} tokens, not {prompt_tokens}")
        prompt = [int(t) for t in source_ids[:prompt_tokens]]
        timings = measure_interleaved({"cached": lambda: generate_cached(model, prompt, new_tokens),
                                       "uncached": lambda: generate_naive(model, prompt, new_tokens)},
                                      rounds=repeats, warmup=warmup if index == 0 else 0)
        cached, uncached = timings["cached"], timings["uncached"]
        record = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                  "cached_s": cached.median, "uncached_s": uncached.median,
                  "cached_spread": cached.spread, "uncached_spread": uncached.spread,
                  "repeats": repeats, "threads": cached.threads,
                  "speedup": uncached.median / cached.median,
                  "speedup_low": float("nan"), "speedup_high": float("nan"), "verdict": "too few runs"}
        if repeats >= MIN_SAMPLES:
            c = compare(cached.samples, uncached.samples, name_a="cached", name_b="uncached")
            record.update(speedup_low=c.low, speedup_high=c.high, verdict=c.verdict)
        records.append(record)
    return records


def speedup_trend(records: Sequence[dict], by: str) -> str:
    """How the speed-up moves as `by` ("new_tokens" or "prompt_tokens") doubles, in words the
    intervals support: "rises at every step, each interval above the last", "rises at every
    step, but neighbouring intervals overlap", or "does not rise at every step"."""
    rows = sorted(records, key=lambda r: r[by])
    pairs = list(zip(rows, rows[1:]))
    if not pairs:
        return "has a single point"
    if not all(b["speedup"] > a["speedup"] for a, b in pairs):
        return "does not rise at every step"
    if all(b["speedup_low"] > a["speedup_high"] for a, b in pairs):
        return "rises at every step, each interval above the last"
    return "rises at every step, but neighbouring intervals overlap"


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32,
                       kv_heads: int | None = None) -> int:
    """Bytes of cache one token needs: ``2 x layers x kv_heads x head_dim x element size``.

    The 2 is one key and one value vector per KV head per layer. ``kv_heads`` defaults to
    the model's; pass ``config.num_heads`` for the multi-head (MHA) layout.
    """
    heads = config.num_kv_heads if kv_heads is None else kv_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * heads * config.head_dim * element


def fill_cache(model, token_ids: Sequence[int], chunk: int = 256):
    """Prefill ``token_ids`` into a new cache of exactly that many positions, ``chunk``
    tokens per forward pass (last position's logits only, so the passes stay small).
    Returns the filled cache."""
    cache = model.new_cache(1, len(token_ids))
    for start in range(0, len(token_ids), chunk):
        model(_ids(token_ids[start:start + chunk]), cache=cache, last_only=True)
    return cache


def eval_prompts(tokenizer, text: str, count: int = 20, length: int = 32) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut from ``text`` at evenly spaced offsets
    (deterministic: the same text gives the same prompts)."""
    ids = tokenizer.encode(text)
    if len(ids) < count * length:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {count} x {length}")
    step = (len(ids) - length) // count
    return [ids[i * step:i * step + length] for i in range(count)]


def _next_token_logits(model, prompt: Sequence[int], cache=None) -> torch.Tensor:
    """Scores for the token after ``prompt``; with ``cache`` (holding ``len(prompt) - 1``
    positions), only the last prompt token is run."""
    if cache is None:
        return model(_ids(prompt), last_only=True)[0, -1].float()
    return model(_ids(prompt[-1:]), cache=cache, last_only=True)[0, -1].float()


def _compare(faulty: torch.Tensor, correct: torch.Tensor) -> dict:
    right = int(torch.argmax(correct))
    chosen = int(torch.argmax(faulty))
    return {"max_abs_err": float((faulty - correct).abs().max()),
            "right_token": right, "chosen_token": chosen, "right": chosen == right}


def stale_cache_trials(model, prompts: Sequence[Sequence[int]], shift: int = 1) -> list[dict]:
    """A cache reused for a different prompt of the same length, one trial per prompt.

    Trial ``i`` fills a cache with all but the last token of prompt A =
    ``prompts[(i + shift) % n]``, then runs the last token of prompt B = ``prompts[i]`` on
    top of it, as if the cache held B. The next-token logits are compared with B's correct
    ones (one uncached pass over B). ``shift=0`` is the control: A is B, the error ~0.
    """
    n = len(prompts)
    trials = []
    for i, prompt in enumerate(prompts):
        donor = prompts[(i + shift) % n]
        if len(donor) != len(prompt):
            raise ValueError("the stale prompt must have the same length as the real one")
        cache = model.new_cache(1, len(prompt))
        model(_ids(donor[:-1]), cache=cache, last_only=True)
        faulty = _next_token_logits(model, prompt, cache)
        correct = _next_token_logits(model, prompt)
        trials.append({"trial": i, "donor": (i + shift) % n, "prompt_tokens": len(prompt),
                       **_compare(faulty, correct)})
    return trials


def perturbed_kv_weights(model, layer: int, scale: float, seed: int) -> torch.Tensor:
    """A COPY of layer ``layer``'s fused QKV matrix whose key and value rows are multiplied
    by ``1 + scale * noise``, one standard-normal draw per row (seeded); query rows are
    unchanged."""
    c = model.config
    qkv = model.layers[layer].qkv
    q_width = c.num_heads * c.head_dim
    noise = torch.randn(qkv.shape[0] - q_width, 1, generator=torch.Generator().manual_seed(seed))
    perturbed = qkv.clone()
    perturbed[q_width:] *= (1 + scale * noise).to(qkv.dtype)
    return perturbed


def perturbed_cache_trials(model, prompts: Sequence[Sequence[int]], layer: int,
                           scale: float = 0.02, seed: int = 0) -> list[dict]:
    """A cache built with one layer's K/V weights perturbed, then used with the right ones.

    For each prompt: swap in :func:`perturbed_kv_weights` (a copy; the model's own tensor is
    never written), fill the cache with all but the last prompt token, put the original
    weights back (in a ``finally`` block, so an error cannot leave the model modified), run
    the last token with the correct weights, and compare the next-token logits with the
    correct ones. Trial ``i`` draws its noise with seed ``seed + i``.
    """
    weights = model.layers[layer]
    original = weights.qkv
    trials = []
    for i, prompt in enumerate(prompts):
        perturbed = perturbed_kv_weights(model, layer, scale, seed + i)
        cache = model.new_cache(1, len(prompt))
        try:
            weights.qkv = perturbed
            model(_ids(prompt[:-1]), cache=cache, last_only=True)
        finally:
            weights.qkv = original
        faulty = _next_token_logits(model, prompt, cache)
        correct = _next_token_logits(model, prompt)
        trials.append({"trial": i, "layer": layer, "scale": scale,
                       "prompt_tokens": len(prompt), **_compare(faulty, correct)})
    return trials


def summarize_trials(trials: Sequence[dict]) -> dict:
    """Median and worst ``max_abs_err`` and how many trials kept the right token."""
    errors = [t["max_abs_err"] for t in trials]
    return {"trials": len(trials), "median_err": statistics.median(errors),
            "worst_err": max(errors), "right": sum(t["right"] for t in trials)}
