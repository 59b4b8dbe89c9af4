"""Prompt caching as a public contract: what a provider's documentation says a request will be
billed, and what our own server's prefix cache says it served (chapter 32).

A provider's prompt cache is described to its clients by a handful of documented rules: how
long a prefix must be before it is cached, in what steps the cached length grows, whether the
client marks breakpoints or the cache is automatic, how long an entry lives, and what a
cached read and a cache write cost relative to an ordinary input token. `DOCUMENTED` is every
such figure, one row each with the page it comes from and the day we read it, and
`CachingContract` is built from those rows; `predict` plays a workload of requests (with up to
the documented number of breakpoints each) through them and says, per request, how many input
tokens the contract bills as read from the cache, as written to it, and as ordinary input;
`usage_fields` writes that as the usage object the provider documents, and `relative_cost`
turns it into a price relative to no caching.

Nothing here claims how any provider implements its cache: the contract is what a client can
observe (usage fields, prices), nothing more. Our own server's contract (`labkit_contract`)
is written from our engine's code (chapter 16): full blocks of 16 tokens, the longest cached
chain of blocks (generated tokens included), never the prompt's last token, no minimum, kept
until evicted. Checking it against the server checks our reading of the code, nothing more, and
it knows nothing of eviction: under memory pressure it is an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CONSULTED = "2026-12-06"  # the day the documented figures below were read


@dataclass(frozen=True)
class DocumentedFigure:
    """One figure a provider's documentation states, where it states it, and when we read it."""

    contract: str    # the contracts it sets (a provider's name: every contract of that provider)
    figure: str      # the CachingContract field it sets, or a note the calculator does not use
    value: object
    statement: str   # what the page says, in our words
    page: str
    consulted: str = CONSULTED


ANTHROPIC_PAGE = "https://platform.claude.com/en/docs/build-with-claude/prompt-caching"
OPENAI_PAGE = "https://openai.com/index/api-prompt-caching/"
OPENAI_GUIDE = "https://platform.openai.com/docs/guides/prompt-caching"
OPENAI_PRICING = "https://platform.openai.com/docs/pricing"
# OpenAI's API reference for `prompt_cache_retention` and `prompt_cache_options`, as the official
# `openai` client of this version ships it (openai/types/chat/completion_create_params.py)
OPENAI_REFERENCE_CLIENT = "3.57.0"
OPENAI_REFERENCE = "https://platform.openai.com/docs/api-reference/chat/create#prompt_cache_retention"

# Every provider figure the calculator uses, and the notes it does not, in one table (the
# chapter prints it): nothing below is typed anywhere else. A contract named after a model
# generation ("openai, GPT-5") takes that row before its provider's.
DOCUMENTED = (
    DocumentedFigure("anthropic", "automatic", False, "cached only up to a cache_control breakpoint: on a "
                     "block the client marks, or, with a top-level cache_control (automatic caching), on "
                     "the last cacheable block, moving forward as the conversation grows", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "max_breakpoints", 4, "at most 4 breakpoints per request", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "minimum_tokens", 1024, "minimum cacheable prompt for Sonnet 4 and Opus 4 "
                     "(other models: 2,048 or 4,096)", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "minimum_tokens_large", 4096, "minimum cacheable prompt for Opus 4.5 and "
                     "Haiku 4.5", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "increment_tokens", 1, "an entry ends exactly at a breakpoint",
                     ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "read_multiplier", 0.1, "a cache read costs 0.1x the base input price",
                     ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "caches_reply", False, "an entry is the prompt up to a breakpoint",
                     ANTHROPIC_PAGE),
    DocumentedFigure("anthropic", "readable_after_response_start", True, "an entry becomes available only "
                     "once the first response has begun; for hits on parallel requests, wait for it",
                     ANTHROPIC_PAGE),
    DocumentedFigure("anthropic, 5-minute", "write_multiplier", 1.25, "a 5-minute cache write costs 1.25x "
                     "the base input price", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic, 5-minute", "ttl_seconds", 300.0, "5-minute lifetime, refreshed at no cost "
                     "each time the entry is read", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic, 1-hour", "write_multiplier", 2.0, "a 1-hour cache write costs 2x the base "
                     "input price", ANTHROPIC_PAGE),
    DocumentedFigure("anthropic, 1-hour", "ttl_seconds", 3600.0, "1-hour lifetime (ttl: 1h)", ANTHROPIC_PAGE),
    DocumentedFigure("openai", "automatic", True, "every prompt is a candidate, no client marks",
                     OPENAI_PAGE),
    DocumentedFigure("openai", "minimum_tokens", 1024, "prompts of 1,024 tokens or more", OPENAI_PAGE),
    DocumentedFigure("openai", "increment_tokens", 128, "cached lengths grow in 128-token steps",
                     OPENAI_PAGE),
    DocumentedFigure("openai", "write_multiplier", 1.0, "no fee to write", OPENAI_PAGE),
    DocumentedFigure("openai", "read_multiplier", 0.5, "at launch (October 2024), cached input at half price "
                     "for GPT-4o", OPENAI_PAGE),
    DocumentedFigure("openai, GPT-5", "read_multiplier", 0.1, "cached input at a tenth of the input price "
                     "for the GPT-5 models", OPENAI_PRICING),
    DocumentedFigure("openai", "caches_reply", False, "hits are exact prefix matches of earlier prompts; "
                     "nothing says a reply is cached before it is sent back as a prompt", OPENAI_GUIDE),
    DocumentedFigure("openai", "readable_after_response_start", False, "nothing documented: the calculator "
                     "lets an entry be read as soon as the request that wrote it arrived", OPENAI_GUIDE),
    DocumentedFigure("openai", "ttl_seconds", 300.0, "in memory: cleared after 5 to 10 minutes without use "
                     "(at most an hour off-peak): the calculator takes the shorter", OPENAI_GUIDE),
    DocumentedFigure("openai", "ttl_extended_seconds", 86400.0, "prompt_cache_retention 24h keeps prefixes "
                     "up to a maximum of 24 hours (a maximum, not a minimum); on models that offer both "
                     "in_memory and 24h, the default without zero data retention (ZDR), in_memory the "
                     "default with ZDR; gpt-5.5 and later offer 24h only. The field is deprecated in "
                     "favour of prompt_cache_options.ttl", OPENAI_REFERENCE),
    DocumentedFigure("openai", "minimum ttl note (gpt-5.6 and later)", 1800.0, "prompt_cache_options.ttl "
                     "(gpt-5.6 and later) sets a minimum lifetime, 30m its default and only value (seconds "
                     "here); independent of prompt_cache_retention: not modelled (no GPT-5.6 row)",
                     OPENAI_REFERENCE),
    DocumentedFigure("openai", "routing note", "prompt_cache_key; about 15 requests per minute",
                     "requests are routed by prefix and prompt_cache_key; above about 15 requests a minute "
                     "for one prefix and key some go to other machines and miss: not modelled (the "
                     "workload sends fewer)", OPENAI_GUIDE),
    DocumentedFigure("anthropic", "usage fields", "input_tokens, cache_creation_input_tokens, "
                     "cache_read_input_tokens", "what the usage object reports", ANTHROPIC_PAGE),
    DocumentedFigure("openai", "usage fields", "prompt_tokens, prompt_tokens_details.cached_tokens",
                     "what the usage object reports", OPENAI_GUIDE),
)


