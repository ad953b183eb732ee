"""Who runs this step: sequences, their state, and the scheduling policy.

The scheduler owns the bookkeeping of the KV block pool (which sequence holds which blocks) and
decides, every step, which sequences run and how many of their tokens go through the model. It
never runs model code and never touches a tensor: it hands the runner a `Batch` and gets back
one sampled token per sequence.

Week 5 has the simplest policy that works: admit every waiting request whose prompt fits into
the free blocks, prefill them together, then decode everything that runs. Weeks 7-9 replace it
with static batching, continuous batching and preemption.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from nanoserve.cache import BlockAllocator, OutOfBlocks, blocks_needed
from nanoserve.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks
    RUNNING = "running"  # holds blocks, runs every step
    FINISHED = "finished"  # done: blocks returned


_ids = itertools.count()


@dataclass
class Sequence:
    """One request's tokens and state, from arrival to its last token."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # EOS and the request's stop tokens
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    generator: torch.Generator | None = None  # seeded requests only
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each output token came out

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class Batch:
    """One step's work: for each sequence, run tokens num_computed .. num_computed + n - 1."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 2048):
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- requests in and out ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if blocks_needed(len(seq.prompt_ids) + 1, self.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"a prompt of {len(seq.prompt_ids)} tokens can never fit in the KV pool "
                f"({self.allocator.num_blocks} blocks of {self.block_size} tokens)"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (stop, length or abort) and give its blocks back."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._free_blocks(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.allocator.free(block)
        seq.block_table = []
        seq.num_computed = 0

    def _grow_to(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate blocks until `seq` can hold `num_tokens` tokens."""
        while len(seq.block_table) < blocks_needed(num_tokens, self.block_size):
            seq.block_table.append(self.allocator.allocate())

    # -- the policy ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """Week 5: prefill every waiting request that fits, else decode every running one."""
        # >>> week05: schedule
        admitted: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            need = blocks_needed(seq.num_tokens, self.block_size)
            if need > self.allocator.num_free or (admitted and seq.num_tokens > budget):
                break
            self.waiting.popleft()
            self._grow_to(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            budget -= seq.num_tokens
            admitted.append(seq)
        if admitted:
            self.running += admitted
            return Batch(admitted, [s.num_tokens - s.num_computed for s in admitted])
        for seq in self.running:  # decode: each sequence needs room for one more token
            try:
                self._grow_to(seq, seq.num_tokens)
            except OutOfBlocks:
                raise OutOfBlocks(
                    "the KV pool is full and this scheduler cannot preempt: give the engine more "
                    "blocks or fewer concurrent requests"
                ) from None
        return Batch(list(self.running), [1] * len(self.running))
        # <<< week05: schedule

    def update(self, batch: Batch, tokens: list[int]) -> None:
        """Record one sampled token per sequence; finish those that hit a stop token or a limit."""
        now = time.perf_counter()
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, tokens):
            if seq.is_finished:  # aborted while its step was running
                continue
            seq.num_computed += n
            seq.output_ids.append(token)
            seq.token_times.append(now)
            if token in seq.stop_ids:
                self.finish(seq, "stop")
            elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
