"""Week 14: prefix caching. Blocks of K/V that a new prompt shares with an earlier one are reused.

Chat traffic resends the same system prompt and the whole conversation every turn; without a
cache, every request prefills all of it again. The K/V of a token depend only on the tokens up to
it (causal attention), so two sequences that start with the same tokens have the same K/V for
that stretch, and one copy in the pool can serve both.

The unit of sharing is a *full* block. A block is named by a hash of its tokens and of the hash of
the block before it, so equal names mean equal prefixes, all the way from the first token:

    hash(block i) = H(hash(block i - 1), tokens of block i)          (block -1: nothing)

Beside the free list of week 4 this allocator keeps:

    ref_count[block]   how many block tables hold the block
    block_of_hash      hash -> the block holding that prefix's last block of K/V
    evictable          blocks nobody holds any more whose content is still good, least
                       recently used first: a later prompt may hit them, or the pool may
                       take them back when it has no plain free block left

so a block is always in exactly one of three states: free, held (ref_count >= 1), or cached and
evictable (ref_count 0, hashed). The partly filled last block of a sequence is never shared: it
is still being written. Nothing here knows about tensors: the scheduler turns hits into a
shorter prefill (`num_computed` starts past the cached blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from nanoserve.scheduler.blocks import BlockAllocator, OutOfBlocks


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """The name of a full block: 16 bytes of BLAKE2b over the parent's name and the block's tokens.

    128 bits make an accidental collision (two different prefixes with one name, which would
    hand a sequence someone else's K/V) vanishingly unlikely: about 2**-64 after 2**32 blocks.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())  # 8 bytes per token id, in a fixed layout
    return h.digest()


def chain_hashes(names: list[bytes], token_ids: list[int], num_blocks: int, block_size: int) -> list[bytes]:
    """The names of a sequence's first `num_blocks` full blocks: `names` (its chain so far, kept
    between calls) extended from `token_ids` as far as needed, so each block is hashed once."""
    while len(names) < num_blocks:
        i = len(names)
        names.append(block_hash(names[-1] if i else None, token_ids[i * block_size : (i + 1) * block_size]))
    return names[:num_blocks]


class PrefixCachingAllocator(BlockAllocator):
    """The week-4 allocator with reference counts, a hash -> block map and an LRU evictable list."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.ref_count = [0] * num_blocks
        self.block_of_hash: dict[bytes, int] = {}
        self.hash_of_block: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # Counters the engine reports (and the metrics week exports).
        self.num_lookups = 0  # admissions that looked for a cached prefix
        self.num_lookup_tokens = 0  # tokens of those sequences
        self.num_hit_tokens = 0  # tokens found in the cache
        self.num_evictions = 0  # cached blocks taken back for new content

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones, and cached ones nobody holds."""
        return len(self.free_blocks) + len(self.evictable)

    def allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block = self.evict()
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.ref_count[block] = 1
        self.used.add(block)
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the last one sends the block to the evictable list if it holds a
        named (full, hashed) prefix, else back to the free list."""
        # >>> week14: release
        if self.ref_count[block] < 1:
            raise ValueError(f"block {block} is not allocated (double free?)")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.used.remove(block)
            if block in self.hash_of_block:
                self.evictable[block] = None  # the most recently used end
            else:
                self.free_blocks.append(block)
        # <<< week14: release

    def evict(self) -> int:
        """Take back the least recently used cached block: its content and its name are gone."""
        # >>> week14: evict
        block, _ = self.evictable.popitem(last=False)
        del self.block_of_hash[self.hash_of_block.pop(block)]
        self.num_evictions += 1
        return block
        # <<< week14: evict

    def match(self, names: list[bytes], num_blocks: int | None = None, token_ids: list[int] = (),
              block_size: int = 0) -> list[int]:
        """The blocks of the longest cached prefix of a sequence's first `num_blocks` full blocks
        (default: as many as `names` has), in order, each now held once more by the caller.

        `names` is the sequence's chain of block names so far, kept between lookups: a block past
        its end is named here, from `token_ids` (blocks of `block_size` tokens) and the name before
        it, and appended, so each block is hashed once per sequence and none past the first miss."""
        num_blocks = len(names) if num_blocks is None else num_blocks
        # >>> week14: match-prefix
        blocks = []
        for i in range(num_blocks):
            if i == len(names):  # not named yet: chain it on its parent's name
                parent = names[-1] if i else None
                names.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
            block = self.block_of_hash.get(names[i])
            if block is None:
                break  # a chain: past the first miss, nothing can match
            blocks.append(block)
        for block in blocks:
            if self.ref_count[block] == 0:  # cached, held by nobody: take it off the evictable list
                del self.evictable[block]
                self.used.add(block)
            self.ref_count[block] += 1
        return blocks
        # <<< week14: match-prefix

    def register(self, block: int, h: bytes) -> None:
        """A held block has just been filled: name it, so later prompts can find it. If another
        block already holds the same prefix (two equal prompts prefilled in one step), the first
        keeps the name and this one stays private."""
        if h not in self.block_of_hash and block not in self.hash_of_block:
            self.block_of_hash[h] = block
            self.hash_of_block[block] = h

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_lookups += 1
        self.num_lookup_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def stats(self) -> dict:
        return dict(lookups=self.num_lookups, lookup_tokens=self.num_lookup_tokens, hit_tokens=self.num_hit_tokens,
                    hit_rate=self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0,
                    evictions=self.num_evictions, cached_blocks=len(self.block_of_hash))

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Every block in exactly one state; reference counts equal the tables that hold each block;
        the two maps each other's inverse. An AssertionError names the first block that breaks one."""
        # >>> week14: invariants
        held = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                held[block] += 1
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks), "a block is twice on the free list"
        for block in range(self.num_blocks):
            states = (block in free) + (block in evictable) + (self.ref_count[block] > 0)
            assert states == 1, f"block {block} is in {states} states (free, evictable, held)"
            assert held[block] == self.ref_count[block], f"block {block}: {held[block]} tables, count {self.ref_count[block]}"
            assert (block in self.used) == (self.ref_count[block] > 0), f"block {block}: used and count disagree"
            assert block not in evictable or block in self.hash_of_block, f"evictable block {block} has no name"
            assert block not in free or block not in self.hash_of_block, f"free block {block} still has a name"
        assert len(self.block_of_hash) == len(self.hash_of_block), "the two maps differ in size"
        for block, h in self.hash_of_block.items():
            assert self.block_of_hash.get(h) == block, f"block {block}'s name points elsewhere"
        # <<< week14: invariants
