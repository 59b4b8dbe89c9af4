"""What one next-token choice is made of: logits, probabilities, entropy, and the decoding rule.

A language model does not output a token. At every step it outputs one score (a *logit*) per
vocabulary entry; a softmax turns the scores into a probability distribution, and a rule
outside the network (``labkit.sampling``) turns the distribution into one token. This module
looks at those pieces one step at a time:

* :func:`greedy_trace` runs greedy decoding with the KV cache and records, for every step, the
  chosen token, the entropy of the distribution, the gap between the two best logits and the
  top few candidates (:class:`StepRecord`);
* :func:`entropy_bits` is the Shannon entropy of a distribution in bits;
* :func:`longest_repeated_ngram` finds the longest run of tokens that occurs twice in a
  sequence (how a looping continuation shows up in numbers);
* :func:`rule_effects` applies several ``SamplingParams`` to the *same* logits and reports
  what survives of the distribution under each (:class:`RuleEffect`);
  :func:`plot_rule_effects` draws them as small multiples;
* :func:`sampling_check` draws many tokens from one distribution with the per-(seed, step)
  random streams of ``labkit.sampling`` and compares the frequencies with the probabilities
  (total variation distance and a chi-square test);
* :func:`final_hidden_state` and :func:`step_logits` expose the last hidden vector (whose dot
  product with each embedding row is that token's logit) and the logits of one decode step;
* :func:`path_margins`, :func:`portable_prefix` and :func:`check_against_reference` say which
  greedy tokens are the same on every machine (:func:`rank_margins` does the same for a
  printed top-k list): a step whose top two logits are closer than
  :data:`PORTABLE_MARGIN` may go either way under another CPU's float32 rounding, and a
  comparison with an independent implementation follows the near-tie rule of
  :mod:`labkit.util.near_tie`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from labkit.engine.loop import greedy_decode
from labkit.sampling import SamplingParams, probabilities, sample
from labkit.util.near_tie import GreedyAgreement, flip_tolerance, greedy_agreement, top_two_margins

__all__ = [
    "StepRecord",
    "greedy_trace",
    "entropy_bits",
    "RepeatedNgram",
    "longest_repeated_ngram",
    "RuleEffect",
    "rule_effects",
    "plot_rule_effects",
    "SamplingCheck",
    "sampling_check",
    "chi2_sf",
    "final_hidden_state",
    "step_logits",
    "lead_phrase",
    "same_choice_phrase",
    "PORTABLE_MARGIN",
    "path_margins",
    "rank_margins",
    "portable_prefix",
    "ReferenceCheck",
    "reference_greedy",
    "check_against_reference",
]



# --------------------------------------------------------------------------- entropy


def entropy_bits(probs) -> float | torch.Tensor:
    """Shannon entropy ``-sum p log2 p`` in bits, over the last axis (``0 log 0 = 0``).

    ``probs`` is a tensor or a sequence of probabilities summing to 1 along the last axis
    (checked to 1e-3). Returns a float for a 1-D input, else a float64 tensor of the leading
    shape. A uniform distribution over ``n`` outcomes has ``log2(n)`` bits; a one-hot has 0.
    """
    p = torch.as_tensor(probs, dtype=torch.float64)
    if p.dim() == 0 or p.shape[-1] == 0:
        raise ValueError("probs must have at least one outcome along the last axis")
    if bool((p < 0).any()) or not bool(torch.isfinite(p).all()):
        raise ValueError("probabilities must be finite and non-negative")
    total = p.sum(-1)
    if not bool(torch.allclose(total, torch.ones_like(total), atol=1e-3)):
        raise ValueError(f"probabilities must sum to 1 along the last axis, got {total.min():.6g}..{total.max():.6g}")
    h = -torch.special.xlogy(p, p).sum(-1) / math.log(2.0)
    h = h.clamp_min(0.0) + 0.0  # rounding below zero, and -0.0, read as 0
    return float(h) if p.dim() == 1 else h


# --------------------------------------------------------------------------- greedy trace


@dataclass(frozen=True)
class StepRecord:
    """One greedy step: the token chosen and what the distribution looked like.

    ``margin`` is the top-1 logit minus the top-2 logit: how far the step was from a tie (0
    means an exact tie, broken towards the lower token id). ``logits`` (the raw ``[V]``
    scores, float32) is kept only when asked for.
    """

    step: int
    token_id: int
    entropy_bits: float
    margin: float
    top_ids: tuple[int, ...]
    top_probs: tuple[float, ...]
    logits: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def top1_prob(self) -> float:
        return self.top_probs[0]

    def row(self, tokenizer=None) -> dict:
        """A flat dict for a table: step, token, entropy, margin, then top-k ids (and text) and probs."""
        out = {"step": self.step, "token_id": self.token_id}
        if tokenizer is not None:
            out["token"] = tokenizer.decode([self.token_id])
        out["entropy_bits"] = self.entropy_bits
        out["top1_prob"] = self.top1_prob
        out["margin_logits"] = self.margin
        for rank, (tid, prob) in enumerate(zip(self.top_ids, self.top_probs), start=1):
            out[f"top{rank}_id"] = tid
            if tokenizer is not None:
                out[f"top{rank}"] = tokenizer.decode([tid])
            out[f"top{rank}_prob"] = prob
        return out


def _record(step: int, logits: torch.Tensor, token: int, top: int, keep_logits: bool) -> StepRecord:
    logits32 = logits.detach().float()
    probs = torch.softmax(logits32.double(), dim=-1)
    best = torch.topk(probs, min(max(top, 1), probs.numel()))
    two = torch.topk(logits32, min(2, logits32.numel())).values
    margin = float(two[0] - two[1]) if two.numel() == 2 else float("inf")
    return StepRecord(
        step=step,
        token_id=token,
        entropy_bits=entropy_bits(probs),
        margin=margin,
        top_ids=tuple(int(i) for i in best.indices[:top]),
        top_probs=tuple(float(v) for v in best.values[:top]),
        logits=logits32.clone() if keep_logits else None,
    )


def greedy_trace(model, prompt_ids: Sequence[int], steps: int, top: int = 5, *,
                 keep_logits: bool = False) -> list[StepRecord]:
    """Greedy decoding of ``steps`` tokens with the KV cache, recording every step.

    The loop is the one cached greedy loop (``labkit.engine.loop.greedy_decode``: one prefill
    of the prompt, then one decode step per token, the argmax with ties to the lowest id, as
    ``labkit.sampling.sample`` under temperature 0), so the tokens are ``generate``'s; unlike
    ``generate`` it does not stop at EOS, so it always returns ``steps`` records. ``top``
    candidates are kept per step; ``keep_logits=True`` also keeps the raw logits of every step
    (``steps * vocab`` floats).
    """
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    if steps < 1:
        raise ValueError("steps must be at least 1")
    run = greedy_decode(model, prompt_ids, steps, keep_logits=True)
    return [_record(step, logits, token, top, keep_logits)
            for step, (token, logits) in enumerate(zip(run.token_ids, run.logits))]


def step_logits(model, prompt_ids: Sequence[int], output_ids: Sequence[int], step: int) -> torch.Tensor:
    """The ``[V]`` logits that choose ``output_ids[step]``, as a cached decode step computes them.

    Step 0's logits come from the prefill of the prompt. For ``step >= 1`` the prompt and
    ``output_ids[:step - 1]`` are prefilled into a KV cache and ``output_ids[step - 1]`` is run
    as one decode step, so the last operation is a one-token step reading a cache, as in
    ``greedy_trace``. Useful to re-check one step under another dtype without the whole loop.
    """
    prompt_ids, output_ids = [int(i) for i in prompt_ids], [int(i) for i in output_ids]
    if not 0 <= step <= len(output_ids):
        raise ValueError(f"step must be in [0, {len(output_ids)}], got {step}")
    cache = model.new_cache(batch=1, max_len=len(prompt_ids) + step)
    logits = model(torch.tensor([prompt_ids + output_ids[:max(step - 1, 0)]]), cache=cache, last_only=True)
    if step >= 1:
        logits = model(torch.tensor([[output_ids[step - 1]]]), cache=cache)
    return logits[0, -1]


def final_hidden_state(model, ids: Sequence[int]) -> torch.Tensor:
    """The final (normed) hidden vectors ``[seq, hidden]`` that the LM head turns into logits.

    ``Llama.forward`` ends with ``F.linear(hidden, lm_head)``; we run it once with the head
    swapped for an identity matrix, which returns the hidden vectors themselves, and put the
    real head back (also on error). ``hidden @ model.lm_head.T`` then reproduces the logits.
    """
    hidden_size = model.config.hidden_size
    head = model.lm_head
    model.lm_head = torch.eye(hidden_size, dtype=head.dtype)
    try:
        return model(torch.tensor([[int(i) for i in ids]]))[0]
    finally:
        model.lm_head = head


# --------------------------------------------------------------------------- repeats


@dataclass(frozen=True)
class RepeatedNgram:
    """The longest n-gram that occurs at least twice: its length, tokens and start positions."""

    n: int
    ngram: tuple
    positions: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.positions)


def longest_repeated_ngram(ids: Sequence) -> RepeatedNgram | None:
    """The longest contiguous run of items that occurs at least twice in ``ids``, or None.

    Occurrences may overlap (in ``a b a b a`` the 3-gram ``a b a`` starts at 0 and 2), which is
    how a loop shows up: a continuation that repeats a 7-token phrase five times in a row has a
    repeated 28-gram. Among n-grams of the longest length the one that occurs first wins;
    ``positions`` lists every start of it. Items can be any hashables (token ids, words).
    """
    items = list(ids)
    best: RepeatedNgram | None = None
    # If an n-gram repeats, so does its (n-1)-prefix: the lengths that repeat are 1..N, so
    # search upwards and stop at the first length with no repeat.
    for n in range(1, len(items)):
        starts: dict[tuple, list[int]] = {}
        for i in range(len(items) - n + 1):
            starts.setdefault(tuple(items[i:i + n]), []).append(i)
        repeated = [(pos[0], gram, pos) for gram, pos in starts.items() if len(pos) >= 2]
        if not repeated:
            break
        first, gram, pos = min(repeated, key=lambda r: r[0])
        best = RepeatedNgram(n=n, ngram=gram, positions=tuple(pos))
    return best


# --------------------------------------------------------------------------- decoding rules


@dataclass(frozen=True)
class RuleEffect:
    """The distribution one decoding rule leaves of a step's logits."""

    name: str
    params: SamplingParams
    probs: torch.Tensor = field(repr=False)  # [V] float64, what `sample` draws from
    survivors: int  # tokens with non-zero probability
    entropy_bits: float
    top_id: int
    top_prob: float

    def row(self, tokenizer=None) -> dict:
        """A flat dict for a table."""
        p = self.params
        out = {
            "rule": self.name,
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty,
            "surviving_tokens": self.survivors,
            "entropy_bits": self.entropy_bits,
            "top_id": self.top_id,
        }
        if tokenizer is not None:
            out["top_token"] = tokenizer.decode([self.top_id])
        out["top_prob"] = self.top_prob
        return out


