"""The scheduler: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (`max_batched_tokens`). Continuous (iteration-level)
batching refills the batch every step: running sequences first (one token each when
decoding, a chunk of the prompt when prefilling), then waiting ones as long as budget,
sequence slots and KV blocks last. Static batching admits a batch only when the previous
one has completely finished. When a running sequence needs a block and none is free, the
newest running sequence is preempted: it gives back all its blocks and waits to be
recomputed from its tokens (prompt plus what it generated), so memory pressure slows
requests down but never crashes the engine or changes their tokens.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from labkit.engine.block_manager import BlockManager
from labkit.engine.sequence import Sequence, Status

BATCHING = ("continuous", "static")
POLICIES = ("fcfs", "shortest")


@dataclass(frozen=True)
class SchedulerConfig:
    batching: str = "continuous"
    max_num_seqs: int = 64            # sequences running at once
    max_batched_tokens: int = 512     # tokens per step (prefill chunks + decodes)
    chunked_prefill: bool = True      # split prompts longer than the step's budget
    policy: str = "fcfs"              # waiting queue order: arrival, or shortest prompt first
    static_batch_size: int = 8        # static batching: requests per batch
    reserve_tokens: int | None = None  # reserve blocks for this many tokens at admission
                                       # (contiguous-style reservation), None: grow on demand

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_batched_tokens", "static_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.reserve_tokens is not None and self.reserve_tokens < 1:
            raise ValueError("reserve_tokens must be at least 1 or None")


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens of seq run through the model this step

    @property
    def completes(self) -> bool:
        """True if after this step every token is computed, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 on_transition: Callable[[Sequence, Status, Status], None] | None = None):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_transition = on_transition
        self.preemptions = 0

    # -- state changes ---------------------------------------------------------------------
    def _move(self, seq: Sequence, new: Status) -> None:
        old, seq.status = seq.status, new
        if self.on_transition is not None:
            self.on_transition(seq, old, new)

    def add(self, seq: Sequence) -> None:
        if seq.status is not Status.WAITING:
            raise ValueError(f"only a waiting sequence can be added, not a {seq.status.value} one")
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (a forked sample) joins the running batch."""
        self._move(seq, Status.RUNNING)
        self.running.append(seq)

    def finish(self, seq: Sequence, status: Status = Status.FINISHED) -> None:
        """Take a sequence out for good (finished or aborted), releasing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.holds_blocks:
            self.blocks.register_full_blocks(seq)
            self.blocks.free(seq)
        self._move(seq, status)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.preemptions += 1
        self.preemptions += 1
        self._move(seq, Status.PREEMPTED)
        self.waiting.appendleft(seq)  # first in line to come back

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # Static batching runs a whole batch at once: its budget is the batch, not tokens.
        budget = self.config.max_batched_tokens if self.config.batching == "continuous" else sys.maxsize
        budget = self._schedule_running(plan, budget)
        may_admit = not plan.preempted and (self.config.batching == "continuous" or not self.running)
        if may_admit:
            self._admit(plan, budget)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_pending_tokens
            if self.config.chunked_prefill:
                n = min(n, budget)
            elif n > budget and plan.scheduled:
                break  # an unchunked prompt waits for a step of its own
            target = seq.num_computed_tokens + n
            while not self.blocks.can_grow(seq, target):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.PREEMPTED:
                break
            plan.copies += self.blocks.grow(seq, target)
            plan.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            i += 1
        return budget

    def _next_waiting(self) -> Sequence:
        if self.config.policy == "shortest":
            return min(self.waiting, key=lambda s: (s.num_tokens, s.arrival_time))
        return self.waiting[0]

    def _admit(self, plan: StepPlan, budget: int) -> None:
        limit = self.config.max_num_seqs
        if self.config.batching == "static":
            limit = min(limit, self.config.static_batch_size)
        while self.waiting and budget > 0 and len(self.running) < limit:
            seq = self._next_waiting()
            self.blocks.allocate_prompt(seq)
            n = seq.num_pending_tokens
            if n > budget:
                if self.config.chunked_prefill:
                    n = budget
                elif plan.scheduled:
                    self._unadmit(seq)  # an unchunked prompt waits for a step of its own
                    break
            target = seq.num_computed_tokens + n
            reserve = max(target, self.config.reserve_tokens or 0)
            if not self.blocks.can_grow(seq, reserve):
                self._unadmit(seq)
                break
            self.blocks.count_lookup(seq)
            plan.copies += self.blocks.grow(seq, reserve)
            self.waiting.remove(seq)
            self._move(seq, Status.RUNNING)
            self.running.append(seq)
            plan.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _unadmit(self, seq: Sequence) -> None:
        """Give back the prefix-cache hits of a sequence that stays waiting."""
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = 0
