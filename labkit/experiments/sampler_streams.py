"""Chapter 6's study of seeded sampling: how many distinct random streams a set of requests
gets under the ``seed + step`` scheme (request r's step s draws from the same stream as request
r + 1's step s - 1) against independent per-(request, step) streams, and what that does to the
tokens of two requests sampled from the same logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from labkit.sampling import SamplingParams, draw_uniform, sample


def stream_draws(requests: int, steps: int, scheme: str = "independent", first_seed: int = 0) -> torch.Tensor:
    """``[requests, steps]`` float64: the uniform the sampler draws at step k of the request
    with seed ``first_seed + r`` (see :func:`labkit.sampling.draw_uniform`)."""
    return torch.tensor([[draw_uniform(first_seed + r, k, scheme=scheme) for k in range(steps)]
                         for r in range(requests)], dtype=torch.float64)


def distinct_streams(requests: int = 100, steps: int = 32, scheme: str = "independent",
                     first_seed: int = 0) -> int:
    """How many different random streams ``requests`` x ``steps`` draws actually use, counted
    as distinct first draws (two 64-bit-seeded streams agreeing on a float64 draw by chance is
    vanishingly unlikely). Naive ``seed + step``: 131 for 100 x 32; independent: 3200."""
    return int(torch.unique(stream_draws(requests, steps, scheme, first_seed)).numel())


def fixed_logits_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, steps: int,
                        scheme: str = "independent") -> list[int]:
    """The tokens one request would sample if the model returned the same ``logits`` at every
    step: isolates the random streams from everything else."""
    return [sample(logits, params, seed=seed, step=k, scheme=scheme) for k in range(steps)]


def shifted_matches(first: Sequence[int], second: Sequence[int]) -> int:
    """How many steps k have ``second[k] == first[k + 1]``: the signature of a one-step-shifted
    copy (``len(first) - 1`` of them when ``second`` is an exact shifted copy)."""
    return sum(int(b == a) for a, b in zip(first[1:], second))