def documented(contract: str, figure: str):
    """The documented value of `figure` for `contract`: its own row, else the row of the longest
    comma-separated start of its name ("openai, GPT-5" for "openai, GPT-5, 24-hour retention"),
    else its provider's."""
    parts = contract.split(", ")
    provider = contract.split(",")[0].split(" ")[0]
    for name in [", ".join(parts[:k]) for k in range(len(parts), 0, -1)] + [provider]:
        for row in DOCUMENTED:
            if row.contract == name and row.figure == figure:
                return row.value
    raise KeyError(f"no documented {figure!r} for {contract!r}")


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
    readable_after_response_start: bool = False  # an entry is read only once its writer's response began
    caches_reply: bool = False   # an automatic cache's entry runs on through the reply's tokens
    usage: str = "openai"        # which provider's usage fields report it (`usage_fields`)


def _provider_contract(name: str, source: str, **override) -> CachingContract:
    fields = {f: documented(name, f) for f in ("automatic", "minimum_tokens", "increment_tokens",
                                                "write_multiplier", "read_multiplier", "ttl_seconds",
                                                "caches_reply", "readable_after_response_start")}
    if not fields["automatic"]:
        fields["max_breakpoints"] = documented(name, "max_breakpoints")
    fields.update(override)
    return CachingContract(name, source, usage=name.split(",")[0].split(" ")[0], **fields)


PROVIDER_CONTRACTS = {
    name: _provider_contract(name, page)
    for name, page in [("anthropic, 5-minute", ANTHROPIC_PAGE), ("anthropic, 1-hour", ANTHROPIC_PAGE),
                       ("openai, GPT-5", OPENAI_PRICING), ("openai (launch, GPT-4o)", OPENAI_PAGE)]
}
# The GPT-5 models' cache kept for the documented 24 hours (extended retention, the default for an
# organization without ZDR): a best case, since 24 hours is a maximum, not a promise.
OPENAI_BEST_CASE = _provider_contract("openai, GPT-5, 24-hour retention", OPENAI_REFERENCE,
                                      ttl_seconds=documented("openai", "ttl_extended_seconds"))


def labkit_contract(block_size: int = 16) -> CachingContract:
    """Our server's cache, from its code: any full block, no minimum, no price, no TTL."""
    return CachingContract("labkit serve", "labkit/engine/block_manager.py", True, block_size, block_size,
                           1.0, 1.0, None, never_last_token=True, caches_reply=True)


