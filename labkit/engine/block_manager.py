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

The manager moves no tensors: it returns the (source, destination) block copies that
copy-on-write needs, and the model runner performs them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from labkit.engine.sequence import Sequence


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler should have checked first."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None         # set once the block is full and registered
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
    copies_on_write: int = 0
    evictions: int = 0          # cached blocks reused for other tokens


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int = 16
    prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free_ids: deque[int] = field(init=False)
    cached: dict[bytes, int] = field(init=False)                  # hash -> block id
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
        """New blocks `seq` needs so that its first `tokens` tokens have slots."""
        return max(0, -(-tokens // self.block_size) - len(seq.block_table))

    # -- taking and releasing blocks ---------------------------------------------------------
    def _take(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
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
            if block.hash is not None:
                self.evictable[block_id] = None  # newest at the end: evicted last
            else:
                self.free_ids.append(block_id)

    def allocate_prompt(self, seq: Sequence) -> int:
        """Give a waiting sequence its first blocks: prefix-cache hits for the full blocks of
        its known tokens that are cached, nothing else yet. Returns the tokens found cached
        (the sequence starts computing from there). At least one token is always left to
        compute, because the next token's logits come from running the last one."""
        if seq.block_table:
            raise AssertionError(f"sequence {seq.seq_id} already holds blocks")
        hits, parent = 0, None
        if self.prefix_caching:
            full = (seq.num_tokens - 1) // self.block_size
            for i in range(full):
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                parent = chain_hash(parent, tokens, seq.cache_salt)
                block_id = self.cached.get(parent)
                if block_id is None or self.blocks[block_id].token_ids != tokens:
                    break
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.evictable[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                hits += 1
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = hits * self.block_size
        return seq.num_computed_tokens

    def count_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's prefix-cache lookups and hits (a lookup that was
        rolled back because the sequence could not be admitted is not counted)."""
        if self.prefix_caching:
            self.counters.prefix_queries += (seq.num_tokens - 1) // self.block_size
            self.counters.prefix_hits += seq.num_cached_prompt_tokens // self.block_size

    def can_grow(self, seq: Sequence, tokens: int) -> bool:
        return self.blocks_needed(seq, tokens) + self._cow_needed(seq, tokens) <= self.num_free

    def _cow_needed(self, seq: Sequence, tokens: int) -> int:
        """1 if the next write lands in a block that another sequence also holds."""
        first = seq.num_computed_tokens
        if first >= tokens or first % self.block_size == 0 or not seq.block_table:
            return 0
        index = first // self.block_size
        if index >= len(seq.block_table):
            return 0
        return int(self.blocks[seq.block_table[index]].ref_count > 1)

    def grow(self, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
        """Make slots for the first `tokens` tokens of `seq`, which will be written from
        position `seq.num_computed_tokens` on. Returns the block copies (source,
        destination) to perform before the write: copy on write of a shared partial block."""
        copies = []
        index = seq.num_computed_tokens // self.block_size
        if self._cow_needed(seq, tokens):
            old = seq.block_table[index]
            new = self._take()
            self._release(old)
            seq.block_table[index] = new
            copies.append((old, new))
            self.counters.copies_on_write += 1
        for _ in range(self.blocks_needed(seq, tokens)):
            seq.block_table.append(self._take())
        return copies

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make the computed full blocks of `seq` findable by later prompts."""
        if not self.prefix_caching:
            return
        hashes = seq.block_hashes  # hashes depend on tokens only: computed once per block
        for i in range(len(hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            digest = chain_hash(hashes[-1] if hashes else None, tokens, seq.cache_salt)
            hashes.append(digest)
            block = self.blocks[seq.block_table[i]]
            if digest in self.cached or block.hash is not None:
                continue  # another block already caches this prefix: keep one copy findable
            block.hash, block.token_ids = digest, tokens
            self.cached[digest] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release all blocks of `seq`, last block first so that a prefix's tail is evicted
        before its head."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (parallel sampling: n > 1)."""
        if child.block_table:
            raise AssertionError("child already holds blocks")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens

    # -- invariants --------------------------------------------------------------------------
    def check(self, live: list[Sequence]) -> None:
        """Raise AssertionError unless every block is accounted for: each block's reference
        count equals the number of live block tables that hold it, free and evictable
        blocks are exactly the unreferenced ones, and the prefix index points at blocks
        that carry the indexed hash."""
        holders = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
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
        if any(self.blocks[b].hash is None for b in evictable):
            raise AssertionError("an evictable block has no hash")
        for digest, block_id in self.cached.items():
            if self.blocks[block_id].hash != digest:
                raise AssertionError(f"prefix index points at block {block_id} with another hash")
