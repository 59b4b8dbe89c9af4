"""The near-tie rule for a served text: did a service's greedy answer give the reference's
tokens, up to a rounding flip?

A service answers with text, not token ids and logits. To hold a streamed or whole answer to
a reference run with the book's near-tie rule (:mod:`labkit.util.near_tie`), this module
finds where the text leaves the reference's tokens, and which token the service must have
taken there: walking the reference's tokens, the first one whose text is not where the
answer goes is the divergence; the service's token is the highest-scoring one (by the
reference's logits at that step, among the top `top_k`) whose text continues the answer.
The reference's gap between its token and that one decides, as everywhere in the book:
within the tolerance (twice the paths' logit error) the divergence is excused and counted;
wider, or with no such token among the top `top_k` (a gap no smaller than the k-th score's),
it fails.

The reference is a greedy run that keeps its logits (:func:`reference_runs`, the engine's
simple loop in this process: one sequence, a contiguous cache, no batching and no server).
Chapter 27 holds every stream of its load runs to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit.util.near_tie import AgreementSummary, GreedyAgreement, greedy_agreement

REPLACEMENT = "\ufffd"  # what a decoded prefix ends with when it stops inside a character


@dataclass(frozen=True)
class ReferenceRun:
    """A reference's greedy tokens, the logits each was chosen from, and its text."""

    tokens: list[int]
    logits: torch.Tensor  # [steps, vocab]
    text: str


def reference_runs(model, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[ReferenceRun]:
    """Each prompt's `max_tokens` greedy tokens from the engine's simple cached loop
    (:func:`labkit.engine.loop.greedy_decode`, which ignores EOS), with their logits."""
    from labkit.engine.loop import greedy_decode

    runs = []
    for prompt in prompts:
        run = greedy_decode(model, list(prompt), max_tokens, keep_logits=True)
        runs.append(ReferenceRun(list(run.token_ids), torch.stack(run.logits),
                                 model.tokenizer.decode(list(run.token_ids))))
    return runs


def _prefix(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids)).rstrip(REPLACEMENT)


def text_agreement(tokenizer, reference: ReferenceRun, text: str, tolerance: float,
                   top_k: int = 64, *, prefix: bool = False) -> GreedyAgreement:
    """The near-tie rule (:func:`labkit.util.near_tie.greedy_agreement`) for an answer known
    only by its `text`, against `reference` (module docstring). With `prefix`, `text` may
    stop early (a stream cut off): it is compared over the tokens it holds."""
    ref = reference.tokens
    if text == reference.text:
        return greedy_agreement(ref, ref, reference.logits, tolerance)
    i = 0
    while i < len(ref) and text.startswith(_prefix(tokenizer, ref[:i + 1])):
        i += 1
    if prefix and i < len(ref) and reference.text.startswith(text) and text == _prefix(tokenizer, ref[:i]):
        return greedy_agreement(ref[:i], ref[:i], reference.logits, tolerance)
    if i == len(ref):  # every reference token is in the text, which goes on: not a rounding flip
        return GreedyAgreement(len(ref), len(ref), len(ref), None, None, None, tolerance, None)
    scores = reference.logits[i].float()
    before = _prefix(tokenizer, ref[:i])
    top = torch.topk(scores, min(top_k, scores.numel()))
    for token in top.indices.tolist():
        if token == ref[i]:
            continue
        piece = _prefix(tokenizer, ref[:i] + [token])
        if piece != before and text.startswith(piece):
            return greedy_agreement(ref, ref[:i] + [token], reference.logits, tolerance)
    # no token of the top k continues the text: its gap is at least the k-th score's
    gap = float(scores[ref[i]] - top.values[-1])
    return GreedyAgreement(len(ref), i + 1, i, ref[i], None, gap, tolerance, None)


def texts_agreement(tokenizer, references: Sequence[ReferenceRun], texts: Sequence[str],
                    tolerance: float) -> AgreementSummary:
    """:func:`text_agreement` of each text against its reference, as one summary."""
    if len(references) != len(texts):
        raise ValueError("one reference per text")
    return AgreementSummary(tuple(text_agreement(tokenizer, r, t, tolerance) for r, t in zip(references, texts)))


__all__ = ["ReferenceRun", "reference_runs", "text_agreement", "texts_agreement"]
