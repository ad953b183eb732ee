"""Issue 38: held KV. A finished sequence's blocks kept, so a later request can start from them.

An agent's conversation grows by appending: each turn (or each tool round) sends everything
before it again, plus a little. A request marked `hold_kv` that ends normally (stop or length)
does not give its blocks back: they stay here, under the request's id, with the tokens whose K/V
they really hold (prompt and output, less the last sampled token, which never went through the
model). A later request with `resume_from` that id takes the entry:

    L = the longest common prefix of its prompt and the held tokens (at most prompt - 1: the
        last prompt token must run, to give logits)
    the blocks covering the first L tokens become its block table; the rest go back to the pool
    it starts with L tokens computed: only prompt[L:] is prefilled

A block that is shared (the prefix cache handed it to someone else too) or named in the prefix
cache as full must never be written again. When L ends inside such a block, that block is dropped
and its tokens are recomputed (L rounds down to the block's start). The other kept blocks hold
exactly the tokens of the new sequence, so their names in the prefix cache stay true, and the new
sequence names the blocks it fills from L on, as any sequence does.

Held entries are a cache: when the scheduler needs blocks and none are free, it evicts them, the
least recently held first, before it refuses a prompt or preempts a running sequence. A request
whose entry is gone is simply prefilled from scratch. Plain Python, like the rest of the scheduler.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from nanoserve.scheduler.blocks import BlockAllocator, blocks_needed
from nanoserve.scheduler.sequence import Sequence, SequenceStatus

# Sequence.resume_outcome: what became of a request's resume_from
RESUMED, EVICTED, MISMATCH = "resumed", "evicted", "mismatch"


@dataclass
class HeldEntry:
    """One held sequence: `blocks` hold the K/V of `token_ids`, computed under adapter `lora_id`."""

    token_ids: list[int]
    blocks: list[int]
    lora_id: int
    held_time: float  # time.perf_counter() when it was held


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class HeldKV:
    """The held entries, by request id, least recently held first, and their counters."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.entries: OrderedDict[int, HeldEntry] = OrderedDict()
        self.num_blocks = 0  # blocks the entries hold (an int: read from other threads without a lock)
        self.num_held = 0  # entries ever held
        self.num_resumed = 0  # requests that started from an entry
        self.num_resumed_tokens = 0  # prompt tokens those requests did not prefill
        self.num_evictions = 0  # entries (or resumes waiting in the queue) dropped for room
        self.num_released = 0  # entries released by their owner

    # -- in: a sequence ends ------------------------------------------------------------------

    def hold(self, seq: Sequence) -> None:
        """`seq` ended normally: keep its blocks under its id instead of freeing them (the
        scheduler's `finish` then finds an empty block table). Blocks past its computed tokens
        (room grown for a next token) go back to the pool."""
        n = min(seq.num_computed, len(seq.token_ids) - seq.num_pending)
        keep = blocks_needed(n, self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self.allocator.free(block)
        if keep:
            self.entries[seq.seq_id] = HeldEntry(seq.token_ids[:n], seq.block_table[:keep], seq.lora_id,
                                                 time.perf_counter())
            self.num_blocks += keep
            self.num_held += 1
        seq.block_table = []

    def release(self, key: int) -> bool:
        """Free an entry's blocks. False if there was no such entry (evicted, taken, never held)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self._free(entry.blocks)
        self.num_released += 1
        return True

    def _free(self, blocks: list[int]) -> None:
        """Blocks that left an entry go back (last first: with prefix caching, the tail is evicted before the head)."""
        for block in reversed(blocks):
            self.allocator.free(block)
        self.num_blocks -= len(blocks)

    # -- out: a request resumes ---------------------------------------------------------------

    def attach(self, seq: Sequence, key: int, reuse: bool = True) -> str:
        """A new request `seq` (queued, no blocks yet) asks to resume from entry `key`: take the
        entry, keep the blocks of the common prefix on `seq` (`resume_blocks`, `resume_len`) for
        its admission, free the rest. Returns the outcome, also kept in `seq.resume_outcome`.
        `reuse=False` (a batching policy that cannot start from computed tokens): take it, free it all."""
        entry = self.entries.pop(key, None)
        if entry is None:
            seq.resume_outcome = EVICTED
            return EVICTED
        n = min(common_prefix(seq.token_ids, entry.token_ids), seq.num_tokens - 1)
        if entry.lora_id != seq.lora_id or seq.params.prompt_logprobs is not None or not reuse:
            n = 0  # other K/V (another adapter), or the prompt's logits are wanted: nothing reusable
        keep = blocks_needed(n, self.block_size)
        if n % self.block_size and not self._writable(entry.blocks[keep - 1]):
            keep -= 1  # L ends inside a shared or named block: drop it, recompute its tokens
            n = keep * self.block_size
        self._free(entry.blocks[keep:])
        seq.resume_outcome = RESUMED if n else MISMATCH
        if n:
            seq.resume_blocks, seq.resume_len = entry.blocks[:keep], n
        return seq.resume_outcome

    def _writable(self, block: int) -> bool:
        """Whether a new sequence may write into `block`: only it holds it, and the prefix cache has no name for it."""
        ref_count = getattr(self.allocator, "ref_count", None)
        named = getattr(self.allocator, "hash_of_block", {})
        return (ref_count is None or ref_count[block] == 1) and block not in named

    def resume(self, seq: Sequence) -> bool:
        """At admission: a sequence with resume blocks starts from them (True); else False."""
        if seq.resume_blocks is None:
            return False
        seq.block_table, seq.resume_blocks = seq.resume_blocks, None
        self.num_blocks -= len(seq.block_table)
        seq.num_computed = seq.num_resumed = seq.resume_len
        self.num_resumed += 1
        self.num_resumed_tokens += seq.resume_len
        return True

    def keep_resume(self, seq: Sequence) -> bool:
        """The scheduler frees `seq`'s blocks. A resumed sequence that did not fit in this step and
        waits on keeps its resumed blocks for its next try (True: nothing to free). Otherwise the
        resume blocks it still carries (aborted in the queue) are freed too (False: free the table)."""
        if seq.status is SequenceStatus.WAITING and seq.num_resumed and seq.first_scheduled_time is None:
            seq.resume_blocks, seq.block_table = seq.block_table, []
            self.num_blocks += len(seq.resume_blocks)
            self.num_resumed -= 1
            self.num_resumed_tokens -= seq.num_resumed
            seq.num_computed = seq.num_resumed = 0
            seq.block_table_version += 1
            return True
        self.drop_resume(seq)
        return False

    def drop_resume(self, seq: Sequence) -> None:
        if seq.resume_blocks is not None:
            self._free(seq.resume_blocks)
            seq.resume_blocks = None

    # -- room -----------------------------------------------------------------------------------

    def evict_until(self, needed: int, waiting: list[Sequence] = ()) -> None:
        """Evict entries, least recently held first, until `needed` blocks are free or none is
        left; then drop the resume blocks of the sequences in `waiting` (last first) the same way."""
        while needed > self.allocator.num_free and self.entries:
            _, entry = self.entries.popitem(last=False)
            self._free(entry.blocks)
            self.num_evictions += 1
        for seq in reversed(list(waiting)):
            if needed <= self.allocator.num_free:
                return
            if seq.resume_blocks is not None:
                self.drop_resume(seq)
                seq.resume_outcome = EVICTED
                self.num_evictions += 1

    def room_for_queue(self, waiting: list[Sequence], running: list[Sequence], max_prompt_tokens: int) -> None:
        """Before a step is scheduled: evict entries if the running sequences' next tokens and the
        head of the queue (its first `max_prompt_tokens` new tokens) would not fit otherwise."""
        if not (self.entries or any(s.resume_blocks for s in waiting)):
            return
        bs = self.block_size
        needed = sum(max(0, blocks_needed(s.num_tokens, bs) - len(s.block_table)) for s in running)
        if waiting:
            head = waiting[0]
            tokens = min(head.num_tokens, head.resume_len + max_prompt_tokens)
            needed += blocks_needed(tokens, bs) - len(head.resume_blocks or ())
        self.evict_until(needed, list(waiting)[1:])

    def stats(self) -> dict:
        return dict(entries=len(self.entries), blocks=self.num_blocks, held=self.num_held, resumed=self.num_resumed,
                    resumed_tokens=self.num_resumed_tokens, evictions=self.num_evictions,
                    released=self.num_released)
