"""Speculative decoding as a measurement: when does guessing ahead pay?

Chapter 17 runs :func:`labkit.engine.speculative.speculative_generate` against plain greedy
decoding (:func:`labkit.engine.loop.generate`) on three kinds of text and several lookaheads
k, and sets the measured speed-up beside the one the arithmetic predicts.

The arithmetic. Each verification is one pass of the target over k + 1 positions (the last
accepted token and k guesses). If each guess is accepted with probability alpha,
independently, a verification yields on average

    E(alpha, k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

tokens. Measured in units of one plain decode step (a 1-token pass, cost 1), a verification
costs ``c_v(k + 1)`` (the cost of a (k+1)-token pass; about 1 on a GPU, more on a CPU) plus
``k * c_d`` for the drafts (``c_d``: one draft step; about 0 for prompt lookup), so

    predicted speed-up = E(alpha, k) / (c_v(k + 1) + k * c_d).

Also here: the text-type prompts, the sweep (interleaved timing through
:func:`labkit.util.timing.measure`), teacher-forced draft agreement (the acceptance rate a
greedy one-hot draft would have, from one pass), and a first-token check of the rejection
rule on a real distribution with two negative controls.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from labkit.util.compare import compare
from labkit.util.timing import Timing, measure, measure_interleaved
from labkit.engine.speculative import (LayerSkipDrafter, NgramDrafter, accept,
                                       expected_tokens_per_verification, speculative_generate)
from labkit.sampling import SamplingParams, step_generator

TEXT_TYPES = ("repetitive", "prose", "chat")

REPETITIVE_TEXTS = (
    "Opening hours:\n"
    "- Monday: 09:00 to 17:00, closed for lunch 12:00 to 13:00\n"
    "- Tuesday: 09:00 to 17:00, closed for lunch 12:00 to 13:00\n"
    "- Wednesday: 09:00 to 17:00, closed for lunch 12:00 to 13:00\n",
    "def test_add_1():\n    assert add(1, 1) == 2\n\n"
    "def test_add_2():\n    assert add(2, 2) == 4\n\n"
    "def test_add_3():\n    assert add(3, 3) == 6\n\n"
    "def test_add_4():\n    assert add(4, 4) == 8\n\n",
)

CHAT_QUESTIONS = (
    "Explain in one paragraph why the sky is blue.",
    "Give three tips for writing a clear email to a colleague.",
)


# -- the arithmetic ---------------------------------------------------------------------------

def predicted_speedup(alpha: float, k: int, verify_cost: float, draft_cost: float = 0.0) -> float:
    """Tokens/s of speculative decoding over plain decoding, from the closed form:
    E(alpha, k) / (verify_cost + k * draft_cost). `verify_cost` is the time of a (k+1)-token
    target pass and `draft_cost` that of one draft step, both divided by one plain 1-token
    decode step."""
    if verify_cost <= 0 or draft_cost < 0:
        raise ValueError("costs must be positive (draft_cost may be 0)")
    return expected_tokens_per_verification(alpha, k) / (verify_cost + k * draft_cost)


def break_even_alpha(k: int, verify_cost: float, draft_cost: float = 0.0, tol: float = 1e-9) -> float:
    """The smallest acceptance rate at which speculation is no slower than plain decoding
    (predicted speed-up 1); 0.0 if it pays even when every guess fails, nan if it cannot pay
    even when every guess succeeds. Bisection: the speed-up grows with alpha."""
    if predicted_speedup(0.0, k, verify_cost, draft_cost) >= 1.0:
        return 0.0
    if predicted_speedup(1.0, k, verify_cost, draft_cost) < 1.0:
        return float("nan")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if predicted_speedup(mid, k, verify_cost, draft_cost) >= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


# -- the prompts ------------------------------------------------------------------------------

def prose_passages(text: str, count: int, tokenizer, min_tokens: int = 100,
                   stride: int = 40) -> list[str]:
    """`count` passages of whole paragraphs of `text`, each at least `min_tokens` tokens long,
    taken `stride` paragraphs apart from the start (deterministic)."""
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80]
    out, i = [], 0
    while len(out) < count and i < len(paragraphs):
        chunk, j = paragraphs[i], i + 1
        while len(tokenizer.encode(chunk)) < min_tokens and j < len(paragraphs):
            chunk, j = chunk + "\n\n" + paragraphs[j], j + 1
        out.append(chunk + "\n\n")
        i += stride
    return out


def text_type_prompts(tokenizer, per_type: int = 1, prose_text: str | None = None) -> dict[str, list[list[int]]]:
    """Token ids of `per_type` (1 or 2) prompts of each text type: "repetitive" (a list
    and code that repeat a pattern), "prose" (paragraphs of labkit/data/eval's Python-docs prose,
    continued as plain text) and "chat" (a question in the chat template; the continuation
    is the assistant's answer)."""
    if not 1 <= per_type <= 2:
        raise ValueError("per_type must be 1 or 2")
    if prose_text is None:
        from labkit.eval import eval_text

        prose_text = eval_text()
    return {
        "repetitive": [tokenizer.encode(t) for t in REPETITIVE_TEXTS[:per_type]],
        "prose": [tokenizer.encode(t) for t in prose_passages(prose_text, per_type, tokenizer)],
        "chat": [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:per_type]],
    }


