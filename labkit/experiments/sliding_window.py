"""Sliding-window attention: what a window costs a model, how far it lets tokens reach, and
what it saves. Chapter 22 runs these on SmolLM2 and Gemma 3 270M.

A layer with window W lets the query at position i see only the keys at positions j with
i - W < j <= i. Gemma 3 was trained that way (15 of its 18 layers have W = 512; layers 5, 11
and 17 are global); SmolLM2 was trained with full attention. Four pieces:

* :func:`sink_window_attention` and :class:`SinkWindowCache`: impose a window on a model
  trained without one, optionally keeping the first ``sinks`` positions visible to every
  query. StreamingLLM (Xiao et al. 2023, arXiv 2309.17453) found that models put a large
  share of their attention on the first tokens whatever they say ("attention sinks"), so
  a plain window, which drops them, breaks the softmax's habits; keeping four is enough.
* :func:`second_half_loss`: the loss on the second half of a passage given all of the first
  half, through such a cache. Full attention (``window=None``) sees everything; a window
  W sees only the last W tokens; W + sinks sees those and the first few.
* :func:`influence_by_distance`: change one token and see which later logits move. A stack
  of windowed layers passes information at most W - 1 positions forward per layer, so with
  every layer windowed the influence stops exactly at sum(W - 1) positions; Gemma's global
  layers carry it the whole way. The windows are imposed by the cache, not by editing the
  model (see the function for why).
* :func:`decode_step_costs`: the arithmetic beside the chapter's timed decode steps: the
  bytes each scheme keeps and the keys a decode step reads, for a full cache, a window as a
  mask over a full cache (:class:`~labkit.models.window_cache.WindowedKVCache`), and a
  rolling cache (:class:`~labkit.models.window_cache.RollingKVCache`).

:func:`paired_interval` and :func:`cache_fit_sentence` read the chapter's measurements
without claiming more than they show: a 95% t interval over passages, and whether the bytes a
step reads fit this machine's last-level cache.

Nothing is timed here (the notebook times with :mod:`labkit.util.timing`), but
:func:`primed_cache`, :func:`decode_step_runner` and :func:`attention_runner` build what it
times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from labkit.experiments.kv_heads import layer_positions
from labkit.experiments.path_agreement import LOGIT_ERROR
from labkit.models.llama import KVCache
from labkit.models.window_cache import RollingKVCache, WindowedKVCache, windowed_attention
from labkit.util.near_tie import GreedyAgreement, flip_tolerance, greedy_agreement


# -- 1. a window (and sinks) imposed by the cache -------------------------------------------

def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                          window: int | None, sinks: int, scale: float) -> torch.Tensor:
    """Causal grouped attention in which the query at position i sees the keys at positions
    j <= i with i - window < j (the window, itself included) or j < sinks (the sinks).
    ``window=None`` sees every j <= i; ``sinks=0`` is
    :func:`~labkit.models.window_cache.windowed_attention`.

    q: [B, kv_heads, group, T, D] for positions q_start .. q_start+T-1
    k, v: [B, kv_heads, S, D] for positions 0 .. S-1
    """
    return windowed_attention(q, k, v, q_start, window, scale, sinks=sinks)


@dataclass
class SinkWindowCache(KVCache):
    """The contiguous `KVCache` with one window (and sinks) imposed on every layer as a mask.

    Every position stays cached: this is the semantics of StreamingLLM, not its economy (a
    ring of W slots plus ``sinks`` fixed ones would hold the same keys). Works for any model
    whose forward pass asks a `KVCacheView` (SmolLM2's `Llama`, `Gemma3`)."""

    # Defaults only because KVCache's `length` has one: build the cache with `empty`.
    window: int | None = None
    sinks: int = 0
    scale: float = 1.0

    @classmethod
    def empty(cls, config, batch: int, max_len: int, window: int | None, sinks: int = 0,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "SinkWindowCache":
        if window is not None and window < 1:
            raise ValueError(f"a window must hold at least the query itself, got {window}")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        plain = KVCache.empty(config, batch, max_len, dtype, device)
        # Gemma scales by query_pre_attn_scalar ** -0.5 (its `attention_scale`); a Llama
        # config has no such field and scales by 1 / sqrt(head_dim), as SDPA does by default.
        scale = getattr(config, "attention_scale", config.head_dim ** -0.5)
        return cls(plain.keys, plain.values, window=window, sinks=sinks, scale=scale)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.store(layer, k, v)
        return sink_window_attention(q, keys.to(q.dtype), values.to(q.dtype), self.length,
                                     self.window, self.sinks, self.scale)


# -- 2. what the window costs: the loss on a passage's second half --------------------------

@dataclass(frozen=True)
class SecondHalfLoss:
    """Negative log-likelihood of the second halves of passages, each given its first half
    through a cache with ``window`` (None: full attention) and ``sinks``."""

    window: int | None
    sinks: int
    tokens_scored: int
    nll_nats: float  # summed, in float64

    @property
    def nats_per_token(self) -> float:
        return self.nll_nats / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    @property
    def label(self) -> str:
        if self.window is None:
            return "full attention"
        if not self.sinks:
            return f"window {self.window}"
        return f"window {self.window} + {self.sinks} sink" + ("s" if self.sinks > 1 else "")


@torch.inference_mode()
def second_half_loss(model, ids: list[int], window: int | None, sinks: int = 0,
                     chunk: int = 256) -> SecondHalfLoss:
    """Score tokens len(ids)//2 .. end of one passage, each predicted from everything before
    it as far as the (window, sinks) cache lets the model see.

    The passage goes through the cache in chunks of ``chunk`` tokens (a chunked prefill:
    the mask gives every query the same keys as one pass would), and each chunk's logits
    are turned into losses at once, so the [tokens, vocab] logits never exist in full.
    """
    if len(ids) < 4:
        raise ValueError("need a passage of at least four tokens")
    half = len(ids) // 2
    cache = SinkWindowCache.empty(model.config, 1, len(ids), window, sinks, model.dtype, model.device)
    tokens = torch.tensor([ids], device=model.device)
    total, scored = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):  # the last token predicts nothing we score
        end = min(start + chunk, len(ids) - 1)
        # logits at position p predict token p + 1; we score targets half .. len - 1
        first = max(start, half - 1)
        if first >= end:  # all context: fill the cache, skip the LM head but for one row
            model(tokens[:, start:end], cache=cache, last_only=True)
            continue
        rows = torch.arange(first - start, end - start, device=model.device)
        logits = model(tokens[:, start:end], cache=cache, rows=rows)
        logp = torch.log_softmax(logits[0].double(), dim=-1)
        targets = tokens[0, first + 1:end + 1]
        total -= logp.gather(1, targets[:, None]).sum().item()
        scored += len(targets)
    return SecondHalfLoss(window, sinks, scored, total)


def passages(ids: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` consecutive, non-overlapping passages of ``length`` tokens from ``ids``."""
    if count * length > len(ids):
        raise ValueError(f"{count} passages of {length} tokens need {count * length}, have {len(ids)}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def window_loss_sweep(model, texts: list[list[int]], windows, sinks: int = 4) -> list[SecondHalfLoss]:
    """Full attention, then for each window W: W alone and W + ``sinks``, every loss summed
    over the passages ``texts`` (one record per setting, for the chapter's table)."""
    settings = [(None, 0)] + [(w, s) for w in windows for s in (0, sinks)]
    records = []
    for window, sink_count in settings:
        parts = [second_half_loss(model, ids, window, sink_count) for ids in texts]
        records.append(SecondHalfLoss(window, sink_count, sum(p.tokens_scored for p in parts),
                                      sum(p.nll_nats for p in parts)))
    return records


def passage_sweep(model, texts: list[list[int]], windows, sinks=(4,)) -> list[dict]:
    """One row per passage and setting: full attention, then each window W alone and with
    each number of ``sinks``. Unlike :func:`window_loss_sweep`, which sums over passages,
    the rows keep each passage apart, so the spread across passages can be shown."""
    settings = [(None, 0)] + [(w, s) for w in windows for s in (0, *sinks)]
    rows = []
    for index, ids in enumerate(texts):
        for window, sink_count in settings:
            r = second_half_loss(model, ids, window, sink_count)
            rows.append({"passage": index, "setting": r.label, "window": window,
                         "sinks": sink_count, "tokens": r.tokens_scored,
                         "nats_per_token": r.nats_per_token,
                         "bits_per_token": r.nats_per_token / math.log(2)})
    return rows


def damage_recovered(full: float, window: float, window_sinks: float) -> float:
    """The share of a window's damage that the sinks take back:
    (window - window with sinks) / (window - full), losses in any one unit. 1 means the
    sinks restore full attention's loss, 0 that they do nothing, below 0 that they hurt."""
    if window == full:
        raise ValueError("the window did no damage: the share is undefined")
    return (window - window_sinks) / (window - full)


# -- 3. how far a token reaches through stacked windows -------------------------------------

def every_layer_windowed(config, window: int) -> tuple[int, ...]:
    """Layer windows with the global layers windowed too: ``window`` everywhere."""
    return (window,) * config.num_layers


def local_layers_windowed(config, window: int) -> tuple[int | None, ...]:
    """The model's own pattern with its local layers' window set to ``window`` (global
    layers stay global): a short window makes the reach measurable on a short input."""
    return tuple(None if w is None else window for w in config.layer_windows)


@dataclass(frozen=True)
class Influence:
    """How much the logits at every position moved when one token was replaced."""

    perturbed_position: int
    layer_windows: tuple[int | None, ...]
    max_abs_logit_change: list[float]  # one per position of the sequence

    @property
    def reach_bound(self) -> int | None:
        """The farthest distance a change can travel: each windowed layer carries it at most
        W - 1 positions forward; None if a global layer carries it anywhere."""
        if any(w is None for w in self.layer_windows):
            return None
        return sum(w - 1 for w in self.layer_windows)

    @property
    def farthest_reach(self) -> int | None:
        """The largest distance after the perturbed position at which any logit moved."""
        moved = [pos for pos, change in enumerate(self.max_abs_logit_change) if change > 0]
        return moved[-1] - self.perturbed_position if moved else None

    def by_distance(self) -> list[tuple[int, float]]:
        """(distance after the perturbed position, change) from the perturbed position on."""
        changes = self.max_abs_logit_change[self.perturbed_position:]
        return list(enumerate(changes))


@torch.inference_mode()
def influence_by_distance(model, ids: list[int], perturbed_position: int,
                          replacement_id: int | None = None,
                          layer_windows: tuple[int | None, ...] | None = None) -> Influence:
    """Run ``ids`` twice, the second time with the token at ``perturbed_position`` replaced by
    ``replacement_id`` (default: the next id), and return the largest |logit difference| at
    every position.

    ``layer_windows`` (default: the model's own) are imposed through a
    :class:`~labkit.models.window_cache.WindowedKVCache` built from a copy of the config,
    not by giving the model a config copy: `Gemma3.forward` also reads
    ``config.layer_windows`` to pick each layer's RoPE base (local 10,000, global
    1,000,000), so windowing a global layer through the config would change its positions
    too. Through the cache only the mask changes, and the model is left untouched.
    """
    if not 0 <= perturbed_position < len(ids):
        raise ValueError(f"position {perturbed_position} is outside the {len(ids)}-token sequence")
    config = model.config
    windows = config.layer_windows if layer_windows is None else tuple(layer_windows)
    if len(windows) != config.num_layers:
        raise ValueError(f"{len(windows)} windows for {config.num_layers} layers")
    if replacement_id is None:
        replacement_id = (ids[perturbed_position] + 1) % config.vocab_size
    if replacement_id == ids[perturbed_position]:
        raise ValueError("the replacement must differ from the token it replaces")
    changed = list(ids)
    changed[perturbed_position] = replacement_id
    cache_config = replace(config, layer_windows=windows)

    def logits(tokens: list[int]) -> torch.Tensor:
        cache = WindowedKVCache.empty(cache_config, 1, len(tokens), model.dtype, model.device)
        return model(torch.tensor([tokens], device=model.device), cache=cache)[0]

    change = (logits(changed) - logits(ids)).abs().amax(dim=-1)
    return Influence(perturbed_position, windows, change.float().tolist())


# -- 4. masked window vs rolling cache: bytes held, keys read -------------------------------

@dataclass(frozen=True)
class DecodeStepCost:
    """One decode step at context ``context`` under one caching scheme, summed over layers.

    ``keys_read``: cached positions the attention kernel reads (each a key and a value per
    KV head); ``keys_attended``: those the mask lets the query see. A mask over a full
    cache reads every position and throws most away; a rolling cache reads only what it
    attends to."""

    scheme: str
    context: int
    kv_bytes_held: int
    keys_read: int
    keys_attended: int
    kv_bytes_read: int


SCHEMES = ("full cache", "mask over full cache", "rolling cache")


def decode_step_costs(config, context: int, dtype_bytes: int = 4) -> list[DecodeStepCost]:
    """The three schemes of chapter 22 for a model with ``config.layer_windows`` (Gemma 3).

    "full cache" is the same model with every layer global (what it would cost without
    windows); the other two run the real windows, as
    :class:`~labkit.models.window_cache.WindowedKVCache` and
    :class:`~labkit.models.window_cache.RollingKVCache` do.
    """
    per_layer_position = 2 * config.num_kv_heads * config.head_dim * dtype_bytes  # a key and a value
    all_positions = sum(layer_positions(config, context, rolling=False))
    in_windows = sum(layer_positions(config, context, rolling=True))
    rows = (  # (held, read, attended), in layer-positions
        (all_positions, all_positions, all_positions),
        (all_positions, all_positions, in_windows),
        (in_windows, in_windows, in_windows),
    )
    return [DecodeStepCost(scheme, context, held * per_layer_position, read, attended,
                           read * per_layer_position)
            for scheme, (held, read, attended) in zip(SCHEMES, rows)]


def primed_cache(model, scheme: str, context: int, seed: int = 0):
    """A cache of ``scheme`` (one of :data:`SCHEMES`) for a decode step at position
    ``context``: ``context`` positions of seeded random keys and values, for timing only
    (what the keys hold does not change what a step reads or computes).

    "full cache": a :class:`~labkit.models.window_cache.WindowedKVCache` with every layer
    global; "mask over full cache": the same cache with the model's windows as masks;
    "rolling cache": a :class:`~labkit.models.window_cache.RollingKVCache`. The model's
    own config (its RoPE bases) is left as it is: only the cache changes.
    """
    config = model.config
    if scheme == "rolling cache":
        cache = RollingKVCache(config, 1, context + 1, model.dtype, model.device)
        tensors = cache.keys + cache.values
    elif scheme in SCHEMES:
        if scheme == "full cache":
            config = replace(config, layer_windows=(None,) * config.num_layers)
        cache = WindowedKVCache.empty(config, 1, context + 1, model.dtype, model.device)
        tensors = [cache.keys, cache.values]
    else:
        raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for t in tensors:
        t.normal_(generator=gen)
    cache.length = context
    return cache


def cache_nbytes(cache) -> int:
    """Bytes a cache has allocated for keys and values, whatever its length: a
    :class:`~labkit.models.window_cache.RollingKVCache` (its rings and global layers) or a
    contiguous `KVCache` such as :class:`~labkit.models.window_cache.WindowedKVCache`."""
    if isinstance(cache, RollingKVCache):
        return cache.nbytes()
    return cache.keys.nbytes + cache.values.nbytes


def decode_step_runner(model, cache, token_id: int = 0):
    """A callable that runs one whole decode step (one token, last row's logits) at the
    cache's present length, and puts the length back after it, so that every call times
    the same step."""
    context = cache.length
    token = torch.tensor([[token_id]], device=model.device)

    def step():
        cache.length = context
        out = model(token, cache=cache, last_only=True)
        cache.length = context
        return out

    return step


def attention_runner(model, cache, seed: int = 0):
    """A callable that runs only the attention of one decode step: ``cache.attend`` in every
    layer for one seeded random query, key and value at the cache's present length (the
    part of a step the cache's scheme changes; projections, MLPs and the LM head are
    left out)."""
    c, context = model.config, cache.length
    gen = torch.Generator(device=model.device).manual_seed(seed)
    q = torch.randn(1, c.num_kv_heads, c.num_heads // c.num_kv_heads, 1, c.head_dim,
                    generator=gen, device=model.device).to(model.dtype)
    kv = torch.randn(1, c.num_kv_heads, 1, c.head_dim, generator=gen,
                     device=model.device).to(model.dtype)

    @torch.inference_mode()
    def attend():
        cache.length = context
        return [cache.attend(layer, q, kv, kv) for layer in range(c.num_layers)]

    return attend


@torch.inference_mode()
def greedy_with_cache(model, cache, prompt_ids: list[int], new_tokens: int):
    """Prefill ``prompt_ids`` into ``cache`` (empty), then ``new_tokens`` greedy tokens
    through it (:func:`labkit.engine.loop.greedy_continue`, logits kept): to hold one
    cache's tokens and logits against another's."""
    from labkit.engine.loop import greedy_continue

    ids = torch.tensor([list(prompt_ids)], device=model.device)
    logits = model(ids, cache=cache, last_only=True)[:, -1]
    return greedy_continue(model, cache, logits, new_tokens, keep_logits=True)


# -- 5. two caches' greedy tokens, held together under the near-tie rule --------------------

# The stated bound on two float32 paths' score difference: the book's one bound for them,
# stated and measured for SmolLM2-135M (path_agreement.LOGIT_ERROR). No bound is stated for
# Gemma 3 270M; chapter 22 reuses this one because its paths are float32 too and differ only
# in the order of their sums, and compare_paths measures each pair's error against it, so a
# Gemma path that outgrew it would fail the check instead of excusing more.
LOGIT_ERROR_BOUND = LOGIT_ERROR


@dataclass(frozen=True)
class PathComparison:
    """A candidate path's greedy tokens held to a reference's (:mod:`labkit.util.near_tie`),
    with the two paths' score error measured on the steps they computed from the same
    context: up to and including the first divergence, never after it."""

    agreement: GreedyAgreement
    score_error: float  # largest |score difference| on the shared steps
    bound: float        # the stated error bound; the tolerance is flip_tolerance(bound)

    @property
    def within_bound(self) -> bool:
        return self.score_error <= self.bound

    @property
    def ok(self) -> bool:
        """Tokens equal up to an excused near-tie, and scores within the stated bound."""
        return self.agreement.ok and self.within_bound

    def describe(self) -> str:
        return (f"{self.agreement.describe()}; largest score difference on the shared steps "
                f"{self.score_error:.2g} (bound {self.bound:g})")


def _scores_of(step) -> dict[int, float] | torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.detach().float().reshape(-1)
    return {int(t): float(v) for t, v in (step.items() if isinstance(step, dict) else step)}


def shared_score_error(reference_scores, candidate_scores, steps: int) -> float:
    """Largest |difference| between two paths' scores over their first `steps` steps, on
    every token the candidate reports (all of them for a [vocab] tensor, its top-k for the
    engine's `top_logprobs`). Both must be logits, or both log-probabilities."""
    worst = 0.0
    for ref, cand in zip(list(reference_scores)[:steps], list(candidate_scores)[:steps]):
        ref, cand = _scores_of(ref), _scores_of(cand)
        if isinstance(cand, torch.Tensor):
            if not isinstance(ref, torch.Tensor):
                raise ValueError("a full candidate row needs a full reference row")
            worst = max(worst, float((ref - cand).abs().max()))
        else:
            for token, value in cand.items():
                if isinstance(ref, torch.Tensor):
                    worst = max(worst, abs(float(ref[token]) - value))
                elif token in ref:
                    worst = max(worst, abs(ref[token] - value))
    return worst


def compare_paths(reference_tokens, reference_scores, candidate_tokens, candidate_scores,
                  bound: float = LOGIT_ERROR_BOUND) -> PathComparison:
    """Hold a candidate's greedy tokens to a reference's: a divergence is excused where the
    reference's gap between the two tokens is within ``flip_tolerance(bound)``, and the two
    paths' scores must differ by at most ``bound`` on the steps they shared."""
    agreement = greedy_agreement(reference_tokens, candidate_tokens, reference_scores,
                                 flip_tolerance(bound))
    return PathComparison(agreement, shared_score_error(reference_scores, candidate_scores,
                                                        agreement.compared), bound)


# -- 6. readings that claim no more than the data -------------------------------------------

# Student's t, 97.5% quantile, for 1 to 30 degrees of freedom (the usual table): a 95%
# interval of the mean of n differences is mean +- T_975[n - 2] * sd / sqrt(n).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class PairedInterval:
    """The mean of n paired differences (one per passage) and the half-width of its 95%
    interval from Student's t with n - 1 degrees of freedom."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    @property
    def verdict(self) -> str:
        """"higher" or "lower" only when the whole interval lies on one side of 0, else
        "within the noise"."""
        if self.low > 0:
            return "higher"
        if self.high < 0:
            return "lower"
        return "within the noise"


def paired_interval(differences) -> PairedInterval:
    """95% t interval of the mean of paired differences (e.g. one window's loss minus
    another's, passage by passage). With five passages the cutoff is 2.776 standard errors,
    not 2: a mean twice its standard error is not yet a finding. Beyond 30 differences the
    30-degree value is used, slightly wider than exact."""
    d = [float(x) for x in differences]
    n = len(d)
    if n < 2:
        raise ValueError(f"an interval needs at least two differences, got {n}")
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = T_975[min(n - 1, len(T_975)) - 1]
    return PairedInterval(mean, t * sd / math.sqrt(n), n)


def cache_fit_sentence(context: int, rolling_bytes: float, masked_bytes: float,
                       llc_bytes: int | None) -> str:
    """Whether the keys and values each scheme reads per decode step at ``context`` are
    smaller than this machine's last-level cache (``llc_bytes``; None where it could not be
    read), as a sentence true of the outcome. The timed runners reuse one cache round after
    round, so bytes that fit may be read from the cache rather than from memory."""
    at = f"At {context:,} tokens"
    if llc_bytes is None:
        return (f"{at} we could not compare the bytes read with this machine's last-level "
                f"cache, whose size could not be read.")
    rolling = f"the rolling cache's {rolling_bytes / 1e6:,.0f} MB"
    masked = f"the mask's {masked_bytes / 1e6:,.0f} MB"
    llc = f"this machine's last-level cache ({llc_bytes / 2**20:,.0f} MiB)"
    if masked_bytes <= llc_bytes and rolling_bytes <= llc_bytes:
        return (f"{at} both {rolling} and {masked} are smaller than {llc}, and the timed "
                f"rounds reuse one cache: both may be read from it rather than from memory.")
    if rolling_bytes <= llc_bytes:
        return (f"{at} {rolling} is smaller than {llc} and {masked} is not. The timed rounds "
                f"reuse one cache, so part of the difference between the two there may come "
                f"from reading the rolling cache's keys from the cache, not from memory.")
    if masked_bytes <= llc_bytes:
        return f"{at} {masked} is smaller than {llc} and {rolling} is not."
    return f"{at} neither {rolling} nor {masked} is smaller than {llc}."
