"""A multi-turn conversation workload played against `labkit serve`, with the cached prompt
tokens the server reported and the time to first token of each turn (chapter 32).

Conversations share one long system prompt and each turn resends the whole conversation, as
every client of a stateless chat API does. They are played round-robin (every conversation's
first turn, then every second turn, ...), so a turn can hit the shared system prompt that
another conversation left in the cache and its own earlier turns. Each turn is sent twice
over the OpenAI chat route with the official client, streamed: once in the conversation's own
cache scope, and once in a scope of its own that nothing else shares (a fresh `cache_salt`:
a cold prefill of the same prompt), so the two times to first token differ only by the cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from labkit.experiments.prompt_cache_pricing import CacheRequest

QUESTIONS = [
    "Which shelf holds the atlases?", "Do you deliver on Saturdays?", "Can I reserve a book by phone?",
    "What does a gift card cost?", "Is there a student discount?", "How long do you keep a reserved book?",
    "Can I order a book that is out of print?", "Do you buy second-hand books?",
]


@dataclass(frozen=True)
class PlayedTurn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int          # usage.prompt_tokens_details.cached_tokens, in the conversation's scope
    ttft_s: float               # in the conversation's scope
    cold_ttft_s: float          # the same prompt in a scope of its own
    cold_cached_tokens: int     # what the cold send found cached (0 unless scopes leak)
    reply: str
    messages: tuple[tuple[str, str], ...]


def system_prompt(tokenizer, tokens: int) -> str:
    """A bookshop assistant's instructions followed by policy text, cut to about `tokens` tokens."""
    from labkit.eval import eval_text

    head = ("You are the assistant of a small bookshop. Answer in two sentences at most and never "
            "invent prices. The shop's policies follow.\n\n")
    ids = tokenizer.encode(head + eval_text())[:tokens]
    return tokenizer.decode(ids)


def _streamed(client, model: str, messages: list[dict], max_tokens: int, salt: str) -> tuple[float, str, dict]:
    start = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"cache_salt": salt})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    if first is None:
        first = time.perf_counter()
    return first - start, "".join(pieces), usage or {}


def play(url: str, model: str, system: str, *, conversations: int, turns: int, max_tokens: int = 16,
         api_key: str = "unused") -> list[PlayedTurn]:
    """Play the workload against the server at `url` (loopback) and return every turn."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=300)
    scope = f"workload-{uuid.uuid4().hex[:8]}"   # one scope for the warm sends of this run
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    played = []
    for turn in range(turns):
        for c in range(conversations):
            history = histories[c]
            history.append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            ttft, reply, usage = _streamed(client, model, history, max_tokens, scope)
            cold_ttft, _, cold_usage = _streamed(client, model, history, max_tokens, f"cold-{uuid.uuid4().hex}")
            details = usage.get("prompt_tokens_details") or {}
            cold_details = cold_usage.get("prompt_tokens_details") or {}
            played.append(PlayedTurn(c, turn, usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0,
                                     ttft, cold_ttft, cold_details.get("cached_tokens") or 0, reply,
                                     tuple((m["role"], m["content"]) for m in history)))
            history.append({"role": "assistant", "content": reply})
    return played


def as_cache_requests(played: list[PlayedTurn], tokenizer) -> list[CacheRequest]:
    """The turns as the contract calculator sees them: each prompt's token ids (the chat
    template, as the server renders it) and its reply's, in the order they were sent. The
    reply's ids are the reply text encoded again with the end-of-turn token after it; the
    engine cached the ids it generated, which are the same unless the text encodes differently."""
    requests = []
    end = tokenizer.eos_token_id
    for index, turn in enumerate(played):
        ids = tokenizer.encode_chat([{"role": r, "content": t} for r, t in turn.messages])
        reply = tokenizer.encode(turn.reply, add_special_tokens=False) + ([end] if end is not None else [])
        requests.append(CacheRequest(tuple(ids), tuple(reply), arrival_s=float(index)))
    return requests


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope
