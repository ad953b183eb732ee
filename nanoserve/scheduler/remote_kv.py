"""Issue 35: the scheduler of one instance of a disaggregated pair (nanoserve/engine/disaggregation.py).

A prefill instance finishes each request after its first token, but the request's blocks must
outlive it until the KV connector has copied them out: `finish` keeps them (`kept`), and
`release_kept` gives them back. A decode instance admits requests whose prompt was computed
elsewhere: `reserve` gives such a request blocks to receive its KV into, and once the KV has
landed `add_computed` puts it into the running set as if its own prefill step had just run. To
the rest of the scheduler that is a prefix-cache hit of the whole prompt: the sequence's first
`num_computed` tokens are in the cache; decoding, preemption (which recomputes it here) and
aborts need nothing new.
"""

from __future__ import annotations

import time

from nanoserve.scheduler.blocks import blocks_needed
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Batch, Sequence, SequenceStatus


class RemoteKVScheduler(Scheduler):
    """A `Scheduler` that can keep a finished sequence's KV (prefill side) and admit a sequence
    whose KV comes from elsewhere (decode side)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: dict[int, list[int]] = {}  # seq_id -> blocks of a finished sequence, KV still to send

    def finish(self, seq: Sequence, reason: str) -> None:
        """As `Scheduler.finish`, but a sequence marked `keep_kv` that ends at its length limit (its
        one token) leaves its blocks in `kept` instead of the free pool."""
        if seq.keep_kv and reason == "length" and not seq.is_finished:
            self.kept[seq.seq_id], seq.block_table = seq.block_table, []
        super().finish(seq, reason)

    def release_kept(self, seq_id: int) -> None:
        """The KV of a kept sequence has been copied out: its blocks go back to the pool."""
        for block in reversed(self.kept.pop(seq_id)):
            self.allocator.free(block)

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for `seq`'s prompt, whose K/V another instance computed and the KV connector
        brings in. False (nothing allocated) while the pool or the running set is full."""
        if blocks_needed(seq.num_tokens, self.block_size) > self.allocator.num_free or \
                len(self.running) >= self.max_num_seqs:
            return False
        self._grow_to(seq, seq.num_tokens)
        return True

    def add_computed(self, seq: Sequence, first_token: int) -> None:
        """The K/V of `seq`'s prompt have landed in its reserved blocks: it runs from now on, as after
        its own prefill step (the prompt computed, its first token appended and checked by `update`,
        its full blocks named for the prefix cache)."""
        # >>> week21: admit-computed
        seq.status, seq.first_scheduled_time = SequenceStatus.RUNNING, time.perf_counter()
        seq.num_computed = seq.num_tokens
        if self.prefix_caching:
            self._cache_full_blocks(seq, 0)
        self.running.append(seq)
        self.update(Batch([seq], [0]), [[first_token]])
        # <<< week21: admit-computed
