"""The KV block manager: which fixed-size block of the cache holds which tokens.

The cache is a pool of `num_blocks` blocks of `block_size` token slots each. A sequence
holds a *block table*, the list of its blocks in token order, so its tokens need not sit
side by side in memory and it takes blocks only as it grows. Blocks are reference
counted: the n samples of one request share the blocks of their prompt, and a block is
copied only when a sequence writes into a block someone else still holds (copy on write).

Prefix caching: every full block gets a hash chained from its parent block's hash, its
tokens and an optional salt (a tenant's scope), so equal hashes mean equal prefixes. A
full block stays findable after its last holder lets go; such unreferenced cached blocks
are reused in least-recently-released order only when the free list is empty.

Layer groups (`labkit.engine.kv_groups`): a model whose layers attend through different
windows (Gemma 3) gets one block table per group of layers, all drawing on this one pool. A
windowed group's blocks are given back as the window passes them (`computed`), and a
prefix hit needs, in such a group, only the blocks the first uncached position still sees.
The prefix index is keyed by (group, hash).

The manager moves no tensors: it returns the (source, destination) block copies that
copy-on-write needs, and the model runner performs them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from labkit.engine.kv_groups import NO_BLOCK, first_block
from labkit.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler should have checked first."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: tuple[int, bytes] | None = None  # (group, chain hash), set once full and registered
    token_ids: tuple[int, ...] = ()   # the tokens a registered block holds (hash collisions)


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...] | list[int], salt: str | None = None) -> bytes:
    """Hash of one full block given its parent block's hash: equal only for equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root:" + (salt or "").encode())
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


