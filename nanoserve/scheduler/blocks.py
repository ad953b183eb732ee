"""Week 4: the bookkeeping of the paged KV cache, without a single tensor.

The pool of KV blocks lives on the device (`nanoserve/attention/paged.py`); which block is free and which
sequence holds which block is plain Python, kept here so that the scheduler, which owns that
bookkeeping, never needs torch. A sequence's *block table* is the list of physical blocks that
hold its tokens in order; `slot_of` turns a token position into its row of the flattened pool.
"""

from __future__ import annotations

import math
from collections import deque


class OutOfBlocks(RuntimeError):
    """The block pool has no free block left (the scheduler must wait, or preempt someone)."""


class BlockAllocator:
    """A free list of physical block ids 0 .. num_blocks - 1."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return len(self.used)

    def allocate(self) -> int:
        # >>> week04: allocate
        if not self.free_blocks:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self.free_blocks.popleft()
        self.used.add(block)
        return block
        # <<< week04: allocate

    def free(self, block: int) -> None:
        # >>> week04: free
        if block not in self.used:
            raise ValueError(f"block {block} is not allocated (double free?)")
        self.used.remove(block)
        self.free_blocks.append(block)
        # <<< week04: free


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return math.ceil(num_tokens / block_size)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The physical slot (row of the flattened pool) that holds token `position`.

    Logical block `position // block_size` of the sequence is physical block
    `block_table[position // block_size]`; within it, the token sits at `position % block_size`.
    """
    # >>> week04: slot-of
    return block_table[position // block_size] * block_size + position % block_size
    # <<< week04: slot-of


def paged_cache_waste(lengths: list[int], block_size: int) -> int:
    """Token slots allocated but unused: only each sequence's last, partly filled block."""
    return sum(blocks_needed(n, block_size) * block_size - n for n in lengths)
