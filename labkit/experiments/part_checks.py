"""Each replaceable part of engine v0, checked against an independent reference.

    part       reference                                   check
    tokenizer  transformers.AutoTokenizer (same GGUF)      identical ids and decoded text
    backend    transformers LlamaForCausalLM (same weights) max |logit diff|, argmax agreement
                                                           (near-ties excused), with and
                                                           without the KV cache
    sampler    transformers' logits warpers + softmax      same kept set, probabilities within
                                                           1e-6, every seeded draw inside the set
    loop       transformers generate(do_sample=False)      greedy tokens identical up to the
                                                           near-tie rule (labkit.util.near_tie)

Every check returns a :class:`CheckResult` whose ``passed`` is a plain bool, so a notebook can
print it as a checked output. A check that cannot fail proves nothing, so this module also
makes deliberately broken parts (``broken_*``): each check must FAIL on its broken part.

The module also holds the baseline throughput of engine v0 on a given number of threads; the
random-stream counts of the seeded sampler are in :mod:`labkit.experiments.sampler_streams`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.engine.contracts import LogitsModel, EngineModel, Loop, Sampler, TokenizerLike
from labkit.sampling import SamplingParams, probabilities, sample
from labkit.util.machine import memory_read_buffer_bytes
from labkit.util.near_tie import GreedyAgreement, flip_tolerance, greedy_agreement

__all__ = [
    "CheckResult",
    "check_tokenizer",
    "check_backend",
    "reference_distribution",
    "check_sampler",
    "check_loop",
    "greedy_paths_agree",
    "broken_tokenizer",
    "broken_backend",
    "broken_sampler",
    "broken_loop",
    "baseline_throughput",
    "interleaved_baselines",
    "BASELINE_STAGES",
    "thread_comparisons",
    "memory_rate_verdict",
    "MEMORY_BOUND_SHARE",
    "memory_read_bytes",
    "weight_stream_share",
    "comparison_rows",
]


@dataclass
class CheckResult:
    """The outcome of one part's check against its reference."""

    part: str
    reference: str
    check: str  # what is compared, in words
    measured: str  # what was found, in words and numbers
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL"

    def row(self) -> dict[str, Any]:
        """One row of the part -> reference -> check -> verdict table."""
        return {"part": self.part, "reference": self.reference, "check": self.check,
                "measured": self.measured, "verdict": self.verdict}


# --------------------------------------------------------------------------- tokenizer


def check_tokenizer(tokenizer: TokenizerLike, reference: Any, texts: Sequence[str]) -> CheckResult:
    """Encode every text with both tokenizers (no special tokens added) and decode our ids with
    both: pass when the ids and the decoded texts are identical for every text."""
    bad_ids, bad_text = [], []
    for text in texts:
        ours = list(tokenizer.encode(text))
        theirs = list(reference.encode(text, add_special_tokens=False))
        if ours != theirs:
            bad_ids.append(text)
        if tokenizer.decode(ours) != reference.decode(ours):
            bad_text.append(text)
    same = len(texts) - len(set(bad_ids) | set(bad_text))
    return CheckResult(
        part="tokenizer", reference=f"transformers {type(reference).__name__}",
        check="same ids (encode) and same text (decode)",
        measured=f"{same}/{len(texts)} texts identical",
        passed=not bad_ids and not bad_text and len(texts) > 0,
        details={"texts": len(texts), "ids_differ": bad_ids, "text_differs": bad_text},
    )


# --------------------------------------------------------------------------- backend


