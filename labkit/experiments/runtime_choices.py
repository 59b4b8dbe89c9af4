"""One runtime choice at a time: which greedy outputs change, and why there (chapter 24).

The model defines a function from tokens to logits. The runtime decides how to compute it:
how a prompt is cut into chunks, which attention kernel sums the scores, how the cache is
laid out, how prompts share a batch, in what precision. Each choice leaves the mathematics
unchanged and changes the order or precision of floating-point sums, so the logits move by
a rounding error. A greedy token changes only where the model's top two candidates were
closer than that error.

Every runtime here produces, for each prompt, ``new_tokens`` greedy tokens (EOS ignored, so
every run has the same length) and the raw log-probabilities of the 20 most likely tokens
at every step (:class:`GreedyRun`). :func:`compare_runs` holds a run to the baseline's under
the book's near-tie rule (:mod:`labkit.util.near_tie`, the one definition the tests and
chapters share): the first step where the tokens differ, both runs' margins there (top-1
minus top-2 log-probability; a difference of log-probabilities is a difference of logits),
whether the rule excuses the divergence, and the largest change of the top-20
log-probabilities at the first generated position (the end of the prompt, before any token
differs). The rule's tolerance for a runtime is twice a stated bound on its error
(:attr:`RuntimeChoice.logit_error`: :data:`labkit.experiments.path_agreement.LOGIT_ERROR`
for float32, ``BF16_LOGIT_ERROR`` for bfloat16), never twice the error of the run it judges:
at a flip between two top-20 tokens the runtime's own change is at least half the gap, so a
tolerance taken from the same steps would excuse every such flip. The measured error
(:func:`runtime_error`, the largest change of the baseline's top-20 log-probabilities on any
step where both had seen the same tokens) is checked against the bound instead.

Runtimes on the model itself (a contiguous cache, one prompt at a time unless padded):

- ``baseline``: whole-prompt prefill, a preallocated cache read up to its filled length,
  PyTorch SDPA's causal kernel for a whole prompt, the chunk's mask after cached positions
  (``labkit.models.llama.grouped_attention``);
- ``chunked(n)``: the prompt prefilled ``n`` tokens per forward call;
- ``math attention``: softmax(QK^T / sqrt(d)) V written out (:class:`MathAttentionCache`);
- ``static cache``: every step attends over all ``max_len`` slots with the unfilled ones
  masked, as a fixed-shape (CUDA-graph friendly) runtime does (:class:`StaticShapeCache`);
- ``padded batch``: all prompts in one batch, left-padded to the longest, pad keys masked
  (:class:`PaddedBatchCache`); positions count from the batch's first slot, which RoPE,
  depending only on distances, turns into the same scores up to rounding;
Runtimes through the serving engine (:func:`engine_runtime`): the paged pool with the
engine's own kernels (labkit's C attention, oneDNN-packed float32 weights, bfloat16 weights
and activations, the model file's quantized blocks), one request at a time or all at once.
PyTorch's own bfloat16 matrix products are slow on a CPU without bfloat16 instructions, so
bfloat16 runs on the engine's kernels (``weights="bf16"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from labkit.engine.backends import ReferenceBackend
from labkit.engine.llm_engine import EngineConfig, LLMEngine
from labkit.engine.scheduler import SchedulerConfig
from labkit.experiments.path_agreement import BF16_LOGIT_ERROR, LOGIT_ERROR
from labkit.models.llama import KVCache
from labkit.sampling import SamplingParams
from labkit.util.near_tie import AgreementSummary, GreedyAgreement, flip_tolerance, greedy_agreement

TOP = 20  # log-probabilities kept per step (the engine reports at most 20)

# Twelve prompts: eight written here (chat turns through the model's template, code, prose,
# lists) and four passages of the evaluation text (:func:`prompt_set` adds them), so that
# chunked prefill has long prompts to cut.
WRITTEN_PROMPTS = (
    ("chat", "What is the capital of France? Answer in one sentence."),
    ("chat", "Explain in two sentences why the sky is blue."),
    ("chat", "Write a haiku about a cache that is always full."),
    ("chat", "Give three tips for writing readable Python code."),
    ("text", "def fibonacci(n):\n    if n < 2:\n        return n\n"),
    ("text", "The three primary colours are"),
    ("text", "Once upon a time, in a small village by the sea, there lived"),
    ("text", "An inference engine takes a trained model and a request, and it must"),
)
PASSAGE_TOKENS = (48, 96, 160, 256)  # lengths of the four evaluation-text prompts
PASSAGE_STRIDE = 2_000               # tokens between the passages' starts


def prompt_set(tokenizer, eval_ids: list[int], count: int = 12) -> list[list[int]]:
    """The chapter's prompts as token ids: the written ones (chat turns through the
    tokenizer's chat template), then passages of `eval_ids`; the first `count`."""
    prompts = []
    for kind, text in WRITTEN_PROMPTS:
        if kind == "chat":
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
        prompts.append(tokenizer.encode(text))
    for i, length in enumerate(PASSAGE_TOKENS):
        start = i * PASSAGE_STRIDE
        if start + length > len(eval_ids):
            raise ValueError(f"the evaluation ids hold {len(eval_ids)} tokens; passage {i} "
                             f"needs {start + length}")
        prompts.append(eval_ids[start:start + length])
    return prompts[:count]


