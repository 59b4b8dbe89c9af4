"""The naive way to generate, kept to be measured against the real loop (chapters 5 and 10).

Chapter 5 contrasts each of these with what :mod:`labkit.engine.loop` does:

* :func:`generate_naive` chooses tokens greedily with no KV cache: every step runs the model
  over the whole sequence so far (prompt plus everything generated), then keeps only the last
  position's logits. Step ``k`` therefore costs a prefill of ``len(prompt) + k`` tokens.
* :func:`check_in_one_pass` runs the model ONCE over prompt + output and reads off, at every
  position, the token the model would have chosen next. Choosing is serial; checking is not.
* :func:`pass_flops` and :func:`generation_flops` count the arithmetic of each, to set the
  measured times beside what the multiply-adds alone predict.
* :func:`time_in_turns` times the naive loop, the cached loop and the checking pass in
  rounds (one of each loop, then several checks), so that a slow spell of a shared machine
  falls on all three, and logs every sample with the process's CPU time and the load
  average; :func:`slowest_reading` says in words what the slowest sample's CPU time shows.

The naive ways to stop and to stream are in :mod:`labkit.experiments.naive_text`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence

import torch

from labkit.util.timing import Timing


def generate_naive(model, prompt_ids: Sequence[int], max_tokens: int, *,
                   stop_token_ids: Iterable[int] = ()) -> tuple[list[int], list[float]]:
    """Greedy generation with no cache: each step re-runs the model over the whole prefix.

    Returns ``(token_ids, per_step_seconds)``; step ``k``'s time covers its forward pass over
    ``len(prompt_ids) + k`` tokens (logits of the last position only) and the argmax. Ties go
    to the lowest id, as in :func:`labkit.sampling.sample`. Generation ends after
    ``max_tokens`` tokens, or at a token in ``stop_token_ids`` (which is not returned; by
    default there is none, so the loop always runs ``max_tokens`` steps).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    stops = {int(t) for t in stop_token_ids}
    sequence = [int(t) for t in prompt_ids]
    out: list[int] = []
    seconds: list[float] = []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        logits = model(torch.tensor([sequence]), last_only=True)[0, -1]
        token = int(torch.argmax(logits))
        seconds.append(time.perf_counter() - t0)
        if token in stops:
            break
        out.append(token)
        sequence.append(token)
    return out, seconds


def check_in_one_pass(model, prompt_ids: Sequence[int],
                      token_ids: Sequence[int]) -> tuple[list[int], list[bool]]:
    """Check a greedy output with ONE forward pass over ``prompt_ids + token_ids``.

    The logits at position ``len(prompt_ids) - 1 + i`` are the model's scores for output
    token ``i`` given everything before it, so their argmax is the token greedy decoding
    would have chosen there. Returns ``(argmax_ids, matches)``, both of length
    ``len(token_ids)``: ``matches[i]`` is whether ``argmax_ids[i] == token_ids[i]``.

    A mismatch at ``i`` is the model disagreeing with token ``i`` given the tokens actually
    present before it; after a changed token, later positions see a different prefix, so
    they may disagree too.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: position 0 of the output has nothing to condition on")
    prompt = [int(t) for t in prompt_ids]
    tokens = [int(t) for t in token_ids]
    if not tokens:
        return [], []
    logits = model(torch.tensor([prompt + tokens]))[0]
    start = len(prompt) - 1
    argmax_ids = logits[start:start + len(tokens)].argmax(-1).tolist()
    return argmax_ids, [a == t for a, t in zip(argmax_ids, tokens)]


def _matmul_shape(config) -> tuple[int, int, int, int, int]:
    """(layers, weights multiplied per token per layer, hidden, vocab, query width) of a
    LlamaConfig or a GPT2Config."""
    if hasattr(config, "hidden_size"):  # Llama: fused q/k/v, o, gate/up, down
        h, q = config.hidden_size, config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
        return config.num_layers, per_layer, h, config.vocab_size, q
    if hasattr(config, "n_embd"):  # GPT-2: c_attn, c_proj, c_fc, mlp c_proj
        h = config.n_embd
        per_layer = h * 3 * h + h * h + 2 * h * config.n_inner
        return config.n_layer, per_layer, h, config.vocab_size, h
    raise TypeError(f"not a LlamaConfig or GPT2Config: {type(config).__name__}")


def pass_flops(config, n_tokens: int, *, past_tokens: int = 0,
               logits_positions: int | None = None) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) of one forward pass.

    The pass processes ``n_tokens`` new tokens after ``past_tokens`` already in a KV cache:
    every layer's weights once per new token, causal attention (scores and weighted values)
    from each new token to itself and every earlier one, and the LM head for
    ``logits_positions`` positions (default: all ``n_tokens``; 1 for a pass that keeps only
    the last position's logits). Norms, activations and softmax are left out: they are a
    few percent at these sizes.
    """
    if n_tokens < 1 or past_tokens < 0:
        raise ValueError("n_tokens must be >= 1 and past_tokens >= 0")
    layers, per_layer, hidden, vocab, q_width = _matmul_shape(config)
    logits_positions = n_tokens if logits_positions is None else logits_positions
    keys = sum(past_tokens + j + 1 for j in range(n_tokens))  # keys each new token attends to
    weights = 2 * n_tokens * per_layer * layers
    attention = 2 * 2 * q_width * keys * layers
    head = 2 * logits_positions * hidden * vocab
    return weights + attention + head


