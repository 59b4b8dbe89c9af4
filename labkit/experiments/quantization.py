"""Chapter 12's measurements of quantized models: perplexity per window with paired
differences and their standard errors, greedy agreement with the float32 model (teacher
forced, and where free-running decoding first parts from it), and decode speed timed in
turns. The quantized models themselves are built by :mod:`labkit.models.quantized`."""

from __future__ import annotations

import math

import torch

from labkit.engine.loop import greedy_continue, greedy_decode
from labkit.engine.backends import FastBackend

ENGINE_FLOAT32 = "float32 (engine)"  # the speed baseline: the engine's own float32 path


def window_scores(model, ids: list[int], window: int = 512) -> list[tuple[float, int]]:
    """(summed NLL in nats, tokens scored) for each window of `window` tokens.

    Consecutive windows overlap by one token, so every token after the first is scored
    exactly once; the sums equal `labkit.eval.score_tokens(model, ids, window,
    stride=window - 1)`, and the per-window values give the noise of a paired comparison.
    """
    from labkit.eval import score_tokens

    step = window - 1
    return [((s := score_tokens(model, ids[start:start + window], window=window)).nll_nats,
             s.tokens_scored) for start in range(0, len(ids) - 1, step)]


def greedy_tokens(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens (EOS not treated specially), with a KV cache."""
    return greedy_decode(model, prompt_ids, new_tokens).token_ids


@torch.inference_mode()
def teacher_forced_matches(model, prompt_ids: list[int], reference: list[int]) -> list[bool]:
    """For each position of `reference` (a greedy continuation of `prompt_ids` by another
    model): does `model`'s argmax, reading the same reference tokens, pick the same token?
    One forward pass. Free-running greedy decoding by `model` reproduces the reference up to
    the first False (there the two continuations part)."""
    ids = torch.tensor([prompt_ids + reference[:-1]])
    choices = model(ids)[0, len(prompt_ids) - 1:].argmax(-1)
    return (choices == torch.tensor(reference)).tolist()


def paired_difference(scores: list[tuple[float, int]], baseline: list[tuple[float, int]]):
    """(difference in nats per token, its standard error) between two `window_scores` of
    the same text: the windows are the units, so the noise shared by both is cancelled."""
    d = torch.tensor([a - b for (a, _), (b, _) in zip(scores, baseline)], dtype=torch.float64)
    n = torch.tensor([c for _, c in baseline], dtype=torch.float64)
    mean = d.sum() / n.sum()
    windows = len(d)
    if windows < 2:
        return mean.item(), float("nan")
    var = ((d - mean * n) ** 2).sum() / (windows * (windows - 1))
    return mean.item(), (var.sqrt() * windows / n.sum()).item()


def score_table(scores: dict, baseline: str) -> list[dict]:
    """One row per model of `scores` (name -> `window_scores` on the same text): bits per
    token, perplexity, and the paired difference from `baseline` with its standard error."""
    rows = []
    for name, windows in scores.items():
        nll, tokens = sum(x for x, _ in windows), sum(n for _, n in windows)
        diff, se = paired_difference(windows, scores[baseline])
        rows.append({"model": name, "tokens": tokens, "bits_per_token": nll / tokens / math.log(2),
                     "perplexity": math.exp(nll / tokens),
                     "delta_bits": diff / math.log(2), "delta_bits_se": se / math.log(2)})
    return rows


def greedy_agreement(model, prompts: list[list[int]], references: list[list[int]]) -> dict:
    """Teacher-forced agreement with reference greedy continuations, over all prompts, and
    where each free-running continuation would first part from its reference."""
    matches = [teacher_forced_matches(model, p, r) for p, r in zip(prompts, references)]
    flat = [m for row in matches for m in row]
    return {"agreement": sum(flat) / len(flat),
            "first_divergence": [row.index(False) if False in row else len(row) for row in matches]}


def decode_runner(model, prompt_ids: list[int], new_tokens: int):
    """Prefill once; return a function that runs `new_tokens` greedy decode steps from the
    end of the prompt each time it is called (the same steps every call), for timing."""
    cache = model.new_cache(1, len(prompt_ids) + new_tokens + 1)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids]), cache=cache, last_only=True)[:, -1]

    def run() -> list[int]:
        cache.length = len(prompt_ids)
        return greedy_continue(model, cache, logits, new_tokens + 1).token_ids[1:]

    return run


def float32_paths(model) -> dict:
    """The float32 systems a speed comparison times, the baseline first.

    The baseline is the engine's own float32 path (`FastBackend().prepare`, i.e.
    `labkit.kernels.packed.pack_model`: one row through labkit's C matrix-vector kernel,
    more rows through oneDNN-packed weights, as `LLM` runs with its fast kernels): a
    quantized kernel is measured against the float32 a server would run, not against
    PyTorch's single-row `F.linear`, the plain model, which
    is timed beside it under the name "float32, F.linear"."""
    return {ENGINE_FLOAT32: FastBackend().prepare(model), "float32, F.linear": model}
