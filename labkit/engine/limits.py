"""Admission: what the runtime cannot do, refused before any work is done.

A request the engine cannot serve must fail at the door, not halfway through: a prompt that
passes the model's last position fails in the middle of its prefill, after its earlier
chunks ran and held blocks; a request whose tokens outgrow the whole KV pool preempts itself
forever. `EngineLimits.refusal` checks a request against what this engine, with this model,
can do, and names the first thing it cannot:

- ``context_length_exceeded``: prompt + max_tokens is longer than the model's context (its
  RoPE table, or a shorter `EngineConfig.max_model_len`);
- ``kv_budget_exceeded``: one sample's tokens need more KV blocks at once than the whole pool
  has (for a model with windowed layers, `kv_groups.peak_blocks`: those layers hold only
  their window and a step's new tokens);
- ``too_many_samples``: n samples are more than the engine runs at once (they decode
  together, forked from one prefill);
- ``unknown_token``: a stop token id, or a logit-bias token id, that this model's vocabulary
  does not have (it could never match or apply, so the field would be silently ignored).

The engine checks every request with it (`LLMEngine.check_request`); the HTTP service's
front end, which has no engine in its process, gets the limits from its worker and checks
the same way, so a request that cannot be served is refused before anything is sent. The
check reads four integers and a list; it does no model work.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from labkit.engine.kv_groups import peak_blocks

REFUSAL_CODES = ("context_length_exceeded", "kv_budget_exceeded", "too_many_samples", "unknown_token")


class Refused(ValueError):
    """A request the runtime cannot serve: `code` (one of REFUSAL_CODES) says why and
    `param` names the request field to change."""

    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int   # prompt + output tokens
    block_size: int
    num_blocks: int      # the KV pool
    vocab_size: int
    max_num_seqs: int = sys.maxsize  # sequences the engine runs at once
    windows: tuple[int | None, ...] = (None,)  # per layer group of the pool (kv_groups)
    step_tokens: int | None = None   # most tokens of a sequence one step writes; None: all of them

    def refusal(self, prompt_tokens: int, max_tokens: int, *, n: int = 1,
                stop_token_ids: tuple[int, ...] = (), logit_bias_ids: tuple[int, ...] = ()) -> Refused | None:
        """Why this engine cannot serve such a request, or None if it can."""
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            param = "prompt" if prompt_tokens >= self.max_model_len else "max_tokens"
            return Refused("context_length_exceeded",
                           f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                           f"exceeds the model's context of {self.max_model_len} tokens", param)
        blocks = self.blocks_for(total)
        if blocks > self.num_blocks:
            return Refused("kv_budget_exceeded",
                           f"{total} tokens need {blocks} KV blocks of {self.block_size} tokens at once, "
                           f"more than the pool's {self.num_blocks}", "max_tokens")
        if n > self.max_num_seqs:
            return Refused("too_many_samples",
                           f"n = {n} samples are more than the {self.max_num_seqs} sequences this "
                           f"engine runs at once", "n")
        unknown = sorted({t for t in stop_token_ids if not 0 <= t < self.vocab_size})
        if unknown:
            return Refused("unknown_token",
                           f"stop token ids {unknown} are outside the model's vocabulary of "
                           f"{self.vocab_size}", "stop_token_ids")
        unknown = sorted({t for t in logit_bias_ids if not 0 <= t < self.vocab_size})
        if unknown:
            return Refused("unknown_token",
                           f"logit_bias token ids {unknown[:10]}{' ...' if len(unknown) > 10 else ''} are "
                           f"outside the model's vocabulary of {self.vocab_size}", "logit_bias")
        return None

    def blocks_for(self, total_tokens: int) -> int:
        """KV blocks one sequence of `total_tokens` holds at its peak."""
        step = total_tokens if self.step_tokens is None else min(total_tokens, self.step_tokens)
        return peak_blocks(self.windows, total_tokens, step, self.block_size)

    def longest_sequence(self) -> int:
        """The most tokens (prompt + output) one sequence can reach in this pool, up to
        `max_model_len`: the pool's capacity for a single request (0 if not even one token)."""
        low, high = 0, self.max_model_len  # blocks_for grows with the length: bisect it
        while low < high:
            middle = (low + high + 1) // 2
            if self.blocks_for(middle) <= self.num_blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def check(self, prompt_tokens: int, max_tokens: int, *, n: int = 1,
              stop_token_ids: tuple[int, ...] = (), logit_bias_ids: tuple[int, ...] = ()) -> None:
        """Raise `Refused` (a ValueError) if the request cannot be served."""
        refused = self.refusal(prompt_tokens, max_tokens, n=n, stop_token_ids=stop_token_ids,
                               logit_bias_ids=logit_bias_ids)
        if refused is not None:
            raise refused
