"""Workloads for serving benchmarks: prompts cut from the book's evaluation text, chat-like
length distributions and Poisson arrival times, all from a seed."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]       # token ids
    max_tokens: list[int]
    arrivals: list[float] | None = None  # seconds from the start; None: all at once

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self) -> dict:
        lengths = [len(p) for p in self.prompts]
        return {"requests": len(self), "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
                "prompt_tokens_total": sum(lengths), "output_tokens_total": sum(self.max_tokens),
                "arrivals": "poisson" if self.arrivals else "all at once",
                "duration_s": self.arrivals[-1] if self.arrivals else 0.0}


def text_prompts(ids: list[int], count: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """`count` slices of the token stream `ids` with lengths uniform in [shortest, longest],
    starting at random offsets (real prose, no two requests alike)."""
    if longest > len(ids):
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the longest prompt {longest}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        start = rng.randrange(0, len(ids) - n + 1)
        prompts.append(ids[start:start + n])
    return prompts


def chat_lengths(count: int, seed: int = 0, prompt_median: int = 160, output_median: int = 120,
                 sigma: float = 0.8, cap: int = 1024) -> list[tuple[int, int]]:
    """(prompt, output) token counts of a chat-like workload: log-normal, long-tailed, each
    total capped at `cap` (the context a contiguous reservation would set aside)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = max(4, min(cap // 2, round(rng.lognormvariate(math.log(prompt_median), sigma))))
        o = max(4, min(cap - p, round(rng.lognormvariate(math.log(output_median), sigma))))
        out.append((p, o))
    return out


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process with `rate` requests per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times
