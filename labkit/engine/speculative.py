"""Speculative decoding: guess k tokens cheaply, check them with one pass of the model.

A *drafter* proposes up to k next tokens. The target model then runs once over the last
accepted token plus the k guesses (k + 1 positions, one call) and keeps the longest run
of guesses it agrees with, plus one token of its own, so every verification yields at
least one token and at most k + 1.

Agreement follows the rejection rule of Leviathan et al. and Chen et al. (2023): a
guess x drawn from the draft distribution q is accepted with probability
min(1, p(x) / q(x)), p being the target's distribution; at the first rejection the
token is drawn from the residual max(0, p - q), renormalised. The accepted tokens are
then distributed exactly as if sampled from p one by one. Under greedy params p is
one-hot, so a guess is accepted iff it is the target's argmax, and the output equals
plain greedy decoding token for token.

Drafters here: `NgramDrafter` (prompt lookup: continue the latest earlier occurrence of
the last n tokens; a deterministic guess, so q is one-hot) and `LayerSkipDrafter` (the
model's own first layers plus its head; no second model with this tokenizer ships here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from labkit.models.llama import KVCache, Llama, shallow_copy
from labkit.sampling import SamplingParams, probabilities, step_generator


# -- drafters ------------------------------------------------------------------------------

class NgramDrafter:
    """Propose the tokens that followed the latest earlier occurrence of the context's last
    n tokens (trying n = max_n down to min_n). One-hot draft distribution."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, params: SamplingParams, step: int):
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest occurrence first
                if context[start:start + n] == tail:
                    guess = context[start + n:start + n + k]
                    if guess:
                        return guess, None
        return [], None

    def rollback(self, length: int) -> None:
        pass


class LayerSkipDrafter:
    """The first `layers` layers of the target, its final norm and LM head, with a KV cache
    of its own. `sample=False` drafts greedily (one-hot q); otherwise it draws from its own
    processed distribution and reports it, so the rejection rule can use q."""

    def __init__(self, model: Llama, layers: int, sample: bool = False, max_len: int = 4096):
        if not 1 <= layers <= len(model.layers):
            raise ValueError(f"layers must be in [1, {len(model.layers)}]")
        draft = shallow_copy(model, layers)  # shares the weights, including packed ones
        self.model, self.layers, self.sample, self.max_len = draft, layers, sample, max_len
        self.cache: KVCache | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache(1, self.max_len)
        if len(prompt_ids) > 1:
            self.model(torch.tensor([prompt_ids[:-1]]), cache=self.cache, last_only=True)

    def propose(self, context: list[int], k: int, params: SamplingParams, step: int):
        # Catch up on accepted tokens the draft cache has not seen (all but the last one).
        if self.cache.length < len(context) - 1:
            self.model(torch.tensor([context[self.cache.length:-1]]), cache=self.cache)
        guess, dists, last = [], [], context[-1]
        for i in range(k):
            logits = self.model(torch.tensor([[last]]), cache=self.cache)[0, -1]
            if self.sample and not params.greedy:
                q = probabilities(logits, params)
                gen = step_generator(_draft_seed(params), step + i)
                last = int(torch.multinomial(q.float(), 1, generator=gen))
                dists.append(q)
            else:
                last = int(logits.argmax())
            guess.append(last)
        return guess, (torch.stack(dists) if dists else None)

    def rollback(self, length: int) -> None:
        """Forget cached positions from `length` on (rejected guesses)."""
        self.cache.length = min(self.cache.length, length)


def _draft_seed(params: SamplingParams) -> int:
    return ((params.seed or 0) * 2654435761 + 97) % 2**63


# -- the verification loop -------------------------------------------------------------------

@dataclass
class SpecStats:
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_verification(self) -> float:
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0


def accept(p: torch.Tensor, guess: list[int], q: torch.Tensor | None, gen: torch.Generator) -> tuple[int, int]:
    """The rejection rule for one verification. p: target probabilities [len(guess) + 1, V];
    q: draft probabilities [len(guess), V] or None (one-hot guesses). Returns (number of
    guesses accepted, the token the target adds after them)."""
    for i, x in enumerate(guess):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if float(torch.rand((), generator=gen, dtype=torch.float64)) < min(1.0, px / qx):
            continue
        residual = p[i].double().clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i].double()).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any token of p; numerically degenerate
            residual = p[i].double()
        return i, int(torch.multinomial(residual, 1, generator=gen))
    last = p[len(guess)].double()
    return len(guess), int(torch.multinomial(last, 1, generator=gen))


@torch.inference_mode()
def speculative_generate(model: Llama, prompt_ids: list[int], params: SamplingParams, drafter,
                         k: int = 4, stop_at_eos: bool = True,
                         kv_dtype: torch.dtype | None = None) -> tuple[list[int], SpecStats]:
    """Generate `params.max_tokens` tokens (fewer at EOS or a stop token) of `prompt_ids`.
    Greedy params give exactly plain greedy decoding; sampling params keep the target's
    distribution. Random draws come from one stream per (seed, verification). `kv_dtype`:
    the target's KV cache (default: the model's dtype), e.g. bfloat16 under float32 weights."""
    if k < 1:
        raise ValueError("lookahead k must be at least 1")
    if params.presence_penalty or params.frequency_penalty or params.logprobs is not None:
        # Each guessed position has its own output history; the verifier scores them together.
        raise ValueError("speculative_generate takes no presence/frequency penalty and no logprobs")
    stats = SpecStats()
    stop = set(params.stop_token_ids)
    eos = model.tokenizer.eos_token_id if model.tokenizer is not None else None
    if stop_at_eos and eos is not None and not params.ignore_eos:
        stop.add(eos)
    cache = KVCache.empty(model.config, 1, len(prompt_ids) + params.max_tokens + k + 1,
                          kv_dtype or model.dtype, model.device)
    if len(prompt_ids) > 1:
        model(torch.tensor([prompt_ids[:-1]]), cache=cache, last_only=True)
    drafter.reset(prompt_ids)
    context, out = list(prompt_ids), []
    seed = params.seed if params.seed is not None else 0
    while len(out) < params.max_tokens:
        want = min(k, params.max_tokens - len(out) - 1)
        t0 = time.perf_counter()
        guess, q = drafter.propose(context, want, params, len(out)) if want > 0 else ([], None)
        t1 = time.perf_counter()
        start = cache.length  # = len(context) - 1: the last token is not cached yet
        logits = model(torch.tensor([[context[-1]] + guess]), cache=cache)[0]
        seen = context if params.repetition_penalty != 1.0 else None
        p = probabilities(logits, params, seen)
        n_ok, extra = accept(p, guess, q, step_generator(seed, stats.verifications))
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.verifications += 1
        stats.proposed += len(guess)
        stats.accepted += n_ok
        stats.accepted_per_step.append(n_ok)
        new = guess[:n_ok] + [extra]
        cache.length = start + 1 + n_ok  # keep the last token and the accepted guesses
        drafter.rollback(cache.length)
        for token in new:
            if token in stop:
                return out, stats
            out.append(token)
            context.append(token)
            if len(out) == params.max_tokens:
                break
    return out, stats


def expected_tokens_per_verification(alpha: float, k: int) -> float:
    """E[tokens per target pass] when each guess is accepted independently with
    probability alpha: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)
