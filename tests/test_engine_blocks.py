"""The KV block manager: allocation, reference counts, copy on write, the prefix cache and
its LRU eviction, checked directly and by random operation sequences (hypothesis)."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.engine.block_manager import BlockManager, OutOfBlocks, chain_hash
from labkit.engine.kv_groups import NO_BLOCK
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def seq(tokens, seq_id=0, salt=None):
    return Sequence(seq_id, str(seq_id), list(tokens), GREEDY, cache_salt=salt)


def admit(bm, s, tokens=None):
    """What the scheduler does: prefix lookup, then slots for every known token."""
    bm.allocate_prompt(s)
    bm.grow(s, s.num_tokens if tokens is None else tokens)


def compute(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_blocks_follow_the_tokens():
    bm = BlockManager(10, block_size=4)
    s = seq(range(9))
    admit(bm, s)
    assert len(s.block_table) == 3 and bm.num_used == 3  # 9 tokens -> 3 blocks of 4
    compute(bm, s)
    s.token_ids += [100, 101, 102]  # 12 tokens still fit in 3 blocks
    assert bm.blocks_needed(s, 12) == 0 and bm.blocks_needed(s, 13) == 1
    bm.free(s)
    assert bm.num_free == 10 and s.block_table == []
    bm.check([])


def test_chain_hash_depends_on_the_whole_prefix_and_the_salt():
    a = chain_hash(None, (1, 2, 3, 4))
    assert chain_hash(None, (1, 2, 3, 4)) == a
    assert chain_hash(a, (5, 6)) != chain_hash(chain_hash(None, (0, 2, 3, 4)), (5, 6))
    assert chain_hash(None, (1, 2, 3, 4), salt="tenant-a") != a
    assert chain_hash(None, (1, 2, 3, 4), salt="tenant-a") != chain_hash(None, (1, 2, 3, 4), salt="tenant-b")


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, block_size=4)
    first = seq(range(12), 0)
    admit(bm, first)
    compute(bm, first)
    second = seq(list(range(8)) + [50, 51, 52], 1)   # shares two full blocks
    assert bm.allocate_prompt(second) == 8
    assert second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    same = seq(range(12), 2)  # the whole prompt cached: still recompute the last block
    assert bm.allocate_prompt(same) == 8
    salted = seq(range(12), 3, salt="other tenant")
    assert bm.allocate_prompt(salted) == 0
    bm.grow(second, second.num_tokens)
    bm.grow(same, same.num_tokens)
    bm.check([first, second, same, salted])


def test_released_cached_blocks_are_found_again_until_evicted():
    bm = BlockManager(4, block_size=4)
    a = seq(range(8), 0)
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    assert bm.num_free == 4 and len(bm.evictable) == 2
    b = seq(list(range(8)) + [9], 1)
    assert bm.allocate_prompt(b) == 8  # found after its holder finished
    bm.free(b)
    c = seq(range(100, 116), 2)  # needs all 4 blocks: evicts both cached ones
    admit(bm, c)
    assert bm.counters.evictions == 2 and not bm.cached
    d = seq(list(range(8)) + [9], 3)
    bm.free(c)
    assert bm.allocate_prompt(d) == 0
    bm.check([d])


def test_eviction_takes_the_least_recently_released_block_and_the_tail_first():
    bm = BlockManager(5, block_size=2)
    a, b = seq([1, 2, 3, 4, 5], 0), seq([7, 8, 9], 1)
    for s in (a, b):
        admit(bm, s)
        compute(bm, s)
    head, tail = a.block_table[0], a.block_table[1]
    bm.free(a)  # tail released first: older in the LRU order
    bm.free(b)
    assert list(bm.evictable)[:2] == [tail, head]
    c = seq([20, 21, 22], 2)
    admit(bm, c)  # 2 blocks: the 2 free ones (partial blocks are never cached) ...
    d = seq([30, 31], 3)
    admit(bm, d)  # ... then the oldest evictable block: a's tail
    assert d.block_table == [tail]
    assert bm.allocate_prompt(seq([1, 2, 3], 4)) == 2  # a's head is still cached


def test_fork_shares_and_copy_on_write_separates():
    bm = BlockManager(8, block_size=4)
    parent = seq(range(6), 0)
    admit(bm, parent)
    compute(bm, parent)
    child = seq(range(6), 1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    partial = parent.block_table[1]
    for s, token in ((parent, 10), (child, 11)):
        s.token_ids.append(token)
    copies = bm.grow(child, 7)  # the child writes position 6 into the shared partial block
    assert len(copies) == 1 and copies[0][0] == partial and child.block_table[1] == copies[0][1]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.grow(parent, 7) == []  # the parent now holds its block alone: no copy
    assert bm.counters.copies_on_write == 1
    bm.check([parent, child])


def test_out_of_blocks_raises_and_can_grow_says_so_first():
    bm = BlockManager(2, block_size=4)
    s = seq(range(9))
    bm.allocate_prompt(s)
    assert not bm.can_grow(s, 9)
    with pytest.raises(OutOfBlocks):
        bm.grow(s, 9)


def test_check_catches_a_leak_and_a_wrong_count():
    bm = BlockManager(4, block_size=4)
    s = seq(range(5))
    admit(bm, s)
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check([])  # s is live but not passed: its blocks look leaked
    bm.blocks[s.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check([s])


class BlockMachine(RuleBasedStateMachine):
    """Random admit / grow / fork / finish / preempt sequences against the invariants."""

    WINDOWS = (None,)

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12 * len(self.WINDOWS), block_size=3, windows=self.WINDOWS)
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def admit(self, tokens):
        s = seq(tokens, self.next_id)
        self.next_id += 1
        self.bm.allocate_prompt(s)
        if self.bm.can_grow(s, s.num_tokens):
            self.bm.grow(s, s.num_tokens)
            self.live.append(s)
        else:
            self.bm.free(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        s = data.draw(st.sampled_from(self.live))
        compute(self.bm, s)
        self.bm.release_passed(s)
        s.token_ids.append(token)
        if self.bm.can_grow(s, s.num_tokens):
            self.bm.grow(s, s.num_tokens)
        else:  # preempt by recompute: give everything back
            self.bm.free(s)
            self.live.remove(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = seq(parent.token_ids, self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        s = data.draw(st.sampled_from(self.live))
        compute(self.bm, s)
        self.bm.free(s)
        self.live.remove(s)

    @invariant()
    def accounted(self):
        self.bm.check(self.live)
        held = {b for s in self.live for table in s.block_tables for b in table if b != NO_BLOCK}
        assert self.bm.num_used == len(held)

    def teardown(self):
        for s in self.live:
            self.bm.free(s)
        assert self.bm.num_free == self.bm.num_blocks


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedBlockMachine(BlockMachine):
    """The same operations on a manager with a full-attention group and two windowed groups
    (windows of 4 and 5 positions over blocks of 3): the window's blocks are given back as it
    passes them, and prefix hits take only what the window still reads."""

    WINDOWS = (None, 4, 5)


TestWindowedBlockMachine = WindowedBlockMachine.TestCase
TestWindowedBlockMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