# -- one greedy run ------------------------------------------------------------------------

@dataclass
class GreedyRun:
    """One prompt's greedy tokens and, per step, the TOP most likely (token, log-prob)."""

    tokens: list[int]
    top: list[list[tuple[int, float]]]

    def margin(self, step: int) -> float:
        """Top-1 minus top-2 log-probability at `step`: how near the choice was to a tie."""
        return self.top[step][0][1] - self.top[step][1][1]


def top_logprobs(logits: torch.Tensor, k: int = TOP) -> list[tuple[int, float]]:
    """The k largest raw log-probabilities of one logits row, largest first, lower token id
    first on ties (the engine's order, and greedy's choice)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(k + 8, logprobs.numel()))
    pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
    return pairs[:k]


def _greedy_steps(step_fn: Callable[[list[int] | None], torch.Tensor], rows: int,
                  new_tokens: int) -> list[GreedyRun]:
    """Drive `rows` sequences for `new_tokens` greedy steps. step_fn(None) runs the prompts
    and step_fn(tokens) one decode step; each returns logits [rows, vocab]."""
    runs = [GreedyRun([], []) for _ in range(rows)]
    logits = step_fn(None)
    for step in range(new_tokens):
        for row, run in enumerate(runs):
            top = top_logprobs(logits[row])
            run.top.append(top)
            run.tokens.append(top[0][0])
        if step + 1 < new_tokens:
            logits = step_fn([run.tokens[-1] for run in runs])
    return runs


def contiguous_runtime(model, prompts: list[list[int]], new_tokens: int, chunk: int | None = None,
                       cache_type: type[KVCache] = KVCache) -> list[GreedyRun]:
    """Greedy runs one prompt at a time on a contiguous cache of type `cache_type`, the
    prompt prefilled in one call or `chunk` tokens per call."""
    runs = []
    for prompt in prompts:
        cache = cache_type.empty(model.config, 1, len(prompt) + new_tokens, model.dtype, model.device)

        def step(tokens, prompt=prompt, cache=cache):
            if tokens is not None:
                return model(torch.tensor([tokens]), cache)[:, -1]
            size = chunk or len(prompt)
            for start in range(0, len(prompt), size):
                logits = model(torch.tensor([prompt[start:start + size]]), cache, last_only=True)
            return logits[:, -1]

        runs += _greedy_steps(step, 1, new_tokens)
    return runs


# -- caches that change how attention is computed ------------------------------------------

class MathAttentionCache(KVCache):
    """The contiguous cache, with attention written out: scores, mask, softmax, weighted sum."""

    def attend(self, layer, q, k, v):
        keys, values = self.store(layer, k, v)
        start, end = self.length, keys.shape[2]
        scores = q @ keys[:, :, None].transpose(-1, -2) / math.sqrt(q.shape[-1])
        q_pos = torch.arange(start, end)[:, None]
        scores = scores.masked_fill(torch.arange(end)[None, :] > q_pos, float("-inf"))
        return torch.softmax(scores, dim=-1) @ values[:, :, None]


class StaticShapeCache(KVCache):
    """The contiguous cache read whole on every step: all max_len slots, the unfilled ones
    masked, so every step's attention has the same shape."""

    def attend(self, layer, q, k, v):
        self.store(layer, k, v)
        batch = q.shape[0]
        return _masked_attention(q, self.keys[layer, :batch], self.values[layer, :batch], self.length,
                                 torch.ones(batch, self.max_len, dtype=torch.bool))


