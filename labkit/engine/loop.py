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


def _stop_string_cut(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only at text that can be new."""
    hits = [i for s in stops if (i := text.find(s, max(0, search_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def generate(model, prompt: str | list[int], params: SamplingParams | None = None, *,
             chat: bool = False, on_text: Callable[[str], None] | None = None) -> Generation:
    """Generate a continuation of `prompt` (text, or token ids) with `model`.

    `chat=True` wraps a text prompt in the model's chat template as one user message.
    `on_text` receives each piece of text as soon as it is final (streaming).
    Stop strings are matched on the decoded text, so they may span token boundaries;
    the returned text ends before the stop string.
    """
    from labkit.tokenizer import IncrementalDetokenizer

    params = params or SamplingParams(temperature=0.0)
    tok = model.tokenizer
    timings = StageTimings()
    start = time.perf_counter()

    if isinstance(prompt, str):
        if chat:
            prompt_ids = tok.encode_chat([{"role": "user", "content": prompt}])
        else:
            prompt_ids = tok.encode(prompt)
    else:
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed to condition on")
    timings.tokenize = time.perf_counter() - start
    timings.events.append(("tokenize", 0.0, timings.tokenize))

    def record(stage: str, began: float) -> float:
        took = time.perf_counter() - began
        timings.events.append((stage, began - start, took))
        return took

    max_len = len(prompt_ids) + params.max_tokens
    cache = model.new_cache(batch=1, max_len=max_len)
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos and tok.eos_token_id is not None:
        stop_ids.add(tok.eos_token_id)
    detok = IncrementalDetokenizer(tok)
    seen = list(prompt_ids)
    out_ids: list[int] = []
    text, finish = "", "length"

    t0 = time.perf_counter()
    logits = model(torch.tensor([prompt_ids]), cache=cache, last_only=True)[0, -1]
    timings.prefill = record("prefill", t0)

    for step in range(params.max_tokens):
        t0 = time.perf_counter()
        token = sample(logits, params, seed=params.seed, step=step, seen_token_ids=seen)
        timings.sample += record("sample", t0)
        if token in stop_ids:
            finish = "stop"
            break
        out_ids.append(token)
        seen.append(token)

        t0 = time.perf_counter()
        piece = detok.add([token])
        before = len(text)
        text += piece
        cut = _stop_string_cut(text, params.stop, before) if params.stop else None
        timings.detokenize += record("detokenize", t0)
        if cut is not None:
            piece = piece[: max(0, cut - before)]
            text = text[:cut]
            finish = "stop"
        if on_text and piece:
            on_text(piece)
        if finish == "stop" or step == params.max_tokens - 1:
            break

        t0 = time.perf_counter()
        logits = model(torch.tensor([[token]]), cache=cache)[0, -1]
        timings.decode_steps.append(record("decode", t0))

    if finish == "length":
        t0 = time.perf_counter()
        tail = detok.flush()
        text += tail
        timings.detokenize += record("detokenize", t0)
        if on_text and tail:
            on_text(tail)
    timings.total = time.perf_counter() - start
    return Generation(prompt_ids, out_ids, text, finish, timings)
