"""The model runner: one step's packed forward pass over the paged cache, and sampling.

It turns a `StepPlan` into tensors (the new tokens of every scheduled sequence side by
side, their positions, their slots), performs the plan's copy-on-write block copies,
calls the model once through the backend's cache view, and samples one token for each
sequence the engine asks for, beside the forward pass: what comes back is token ids
(`SampledToken`), not logits. Every sequence samples from its own (seed, step) stream, so
its tokens do not depend on which other sequences share the step. A sequence whose params
ask for `logprobs` also gets the raw log-probabilities of its token and of the most likely
alternatives (see `labkit.sampling.SamplingParams`), computed here because only here are
the logits at hand.

A sequence with a response format carries a grammar matcher (`labkit.structured`): its row
is sampled under the matcher's mask of allowed tokens, applied after the penalties and
before temperature, filters and greedy. Rows without one take the path they would take
alone, so constrained and unconstrained sequences share a step without changing each
other's tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from labkit.engine.interfaces import Backend, KVPoolLike, ServedModel
from labkit.engine.scheduler import StepPlan
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams, sample_batch
from labkit.structured.contract import MaskClock, bitmask_words, unpack_bitmask


@dataclass(frozen=True)
class SampledToken:
    """One sampled token. `logprob` and `top_logprobs` are None unless the sequence's params
    ask for logprobs; `top_logprobs` then holds `params.logprobs` (token_id, logprob) pairs,
    most likely first."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def _is_plain_greedy(params: SamplingParams) -> bool:
    """True when the token is the argmax of the raw logits: no bias or penalty can move it."""
    return (params.greedy and not params.logit_bias and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)


def _raw_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]
                  ) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For each row of `logits`: the raw log-probability of `tokens[row]` and the `ks[row]`
    most likely (token_id, logprob) pairs, lower id first on ties."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    k = min(max(ks), logprobs.shape[-1])
    if k == 0:
        return [(lp, ()) for lp in chosen]
    # topk's order among equal values is unspecified, so take every id at least as likely as
    # the k-th (all ties included) and order those few by a stable sort: ascending id within
    # a value, since nonzero lists ids in ascending order.
    kth = torch.topk(logprobs, k, dim=-1).values[:, -1:]
    out = []
    for row in range(logprobs.shape[0]):
        ids = torch.nonzero(logprobs[row] >= kth[row]).squeeze(1)
        values = logprobs[row, ids]
        order = torch.sort(values, descending=True, stable=True).indices[:ks[row]]
        out.append((chosen[row], tuple(zip(ids[order].tolist(), values[order].tolist()))))
    return out


def _draw(seqs: list[Sequence], logits: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int]:
    """One token per row: the argmax where every row is plain greedy, else `sample_batch`."""
    if allowed is None and all(_is_plain_greedy(s.params) for s in seqs):
        # What sample_batch returns for greedy rows (the argmax, lowest id on ties),
        # without building the one-hot distributions.
        return logits.argmax(dim=-1).tolist()
    seen = [s.token_ids if s.params.repetition_penalty != 1.0 else None for s in seqs]
    outputs = [s.output_token_ids if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
               else None for s in seqs]
    return sample_batch(logits.cpu(), [s.params for s in seqs], [s.sampling_seed for s in seqs],
                        [len(s.output_token_ids) for s in seqs], seen, output_token_ids=outputs, allowed=allowed)


def _allowed(seqs: list[Sequence], vocab_size: int, clock: MaskClock | None) -> torch.Tensor:
    """Bool [len(seqs), vocab_size]: each sequence's grammar mask (its matcher's time is
    clocked by the matcher; unpacking the masks is clocked here). The step is recorded with
    its fill (every row's matcher) and its unpack (one op for the step) apart."""
    step_started = time.perf_counter()
    bitmask = torch.zeros(len(seqs), bitmask_words(vocab_size), dtype=torch.int32)
    for row, seq in enumerate(seqs):
        seq.matcher.fill_bitmask(bitmask[row])
    started = time.perf_counter()
    allowed = unpack_bitmask(bitmask, vocab_size)
    if clock is not None:
        done = time.perf_counter()
        clock.seconds += done - started
        clock.record_step(done - step_started, len(seqs), fill_seconds=started - step_started)
    return allowed


class ModelRunner:
    def __init__(self, model: ServedModel, pool: KVPoolLike, backend: Backend,
                 mask_clock: MaskClock | None = None):
        self.model, self.pool, self.backend = model, pool, backend
        self.device = pool.device
        self.mask_clock = mask_clock or MaskClock()

    @torch.inference_mode()
    def run(self, plan: StepPlan, samples: list[tuple[Sequence, Sequence]]) -> list[SampledToken]:
        """Run the plan's tokens through the model; return one token for each pair
        (row owner, sample) of `samples`. The owner is a scheduled sequence whose tokens this
        step completes; the sample is it, or a sibling forked from it (n > 1), which draws
        from the same logits with its own seed."""
        self.pool.copy_blocks(plan.copies)
        ids, tables, starts, counts, row_of = [], [], [], [], {}
        row = 0
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            tables.append(seq.block_tables)
            starts.append(start)
            counts.append(n)
            row += n
            if item.completes:
                row_of[seq.seq_id] = len(row_of), row - 1
        batch = self.backend.batch(self.pool, tables, starts, counts)
        rows = torch.tensor([r for _, r in row_of.values()], dtype=torch.long, device=self.device)
        logits = self.model(torch.tensor([ids], device=self.device), cache=batch, rows=rows)[0]
        if not samples:
            return []
        picks = [row_of[owner.seq_id][0] for owner, _ in samples]
        if picks != list(range(len(row_of))):
            logits = logits[torch.tensor(picks, dtype=torch.long, device=logits.device)]
        return self.sample([seq for _, seq in samples], logits, self.mask_clock)

    @staticmethod
    def sample(seqs: list[Sequence], logits: torch.Tensor, mask_clock: MaskClock | None = None
               ) -> list[SampledToken]:
        """One token for each sequence from its row of `logits` (raw, one row per sequence)."""
        if not seqs:
            return []
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not constrained:
            tokens = _draw(seqs, logits)
        else:
            tokens = [0] * len(seqs)
            plain = [i for i, s in enumerate(seqs) if s.matcher is None]
            if plain:
                rows = logits[torch.tensor(plain, device=logits.device)]
                for i, token in zip(plain, _draw([seqs[i] for i in plain], rows)):
                    tokens[i] = token
            rows = logits[torch.tensor(constrained, device=logits.device)]
            picked = [seqs[i] for i in constrained]
            allowed = _allowed(picked, rows.shape[-1], mask_clock)
            for i, token in zip(constrained, _draw(picked, rows, allowed)):
                tokens[i] = token
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asking:
            return [SampledToken(t) for t in tokens]
        rows = logits if len(asking) == len(seqs) else logits[torch.tensor(asking, device=logits.device)]
        found = _raw_logprobs(rows, [tokens[i] for i in asking], [seqs[i].params.logprobs for i in asking])
        extra = dict(zip(asking, found))
        return [SampledToken(t, *extra[i]) if i in extra else SampledToken(t) for i, t in enumerate(tokens)]