def rule_effects(logits: torch.Tensor, rules: Mapping[str, SamplingParams],
                 seen: Sequence[int] | None = None) -> list[RuleEffect]:
    """Apply every rule of ``rules`` (name -> SamplingParams) to the same ``[V]`` logits.

    Each rule's distribution is ``labkit.sampling.probabilities(logits, params, seen)``, the
    one ``sample`` draws from (one-hot under greedy). ``seen`` (prompt plus output so far) only
    matters to rules with a repetition penalty. Returns one :class:`RuleEffect` per rule, in order.
    """
    if logits.dim() != 1:
        raise ValueError("rule_effects takes the [V] logits of one step")
    effects = []
    for name, params in rules.items():
        probs = probabilities(logits.float(), params, seen).double()
        probs = probs / probs.sum()
        top_prob, top_id = torch.max(probs, dim=-1)
        effects.append(RuleEffect(
            name=name,
            params=params,
            probs=probs,
            survivors=int((probs > 0).sum()),
            entropy_bits=entropy_bits(probs),
            top_id=int(top_id),
            top_prob=float(top_prob),
        ))
    return effects


def plot_rule_effects(axes, effects: Sequence[RuleEffect], token_ids: Sequence[int],
                      labels: Sequence[str], *, highlight: Sequence[int] = (),
                      ylabel: str = "probability") -> None:
    """Small multiples: one panel per rule, a bar per token of ``token_ids`` (same order in all).

    ``axes`` is a sequence (or array) of at least ``len(effects)`` matplotlib axes sharing
    their x axis; spare axes are hidden. ``labels`` name the tokens on the bottom row's x axis.
    Bars of ``highlight`` ids (e.g. tokens a repetition penalty sees) get the second colour.
    Each panel says the rule's name, its surviving tokens and its entropy in its corner.
    """
    flat = list(getattr(axes, "flat", axes))
    if len(flat) < len(effects):
        raise ValueError(f"{len(effects)} rules but only {len(flat)} axes")
    ids = [int(i) for i in token_ids]
    marked = set(int(i) for i in highlight)
    colours = ["C1" if i in marked else "C0" for i in ids]
    x = list(range(len(ids)))
    for ax, effect in zip(flat, effects):
        ax.bar(x, effect.probs[ids].tolist(), color=colours, width=0.8)
        tokens = "1 token" if effect.survivors == 1 else f"{effect.survivors:,} tokens"
        ax.text(0.98, 0.95, f"{effect.name}\n{tokens}, {effect.entropy_bits:.2f} bits",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
        ax.grid(axis="x", visible=False)
    for ax in flat[len(effects):]:
        ax.set_visible(False)
    ncols = axes.shape[-1] if hasattr(axes, "shape") and len(axes.shape) == 2 else len(flat)
    for index, ax in enumerate(flat[:len(effects)]):
        if index % ncols == 0:
            ax.set_ylabel(ylabel)
    # The bottom visible panel of each column carries the token labels.
    for column in range(ncols):
        col = [ax for index, ax in enumerate(flat[:len(effects)]) if index % ncols == column]
        if col:
            col[-1].set_xticks(x, list(labels), rotation=90, fontsize=7)
            col[-1].tick_params(axis="x", labelbottom=True)


# --------------------------------------------------------------------------- sampling check


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for a chi-square variable with ``dof`` degrees of freedom.

    The regularised upper incomplete gamma function Q(dof/2, statistic/2), from torch (so no
    scipy is needed). For ``dof = 2`` it is ``exp(-statistic / 2)``.
    """
    if dof < 1:
        raise ValueError("dof must be at least 1")
    a = torch.tensor(dof / 2.0, dtype=torch.float64)
    x = torch.tensor(max(statistic, 0.0) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


@dataclass(frozen=True)
class SamplingCheck:
    """Empirical frequencies of ``draws`` samples against the probabilities they came from.

    ``tv`` is the total variation distance (half the L1 distance) between the frequencies and
    ``probs``; ``expected_tv`` is what sampling noise alone gives on average for this many
    draws (``sum_i sqrt(p_i (1 - p_i) / (2 pi n))``, the normal approximation). ``chi2`` and
    ``p_value`` test the counts against ``probs``, with outcomes expected fewer than 5 times
    pooled into one bin (``bins`` is the number of bins after pooling, ``dof = bins - 1``).
    """

    draws: int
    counts: torch.Tensor = field(repr=False)  # [V] int64
    probs: torch.Tensor = field(repr=False)  # [V] float64
    tv: float
    expected_tv: float
    chi2: float
    bins: int
    p_value: float

    @property
    def dof(self) -> int:
        return self.bins - 1

    def frequencies(self) -> torch.Tensor:
        return self.counts.double() / self.draws


def sampling_check(logits: torch.Tensor, params: SamplingParams, draws: int, *, step: int,
                   seen: Sequence[int] | None = None, first_seed: int = 0) -> SamplingCheck:
    """Draw ``draws`` tokens from one step's logits and compare them with the probabilities.

    Draw ``i`` is ``labkit.sampling.sample(logits, params, seed=first_seed + i, step=step)``:
    request ``first_seed + i`` at step ``step``, each with its own random stream, exactly as
    the engine samples. ``params`` must not be greedy (a greedy draw is not random).
    """
    if params.greedy:
        raise ValueError("greedy params draw the same token every time: nothing to check")
    if draws < 1:
        raise ValueError("draws must be at least 1")
    probs = probabilities(logits.float(), params, seen).double()
    probs = probs / probs.sum()
    counts = torch.zeros_like(probs, dtype=torch.int64)
    for i in range(draws):
        counts[sample(logits, params, seed=first_seed + i, step=step, seen_token_ids=seen)] += 1
    freq = counts.double() / draws
    tv = 0.5 * float((freq - probs).abs().sum())
    expected_tv = float(torch.sqrt(probs * (1 - probs) / (2 * math.pi * draws)).sum())
    expected = probs * draws
    big = expected >= 5
    obs = counts[big].double().tolist()
    exp = expected[big].tolist()
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp > 0 or rest_obs > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    if len(obs) < 2:
        chi2, p_value = 0.0, 1.0
    else:
        chi2 = sum((o - e) ** 2 / e if e > 0 else (math.inf if o else 0.0) for o, e in zip(obs, exp))
        p_value = chi2_sf(chi2, len(obs) - 1) if math.isfinite(chi2) else 0.0
    return SamplingCheck(draws=draws, counts=counts, probs=probs, tv=tv, expected_tv=expected_tv,
                         chi2=chi2, bins=len(obs), p_value=p_value)


# --------------------------------------------------------------------------- verdicts in words


def lead_phrase(margin: float, *, digits: int = 3) -> str:
    """How one candidate stands against another, from ``margin`` = its logit minus the other's.

    "leads the runner-up by 0.125 logits", "trails the runner-up by 0.125 logits", or "ties
    with the runner-up" (when the margin rounds to zero at ``digits``): the sign picks the
    verb, so a sentence never reads "leads by -0.125".
    """
    shown = round(abs(margin), digits)
    if shown == 0:
        return "ties with the runner-up"
    verb = "leads" if margin > 0 else "trails"
    return f"{verb} the runner-up by {shown:.{digits}f} logits"


def same_choice_phrase(chosen: int, reference: int, *, reference_name: str = "float32") -> str:
    """ "the same token as in float32" or "not the token float32 chose"."""
    if int(chosen) == int(reference):
        return f"the same token as in {reference_name}"
    return f"not the token {reference_name} chose"


# --------------------------------------------------------------------------- tokens on any machine

# A greedy step whose top two logits are further apart than this chooses the same token on any
# machine that computes the model correctly in float32; a checked output of greedy token ids
# stops before the first step within it. Measured for SmolLM2-135M along the greedy path of the
# book's prompt: float32 logits differ from a float64 run of the same model by at most 2.7e-5,
# and between PyTorch's AVX-512 and AVX2 kernels by 2.9e-5; two float32 paths therefore move a
# gap by at most about 1e-4 (twice their difference, :func:`labkit.util.near_tie.flip_tolerance`).
# The margin is ten times that, for kernels and libraries we could not run.
PORTABLE_MARGIN = 1e-3


def path_margins(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[float]:
    """Top-1 minus top-2 logit of every step that chose ``output_ids``, from one forward pass
    over prompt and output (the logits at position ``len(prompt) - 1 + i`` choose output ``i``).
    ``model(ids)`` returns logits ``[1, seq, vocab]`` (or an object with ``.logits``)."""
    prompt_ids, output_ids = [int(i) for i in prompt_ids], [int(i) for i in output_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if not output_ids:
        return []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids + output_ids]))
    logits = getattr(out, "logits", out)[0, len(prompt_ids) - 1:-1]
    return top_two_margins(logits)


def rank_margins(logits: torch.Tensor, k: int) -> list[float]:
    """The gaps between neighbouring ranks of one ``[vocab]`` logit vector, from the best down
    to the ``k + 1``-th: ``k`` numbers, the last one between the ``k``-th and the best token
    left out. A printed top-``k`` list (which tokens, in which order) is the same on every
    machine when every gap is above :data:`PORTABLE_MARGIN`, as one greedy choice is when its
    top-two margin is (``rank_margins(logits, 1)`` is that margin)."""
    scores = torch.as_tensor(logits).detach().float().reshape(-1)
    if not 1 <= k < scores.numel():
        raise ValueError(f"need 1 <= k < {scores.numel()} (the vocabulary size), got {k}")
    top = torch.topk(scores, k + 1).values
    return (top[:-1] - top[1:]).tolist()


def portable_prefix(margins: Sequence[float], margin: float = PORTABLE_MARGIN) -> int:
    """How many leading greedy steps choose the same token on every machine: the steps before
    the first whose top-two logit margin is at most ``margin`` (all of them when none is).
    From that step on, another machine's rounding may take the runner-up, and every later
    token then continues a different text."""
    if not margin >= 0:
        raise ValueError(f"the margin is a non-negative logit gap, got {margin!r}")
    return next((i for i, m in enumerate(margins) if m <= margin), len(margins))


@dataclass(frozen=True)
class ReferenceCheck:
    """Our greedy tokens against an independent implementation's, under the near-tie rule."""

    agreement: GreedyAgreement
    logit_error: float          # max |our logit - reference logit| on the steps both shared
    reference_ids: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.agreement.ok

    @property
    def excused(self) -> int:
        """Sequences that parted at a near-tie (0 or 1: one sequence is compared)."""
        return int(self.agreement.excused)

    @property
    def tolerance(self) -> float:
        return self.agreement.tolerance

    def describe(self) -> str:
        return (f"{self.agreement.describe()}; largest logit difference {self.logit_error:.1e}, "
                f"tolerance {self.tolerance:.1e}")


def reference_greedy(reference, prompt_ids: Sequence[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens of another implementation (``reference(ids)`` returns logits
    ``[1, seq, vocab]``, or an object with ``.logits``, as a ``transformers`` model does), each
    step a full pass over the sequence so far, with no cache, ties to the lowest id; and the
    ``[steps, vocab]`` float32 logits that chose them."""
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("the prompt is empty")
    chosen, scores = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = reference(torch.tensor([ids + chosen]))
            logits = getattr(out, "logits", out)[0, -1].float()
            top = logits.max()
            chosen.append(int((logits == top).nonzero()[0]))  # the lowest id among equal maxima
            scores.append(logits)
    return chosen, torch.stack(scores) if scores else torch.empty(0)


def check_against_reference(reference, prompt_ids: Sequence[int], output_ids: Sequence[int],
                            output_logits: torch.Tensor) -> ReferenceCheck:
    """Compare our greedy ``output_ids`` (chosen from ``output_logits`` ``[steps, vocab]``) with
    the greedy tokens of ``reference`` on the same prompt, under the near-tie rule
    (:mod:`labkit.util.near_tie`). The tolerance is measured, not chosen: the largest
    difference between our logits and the reference's over every vocabulary entry of the steps
    both paths share (up to and including the first that differs), doubled
    (:func:`~labkit.util.near_tie.flip_tolerance`)."""
    ours = torch.as_tensor(output_logits).detach().float()
    output_ids = [int(i) for i in output_ids]
    if ours.shape[0] != len(output_ids):
        raise ValueError(f"{len(output_ids)} tokens but logits for {ours.shape[0]} steps")
    ref_ids, ref_scores = reference_greedy(reference, prompt_ids, len(output_ids))
    shared = next((i for i, (a, b) in enumerate(zip(ref_ids, output_ids)) if a != b), len(output_ids) - 1)
    error = float((ours[:shared + 1] - ref_scores[:shared + 1]).abs().max()) if output_ids else 0.0
    found = greedy_agreement(ref_ids, output_ids, ref_scores, flip_tolerance(error), candidate_scores=ours)
    return ReferenceCheck(found, error, tuple(ref_ids))