def _reference_logits(reference_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(torch.tensor([ids])).logits[0].float()


def _cached_logits(backend: LogitsModel, ids: list[int], split: int) -> torch.Tensor:
    """Logits of ``ids`` computed the way the loop does: prefill ``ids[:split]`` into a cache,
    then one token per call."""
    cache = backend.new_cache(batch=1, max_len=len(ids))
    parts = [backend(torch.tensor([ids[:split]]), cache=cache)[0]]
    parts += [backend(torch.tensor([[t]]), cache=cache)[0] for t in ids[split:]]
    return torch.cat(parts).float()


def check_backend(backend: LogitsModel, reference_model: Any, prompts: Sequence[list[int]], *,
                  atol: float = 1e-3) -> CheckResult:
    """Logits of every prompt (token ids) at every position, from one pass without a cache and
    from a prefill of the first half followed by one-token steps with the cache, against the
    reference's single pass. Pass when max |diff| <= ``atol`` and the argmax agrees everywhere
    but at near-ties: positions where the reference's gap between its argmax and ours is within
    twice that path's largest difference (:func:`~labkit.util.near_tie.flip_tolerance`), which
    rounding may break either way; they are counted in ``details["argmax_excused"]``."""
    diffs, agree, excused, positions, peak = {"one pass": 0.0, "cached": 0.0}, 0, 0, 0, 0.0
    for ids in prompts:
        ref = _reference_logits(reference_model, list(ids))
        peak = max(peak, float(ref.abs().max()))
        with torch.no_grad():
            full = backend(torch.tensor([list(ids)]))[0].float()
        cached = _cached_logits(backend, list(ids), max(1, len(ids) // 2))
        for path, ours in (("one pass", full), ("cached", cached)):
            diff = float((ours - ref).abs().max())
            diffs[path] = max(diffs[path], diff)
            mine, theirs = ours.argmax(-1), ref.argmax(-1)
            same = mine == theirs
            gap = ref.gather(-1, theirs[:, None]) - ref.gather(-1, mine[:, None])
            agree += int(same.sum())
            excused += int(((~same) & (gap[:, 0] <= flip_tolerance(diff))).sum())
            positions += ref.shape[0]
    max_diff = max(diffs.values())
    passed = max_diff <= atol and agree + excused == positions and positions > 0
    return CheckResult(
        part="backend", reference="transformers LlamaForCausalLM, same weights",
        check=f"max |logit diff| <= {atol:g} and same argmax, with and without the cache",
        measured=(f"max |diff| {max_diff:.1e} (|logits| up to {peak:.0f}); argmax {agree}/{positions}"
                  + (f" ({excused} near-ties excused)" if excused else "")),
        passed=passed,
        details={"max_abs_diff": max_diff, "max_abs_diff_one_pass": diffs["one pass"],
                 "max_abs_diff_cached": diffs["cached"], "argmax_agree": agree,
                 "argmax_excused": excused, "positions": positions,
                 "max_abs_logit": peak, "atol": atol},
    )


# --------------------------------------------------------------------------- sampler


def reference_distribution(logits: torch.Tensor, params: SamplingParams,
                           seen_token_ids: Sequence[int] | None = None) -> torch.Tensor:
    """The next-token distribution transformers' ``generate`` would sample from: its logits
    processors and warpers in its own order, then a softmax. Greedy params give the one-hot."""
    from transformers.generation import logits_process as lp

    scores = logits.detach().float().reshape(1, -1).clone()
    seen = torch.tensor([list(seen_token_ids or [0])], dtype=torch.long)
    steps: list[Any] = []
    if params.repetition_penalty != 1.0 and seen_token_ids:
        steps.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.greedy:
        for step in steps:
            scores = step(seen, scores)
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()[0]
    if params.temperature != 1.0:
        steps.append(lp.TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        steps.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        steps.append(lp.TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        steps.append(lp.MinPLogitsWarper(params.min_p))
    for step in steps:
        scores = step(seen, scores)
    return torch.softmax(scores, dim=-1)[0]


def check_sampler(sampler: Sampler, logits: torch.Tensor, settings: Sequence[SamplingParams], *,
                  distribution: Callable[[torch.Tensor, SamplingParams], torch.Tensor] = probabilities,
                  draws: int = 64, atol: float = 1e-6) -> CheckResult:
    """For each setting: the sampler's distribution (``distribution(logits, params)``) against
    :func:`reference_distribution` (same set of tokens with nonzero probability, and every
    probability within ``atol``), and ``draws`` seeded draws of ``sampler`` must all fall in
    the reference's kept set."""
    max_diff, set_mismatch, outside, kept_sizes = 0.0, 0, 0, []
    for params in settings:
        ref = reference_distribution(logits, params)
        ours = distribution(logits, params).float().reshape(-1)
        kept = ref > 0
        kept_sizes.append(int(kept.sum()))
        set_mismatch += int(not torch.equal(ours > 0, kept))
        max_diff = max(max_diff, float((ours - ref).abs().max()))
        for seed in range(draws):
            token = sampler(logits, params, seed=seed, step=0, seen_token_ids=None)
            outside += int(not kept[int(token)])
    n = len(settings)
    passed = set_mismatch == 0 and max_diff <= atol and outside == 0 and n > 0
    return CheckResult(
        part="sampler", reference="transformers Temperature/TopK/TopP warpers + softmax",
        check=f"same kept set, |p diff| <= {atol:g}, every draw in the kept set",
        measured=(f"kept sets equal {n - set_mismatch}/{n}; max |p diff| {max_diff:.1e}; "
                  f"draws outside {outside}/{n * draws}"),
        passed=passed,
        details={"settings": n, "kept_set_mismatches": set_mismatch, "max_abs_prob_diff": max_diff,
                 "draws": n * draws, "draws_outside": outside, "kept_sizes": kept_sizes},
    )


# --------------------------------------------------------------------------- loop


def _reference_greedy(reference_model: Any, prompt_ids: list[int], max_tokens: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(eos)] if eos in new else new  # our loop reports EOS as a finish reason


def greedy_paths_agree(model: Any, reference_model: Any, prompt_ids: Sequence[int],
                       ours: Sequence[int], theirs: Sequence[int]) -> GreedyAgreement:
    """Our greedy tokens ``ours`` against the reference's ``theirs`` (both continuing
    ``prompt_ids``), under the near-tie rule (:mod:`labkit.util.near_tie`). The reference's
    scores are its logits along its own tokens (one pass over prompt and ``theirs``); the
    tolerance is measured, not chosen: twice the largest difference between ``model``'s logits
    and the reference's on the positions the two share (up to and including the first where
    they differ), over the whole vocabulary. Our logits are taken both from one pass and, where
    ``model`` has a KV cache (``new_cache``), the way the loop that chose ``ours`` computes
    them: a prefill of the prompt, then one token per call. The cached path sums in other
    shapes and can differ from the reference where the one pass does not (bit-identical
    passes would otherwise give a tolerance of 0); a flip of our token at a reference gap
    ``g`` needs ``g`` within twice the difference on the path that chose it."""
    prompt_ids, ours, theirs = [int(i) for i in prompt_ids], [int(i) for i in ours], [int(i) for i in theirs]
    if not theirs:
        return greedy_agreement(theirs, ours, [], 0.0)
    ids = torch.tensor([prompt_ids + theirs])
    start = len(prompt_ids) - 1
    ref = _reference_logits(reference_model, ids[0].tolist())[start:start + len(theirs)]
    with torch.no_grad():
        mine = model(ids)[0].float()[start:start + len(theirs)]
    shared = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(ours), len(theirs)) - 1)
    shared = max(0, min(shared, len(theirs) - 1))
    error = float((mine[:shared + 1] - ref[:shared + 1]).abs().max())
    if hasattr(model, "new_cache"):
        with torch.no_grad():
            looped = _cached_logits(model, prompt_ids + theirs, len(prompt_ids))
        looped = looped[start:start + len(theirs)]
        error = max(error, float((looped[:shared + 1] - ref[:shared + 1]).abs().max()))
    return greedy_agreement(theirs, ours, ref, flip_tolerance(error), candidate_scores=mine)


def check_loop(loop: Loop, model: EngineModel, reference_model: Any, prompts: Sequence[str], *,
               max_tokens: int = 16) -> CheckResult:
    """Greedy continuation of each prompt by ``loop(model, prompt, params)`` against the
    reference's ``generate(do_sample=False)`` on the same prompt ids (encoded by the model's
    tokenizer): pass when every prompt's tokens are identical, or part only at a near-tie
    (:func:`greedy_paths_agree`: the reference's two candidates there within twice the measured
    difference of the two backends' logits); excused near-ties are counted, never hidden."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    eos = model.tokenizer.eos_token_id
    same, excused, first_divergence, failed, tolerances = 0, 0, [], 0, []
    for prompt in prompts:
        prompt_ids = list(model.tokenizer.encode(prompt))
        ours = list(loop(model, prompt, params).token_ids)
        theirs = _reference_greedy(reference_model, prompt_ids, max_tokens, eos)
        found = greedy_paths_agree(model, reference_model, prompt_ids, ours, theirs)
        tolerances.append(found.tolerance)
        same += int(found.exact)
        excused += int(found.excused)
        failed += int(not found.ok)
        if not found.exact:
            first_divergence.append(found.diverged_at)
    return CheckResult(
        part="loop", reference="transformers generate(do_sample=False)",
        check=f"greedy tokens identical up to the near-tie rule, {max_tokens} new tokens per prompt",
        measured=(f"{same}/{len(prompts)} prompts identical token for token"
                  + (f", {excused} parted at a near-tie (excused)" if excused else "")),
        passed=failed == 0 and len(prompts) > 0,
        details={"prompts": len(prompts), "identical": same, "excused": excused,
                 "first_divergence": first_divergence, "tolerances": tolerances},
    )


# --------------------------------------------------------------------------- broken parts


class _DropsToken:
    def __init__(self, tokenizer: TokenizerLike, token_id: int):
        self._tok, self._drop = tokenizer, token_id
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return [t for t in self._tok.encode(text) if t != self._drop]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def broken_tokenizer(tokenizer: TokenizerLike, token_id: int) -> TokenizerLike:
    """A tokenizer that silently drops every occurrence of ``token_id`` when encoding."""
    return _DropsToken(tokenizer, token_id)


class _Perturbed:
    def __init__(self, backend: LogitsModel, scale: float, seed: int):
        self._backend, self._scale, self._seed = backend, scale, seed
        self.tokenizer = getattr(backend, "tokenizer", None)

    def new_cache(self, *, batch: int = 1, max_len: int = 2048) -> Any:
        return self._backend.new_cache(batch=batch, max_len=max_len)

    def __call__(self, input_ids: torch.Tensor, cache: Any = None, last_only: bool = False) -> torch.Tensor:
        logits = self._backend(input_ids, cache=cache, last_only=last_only)
        gen = torch.Generator().manual_seed(self._seed + int(input_ids.sum()))
        return logits + self._scale * torch.randn(logits.shape, generator=gen).to(logits)


def broken_backend(backend: LogitsModel, scale: float = 1e-2, seed: int = 0) -> LogitsModel:
    """A backend whose logits carry Gaussian noise of standard deviation ``scale``."""
    return _Perturbed(backend, scale, seed)


def _ignore_top_k(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, top_k=0)


def broken_sampler() -> tuple[Sampler, Callable[[torch.Tensor, SamplingParams], torch.Tensor]]:
    """A sampler (and its distribution) that ignores ``top_k``: the (sampler, distribution)
    pair to pass to :func:`check_sampler`."""

    def sampler(logits, params, *, seed, step, seen_token_ids=None):
        return sample(logits, _ignore_top_k(params), seed=seed, step=step, seen_token_ids=seen_token_ids)

    def distribution(logits, params):
        return probabilities(logits, _ignore_top_k(params))

    return sampler, distribution


def broken_loop(loop: Loop) -> Loop:
    """A loop that drops the last token of the prompt before generating (an off-by-one)."""

    def dropping(model, prompt, params=None, *, chat=False, on_text=None):
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return loop(model, ids[:-1], params, chat=chat, on_text=on_text)

    return dropping




# --------------------------------------------------------------------------- baseline


def baseline_throughput(model: EngineModel, prompt: str, *, threads: int, new_tokens: int = 32,
                        repeats: int = 5, warmup: int = 1, loop: Loop | None = None) -> dict[str, Any]:
    """Greedy decode of exactly ``new_tokens`` tokens (EOS ignored), timed with
    :func:`labkit.util.timing.measure` on ``threads`` threads. The request time is the
    measured median; prefill and per-token decode times are medians over the same timed runs'
    :class:`~labkit.engine.loop.StageTimings`. The per-run samples travel with the row
    (``request_samples_s``, ``prefill_samples_s``, ``decode_step_samples_s``), so that two
    rows can be compared with their intervals (:func:`thread_comparisons`)."""
    from labkit.util.timing import measure
    from labkit.engine.loop import generate

    loop = loop or generate
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs = []
    timing = measure(lambda: runs.append(loop(model, prompt, params)), name=f"{threads} thread(s)",
                     repeats=repeats, warmup=warmup, threads=threads)
    timed = runs[warmup:]
    prefills = [r.timings.prefill for r in timed]
    steps = [r.timings.decode / len(r.timings.decode_steps) for r in timed]
    prefill, step = statistics.median(prefills), statistics.median(steps)
    return {
        "threads": timing.threads, "new_tokens": len(timed[-1].token_ids),
        "prompt_tokens": len(timed[-1].prompt_token_ids), "repeats": len(timing.samples),
        "request_s": timing.median, "request_spread": timing.spread,
        "tokens_per_s": new_tokens / timing.median, "prefill_ms": 1e3 * prefill,
        "decode_ms_per_token": 1e3 * step, "decode_tokens_per_s": 1.0 / step,
        "request_samples_s": list(timing.samples), "prefill_samples_s": prefills,
        "decode_step_samples_s": steps,
    }


def interleaved_baselines(model: EngineModel, prompt: str, *, threads: Sequence[int] = (1, 2),
                          new_tokens: int = 32, rounds: int = 5, warmup: int = 1,
                          loop: Loop | None = None,
                          extras: dict[str, Callable[[], Any]] | None = None,
                          extra_repeats: int = 3) -> list[dict[str, Any]]:
    """:func:`baseline_throughput` on each of `threads`, timed interleaved: round by round,
    one request on each thread count in turn (after `warmup` untimed requests on each), so
    that a drift of the machine's speed during the run falls on every thread count alike
    instead of on whichever ran last. Each of `extras` (a name and a call, such as a plain
    memory read) is timed `extra_repeats` times right after each request, on the same
    threads; its times travel as ``<name>_samples_s``. One row per thread count, in the
    fields of :func:`baseline_throughput`."""
    import time

    from labkit.engine.loop import generate
    from labkit.util.timing import Timing, num_threads

    if rounds < 3:
        raise ValueError(f"a comparison with an interval needs at least 3 rounds, got {rounds}")
    loop, extras = loop or generate, extras or {}
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    runs: dict[int, list] = {t: [] for t in threads}
    times: dict[int, list[float]] = {t: [] for t in threads}
    extra_times: dict[tuple[int, str], list[float]] = {(t, n): [] for t in threads for n in extras}
    for round_index in range(-warmup, rounds):
        for count in threads:
            with num_threads(count):
                start = time.perf_counter()
                run = loop(model, prompt, params)
                elapsed = time.perf_counter() - start
                for name, fn in extras.items():
                    for _ in range(extra_repeats):
                        begin = time.perf_counter()
                        fn()
                        if round_index >= 0:
                            extra_times[(count, name)].append(time.perf_counter() - begin)
            if round_index >= 0:
                runs[count].append(run)
                times[count].append(elapsed)
    rows = []
    for count in threads:
        timing = Timing(f"{count} thread(s)", times[count], warmup=warmup, threads=count)
        prefills = [r.timings.prefill for r in runs[count]]
        steps = [r.timings.decode / len(r.timings.decode_steps) for r in runs[count]]
        prefill, step = statistics.median(prefills), statistics.median(steps)
        row = {
            "threads": count, "new_tokens": len(runs[count][-1].token_ids),
            "prompt_tokens": len(runs[count][-1].prompt_token_ids), "repeats": rounds,
            "request_s": timing.median, "request_spread": timing.spread,
            "tokens_per_s": new_tokens / timing.median, "prefill_ms": 1e3 * prefill,
            "decode_ms_per_token": 1e3 * step, "decode_tokens_per_s": 1.0 / step,
            "request_samples_s": list(times[count]), "prefill_samples_s": prefills,
            "decode_step_samples_s": steps,
        }
        for name in extras:
            row[f"{name}_samples_s"] = extra_times[(count, name)]
        rows.append(row)
    return rows


# The stages whose samples a baseline row carries (with an added "memory_read" where a row has
# ``memory_read_samples_s``).
BASELINE_STAGES = ("request", "prefill", "decode_step")


def thread_comparisons(one: dict[str, Any], two: dict[str, Any],
                       stages: Sequence[str] = BASELINE_STAGES) -> dict[str, Any]:
    """Two threads against one, stage by stage, with bootstrap intervals.

    ``one`` and ``two`` are rows of :func:`baseline_throughput` (on one and on two threads);
    for each stage their ``<stage>_samples_s`` are compared with
    :func:`labkit.util.compare.compare`, two threads as ``a``, so each
    :class:`~labkit.util.compare.Comparison`'s ``ratio`` is median(one) / median(two), the
    speed-up of the second thread, and its verdict is "faster" only when the whole interval
    lies above 1."""
    from labkit.util.compare import compare

    return {stage: compare(two[f"{stage}_samples_s"], one[f"{stage}_samples_s"],
                           name_a="two threads", name_b="one thread")
            for stage in stages}


def memory_read_bytes(last_level_cache: int | None) -> int:
    """The size of a buffer whose sum reads main memory rather than a cache (four times the
    last-level cache, between 256 MiB and 1 GiB: a machine whose cache is larger than a
    quarter of that gets a buffer the cache may hold, and the chapter says so); the same
    buffer the machine line's memory read rate is measured on."""
    return memory_read_buffer_bytes(last_level_cache)


def weight_stream_share(row: dict[str, Any], weight_bytes: int, read_bytes: int
                        ) -> tuple[float, float, float]:
    """A decode step's weight-stream rate as a share of the plain read's rate, with the 95%
    bootstrap interval of the ratio of medians: ``(share, low, high)``.

    ``row`` is a :func:`baseline_throughput` row carrying ``memory_read_samples_s`` (times of
    a sum over ``read_bytes``); the step's rate is ``weight_bytes`` over its time, so the
    share is ``weight_bytes / read_bytes * median(read) / median(step)``. The step's time also
    holds sampling and Python, so its rate, and this share, are lower bounds."""
    from labkit.util.compare import compare

    times = compare(row["decode_step_samples_s"], row["memory_read_samples_s"],
                    name_a="decode step", name_b="memory read")  # ratio: read / step time
    scale = weight_bytes / read_bytes
    return scale * times.ratio, scale * times.low, scale * times.high


# A decode step whose weight stream runs at this share of a plain read's rate or more counts as
# set by memory bandwidth: a line drawn, not measured (the step also samples and runs Python).
MEMORY_BOUND_SHARE = 0.8


def memory_rate_verdict(step_gb_s: float, read_gb_s: float, *, close: float = MEMORY_BOUND_SHARE,
                        interval: tuple[float, float] | None = None) -> str:
    """Whether a decode step's weight stream ran near the memory's rate, in words.

    ``step_gb_s`` is the weight bytes a decode step reads divided by its time; ``read_gb_s``
    the rate of a plain sequential read on the same threads. At ``close`` (80%) of the plain
    read or more the step is limited by memory; below, memory bandwidth does not set its
    time on its own. With ``interval`` (the share's low and high, from
    :func:`weight_stream_share`) the verdict is taken only when the whole interval lies on one
    side of ``close``; an interval across it gets a clause that says the runs cannot tell.
    A clause for a glued sentence."""
    if step_gb_s <= 0 or read_gb_s <= 0:
        raise ValueError(f"rates must be positive, got {step_gb_s} and {read_gb_s}")
    low, high = interval if interval is not None else (step_gb_s / read_gb_s,) * 2
    if low > high:
        raise ValueError(f"the interval's low {low} exceeds its high {high}")
    if low >= close:
        return "the step ran close to the memory's rate, so memory bandwidth set its time"
    if high < close:
        return "memory bandwidth alone did not set the step's time"
    return (f"the interval reaches across {close:.0%} of the plain read, so these runs cannot "
            f"say whether memory bandwidth set the step's time")


def comparison_rows(comparisons: dict[str, Any], labels: dict[str, str] | None = None
                    ) -> list[dict[str, Any]]:
    """One table row per :class:`~labkit.util.compare.Comparison`: the stage (named by
    ``labels`` where given), the ratio of medians, its interval and the verdict."""
    labels = labels or {}
    return [{"stage": labels.get(stage, stage), "speedup_x": round(c.ratio, 2),
             f"{c.confidence:.0%} interval": f"{c.low:.2f}-{c.high:.2f}", "verdict": c.verdict}
            for stage, c in comparisons.items()]