class PaddedBatchCache(KVCache):
    """A batch of left-padded prompts: row i's first `pads[i]` slots hold padding that no
    real token may see."""

    pads: torch.Tensor

    def attend(self, layer, q, k, v):
        keys, values = self.store(layer, k, v)
        valid = torch.arange(keys.shape[2])[None, :] >= self.pads[:, None]
        return _masked_attention(q, keys, values, self.length, valid)


def _masked_attention(q, k, v, q_start: int, valid: torch.Tensor) -> torch.Tensor:
    """SDPA of q [B, kv, group, T, D] over k, v [B, kv, S, D]: causal, and only the keys
    `valid` [B, S] marks, except that a query always sees its own slot (so a padding query,
    which sees no valid key, gets a finite output that nothing reads)."""
    batch, kv_heads, group, steps, dim = q.shape
    keys = k.shape[2]
    q_pos = torch.arange(q_start, q_start + steps).repeat(group)            # [group*T]
    key_pos = torch.arange(keys)
    causal = key_pos[None, :] <= q_pos[:, None]                              # [group*T, S]
    own = key_pos[None, :] == q_pos[:, None]
    mask = causal[None] & (valid[:, None, :] | own[None])                    # [B, group*T, S]
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, group * steps, dim), k, v,
                                         attn_mask=mask[:, None])
    return out.reshape(batch, kv_heads, group, steps, dim)


def padded_batch_runtime(model, prompts: list[list[int]], new_tokens: int, pad_id: int = 0) -> list[GreedyRun]:
    """All prompts in one batch, left-padded to the longest, then decoded together."""
    longest = max(len(p) for p in prompts)
    cache = PaddedBatchCache.empty(model.config, len(prompts), longest + new_tokens, model.dtype, model.device)
    cache.pads = torch.tensor([longest - len(p) for p in prompts])
    batch = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])

    def step(tokens):
        if tokens is None:
            return model(batch, cache, last_only=True)[:, -1]
        return model(torch.tensor(tokens)[:, None], cache)[:, -1]

    return _greedy_steps(step, len(prompts), new_tokens)


# -- the serving engine --------------------------------------------------------------------

class NativeAttentionBackend(ReferenceBackend):
    """The model's weights as loaded (F.linear), with labkit's C paged-attention kernel:
    only the attention kernel differs from the reference backend."""

    name = "reference + C attention"
    native_attention = True