def generation_flops(config, prompt_len: int, new_tokens: int) -> dict[str, int]:
    """FLOPs of generating ``new_tokens`` greedily after a ``prompt_len``-token prompt, three ways.

    ``naive``: one pass per step over the whole sequence so far, last-position logits only
    (:func:`generate_naive`); ``cached``: a prefill of the prompt, then one-token passes that
    read the cache (:func:`labkit.engine.loop.generate`; the last token is never fed back);
    ``check``: one pass over prompt + output with logits at every position
    (:func:`check_in_one_pass`).
    """
    naive = sum(pass_flops(config, prompt_len + k, logits_positions=1) for k in range(new_tokens))
    cached = pass_flops(config, prompt_len, logits_positions=1) + sum(
        pass_flops(config, 1, past_tokens=prompt_len + k - 1) for k in range(1, new_tokens))
    check = pass_flops(config, prompt_len + new_tokens)
    return {"naive": naive, "cached": cached, "check": check}


def _timed(fn) -> tuple[object, float, float]:
    """(result, wall seconds, process CPU seconds) of one call."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - cpu0


def time_in_turns(runners: dict, *, rounds: int, checks_per_round: int = 1,
                  check: str | None = None, warmup: int = 1) -> dict:
    """Time several calls in rounds, the way chapter 5 times its three paths.

    ``runners`` maps a name to a function of no arguments. Each round calls every runner once
    in order, except the one named ``check``, which is called ``checks_per_round`` times (a
    short call needs more samples than a long one to show its spread). Before the rounds,
    every runner is called ``warmup`` times untimed: the first calls pay one-time costs
    (allocations, packed weights, page faults).

    Returns ``{"timings": {name: Timing}, "results": {name: [return values]}, "log": [...]}``.
    ``log`` has one row per timed call in the order they ran: round, name, wall seconds,
    process CPU seconds, ``cpu_share`` = CPU seconds / (wall seconds x threads) (near 1 when
    the process had every core it asked for; well below 1 when it was waiting for a core, or
    for anything else) and the 1-minute load average read after the call.
    """
    if rounds < 1 or checks_per_round < 1 or warmup < 0:
        raise ValueError("rounds and checks_per_round must be >= 1, warmup >= 0")
    if check is not None and check not in runners:
        raise ValueError(f"check={check!r} is not one of the runners {list(runners)}")
    threads = torch.get_num_threads()
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    results: dict[str, list] = {name: [] for name in runners}
    log: list[dict] = []
    for r in range(rounds):
        for name, fn in runners.items():
            for _ in range(checks_per_round if name == check else 1):
                out, wall, cpu = _timed(fn)
                samples[name].append(wall)
                results[name].append(out)
                log.append({"round": r, "what": name, "wall_s": wall, "cpu_s": cpu,
                            "cpu_share": cpu / (wall * threads) if wall > 0 else 0.0,
                            "load_1min": os.getloadavg()[0]})
    timings = {name: Timing(name, s, warmup, threads, {"rounds": rounds})
               for name, s in samples.items()}
    return {"timings": timings, "results": results, "log": log}


def slowest_reading(log: Sequence[dict], what: str, *, slow: float = 1.5,
                    held_off: float = 0.7) -> str:
    """What the slowest timed call of ``what`` shows, in words a sentence can glue.

    If the slowest call took less than ``slow`` times the median call, the spread is small and
    the phrase says so. Otherwise it compares the slowest call's ``cpu_share`` with the median
    share: below ``held_off`` times it, the process got less of the cores during that call
    (other work on the machine, or waiting), so the extra time is not the call's own work;
    otherwise the process was busy for the whole call, so the extra time was spent computing.
    """
    rows = [row for row in log if row["what"] == what]
    if not rows:
        raise ValueError(f"no samples of {what!r} in the log")
    median_wall = statistics.median(row["wall_s"] for row in rows)
    median_share = statistics.median(row["cpu_share"] for row in rows)
    worst = max(rows, key=lambda row: row["wall_s"])
    ratio = worst["wall_s"] / median_wall
    if ratio < slow:
        return (f"the slowest call took {ratio:.2f} times the median, so the median stands "
                f"for every call")
    if worst["cpu_share"] < held_off * median_share:
        return (f"the slowest call took {ratio:.1f} times the median, and during it the process "
                f"used the cores only {worst['cpu_share']:.0%} of the time against "
                f"{median_share:.0%} in the median call: it was held off the CPU, so the extra "
                f"time was the machine's, not the call's")
    return (f"the slowest call took {ratio:.1f} times the median while the process used the "
            f"cores {worst['cpu_share']:.0%} of the time ({median_share:.0%} in the median "
            f"call): the extra time was spent computing (or spinning), not waiting for a core")


def against_prediction(low: float, high: float, predicted: float) -> str:
    """Where a predicted ratio falls against a measured interval [low, high], as the words
    "above", "below" or "within the interval of" the measured ratio would read: "the
    measured ratio was ``above`` the arithmetic's" when the whole interval exceeds it."""
    if low > high:
        raise ValueError("low must not exceed high")
    if low > predicted:
        return "above"
    if high < predicted:
        return "below"
    return "within the interval of"


