"""The serving engine's sliding windows, counted in blocks (chapter 22).

The engine (`labkit.engine`) stores keys and values in blocks of `block_size` positions.
For a model with windowed layers it splits the layers into groups of one window each
(`labkit.engine.kv_groups`), gives every sequence one block table per group, and hands a
windowed group's blocks back to the pool as the window passes them. Two measurements:

* :func:`engine_block_trace`: one request through a real `LLMEngine`, the blocks its
  sequence holds in each group recorded after every step.
* :func:`blocks_held`: the same block manager driven step by step the way the engine drives
  it (slots, then the step, then register and give back), without the model, for lengths
  the CPU cannot prefill in a chapter's time; against the blocks the same sequence would hold
  if every group kept every position (a window applied only as a mask).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.engine.block_manager import BlockManager
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams


def engine_block_trace(engine, prompt_ids: list[int], new_tokens: int, logprobs: int | None = None):
    """Run one greedy request (EOS ignored) through `engine`, checking its block accounting
    after every step. Returns the request's output and one row per step: positions cached
    and the blocks held in each group, before the request finishes and gives them back.
    With `logprobs` the output's samples carry that many top log-probabilities per token
    (to hold the engine's greedy tokens to another path's under the near-tie rule)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=logprobs)
    request_id = engine.add_request(prompt_ids, params)
    seq = engine.requests[request_id].seqs[0]
    rows = []
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        if not seq.status.done:
            rows.append({"positions": seq.num_computed_tokens, "held": seq.blocks_held})
    return engine.release(request_id), rows


@dataclass(frozen=True)
class BlocksHeld:
    tokens: int
    held: int          # blocks held after the last step, every group
    peak: int          # most blocks held at once (during a step, before passed ones go back)
    every_position: int  # blocks if every group kept every position


def blocks_held(windows: tuple[int | None, ...], tokens: int, step_tokens: int,
                block_size: int = 16) -> BlocksHeld:
    """Drive a `BlockManager` over groups of these windows through one sequence of `tokens`
    positions computed `step_tokens` at a time (a chunked prefill), as `LLMEngine` does."""
    manager = BlockManager(len(windows) * -(-tokens // block_size), block_size, prefix_caching=False,
                           windows=windows)
    seq = Sequence(0, "0", list(range(tokens)), SamplingParams(temperature=0.0))
    manager.allocate_prompt(seq)
    peak = 0
    while seq.num_computed_tokens < tokens:
        step = min(step_tokens, tokens - seq.num_computed_tokens)
        manager.grow(seq, seq.num_computed_tokens + step)
        peak = max(peak, manager.num_used)
        seq.num_computed_tokens += step
        manager.computed(seq)
    manager.check([seq])
    return BlocksHeld(tokens, manager.num_used, peak, len(windows) * -(-tokens // block_size))