@dataclass
class BlockCounters:
    prefix_queries: int = 0     # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0        # ... and found
    prefix_query_tokens: int = 0  # prompt tokens of the sequences admitted with a lookup (vLLM's queries)
    prefix_hit_tokens: int = 0    # ... of them found in the cache (vLLM's hits)
    copies_on_write: int = 0
    evictions: int = 0          # cached blocks reused for other tokens


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int = 16
    prefix_caching: bool = True
    windows: tuple[int | None, ...] = (None,)  # per layer group: its window (None: every position)
    blocks: list[Block] = field(init=False)
    free_ids: deque[int] = field(init=False)
    cached: dict[tuple[int, bytes], int] = field(init=False)      # (group, hash) -> block id
    evictable: OrderedDict[int, None] = field(init=False)         # cached, ref_count 0, LRU order
    counters: BlockCounters = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_ids = deque(range(self.num_blocks))
        self.cached, self.evictable = {}, OrderedDict()
        self.counters = BlockCounters()

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: never-used or released ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """New blocks `seq` needs, over all its tables, so that its first `tokens` tokens have slots."""
        want = -(-tokens // self.block_size)
        return sum(max(0, want - len(table)) for table in self._tables(seq))

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s block tables, one per group (made empty for a sequence that holds none)."""
        if len(seq.block_tables) != len(self.windows):
            if any(seq.block_tables):
                raise AssertionError(f"sequence {seq.seq_id} holds tables of another manager")
            seq.block_tables = [[] for _ in self.windows]
        return seq.block_tables

    def _first_block(self, group: int, position: int) -> int:
        """The first block of `group` a query at `position` reads."""
        return first_block(self.windows[group], position, self.block_size)

    # -- taking and releasing blocks ---------------------------------------------------------
    def _take(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.key]
            block.key, block.token_ids = None, ()
            self.counters.evictions += 1
        else:
            raise OutOfBlocks("no free KV block")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise AssertionError(f"block {block_id} released with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self.evictable[block_id] = None  # newest at the end: evicted last
            else:
                self.free_ids.append(block_id)

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _cached_block(self, group: int, digest: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get((group, digest))
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def allocate_prompt(self, seq: Sequence) -> int:
        """Give a waiting sequence its first blocks: prefix-cache hits for the full blocks of
        its known tokens that are cached, nothing else yet. Returns the tokens found cached
        (the sequence starts computing from there). At least one token is always left to
        compute, because the next token's logits come from running the last one.

        A hit of h blocks needs, in every full-attention group, blocks 0 .. h-1 cached, and in
        a windowed group only those the position h * block_size still sees; the blocks before
        them stay NO_BLOCK."""
        tables = self._tables(seq)
        if any(tables):
            raise AssertionError(f"sequence {seq.seq_id} already holds blocks")
        hits, bs = 0, self.block_size
        if self.prefix_caching:
            full = (seq.num_tokens - 1) // bs
            pieces = [tuple(seq.token_ids[i * bs:(i + 1) * bs]) for i in range(full)]
            digests: list[bytes] = []
            for tokens in pieces:
                digests.append(chain_hash(digests[-1] if digests else None, tokens, seq.cache_salt))
            hits = full
            for group, window in enumerate(self.windows):
                if window is None:  # a full group's hit is the longest cached prefix
                    hits = next((i for i in range(hits) if self._cached_block(group, digests[i], pieces[i]) is None),
                                hits)
            while hits and not all(self._cached_block(group, digests[i], pieces[i]) is not None
                                   for group, window in enumerate(self.windows) if window is not None
                                   for i in range(self._first_block(group, hits * bs), hits)):
                hits -= 1
            for group, table in enumerate(tables):
                first = self._first_block(group, hits * bs)
                table += [NO_BLOCK] * first
                for i in range(first, hits):
                    block_id = self._cached_block(group, digests[i], pieces[i])
                    self._hold(block_id)
                    table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = hits * bs
        return seq.num_computed_tokens

    def count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix-cache lookups and hits (a lookup that was
        rolled back because the sequence could not be admitted is not counted)."""
        if self.prefix_caching:
            self.counters.prefix_queries += (seq.num_tokens - 1) // self.block_size
            self.counters.prefix_hits += seq.num_cached_prompt_tokens // self.block_size
            self.counters.prefix_query_tokens += seq.num_tokens
            self.counters.prefix_hit_tokens += seq.num_cached_prompt_tokens

    def can_grow(self, seq: Sequence, tokens: int) -> bool:
        return self.blocks_needed(seq, tokens) + self._cow_needed(seq, tokens) <= self.num_free

    def _cow_needed(self, seq: Sequence, tokens: int) -> int:
        """Blocks to copy before the next write: one per table whose next write lands in a
        block that another sequence also holds."""
        first = seq.num_computed_tokens
        if first >= tokens or first % self.block_size == 0:
            return 0
        index = first // self.block_size
        return sum(index < len(table) and self.blocks[table[index]].ref_count > 1 for table in self._tables(seq))

    def grow(self, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
        """Make slots for the first `tokens` tokens of `seq`, which will be written from
        position `seq.num_computed_tokens` on. Returns the block copies (source,
        destination) to perform before the write: copy on write of a shared partial block."""
        copies = []
        first = seq.num_computed_tokens
        index = first // self.block_size
        want = -(-tokens // self.block_size)
        for table in self._tables(seq):
            if (first < tokens and first % self.block_size and index < len(table)
                    and self.blocks[table[index]].ref_count > 1):
                old = table[index]
                new = self._take()
                self._release(old)
                table[index] = new
                copies.append((old, new))
                self.counters.copies_on_write += 1
            for _ in range(want - len(table)):
                table.append(self._take())
        return copies

    def computed(self, seq: Sequence) -> None:
        """`seq`'s computed tokens have advanced: register its full blocks, then give back
        the blocks its windows passed (in that order, so a passed full block stays findable
        by later prompts)."""
        self.register_full_blocks(seq)
        self.release_passed(seq)

    def release_passed(self, seq: Sequence) -> int:
        """Give back, in every windowed group, the blocks no later query of `seq` reads (those
        before the first block position `seq.num_computed_tokens` sees). Call it after
        `register_full_blocks`, so that a passed full block stays findable. Returns how many
        blocks were given back."""
        released = 0
        for group, table in enumerate(self._tables(seq)):
            passed = start = min(self._first_block(group, seq.num_computed_tokens), len(table))
            while start > 0 and table[start - 1] != NO_BLOCK:  # given back so far: a prefix
                start -= 1
            for i in range(start, passed):  # oldest first: evicted first if cached
                self._release(table[i])
                table[i] = NO_BLOCK
                released += 1
        return released

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the computed full blocks of `seq` findable by later prompts."""
        if not self.prefix_caching:
            return
        hashes = seq.block_hashes  # hashes depend on tokens only: computed once per block
        for i in range(len(hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            digest = chain_hash(hashes[-1] if hashes else None, tokens, seq.cache_salt)
            hashes.append(digest)
            for group, table in enumerate(self._tables(seq)):
                if table[i] == NO_BLOCK:
                    continue
                block = self.blocks[table[i]]
                if (group, digest) in self.cached or block.key is not None:
                    continue  # another block already caches this prefix: keep one copy findable
                block.key, block.token_ids = (group, digest), tokens
                self.cached[block.key] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release all blocks of `seq`, last block first so that a prefix's tail is evicted
        before its head."""
        for table in self._tables(seq):
            for block_id in reversed(table):
                if block_id != NO_BLOCK:
                    self._release(block_id)
        seq.block_tables = [[] for _ in self.windows]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (parallel sampling: n > 1)."""
        if any(self._tables(child)):
            raise AssertionError("child already holds blocks")
        for table in self._tables(parent):
            for block_id in table:
                if block_id != NO_BLOCK:
                    self.blocks[block_id].ref_count += 1
        child.block_tables = [list(table) for table in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens

    # -- invariants --------------------------------------------------------------------------
    def check(self, live: list[Sequence]) -> None:
        """Raise AssertionError unless every block is accounted for: each block's reference
        count equals the number of live block tables that hold it, free and evictable
        blocks are exactly the unreferenced ones, the prefix index points at blocks that
        carry the indexed key, and no windowed table holds a block its window has passed."""
        holders = [0] * self.num_blocks
        for seq in live:
            for group, table in enumerate(self._tables(seq)):
                passed = self._first_block(group, seq.num_computed_tokens)
                if any(block_id != NO_BLOCK for block_id in table[:passed]):
                    raise AssertionError(f"sequence {seq.seq_id} holds blocks its window has passed")
                for block_id in table:
                    if block_id != NO_BLOCK:
                        holders[block_id] += 1
        for block in self.blocks:
            if block.ref_count != holders[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count}, "
                                     f"held by {holders[block.block_id]} tables")
        free, evictable = set(self.free_ids), set(self.evictable)
        if len(free) != len(self.free_ids) or free & evictable:
            raise AssertionError("a block is listed twice among the free blocks")
        unreferenced = {b.block_id for b in self.blocks if b.ref_count == 0}
        if free | evictable != unreferenced:
            raise AssertionError("free + evictable blocks differ from the unreferenced blocks")
        if any(self.blocks[b].key is None for b in evictable):
            raise AssertionError("an evictable block has no key")
        for key, block_id in self.cached.items():
            if self.blocks[block_id].key != key:
                raise AssertionError(f"prefix index points at block {block_id} with another key")