def step_growth_reading(first_s: float, last_s: float, first_flops: float, last_flops: float,
                        *, flat: float = 1.3, near: float = 2.0) -> str:
    """How the time of a naive step grew from the first step to the last, against how its
    arithmetic grew, as a sentence to glue: time growth ``t = last_s / first_s`` and FLOP
    growth ``f = last_flops / first_flops``. Below ``flat`` the time "hardly grew"; within a
    factor ``near`` of ``f`` it grew "about as its arithmetic did"; otherwise it grew less
    (or more) than its arithmetic. Time is compared with arithmetic, not with a fixed bar, so
    the sentence says "as its arithmetic does" only where the two grew alike."""
    if min(first_s, last_s, first_flops, last_flops) <= 0 or flat < 1 or near < 1:
        raise ValueError("times and FLOPs must be positive, flat and near at least 1")
    t, f = last_s / first_s, last_flops / first_flops
    grew = f"{t:.1f} times from the first step to the last, against {f:.1f} times the FLOPs"
    if t < flat:
        return (f"On this machine the time of a naive step hardly grew with the text ({grew}): "
                f"at these lengths a pass is mostly the part that does not grow with its length "
                f"(reading every weight, starting each operator).")
    if t < f / near:
        return (f"The time of a naive step grew with the text, but much less than its "
                f"arithmetic ({grew}): a pass also has a part that does not grow with its "
                f"length (reading every weight, starting each operator).")
    if t <= f * near:
        return (f"The time of a naive step grew with the text about as its arithmetic did "
                f"({grew}).")
    return (f"The time of a naive step grew with the text faster than its arithmetic ({grew}): "
            f"something besides the FLOPs grew with the length on this machine.")


__all__ = [
    "against_prediction",
    "check_in_one_pass",
    "generate_naive",
    "generation_flops",
    "pass_flops",
    "slowest_reading",
    "step_growth_reading",
    "time_in_turns",
]

