"""What fits: the sizes every request is checked against before it is queued.

The engine checks a request with these in `LLMEngine.check_request`; the HTTP service's front
end, which has no engine in its process, gets them from its worker and checks the same way,
so a request that cannot fit is refused before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int   # prompt + output tokens
    block_size: int
    num_blocks: int      # the KV pool
    vocab_size: int

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError if prompt + output cannot fit the context or the KV pool."""
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        if -(-total // self.block_size) > self.num_blocks:
            raise ValueError(f"{total} tokens need more KV blocks than the pool's {self.num_blocks}")
