"""Perplexity and bits per token of a model on a fixed text.

The text is cut into windows of `window` tokens; consecutive windows overlap by
`window - stride` tokens, and only the tokens a window adds beyond the previous one are
scored, so every token after the first is scored exactly once, with at least
`window - stride` tokens of context (except at the start). Negative log-likelihoods are
summed in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

# The book's evaluation text, shipped inside the package (its source and licence:
# labkit/data/eval/README.md). A path in a checkout, a resource in an installed wheel.
EVAL_TEXT = resources.files("labkit") / "data" / "eval" / "python-docs-prose.txt"


@dataclass
class Score:
    tokens_scored: int
    nll_nats: float  # summed negative log-likelihood

    @property
    def nats_per_token(self) -> float:
        return self.nll_nats / self.tokens_scored

    @property
    def bits_per_token(self) -> float:
        return self.nats_per_token / math.log(2)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)


def eval_text(path: str | Path | resources.abc.Traversable = EVAL_TEXT) -> str:
    """The text at `path` (default: the book's evaluation text, `EVAL_TEXT`)."""
    source = Path(path) if isinstance(path, str) else path
    if not source.is_file():
        raise FileNotFoundError(f"evaluation text {source} is missing (see labkit/data/eval/README.md)")
    return source.read_text(encoding="utf-8")


@torch.inference_mode()
def score_tokens(logits_fn, ids: list[int], window: int = 512, stride: int | None = None,
                 max_tokens: int | None = None) -> Score:
    """Score `ids` with `logits_fn(LongTensor[1, T]) -> logits[1, T, V]`."""
    stride = stride or window
    if not 0 < stride <= window:
        raise ValueError("need 0 < stride <= window")
    ids = ids[: max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise ValueError("need at least two tokens to score")
    total, count, scored_to = 0.0, 0, 1  # position 0 has no context: never scored
    start = 0
    while scored_to < len(ids):
        end = min(start + window, len(ids))
        chunk = torch.tensor([ids[start:end]])
        logp = torch.log_softmax(logits_fn(chunk)[0].double(), dim=-1)
        # logits at position p predict token p+1; score targets scored_to .. end-1
        targets = torch.tensor(ids[scored_to:end])
        rows = torch.arange(scored_to - 1 - start, end - 1 - start)
        total -= logp[rows, targets].sum().item()
        count += len(targets)
        scored_to = end
        start = end - (window - stride) if end < len(ids) else end
        start = max(start, 0)
    return Score(count, total)


def perplexity(model, text: str | None = None, window: int = 512, stride: int | None = None,
               max_tokens: int | None = None) -> Score:
    """Score `model` (a labkit model with a tokenizer) on `text` (default: the book's text)."""
    text = eval_text() if text is None else text
    ids = model.tokenizer.encode(text)
    return score_tokens(model, ids, window=window, stride=stride, max_tokens=max_tokens)