# -- drafters ---------------------------------------------------------------------------------

class CountedModule:
    """A model wrapper that counts its calls (`passes`) and the tokens they carried, and
    otherwise behaves as the model (attributes are forwarded)."""

    def __init__(self, module):
        self.module, self.passes, self.tokens = module, 0, 0

    def __call__(self, ids, *args, **kwargs):
        self.passes += 1
        self.tokens += int(ids.shape[-1])
        return self.module(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


def make_drafter(model, name: str):
    """"ngram" -> NgramDrafter(max_n=3); "layerskip-L" -> LayerSkipDrafter(model, L), whose
    draft model is wrapped in a :class:`CountedModule` so a run can report its draft passes."""
    if name == "ngram":
        return NgramDrafter(max_n=3, min_n=1)
    if name.startswith("layerskip-"):
        drafter = LayerSkipDrafter(model, int(name.split("-", 1)[1]))
        drafter.model = CountedModule(drafter.model)
        return drafter
    raise ValueError(f"unknown drafter {name!r}")


def draft_passes(drafter, prompt_len: int) -> int:
    """Passes of a layer-skip draft model during generation (its prefill of the prompt in
    `reset` left out), 0 for a drafter without a counted model. Per verification a greedy
    layer-skip draft makes one 1-token pass per guess, plus one catch-up pass over the last
    guess when every guess was accepted (the draft produced that token but never fed it
    through its own layers), so passes per guess exceed 1 exactly when guesses are accepted."""
    counted = getattr(drafter, "model", None)
    if not isinstance(counted, CountedModule):
        return 0
    return counted.passes - (1 if prompt_len > 1 else 0)


@torch.inference_mode()
def draft_agreement(model, layers: Iterable[int], prompt_ids: list[int], target_ids: list[int]) -> dict[int, float]:
    """Teacher-forced acceptance rate of a greedy layer-skip draft of each depth in `layers`:
    the share of positions of `target_ids` (the target's own greedy continuation of
    `prompt_ids`) where the draft's argmax equals the target token. Under greedy decoding a
    guess is checked only when every earlier guess was accepted, so its context is always the
    target's greedy output: this is the per-guess acceptance rate, from one pass per depth."""
    ids = torch.tensor([list(prompt_ids) + list(target_ids)])
    start, n = len(prompt_ids) - 1, len(target_ids)
    target = torch.tensor(target_ids)
    out = {}
    for depth in layers:
        draft = LayerSkipDrafter(model, depth).model
        guess = draft(ids)[0, start:start + n].argmax(-1)
        out[depth] = float((guess == target).double().mean())
    return out


# -- costs of the passes ------------------------------------------------------------------------

@torch.inference_mode()
def pass_costs(model, context_ids: list[int], sizes: Sequence[int], *, draft_layers: Sequence[int] = (),
               repeats: int = 5, warmup: int = 1) -> list[dict[str, Any]]:
    """Time one pass of the target over `n` new tokens after a cached context, for n in
    `sizes` (n = 1 is a plain decode step, n = k + 1 a verification), and one 1-token step of
    each layer-skip draft depth, all in turns (`measure_interleaved`: each of `repeats`
    rounds times every pass once), so that passes of neighbouring sizes can be compared
    sample by sample. Records: what ("target" or "draft-L"), tokens, layers, median_s,
    p25_s, p75_s, spread, repeats, samples (seconds), and relative (median / the target's
    1-token median)."""
    sizes = sorted(set(sizes) | {1})
    extra = list(context_ids[-max(sizes):])
    runners, shapes = {}, {}
    for what, module in [("target", model)] + [(f"draft-{d}", LayerSkipDrafter(model, d).model)
                                               for d in draft_layers]:
        cache = module.new_cache(1, len(context_ids) + max(sizes) + 1)
        module(torch.tensor([context_ids]), cache=cache, last_only=True)
        filled = cache.length
        for n in (sizes if what == "target" else [1]):
            ids = torch.tensor([extra[:n]])

            def step(ids=ids, cache=cache, filled=filled, module=module):
                cache.length = filled  # every pass starts from the same cached context
                return module(ids, cache=cache)

            runners[f"{what}-{n}"] = step
            shapes[f"{what}-{n}"] = (what, n, len(module.layers))
    timings = measure_interleaved(runners, rounds=repeats, warmup=warmup)
    rows = [{"what": what, "tokens": n, "layers": layers, "median_s": timings[name].median,
             "p25_s": timings[name].quantile(0.25), "p75_s": timings[name].quantile(0.75),
             "spread": timings[name].spread, "repeats": len(timings[name].samples),
             "samples": list(timings[name].samples)}
            for name, (what, n, layers) in shapes.items()]
    base = timings["target-1"].median
    for row in rows:
        row["relative"] = row["median_s"] / base
    return rows


# -- the sweep ----------------------------------------------------------------------------------

def interleaved(runners: Mapping[str, Callable[[], Any]], rounds: int) -> dict[str, Timing]:
    """Time several runners in turns (A, B, C, A, B, C, ...), one `measure` call per sample, so
    a slow spell of a shared machine falls on all of them alike. No warm-up here: warm the
    model up before (the first calls' one-time costs are not the runners')."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    threads = 0
    for _ in range(rounds):
        for name, fn in runners.items():
            timing = measure(fn, name=name, repeats=1, warmup=0)
            samples[name] += timing.samples
            threads = timing.threads
    return {name: Timing(name, s, warmup=0, threads=threads) for name, s in samples.items()}


def speculation_sweep(model, prompts: Mapping[str, Sequence[list[int]]],
                      configs: Sequence[tuple[str, int]], new_tokens: int, rounds: int = 2,
                      plain: Callable | None = None, prompt_offset: int = 0) -> list[dict[str, Any]]:
    """For every prompt of every text type, time plain greedy decoding and speculative greedy
    decoding with each (drafter name, k) of `configs`, interleaved over `rounds`.

    `plain(model, prompt_ids, params)` -> token ids defaults to labkit.engine.loop.generate.
    One record per (text type, prompt, system): text_type, prompt, drafter ("none" for plain),
    k (0 for plain), tokens, median_s, p25_s, p75_s, spread, repeats, samples_s (the timed
    samples, one per round, in round order), tokens_per_s, speedup (plain median / this
    median, same prompt), acceptance_rate, tokens_per_verification, verifications, proposed,
    accepted, draft_share (share of the speculative run's draft + verify time spent
    drafting), draft_s and verify_s (the last run's seconds in each), draft_passes (the last
    run's passes of a layer-skip draft model, :func:`draft_passes`; 0 otherwise),
    equal_to_plain (same token ids as plain greedy), token_ids (the output).
    `prompt_offset` is added to the prompt index."""
    if plain is None:
        from labkit.engine.loop import generate

        def plain(model, ids, params):
            return generate(model, ids, params).token_ids

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    records = []
    for text_type, items in prompts.items():
        for index, ids in enumerate(items):
            last: dict[str, Any] = {}

            def run_plain(ids=ids):
                last["plain"] = plain(model, ids, params)

            runners = {"plain": run_plain}
            for drafter_name, k in configs:
                def run_spec(ids=ids, drafter_name=drafter_name, k=k):
                    drafter = make_drafter(model, drafter_name)
                    tokens, stats = speculative_generate(model, ids, params, drafter, k=k)
                    last[(drafter_name, k)] = tokens, stats, draft_passes(drafter, len(ids))
                runners[(drafter_name, k)] = run_spec
            timings = interleaved(runners, rounds)
            base = timings["plain"].median
            for key, timing in timings.items():
                row = {"text_type": text_type, "prompt": index, "tokens": 0,
                       **_timing_summary(timing), "speedup": base / timing.median}
                if key == "plain":
                    tokens = last["plain"]
                    row.update(drafter="none", k=0, acceptance_rate=float("nan"),
                               tokens_per_verification=1.0, verifications=len(tokens),
                               proposed=0, accepted=0, draft_share=0.0, draft_s=0.0,
                               verify_s=0.0, draft_passes=0, equal_to_plain=True)
                else:
                    tokens, stats, passes = last[key]
                    spent = stats.draft_s + stats.verify_s
                    row.update(drafter=key[0], k=key[1], acceptance_rate=stats.acceptance_rate,
                               tokens_per_verification=stats.tokens_per_verification,
                               verifications=stats.verifications, proposed=stats.proposed,
                               accepted=stats.accepted,
                               draft_share=stats.draft_s / spent if spent else 0.0,
                               draft_s=stats.draft_s, verify_s=stats.verify_s,
                               draft_passes=passes,
                               equal_to_plain=list(tokens) == list(last["plain"]))
                row["prompt"] += prompt_offset
                row["tokens"] = len(tokens)
                row["tokens_per_s"] = len(tokens) / timing.median
                row["token_ids"] = list(tokens)
                records.append(row)
    return records


def chapter_sweep(model, prompts: Mapping[str, Sequence[list[int]]], ngram_ks: Sequence[int],
                  layerskip_layers: int, layerskip_ks: Sequence[int], new_tokens: int,
                  rounds: int = 2, plain: Callable | None = None) -> list[dict[str, Any]]:
    """Chapter 17's sweep: on the first prompt of each text type, plain decoding against
    prompt lookup ("ngram") at every k of `ngram_ks` and a layer-skip draft of
    `layerskip_layers` layers at every k of `layerskip_ks`; on the other prompts, plain
    against prompt lookup only (the layer-skip draft is the expensive one). Records as
    :func:`speculation_sweep`."""
    ngram = [("ngram", k) for k in ngram_ks]
    skip = [(f"layerskip-{layerskip_layers}", k) for k in layerskip_ks]
    records = speculation_sweep(model, {t: v[:1] for t, v in prompts.items()}, ngram + skip,
                                new_tokens, rounds, plain)
    rest = {t: v[1:] for t, v in prompts.items() if len(v) > 1}
    if rest:
        records += speculation_sweep(model, rest, ngram, new_tokens, rounds, plain, prompt_offset=1)
    return records


def verification_error(model, prompt_ids: list[int], tokens: Sequence[int],
                       step_logits: Sequence[torch.Tensor], width: int) -> float:
    """Largest |logit difference| between one pass over the first `width` greedy `tokens`
    after the prompt (as a verification computes them: `width` rows in one call) and the
    one-token steps that chose them (`step_logits[i]` chose `tokens[i]`). That is the
    rounding difference between the two numerical paths speculation compares, measured."""
    width = min(width, len(tokens) - 1)
    if width < 1:
        return 0.0
    with torch.inference_mode():
        cache = model.new_cache(1, len(prompt_ids) + width + 1)
        model(torch.tensor([list(prompt_ids)]), cache=cache, last_only=True)
        rows = model(torch.tensor([list(tokens[:width])]), cache=cache)[0].float()
    return max(float((rows[i] - step_logits[i + 1].float()).abs().max()) for i in range(width))


def plain_agreement(model, prompts: Mapping[str, Sequence[list[int]]], records: Sequence[dict[str, Any]],
                    width: int, logit_error: float | None = None) -> tuple[Any, float]:
    """Every record of :func:`speculation_sweep` (plain and speculative) against the one-token
    greedy loop's tokens and logits for its prompt (`labkit.engine.loop.greedy_decode`),
    under the near-tie rule (`labkit.experiments.path_agreement`): a verification computes
    k + 1 rows in one call, a plain step one, so their logits may differ in the last bits,
    and a divergence where the loop's two best tokens were that close is excused and
    counted. Returns (the `AgreementSummary`, one sequence per record in order, and the
    largest `verification_error` measured over the prompts with `width` rows)."""
    from labkit.engine.loop import greedy_decode
    from labkit.experiments import path_agreement as pa

    references, measured = {}, 0.0
    for text_type, items in prompts.items():
        for index, ids in enumerate(items):
            longest = max((len(r["token_ids"]) for r in records
                           if r["text_type"] == text_type and r["prompt"] == index), default=0)
            if longest == 0:
                continue
            run = greedy_decode(model, ids, longest, keep_logits=True)
            references[text_type, index] = run
            measured = max(measured, verification_error(model, ids, run.token_ids, run.logits, width))
    refs = [references[r["text_type"], r["prompt"]] for r in records]
    summary = pa.compare([ref.token_ids[:len(r["token_ids"])] for ref, r in zip(refs, records)],
                         [r["token_ids"] for r in records],
                         [ref.logits for ref in refs],
                         logit_error=pa.LOGIT_ERROR if logit_error is None else logit_error)
    return summary, measured


def add_predictions(records: Iterable[dict[str, Any]], verify_cost: Mapping[int, float],
                    draft_cost: Mapping[str, float]) -> list[dict[str, Any]]:
    """Copy each speculative record with expected_tpv (E(alpha, k) from its measured acceptance
    rate) and predicted_speedup (:func:`predicted_speedup` with the relative cost of a
    (k+1)-token pass from `verify_cost` {tokens: relative} and the relative cost of one draft
    step from `draft_cost` {drafter name: relative}, 0 where absent). Plain rows are dropped."""
    out = []
    for row in records:
        if row["drafter"] == "none":
            continue
        alpha, k = row["acceptance_rate"], int(row["k"])
        cost = draft_cost.get(row["drafter"], 0.0)
        out.append({**row, "expected_tpv": expected_tokens_per_verification(alpha, k),
                    "predicted_speedup": predicted_speedup(alpha, k, verify_cost[k + 1], cost)})
    return out


def _timing_summary(timing: Timing) -> dict[str, Any]:
    return {"median_s": timing.median, "p25_s": timing.quantile(0.25),
            "p75_s": timing.quantile(0.75), "spread": timing.spread, "repeats": len(timing.samples),
            "samples_s": list(timing.samples)}


# -- verdicts from the samples -------------------------------------------------------------------

RELATION = {"faster": "faster than", "slower": "slower than", "within the noise": "within the noise of"}


def pooled_speedups(records: Iterable[dict[str, Any]], confidence: float = 0.95) -> list[dict[str, Any]]:
    """One row per (text_type, drafter, k) of the speculative records: the speed-up over plain
    decoding of the same prompts, with its bootstrap interval and verdict
    (:func:`labkit.util.compare.compare`). Round r's sample of a setting is the sum, over the
    setting's prompts, of each prompt's r-th timed run; plain decoding is pooled over the same
    prompts. Each prompt's runs are interleaved with its own plain runs, but two prompts may
    be timed in different sweep calls (:func:`chapter_sweep` times the first prompts apart
    from the others), so a summed round pairs runs of one round number, not of one moment.
    The interval covers the round-to-round noise of these prompts' timings, not the spread
    between prompts (see the per-prompt `speedup` of the records). Row: text_type,
    drafter, k, prompts, speedup_x (median plain total / median speculative total), low_x,
    high_x, verdict ("faster", "slower", "within the noise"), relation ("faster than", ...),
    interval (the ratio and interval in words), acceptance_rate and tokens_per_verification
    (pooled over the prompts' runs), draft_share (mean)."""
    records = list(records)
    plain = {(r["text_type"], r["prompt"]): r["samples_s"] for r in records if r["drafter"] == "none"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r["drafter"] != "none":
            groups.setdefault((r["text_type"], r["drafter"], int(r["k"])), []).append(r)
    out = []
    for (text_type, drafter, k), rows in groups.items():
        spec_total = [sum(s) for s in zip(*(r["samples_s"] for r in rows))]
        plain_total = [sum(s) for s in zip(*(plain[text_type, r["prompt"]] for r in rows))]
        c = compare(spec_total, plain_total, name_a="speculative", name_b="plain",
                    confidence=confidence)
        proposed = sum(r["proposed"] for r in rows)
        verifications = sum(r["verifications"] for r in rows)
        accepted = sum(r["accepted"] for r in rows)
        out.append({"text_type": text_type, "drafter": drafter, "k": k, "prompts": len(rows),
                    "speedup_x": c.ratio, "low_x": c.low, "high_x": c.high, "verdict": c.verdict,
                    "relation": RELATION[c.verdict], "interval": c.interval_text(),
                    "acceptance_rate": accepted / proposed if proposed else 0.0,
                    "tokens_per_verification": (accepted + verifications) / verifications,
                    "draft_share": sum(r["draft_share"] for r in rows) / len(rows)})
    return out


def draft_cost_per_guess(records: Iterable[dict[str, Any]], step_s: float) -> list[dict[str, Any]]:
    """For each layer-skip record, what its draft cost per guess, in units of `step_s` (one
    1-token decode step of the target): passes_per_guess (draft passes / guesses proposed),
    pass_steps (draft seconds per pass / step_s) and guess_steps (draft seconds per guess /
    step_s = their product). Prompt lookup has no draft passes and is left out."""
    out = []
    for r in records:
        if not str(r["drafter"]).startswith("layerskip") or not r["proposed"] or not r["draft_passes"]:
            continue
        out.append({"text_type": r["text_type"], "prompt": r["prompt"], "drafter": r["drafter"],
                    "k": int(r["k"]), "acceptance_rate": r["acceptance_rate"],
                    "passes_per_guess": r["draft_passes"] / r["proposed"],
                    "pass_steps": r["draft_s"] / r["draft_passes"] / step_s,
                    "guess_steps": r["draft_s"] / r["proposed"] / step_s})
    return out


def break_even_text(alpha: float) -> str:
    """A break-even acceptance rate (:func:`break_even_alpha`) in words for the prose."""
    if alpha != alpha:  # nan
        return "cannot break even, even if every guess is accepted"
    if alpha == 0.0:
        return "pays even if every guess fails"
    return f"breaks even at an acceptance rate of {alpha:.2f}"


# -- readings that claim a difference only beyond a stated margin ----------------------------------

COST_MARGIN = 0.15
"""Relative difference below which two timed costs of a pass are read as the same. Chapter
17's isolated pass timings on a shared 2-core machine have quartile spreads (IQR / median)
of up to about 10% for a draft step and 4-8% for the target's passes (its full run's
`pass_costs.csv`); a ratio of two such medians moves by about their sum."""


def cost_relation(measured: float, reference: float, margin: float = COST_MARGIN) -> str:
    """`measured` against `reference` (two costs in one unit) in words for the prose:
    "more than" or "less than" only beyond `margin` (relative), else "about the same as"."""
    if measured <= 0 or reference <= 0:
        raise ValueError("costs are positive")
    if measured > reference * (1 + margin):
        return "more than"
    if measured < reference / (1 + margin):
        return "less than"
    return "about the same as"


def _and(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def c_kernel_rows(model) -> int:
    """The most tokens a pass of `model` can carry and still multiply through labkit's C
    matrix-vector kernel here, 0 where no pass does. It reads the rule of
    :class:`labkit.kernels.packed.PackedLinear` off this model on this machine: every matrix
    packed with `native_gemv`, float32, and the C library built (`native.load()`); then
    passes of up to the matrices' `max_rows` tokens (`native.gemv_max_rows()` when they were
    packed) take the C kernel and wider ones oneDNN's."""
    from labkit.kernels import native
    from labkit.kernels.packed import PackedLinear
    from labkit.models.llama import MATRICES

    layers = getattr(model, "layers", None)
    if not layers:
        return 0
    matrices = [getattr(layer, name, None) for layer in layers for name in MATRICES]
    matrices.append(getattr(model, "lm_head", None))
    if not all(isinstance(m, PackedLinear) and m.native_gemv and m.weight.dtype == torch.float32
               for m in matrices):
        return 0
    return min(m.max_rows for m in matrices) if native.load() is not None else 0


def dispatch_reading(c_rows: int, relative: Mapping[int, float], margin: float = COST_MARGIN) -> str:
    """Which kernel the target's passes of each size took (`c_rows` from
    :func:`c_kernel_rows`) and whether that shaped the measured pass costs (`relative`:
    {tokens: time / one decode step}), in sentences for the prose. A pass on the C kernel
    that cost more than the first pass on oneDNN beyond `margin` is a hump made by the
    dispatch threshold, not by the text or the lookahead, and is named as such."""
    if c_rows <= 0:
        return ("Here no pass went through labkit's C matrix-vector kernel: every size used "
                "the same library kernels, so no change of kernel lies inside the curve.")
    head = (f"Here passes of 1 to {c_rows} tokens went through labkit's C matrix-vector "
            f"kernel and passes of {c_rows + 1} or more through oneDNN's blocked kernel")
    after = relative.get(c_rows + 1)
    if after is None:
        return head + "; the sizes measured do not reach that change of kernel."
    dearer = [n for n in sorted(relative)
              if n <= c_rows and cost_relation(relative[n], after, margin) == "more than"]
    if not dearer:
        return (head + f"; no pass on the C kernel cost more than a {c_rows + 1}-token pass "
                f"on oneDNN beyond {margin:.0%}, so the curve has no hump where the kernel "
                "changes.")
    sizes = _and([str(n) for n in dearer])
    costs = _and([f"{relative[n]:.2f}" for n in dearer])
    ks = _and([str(n - 1) for n in dearer])
    return (head + f". Passes of {sizes} tokens, on the C kernel, cost more than a "
            f"{c_rows + 1}-token pass on oneDNN ({costs} against {after:.2f} decode steps): "
            "the hump in the curve is that change of kernel, an effect of where the engine "
            "switches kernels, not of the text or of the lookahead, and the break-even rates "
            f"and speed-ups at k = {ks} carry it.")


def best_setting_reading(rows: Sequence[Mapping[str, Any]], best: Mapping[str, Any]) -> str:
    """What the fastest setting of :func:`pooled_speedups` (`best`, one of `rows`) shows, in
    words that claim no more than the sweep: whether its k is the largest tried on its text
    and drafter (then it is the best tried, not an optimum), and whether its interval
    overlaps those of the other k (then the sweep does not single it out)."""
    same = [r for r in rows if r["text_type"] == best["text_type"] and r["drafter"] == best["drafter"]]
    ks = sorted(int(r["k"]) for r in same)
    k = int(best["k"])
    if k == ks[-1] and len(ks) > 1:
        edge = f"k = {k} is the largest lookahead tried, so it is the best tried, not an optimum"
    else:
        edge = f"k = {k} lies within the lookaheads tried ({ks[0]} to {ks[-1]})"
    close = sorted(int(r["k"]) for r in same
                   if int(r["k"]) != k and float(r["high_x"]) >= float(best["low_x"]))
    if close:
        return (f"{edge}; its interval overlaps that of k = {_and([str(c) for c in close])}, "
                "so the sweep does not single it out")
    return f"{edge}; its interval lies above those of the other lookaheads on this text"


# -- the rejection rule on a real distribution -------------------------------------------------

RULES = ("rejection", "resample_from_p", "draft_only")


def first_token_draws(p: torch.Tensor, q: torch.Tensor, draws: int, rule: str = "rejection",
                      seed: int = 0) -> torch.Tensor:
    """Counts [V] of the first output token over `draws` independent trials of one guess x ~ q
    checked against the target's p. Rules: "rejection" (labkit's `accept`: keep x with
    probability min(1, p(x)/q(x)), else draw from the residual max(0, p - q)), and two negative
    controls: "resample_from_p" (on rejection draw from p itself: a common bug) and
    "draft_only" (always keep x, i.e. sample the draft). Trial i uses its own stream (seed, i)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}")
    p, q = p.double(), q.double()
    both = torch.stack([p, p])  # accept() wants a row per guess plus the bonus row
    counts = torch.zeros(p.numel(), dtype=torch.float64)
    for i in range(draws):
        gen = step_generator(seed, i)
        x = int(torch.multinomial(q, 1, generator=gen))
        if rule == "rejection":
            n_ok, extra = accept(both, [x], q[None], gen)
            token = x if n_ok == 1 else extra
        elif rule == "resample_from_p":
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            token = x if u < min(1.0, float(p[x] / q[x])) else int(torch.multinomial(p, 1, generator=gen))
        else:
            token = x
        counts[token] += 1
    return counts


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Chi-square goodness-of-fit p-value of `counts` against `expected_probs`, over the tokens
    whose expected count is at least `min_expected` plus one bin for all the others.
    Returns (p-value, number of bins)."""
    from scipy.stats import chisquare

    counts, probs = counts.double(), expected_probs.double() / expected_probs.double().sum()
    total = float(counts.sum())
    keep = probs * total >= min_expected
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([probs[keep], probs[~keep].sum()[None]]) * total
    if float(exp[-1]) < min_expected:  # the rest bin is too small to test: fold it away
        obs, exp = obs[:-1], exp[:-1]
        exp = exp / exp.sum() * obs.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue), int(obs.numel())


def overlap(p: torch.Tensor, q: torch.Tensor) -> float:
    """sum_x min(p(x), q(x)): the probability that the rejection rule accepts a guess x ~ q."""
    return float(torch.minimum(p.double(), q.double()).sum())
