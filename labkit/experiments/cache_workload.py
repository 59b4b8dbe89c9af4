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


def _streamed(client, model: str, messages: list[dict], max_tokens: int, salt: str
              ) -> tuple[float, str, dict]:
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


def _client(url: str, api_key: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=300)


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def play(url: str, model: str, system: str, *, conversations: int, turns: int, max_tokens: int = 16,
         api_key: str = "unused", scope: str | None = None, cold: bool = True) -> list[PlayedTurn]:
    """Play the workload against the server at `url` (loopback) and return every turn. One
    short request goes first, untimed, so that no turn pays the server's one-off costs. The
    warm sends share the cache scope `scope` (a fresh one by default); with `cold=False` no
    turn is sent again in a scope of its own (its cold fields are then nan and -1)."""
    client = _client(url, api_key)
    _streamed(client, model, [{"role": "user", "content": "Hello."}], 2, f"warm-up-{uuid.uuid4().hex}")
    scope = scope or f"workload-{uuid.uuid4().hex[:8]}"
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    played = []
    for turn in range(turns):
        for c in range(conversations):
            history = histories[c]
            history.append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            ttft, reply, usage = _streamed(client, model, history, max_tokens, scope)
            cold_ttft, cold_cached = float("nan"), -1
            if cold:
                salt = f"cold-{uuid.uuid4().hex}"
                cold_ttft, _, cold_usage = _streamed(client, model, history, max_tokens, salt)
                cold_cached = _cached(cold_usage)
            played.append(PlayedTurn(c, turn, usage.get("prompt_tokens", 0), _cached(usage), ttft, cold_ttft,
                                     cold_cached, reply, tuple((m["role"], m["content"]) for m in history)))
            history.append({"role": "assistant", "content": reply})
    return played


@dataclass(frozen=True)
class KeyProbe:
    """One send of a prompt under an API key, in a given cache scope, and what the server's own
    usage said it found cached."""

    sender: str
    prompt_tokens: int
    cached_tokens: int


def probe_keys(url: str, model: str, messages: tuple[tuple[str, str], ...], scope: str,
               sends: list[tuple[str, str]]) -> list[KeyProbe]:
    """Send one conversation's prompt once per (label, API key) of `sends`, in order, all in the
    cache scope `scope` (the same `cache_salt`): whether a key finds what another key left."""
    history = [{"role": r, "content": t} for r, t in messages]
    probes = []
    for label, key in sends:
        _, _, usage = _streamed(_client(url, key), model, history, 1, scope)
        probes.append(KeyProbe(label, usage.get("prompt_tokens", 0), _cached(usage)))
    return probes


def cold_sweep(url: str, model: str, tokenizer, lengths: list[int], repeats: int = 2,
               api_key: str = "unused") -> list[tuple[int, float]]:
    """(prompt tokens, time to first token) of cold sends over a range of prompt lengths: the
    system prompt cut to each length and one question, each send in a scope of its own, so a
    line through them can separate a fixed cost from a cost per prompt token."""
    client = _client(url, api_key)
    _streamed(client, model, [{"role": "user", "content": "Hello."}], 2, f"warm-up-{uuid.uuid4().hex}")
    points = []
    for _ in range(repeats):
        for length in lengths:
            history = [{"role": "system", "content": system_prompt(tokenizer, length)},
                       {"role": "user", "content": QUESTIONS[0]}]
            ttft, _, usage = _streamed(client, model, history, 1, f"sweep-{uuid.uuid4().hex}")
            points.append((usage.get("prompt_tokens", 0), ttft))
    return points


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


@dataclass(frozen=True)
class MessagesTurn:
    """One turn sent over the Anthropic Messages route with `cache_control` breakpoints at the
    system prompt's end and at the last user message's end, and the usage the server reported."""

    conversation: int
    turn: int
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    reply: str
    messages: tuple[tuple[str, str], ...]

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens


def play_messages(url: str, model: str, system: str, *, conversations: int, turns: int, max_tokens: int = 16,
                  api_key: str = "unused") -> list[MessagesTurn]:
    """The workload of `play` (round-robin, greedy) over `POST /v1/messages` with the official
    `anthropic` client: the system prompt is one text block marked with `cache_control`, and so
    is the last user message, as a client marks both ends. The Messages API has no
    `cache_salt`: the scope is the API key's alone."""
    from anthropic import Anthropic

    client = Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=300)
    mark = {"type": "ephemeral"}
    histories: list[list[dict]] = [[] for _ in range(conversations)]
    played = []
    for turn in range(turns):
        for c in range(conversations):
            history = histories[c]
            history.append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            sent = history[:-1] + [{"role": "user", "content": [
                {"type": "text", "text": history[-1]["content"], "cache_control": mark}]}]
            # this client version has no `temperature` argument; the route still takes the field
            answer = client.messages.create(model=model, max_tokens=max_tokens, extra_body={"temperature": 0.0},
                                            system=[{"type": "text", "text": system, "cache_control": mark}],
                                            messages=sent)
            reply = "".join(block.text for block in answer.content if block.type == "text")
            usage = answer.usage
            sent_messages = (("system", system),) + tuple((m["role"], m["content"]) for m in history)
            played.append(MessagesTurn(c, turn, usage.input_tokens, usage.cache_creation_input_tokens or 0,
                                       usage.cache_read_input_tokens or 0, reply, sent_messages))
            history.append({"role": "assistant", "content": reply})
    return played


def fit_quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """a, b, c of y = a + b x + c x^2 by least squares on the relative error ((y - fit) / y),
    so that short prompts (a few tens of ms) weigh as much as long ones (seconds): timing noise
    grows with the time measured."""
    import numpy as np

    if len(set(xs)) < 3:
        raise ValueError("a quadratic needs at least three distinct x values")
    if any(y <= 0 for y in ys):
        raise ValueError("times must be positive")
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    design = np.stack([np.ones_like(x), x, x * x], axis=1) / y[:, None]
    (a, b, c), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    return float(a), float(b), float(c)


def forecast_ttft(fit: tuple[float, float, float], computed: int, cached: int = 0) -> float:
    """Time to first token that a quadratic `fit` (a, b, c of `fit_quadratic`, over whole
    prompts computed from nothing) forecasts for `computed` new tokens on top of `cached` tokens
    already in the cache: the fixed cost a plus the fit's token cost of the whole prompt less
    that of the cached part, f(cached + computed) - f(cached) with f(x) = b x + c x^2. The
    quadratic term is the attention of each new token to every token before it, so the new
    tokens pay for the cached prefix too; `cached=0` is the forecast from an empty context."""
    if computed < 0 or cached < 0:
        raise ValueError("token counts cannot be negative")
    a, b, c = fit

    def tokens_cost(x: int) -> float:
        return b * x + c * x * x

    return a + tokens_cost(cached + computed) - tokens_cost(cached)
