"""The state of one sequence in the serving engine.

A request asks for `n` samples of one prompt; each sample is a `Sequence`. The engine
treats every sequence the same way, whatever its phase: the first `num_computed_tokens`
of `token_ids` have their keys and values in the KV cache, the rest must still be run
through the model. A fresh prompt has none computed (prefill), a decoding sequence has
all but its newest token computed (decode), a prefill split over several steps sits in
between (chunked prefill), and a preempted sequence goes back to none (recompute).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from labkit.engine.kv_groups import NO_BLOCK
from labkit.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued, holds no KV blocks
    RUNNING = "running"      # holds KV blocks, is scheduled step after step
    PREEMPTED = "preempted"  # lost its blocks under memory pressure; queued to recompute
    FINISHED = "finished"    # stopped by EOS, a stop token or string, or max_tokens
    ABORTED = "aborted"      # cancelled by the client

    @property
    def done(self) -> bool:
        return self in (Status.FINISHED, Status.ABORTED)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0               # which of the request's n samples this is
    cache_salt: str | None = None       # prefix-cache scope (e.g. a tenant)
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0        # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0   # of those, how many a prefix-cache hit supplied
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # one per layer group
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full computed blocks
    first_scheduled_time: float | None = None  # first moved to RUNNING
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None    # "stop", "length" or "abort"
    preemptions: int = 0
    text: str = ""                      # detokenized output, stop strings cut off
    # One entry per output token when params.logprobs is set, else None. Appended only with
    # a kept token; a preempted sequence keeps its output, so they stay aligned through a
    # recompute (which samples nothing until it reaches the end of that output).
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    # The sample's grammar matcher when its params have a response format (a
    # labkit.structured GrammarMatcher): the runner asks it for the step's allowed tokens,
    # the output processor feeds it each kept token. Its state follows output_token_ids, so a
    # preempted sequence keeps it through a recompute.
    matcher: object | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            if self.top_logprobs is None:
                self.top_logprobs = []

    @property
    def block_table(self) -> list[int]:
        """The first group's block table: the only one of a model without windows."""
        return self.block_tables[0]

    @property
    def blocks_held(self) -> list[int]:
        """Blocks held in each layer group's table (a windowed group's passed ones excluded)."""
        return [sum(block_id != NO_BLOCK for block_id in table) for table in self.block_tables]

    @property
    def holds_blocks(self) -> bool:
        return any(self.block_tables)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    # -- sampling stream -------------------------------------------------------------------
    @property
    def sampling_seed(self) -> int | None:
        """The request's seed for sample 0; a seed derived from it for the others, so the
        n samples of one request draw from different streams and stay reproducible."""
        seed = self.params.seed
        if seed is None or self.sample_index == 0:
            return seed
        digest = hashlib.blake2b(f"{seed}/{self.sample_index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")