@dataclass(frozen=True)
class CacheRequest:
    """One request of a workload: its prompt's token ids, the ids its reply added to the
    sequence (a later turn's prompt may start with them), when it arrived, and where the
    client's cache breakpoints end (token counts, at most the contract's maximum; none: the
    request marks nothing), and how long after its arrival its response began (where the
    contract makes an entry readable only from then): `response_start_s` when it reads from
    the cache, `cold_response_start_s` when it reads nothing and computes the whole prompt
    (None: the same as `response_start_s`), since a request that misses starts later."""

    prompt: tuple[int, ...]
    reply: tuple[int, ...] = ()
    arrival_s: float = 0.0
    breakpoints: tuple[int, ...] = ()
    response_start_s: float = 0.0
    cold_response_start_s: float | None = None

    def response_start(self, read: int) -> float:
        """How long after arrival its response begins, given the tokens it read from the cache."""
        if read or self.cold_response_start_s is None:
            return self.response_start_s
        return self.cold_response_start_s


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
    """How many leading tokens `a` and `b` share (a bisection over slice comparisons, which run
    in C: the cost figure plays the workload a few hundred times)."""
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def cacheable(contract: CachingContract, length: int) -> int:
    """The longest cacheable length not above `length`: 0, or minimum + k * increment."""
    if length < contract.minimum_tokens:
        return 0
    return contract.minimum_tokens + (length - contract.minimum_tokens) // contract.increment_tokens \
        * contract.increment_tokens


def _check_breakpoints(contract: CachingContract, request: CacheRequest) -> tuple[int, ...]:
    marks = tuple(sorted(set(request.breakpoints)))
    if any(not 0 < m <= len(request.prompt) for m in marks):
        raise ValueError(f"a breakpoint ends inside the prompt (1..{len(request.prompt)}), got {marks}")
    if contract.max_breakpoints is not None and len(marks) > contract.max_breakpoints:
        raise ValueError(f"{contract.name} allows {contract.max_breakpoints} breakpoints, got {len(marks)}")
    return marks


def predict(contract: CachingContract, requests: Sequence[CacheRequest]) -> list[Billed]:
    """Play `requests` (in arrival order) through `contract`'s documented rules.

    Entries are token sequences with the time they were last used. An automatic cache reads the
    longest prefix a request shares with a live entry, cut to a cacheable length (and short of
    the prompt's last token where the contract says so), then holds the prompt (and the reply,
    where `caches_reply`) for later requests and bills no write. An explicit cache reads only a
    whole entry, one that ends at a breakpoint some request wrote, that the prompt starts with
    and that ends by the request's last breakpoint; it then writes an entry at each of the
    request's breakpoints past what it read, billing as written every token from the read to
    the last of them. A request without a breakpoint neither reads nor writes. Where the contract
    says so (`readable_after_response_start`), an entry can be read only from the moment the
    response of the request that wrote it began (`response_start(read)` after its arrival: a
    request that read nothing computed its whole prompt, so its response begins at its cold
    start, and requests arriving before then find no entry and write their own)."""
    entries: list[tuple[tuple[int, ...], float, float]] = []  # tokens, last used, readable from
    billed = []
    for request in requests:
        now, prompt = request.arrival_s, request.prompt
        marks = () if contract.automatic else _check_breakpoints(contract, request)
        live = [(tokens, used, ready) for tokens, used, ready in entries
                if contract.ttl_seconds is None or now - used <= contract.ttl_seconds]
        if contract.automatic:
            limit = len(prompt) - 1 if contract.never_last_token else len(prompt)
        else:
            limit = marks[-1] if marks else 0
        read, hit = 0, None
        for index, (tokens, _, ready) in enumerate(live):
            if ready > now:  # its writer's response has not begun: not readable yet
                continue
            if contract.automatic:
                shared = cacheable(contract, min(common_prefix(tokens, prompt), limit))
            else:  # an entry ends at a breakpoint a client wrote: it is read whole or not at all
                shared = len(tokens) if len(tokens) <= limit and prompt[:len(tokens)] == tokens else 0
            if shared > read:
                read, hit = shared, index
        if hit is not None:
            live[hit] = (live[hit][0], now, live[hit][2])  # a hit refreshes the entry's time to live
        ready = now + request.response_start(read) if contract.readable_after_response_start else now
        written = 0
        if contract.automatic:
            live.append((prompt + request.reply if contract.caches_reply else prompt, now, ready))
        else:
            ends = [end for end in (cacheable(contract, m) for m in marks) if end > read]
            if ends:
                written = max(ends) - read
                live += [(prompt[:end], now, ready) for end in ends]
        entries = live
        billed.append(Billed(read, written, len(prompt) - read - written))
    return billed


def usage_fields(contract: CachingContract, billed: Billed) -> dict:
    """The input side of the usage object the contract's provider documents for a request
    billed so (Anthropic: tokens read, written and neither; OpenAI: the prompt and the part of
    it read from the cache)."""
    if contract.usage == "anthropic":
        return {"input_tokens": billed.ordinary, "cache_creation_input_tokens": billed.written,
                "cache_read_input_tokens": billed.read}
    if contract.usage == "openai":
        return {"prompt_tokens": billed.total, "prompt_tokens_details": {"cached_tokens": billed.read}}
    raise ValueError(f"no usage fields known for {contract.usage!r}")


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
