"""Prompt caching as a public contract: what a provider's documentation says a request will be
billed, and what our own server's prefix cache says it served (chapter 32).

A provider's prompt cache is described to its clients by a handful of documented rules: how
long a prefix must be before it is cached, in what steps the cached length grows, whether the
client marks breakpoints or the cache is automatic, how long an entry lives, and what a
cached read and a cache write cost relative to an ordinary input token. `CachingContract`
holds those rules, each with the page it comes from and the day we read it; `predict` plays a
workload of requests through them and says, per request, how many input tokens the contract
bills as read from the cache, as written to it, and as ordinary input; `relative_cost` turns
that into a price relative to no caching.

Nothing here claims how any provider implements its cache: the contract is what a client can
observe (usage fields, prices), nothing more. Our own server's contract (`labkit_contract`)
is written from our engine's code (chapter 16): full blocks of 16 tokens, the longest cached
chain of blocks, never the prompt's last token, no minimum, kept until evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CONSULTED = "2026-12-06"  # the day the documented figures below were read


@dataclass(frozen=True)
class CachingContract:
    """A prompt cache as its documentation describes it to clients."""

    name: str
    source: str                  # the documentation page
    automatic: bool              # True: every prompt is a candidate; False: only up to a client breakpoint
    minimum_tokens: int          # a shorter prefix is never cached
    increment_tokens: int        # cached lengths are minimum + k * increment
    write_multiplier: float      # price of a token written to the cache, per ordinary input token
    read_multiplier: float       # price of a token read from it
    ttl_seconds: float | None    # an entry unused this long is gone (refreshed on every hit); None: until evicted
    max_breakpoints: int | None = None
    never_last_token: bool = False  # the prompt's last token is always computed


ANTHROPIC_PAGE = "https://platform.claude.com/en/docs/build-with-claude/prompt-caching"
OPENAI_PAGE = "https://openai.com/index/api-prompt-caching/"

PROVIDER_CONTRACTS = {
    # Breakpoints marked with cache_control; 5-minute entries written at 1.25x the base input
    # price, 1-hour entries at 2x, reads at 0.1x; at most 4 breakpoints; the minimum is per
    # model (1,024 tokens for Sonnet 4 and Opus 4, 2,048 or 4,096 for others).
    "anthropic, 5-minute": CachingContract("anthropic, 5-minute", ANTHROPIC_PAGE, False, 1024, 1, 1.25, 0.1,
                                           300.0, max_breakpoints=4),
    "anthropic, 1-hour": CachingContract("anthropic, 1-hour", ANTHROPIC_PAGE, False, 1024, 1, 2.0, 0.1,
                                         3600.0, max_breakpoints=4),
    # Automatic from 1,024 tokens, in 128-token steps, no write premium; the launch post gives
    # cached input at half price for the GPT-4o family (later models list other discounts:
    # the read multiplier is per model); entries cleared after 5-10 minutes of inactivity.
    "openai (launch, GPT-4o)": CachingContract("openai (launch, GPT-4o)", OPENAI_PAGE, True, 1024, 128, 1.0,
                                               0.5, 300.0),
}


def labkit_contract(block_size: int = 16) -> CachingContract:
    """Our server's cache, from its code: any full block, no minimum, no price, no TTL."""
    return CachingContract("labkit serve", "labkit/engine/block_manager.py", True, block_size, block_size,
                           1.0, 1.0, None, never_last_token=True)


@dataclass(frozen=True)
class CacheRequest:
    """One request of a workload: its prompt's token ids, the ids its reply added to the
    sequence (a later turn's prompt may start with them), when it arrived, and where the
    client's last cache breakpoint ends (a token count; None: no breakpoint)."""

    prompt: tuple[int, ...]
    reply: tuple[int, ...] = ()
    arrival_s: float = 0.0
    breakpoint_tokens: int | None = None


@dataclass(frozen=True)
class Billed:
    """How a contract bills one request's input tokens (they add up to the prompt)."""

    read: int
    written: int
    ordinary: int

    @property
    def total(self) -> int:
        return self.read + self.written + self.ordinary


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cacheable(contract: CachingContract, length: int) -> int:
    """The longest cacheable length not above `length`: 0, or minimum + k * increment."""
    if length < contract.minimum_tokens:
        return 0
    return contract.minimum_tokens + (length - contract.minimum_tokens) // contract.increment_tokens \
        * contract.increment_tokens


def predict(contract: CachingContract, requests: Sequence[CacheRequest]) -> list[Billed]:
    """Play `requests` (in arrival order) through `contract`'s documented rules.

    Entries are token sequences with the time they were last used. An automatic cache reads the
    longest prefix a request shares with a live entry, cut to a cacheable length (and short of
    the prompt's last token where the contract says so); an explicit one reads only a whole
    entry, one that ends at a breakpoint some request wrote and that the prompt starts with. An automatic cache then holds the whole sequence
    (prompt and reply) for later requests and bills no write; an explicit one writes the
    prompt up to the client's breakpoint, billing the tokens past what it read."""
    entries: list[tuple[tuple[int, ...], float]] = []
    billed = []
    for request in requests:
        now, prompt = request.arrival_s, request.prompt
        live = [(tokens, used) for tokens, used in entries
                if contract.ttl_seconds is None or now - used <= contract.ttl_seconds]
        limit = len(prompt) - 1 if contract.never_last_token else len(prompt)
        read, hit = 0, None
        for index, (tokens, _) in enumerate(live):
            if contract.automatic:
                shared = cacheable(contract, min(common_prefix(tokens, prompt), limit))
            else:  # an entry ends at a breakpoint a client wrote: it is read whole or not at all
                shared = len(tokens) if len(tokens) <= limit and prompt[:len(tokens)] == tokens else 0
            if shared > read:
                read, hit = shared, index
        if hit is not None:
            live[hit] = (live[hit][0], now)  # a hit refreshes the entry's time to live
        written = 0
        if contract.automatic:
            live.append((prompt + request.reply, now))
        elif request.breakpoint_tokens is not None:
            end = cacheable(contract, min(request.breakpoint_tokens, len(prompt)))
            if end > read:
                written = end - read
                live.append((prompt[:end], now))
        entries = live
        billed.append(Billed(read, written, len(prompt) - read - written))
    return billed


def relative_cost(contract: CachingContract, billed: Sequence[Billed]) -> float:
    """Input cost with the cache over the same input at the ordinary price (1.0: no saving)."""
    total = sum(b.total for b in billed)
    if not total:
        raise ValueError("no input tokens")
    paid = sum(b.ordinary + b.read * contract.read_multiplier + b.written * contract.write_multiplier
               for b in billed)
    return paid / total


def break_even_reads(contract: CachingContract) -> float:
    """Reads of a written prefix after which writing it was cheaper than not caching:
    (write - 1) / (1 - read), the write premium over the saving per read."""
    if contract.read_multiplier >= 1.0:
        return float("inf")
    return max(0.0, contract.write_multiplier - 1.0) / (1.0 - contract.read_multiplier)
