"""Engine v0: one request, one contiguous KV cache, a plain generation loop.

    text -> tokenizer -> prefill (whole prompt, fills the cache) -> sample
         -> decode steps (one token each, reads the cache) -> sample -> detokenize

Every stage is timed, so a chapter can draw the waterfall of one request. The batched,
paged, continuously scheduled engine of Part III keeps the same contracts.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from labkit.engine.output import OutputProcessor, encode_prompt
from labkit.sampling import SamplingParams, sample


@dataclass
class StageTimings:
    """Seconds spent in each stage of one request (perf_counter deltas)."""

    tokenize: float = 0.0
    prefill: float = 0.0
    decode_steps: list[float] = field(default_factory=list)
    sample: float = 0.0
    detokenize: float = 0.0
    total: float = 0.0
    # (stage, start, duration) in seconds from the request's start, in the order they ran:
    # what a waterfall of one request draws.
    events: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float:
        return self.tokenize + self.prefill

    @property
    def decode(self) -> float:
        return sum(self.decode_steps)

    def summary(self) -> list[dict]:
        """One row per stage: how many times it ran, its total seconds, its share of the request."""
        rows: dict[str, dict] = {}
        for stage, _, took in self.events:
            row = rows.setdefault(stage, {"stage": stage, "calls": 0, "seconds": 0.0})
            row["calls"] += 1
            row["seconds"] += took
        for row in rows.values():
            row["share"] = row["seconds"] / self.total if self.total else float("nan")
        return list(rows.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out["events"] = [list(e) for e in self.events]
        out["time_to_first_token"] = self.time_to_first_token
        out["decode"] = self.decode
        steps = len(self.decode_steps)
        out["decode_tokens_per_second"] = steps / self.decode if steps else None
        return out


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    timings: StageTimings

    def to_dict(self) -> dict:
        return {
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": self.timings.to_dict(),
        }


def generate(model, prompt: str | list[int], params: SamplingParams | None = None, *,
             chat: bool = False, on_text: Callable[[str], None] | None = None) -> Generation:
    """Generate a continuation of `prompt` (text, or token ids) with `model`.

    `chat=True` wraps a text prompt in the model's chat template as one user message.
    `on_text` receives each piece of text as soon as it is final (streaming).
    Stop strings are matched on the decoded text, so they may span token boundaries;
    the returned text ends before the stop string.
    """
    params = params or SamplingParams(temperature=0.0)
    tok = model.tokenizer
    timings = StageTimings()
    start = time.perf_counter()
    prompt_ids = encode_prompt(prompt, tok, getattr(getattr(model, "config", None), "vocab_size", None), chat=chat)
    timings.tokenize = time.perf_counter() - start
    timings.events.append(("tokenize", 0.0, timings.tokenize))

    def record(stage: str, began: float) -> float:
        took = time.perf_counter() - began
        timings.events.append((stage, began - start, took))
        return took

    cache = model.new_cache(batch=1, max_len=len(prompt_ids) + params.max_tokens)
    output = OutputProcessor(tok, params)
    seen = list(prompt_ids)

    t0 = time.perf_counter()
    logits = model(torch.tensor([prompt_ids]), cache=cache, last_only=True)[0, -1]
    timings.prefill = record("prefill", t0)

    for step in range(params.max_tokens):
        t0 = time.perf_counter()
        token = sample(logits, params, seed=params.seed, step=step, seen_token_ids=seen,
                       output_token_ids=seen[len(prompt_ids):])
        timings.sample += record("sample", t0)
        seen.append(token)
        t0 = time.perf_counter()
        delta = output.add(token)
        timings.detokenize += record("detokenize", t0)
        if on_text and delta.text:
            on_text(delta.text)
        if delta.finish_reason is not None:
            break
        t0 = time.perf_counter()
        logits = model(torch.tensor([[token]]), cache=cache)[0, -1]
        timings.decode_steps.append(record("decode", t0))

    timings.total = time.perf_counter() - start
    return Generation(prompt_ids, output.token_ids, output.text, output.finish_reason or "length", timings)


# -- the one cached greedy loop --------------------------------------------------------------

@dataclass
class GreedyRun:
    """What `greedy_continue` chose: the first row's tokens, each decode step's seconds, and
    (if asked) the logits [vocab] that chose each token."""

    token_ids: list[int]
    step_seconds: list[float]
    logits: list[torch.Tensor]


def decode_step(model, token_ids: torch.Tensor, cache) -> torch.Tensor:
    """One cached decode step: logits [batch, vocab] of the new tokens [batch, 1]."""
    return model(token_ids, cache=cache, last_only=True)[:, -1]


@torch.no_grad()  # not inference_mode: a compiled step's graphs and the chapter's counts expect no_grad
def greedy_continue(model, cache, logits: torch.Tensor, new_tokens: int, *,
                    step: Callable = decode_step, keep_logits: bool = False) -> GreedyRun:
    """Greedy tokens from a prefilled `cache` whose last position gave `logits` [batch, vocab]:
    `new_tokens` argmax choices (ties to the lowest id, as `labkit.sampling.sample`), EOS not
    special, each token after the first fed back through `step(model, ids, cache)` (the plain
    `decode_step`, or a compiled one). Every row of a batch is fed its own token."""
    tokens, seconds, kept = [], [], []
    next_ids = logits.argmax(-1, keepdim=True)
    while True:
        if keep_logits:
            kept.append(logits[0].float().clone())
        tokens.append(int(next_ids[0, 0]))
        if len(tokens) >= new_tokens:
            return GreedyRun(tokens, seconds, kept)
        start = time.perf_counter()
        logits = step(model, next_ids, cache)
        next_ids = logits.argmax(-1, keepdim=True)
        seconds.append(time.perf_counter() - start)


@torch.no_grad()
def greedy_decode(model, prompt_ids: list[int], new_tokens: int, *, step: Callable = decode_step,
                  keep_logits: bool = False) -> GreedyRun:
    """Prefill `prompt_ids` into a fresh cache of the model's own kind, then `greedy_continue`."""
    cache = model.new_cache(1, len(prompt_ids) + new_tokens)
    ids = torch.tensor([list(prompt_ids)], device=getattr(model, "device", None))
    logits = model(ids, cache=cache, last_only=True)[:, -1]
    return greedy_continue(model, cache, logits, new_tokens, step=step, keep_logits=keep_logits)