def engine_runtime(model, prompts: list[list[int]], new_tokens: int, *, together: bool = False,
                   backend=None, weights: str | None = "f32") -> list[GreedyRun]:
    """Greedy runs through the serving engine: one request at a time (whole-prompt prefill,
    so only the paged cache and the kernels differ from the baseline) or all requests queued
    at once (continuous batching, 512-token steps)."""
    longest = max(len(p) for p in prompts)
    scheduler = SchedulerConfig(max_batched_tokens=512 if together else max(512, longest))
    # a pool just large enough for every sequence at once (a larger one costs time to zero)
    pool = sum(len(p) + new_tokens + 16 for p in prompts)
    config = EngineConfig(kv_cache_tokens=16 * -(-pool // 16), prefix_caching=False, weights=weights,
                          scheduler=scheduler, backend=backend)
    engine = LLMEngine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    groups = [prompts] if together else [[p] for p in prompts]
    runs = []
    for group in groups:
        for out in engine.generate(group, params):
            sample = out.samples[0]
            top = [sorted(pairs, key=lambda p: (-p[1], p[0])) for pairs in sample.top_logprobs]
            runs.append(GreedyRun(list(sample.token_ids), [list(t) for t in top]))
    engine.check_invariants()
    return runs


# -- holding a run to the baseline ---------------------------------------------------------

@dataclass(frozen=True)
class Divergence:
    """How one prompt's run under a runtime compares with the baseline's."""

    prompt: int
    identical: bool
    first_step: int | None          # first step whose token differs (None: none does)
    baseline_margin: float | None   # the baseline's top-1 minus top-2 there
    runtime_margin: float | None    # the runtime's own margin there
    baseline_token: int | None
    runtime_token: int | None
    flip_change: float | None       # largest |change| of the top-20 log-probs at that step
    prompt_end_change: float        # the same at step 0, the end of the prompt
    agreement: GreedyAgreement      # the near-tie rule's verdict on this prompt

    @property
    def gap(self) -> float | None:
        """The baseline's log-probability of its token minus that of the runtime's token at
        the flip (its top-two margin when the runtime took the runner-up)."""
        return self.agreement.margin

    @property
    def excused(self) -> bool | None:
        """Whether the near-tie rule excuses the flip (None: no flip)."""
        return None if self.identical else self.agreement.excused


def step_change(base: GreedyRun, other: GreedyRun, step: int) -> float:
    """The largest |difference| of log-probabilities at `step` over the tokens both runs
    list among their top 20 (infinite if they share none)."""
    theirs = dict(other.top[step])
    return max((abs(lp - theirs[t]) for t, lp in base.top[step] if t in theirs), default=math.inf)


def first_difference(base: GreedyRun, run: GreedyRun) -> int | None:
    """The first step whose tokens differ (None: none does)."""
    return next((s for s, (a, b) in enumerate(zip(base.tokens, run.tokens)) if a != b), None)


def runtime_error(baseline: list[GreedyRun], runs: list[GreedyRun]) -> float:
    """The runtime's measured error: the largest change of the baseline's top-20
    log-probabilities over every step on which both runs had seen the same tokens (each
    prompt's steps up to and including its first difference). It must stay within the
    runtime's stated bound (:attr:`RuntimeChoice.logit_error`), twice which is the near-tie
    rule's tolerance (:func:`labkit.util.near_tie.flip_tolerance`)."""
    worst = 0.0
    for base, run in zip(baseline, runs, strict=True):
        first = first_difference(base, run)
        shared = len(base.tokens) if first is None else first + 1
        worst = max([worst] + [step_change(base, run, s) for s in range(shared)])
    return worst


def compare_runs(baseline: list[GreedyRun], runs: list[GreedyRun],
                 tolerance: float | None = None) -> list[Divergence]:
    """Each prompt's run held to the baseline's under the near-tie rule, with `tolerance`
    (default: twice the stated float32 bound, ``path_agreement.LOGIT_ERROR``; a bfloat16
    runtime passes twice ``BF16_LOGIT_ERROR``). Check :func:`runtime_error` against the same
    bound: the tolerance holds only while the runtime's error does."""
    if tolerance is None:
        tolerance = flip_tolerance(LOGIT_ERROR)
    rows = []
    for i, (base, run) in enumerate(zip(baseline, runs, strict=True)):
        change = step_change(base, run, 0)
        agreement = greedy_agreement(base.tokens, run.tokens, base.top, tolerance, run.top)
        step = agreement.diverged_at
        if step is None:
            rows.append(Divergence(i, True, None, None, None, None, None, None, change, agreement))
        else:
            rows.append(Divergence(i, False, step, base.margin(step), run.margin(step),
                                   base.tokens[step], run.tokens[step],
                                   step_change(base, run, step), change, agreement))
    return rows


def agreement_summary(rows: list[Divergence]) -> AgreementSummary:
    """The near-tie rule's summary of one runtime's prompts: equal, excused, failed."""
    return AgreementSummary(tuple(r.agreement for r in rows))


def margins(runs: list[GreedyRun]) -> list[float]:
    """Every step's top-1 minus top-2 margin, over every run."""
    return [run.margin(s) for run in runs for s in range(len(run.tokens))]


# -- which path a runtime's forward passes took ----------------------------------------------

@dataclass
class PassCount:
    """The forward passes of the engine's block models (`gguf_blocks.BlockLlama`: the
    bfloat16 and model-file weights) during one run: the tokens of each pass, and of each
    pass that ran labkit's C layers on the blocks (a step of at most `native.MAX_ROWS`
    tokens on the paged pool); every other pass multiplied the dense weights (oneDNN)."""

    passes: list[int] = field(default_factory=list)
    block: list[int] = field(default_factory=list)


@contextmanager
def counting_passes() -> Iterator[PassCount]:
    """Count, while the block is running, which path each forward pass of a `BlockLlama`
    took, by wrapping `BlockLlama.forward` and `native.decoder_layers_blocks` (restored on
    exit; the wrappers only count). The chapter says from this which of a runtime's steps
    read the blocks, instead of assuming it from the kernels' row limit."""
    from labkit.kernels import gguf_blocks, native

    count = PassCount()
    forward, layers = gguf_blocks.BlockLlama.forward, native.decoder_layers_blocks

    def counted_forward(self, *args, **kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        count.passes.append(input_ids.numel())
        return forward(self, *args, **kwargs)

    def counted_layers(x, *args, **kwargs):
        count.block.append(x.shape[0])
        return layers(x, *args, **kwargs)

    gguf_blocks.BlockLlama.forward, native.decoder_layers_blocks = counted_forward, counted_layers
    try:
        yield count
    finally:
        gguf_blocks.BlockLlama.forward, native.decoder_layers_blocks = forward, layers


def bf16_path(onednn: dict[str, Any] | None = None, short: bool = False) -> str:
    """The matrix product that runs the bfloat16 runtime's larger steps (prefill) here, from
    `onednn` (``labkit.kernels.dispatch.dispatch_report()["onednn"]``, its default): oneDNN's
    bfloat16 GEMM where the CPU multiplies bfloat16 natively, which hands back each product
    rounded to bfloat16 (`bf16_weights.OneDNNBF16Linear`); else oneDNN's float32 GEMM on the
    rounded weights, float32 out. Steps of a few tokens take labkit's bfloat16 C kernel on
    any CPU."""
    if onednn is None:
        from labkit.kernels.dispatch import dispatch_report

        onednn = dispatch_report()["onednn"]
    if onednn.get("available", True) and onednn["bf16_gemm_native"]:
        isa = "AMX" if onednn.get("amx") else "AVX512-BF16"
        if short:
            return f"oneDNN's bfloat16 GEMM ({isa}), products rounded to bfloat16"
        return f"oneDNN's bfloat16 GEMM ({isa}), which also rounds each product to bfloat16"
    if short:
        return "oneDNN's float32 GEMM on the rounded weights"
    return ("oneDNN's float32 GEMM on the rounded weights, float32 out (no native bfloat16 "
            "GEMM here)")


# -- the chapter's runtimes ----------------------------------------------------------------

@dataclass(frozen=True)
class RuntimeChoice:
    name: str
    group: str       # "one change" (the source's seven) or "the serving engine"
    changes: str     # what differs from the baseline
    run: Callable[..., list[GreedyRun]]  # (model, prompts, new_tokens) -> runs
    needs_native: bool = False  # runs labkit's C kernels (refused or replaced without them)
    logit_error: float = LOGIT_ERROR  # stated bound on its error; the near-tie tolerance is twice it
    prefill_chunk: int | None = None  # tokens per prefill call, where that is all it changes

    def repeats_baseline(self, prompt_tokens: int) -> bool:
        """True where this runtime's computation on a prompt of `prompt_tokens` is the
        baseline's by construction: a chunked prefill whose chunk holds the whole prompt
        runs one call, as the baseline does, and its decode steps are the baseline's. Such a
        run is identical whatever the chunking does, so it tests nothing."""
        return self.prefill_chunk is not None and prompt_tokens <= self.prefill_chunk


def unavailable(choice: RuntimeChoice) -> str | None:
    """Why `choice` cannot run as named on this machine (None: it can). The bfloat16 and
    model-file modes refuse to run without labkit's C kernels, and the C attention and
    packed backends would quietly fall back to PyTorch, so without the kernels they are
    not the runtime their name says."""
    if choice.needs_native:
        from labkit.kernels import native

        if native.load() is None:
            return f"needs labkit's C kernels: {native.why_unavailable()}"
    return None


def choices() -> list[RuntimeChoice]:
    """The runtimes the chapter compares with the baseline, in its table's order."""
    from labkit.engine.backends import FastBackend

    one, engine = "one change", "the serving engine"
    return [
        RuntimeChoice("chunked prefill, 64", one, "the prompt prefilled 64 tokens per call",
                      lambda m, p, n: contiguous_runtime(m, p, n, chunk=64), prefill_chunk=64),
        RuntimeChoice("chunked prefill, 16", one, "the prompt prefilled 16 tokens per call",
                      lambda m, p, n: contiguous_runtime(m, p, n, chunk=16), prefill_chunk=16),
        RuntimeChoice("attention written out", one, "softmax(QK^T)V in plain tensor operations",
                      lambda m, p, n: contiguous_runtime(m, p, n, cache_type=MathAttentionCache)),
        RuntimeChoice("C attention kernel", one, "labkit's paged-attention kernel over a paged cache",
                      lambda m, p, n: engine_runtime(m, p, n, backend=NativeAttentionBackend()),
                      needs_native=True),
        RuntimeChoice("static-shape cache", one, "every step attends over all slots, unfilled ones masked",
                      lambda m, p, n: contiguous_runtime(m, p, n, cache_type=StaticShapeCache)),
        RuntimeChoice("padded batch", one, "all prompts in one batch, left-padded",
                      padded_batch_runtime),
        RuntimeChoice("bfloat16", one, "bfloat16 weights and activations, float32 sums",
                      lambda m, p, n: engine_runtime(m, p, n, weights="bf16"), needs_native=True,
                      logit_error=BF16_LOGIT_ERROR),
        RuntimeChoice("paged, gather + SDPA", engine, "the engine's reference backend, one request at a time",
                      lambda m, p, n: engine_runtime(m, p, n, backend=ReferenceBackend())),
        RuntimeChoice("continuous batch", engine, "all prompts queued at once, 512-token steps",
                      lambda m, p, n: engine_runtime(m, p, n, together=True, backend=ReferenceBackend())),
        RuntimeChoice("packed float32 + C kernels", engine,
                      "the continuous batch on oneDNN-packed weights and C kernels (the engine's f32)",
                      lambda m, p, n: engine_runtime(m, p, n, together=True, backend=FastBackend()),
                      needs_native=True),
        RuntimeChoice("the model file's blocks", engine,
                      "the continuous batch with the GGUF's own blocks for steps of a few tokens "
                      "(labkit serve's default weights)",
                      lambda m, p, n: engine_runtime(m, p, n, together=True, weights="gguf"),
                      needs_native=True),
    ]


# -- admission -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdmissionResult:
    request: str
    code: str | None        # None: admitted
    param: str | None
    message: str
    seconds: float          # time the engine took to answer
    unchanged: bool         # no request queued, no step run, no block taken


def try_admission(engine: LLMEngine, label: str, prompt, params: SamplingParams, n: int = 1) -> AdmissionResult:
    """Offer one request to `engine`: refused (with the engine state checked unchanged) or
    admitted (then aborted and released, so the engine is left as found)."""
    import time

    from labkit.engine.limits import Refused

    before = (len(engine.requests), engine.steps, engine.stats().blocks_used)
    start = time.perf_counter()
    try:
        request_id = engine.add_request(prompt, params, n=n)
    except Refused as refused:
        seconds = time.perf_counter() - start
        after = (len(engine.requests), engine.steps, engine.stats().blocks_used)
        return AdmissionResult(label, refused.code, refused.param, str(refused), seconds, after == before)
    seconds = time.perf_counter() - start
    engine.abort(request_id)
    engine.release(request_id)
    return AdmissionResult(label, None, None, "admitted", seconds, True)
