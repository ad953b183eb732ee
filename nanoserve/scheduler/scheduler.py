"""Who runs this step: sequences, their state, and the batching policy.

The scheduler owns the bookkeeping of the KV block pool (which sequence holds which blocks) and
decides, every step, which sequences run and how many of their tokens go through the model. It
never runs model code and never touches a tensor (it does not even import torch): it hands the
runner a `Batch` and gets back the tokens sampled for each sequence.

Week 5 has the simplest policy that works: admit every waiting request whose prompt fits into
the free blocks, prefill them together, then decode everything that runs. Weeks 7-9 replace it
with static batching, continuous batching and preemption.
"""

from __future__ import annotations

import time
from collections import deque

from nanoserve.scheduler.adapters import hold_back, name_first_block
from nanoserve.scheduler.blocks import BlockAllocator, OutOfBlocks, blocks_needed
from nanoserve.scheduler.cpu_tier import TieredPrefixAllocator
from nanoserve.scheduler.held import HeldKV
from nanoserve.scheduler.prefix_cache import PrefixCachingAllocator, chain_hashes
from nanoserve.scheduler.sequence import PENDING, Batch, Sequence, SequenceStatus

BATCHING = ("admit-all", "static", "continuous")


class Scheduler:
    """Keeps the waiting queue and the running set, and decides each step's batch.

    batching:
      "admit-all"   week 5: prefill every waiting request that fits, then decode; no limits
                    beyond memory, and running out of blocks mid-decode is an error.
      "static"      week 7: admit a batch (up to max_num_seqs, all prefilled in one step) only
                    when nothing runs, reserve each request's whole KV (prompt + max_tokens)
                    up front, run the batch to its end.
      "continuous"  week 8: every step, decode everything running and admit waiting requests
                    (FCFS) into the same step while the limits allow.
    preemption (week 9, continuous only): when a running sequence needs a block and none is
    free, the most recently admitted sequence gives its blocks back and waits at the front of
    the queue, to be recomputed later.
    prefix caching (week 14, continuous only): a sequence being admitted starts from the blocks
    of its prefix that the pool still holds, and only the rest of it is prefilled. With
    `cpu_blocks` (issue 35), blocks the pool evicts go to a CPU tier of that many blocks, and come
    back from there on a hit (nanoserve/scheduler/cpu_tier.py): the batch carries the copies.
    chunked prefill (week 15, continuous only): the step's token budget goes to the running
    decodes first; what is left goes to prompts, cut into chunks where they do not fit, so a
    long prompt never stalls the streams that are already decoding.
    scheduling "priority" (continuous only; default "fcfs"): the queue and the running set are
    kept in order of priority (lower first, arrival order among equals), so admission takes the
    best-ranked request and preemption the worst; a request gains one level for every
    `aging_steps` steps it has waited, so none waits forever.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 2048,
                 batching: str = "continuous", preemption: bool = True, prefix_caching: bool = False,
                 chunked_prefill: bool = False, scheduling: str = "fcfs", aging_steps: int = 200,
                 cpu_blocks: int = 0, max_loras: int = 0):
        if batching not in BATCHING:
            raise ValueError(f"unknown batching {batching!r}: choose one of {', '.join(BATCHING)}")
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling order {scheduling!r}: choose fcfs or priority")
        asked = [name for name, on in (("prefix caching", prefix_caching), ("chunked prefill", chunked_prefill),
                                       ("priority scheduling", scheduling == "priority")) if on]
        if asked and batching != "continuous":
            raise ValueError(f"{' and '.join(asked)} work with continuous batching only, not {batching!r}")
        self.by_priority = scheduling == "priority" and batching == "continuous"
        self.aging_steps = aging_steps
        self.prefix_caching = prefix_caching and batching == "continuous"
        self.chunked_prefill = chunked_prefill and batching == "continuous"
        if cpu_blocks and not self.prefix_caching:
            raise ValueError("a CPU tier keeps the blocks the prefix cache evicts: it needs prefix caching")
        if self.prefix_caching and cpu_blocks:
            self.allocator: BlockAllocator = TieredPrefixAllocator(num_blocks, cpu_blocks)
        elif self.prefix_caching:
            self.allocator = PrefixCachingAllocator(num_blocks)
        else:
            self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.batching = batching
        self.preemption = preemption and batching == "continuous"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.ending: list[Sequence] = []  # async scheduling: their last token is on the GPU; never scheduled again
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens sent through the model so far, prefill and decode
        self.min_chunk = block_size  # week 15: the smallest piece of a new prompt worth admitting
        self.max_loras = max_loras  # week 23: distinct adapters running at once (the device's slots)
        self.num_held_for_adapters = 0  # steps in which the head of the queue waited for an adapter slot
        self.held = HeldKV(self.allocator, block_size)  # issue 38: finished sequences' KV, kept for a resume

    # -- requests in and out ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        longest = min(seq.max_total_tokens, self.max_model_len)
        if blocks_needed(longest, self.block_size) > self.allocator.num_blocks:
            raise ValueError(
                f"a request of {seq.prompt_len} prompt tokens + {seq.params.max_tokens} new "
                f"tokens can never fit in the KV pool ({self.allocator.num_blocks} blocks of "
                f"{self.block_size} tokens): shorten it or lower max_tokens"
            )
        self.waiting.append(seq)
        name_first_block(seq, self.block_size)  # week 23

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.ending)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (stop, length or abort) and give its blocks back."""
        if seq.is_finished:
            return
        if seq.hold_kv and reason in ("stop", "length"):  # issue 38: its blocks stay, under its id
            self.held.hold(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._free_blocks(seq)
        if seq.num_pending:  # async scheduling: tokens sampled after its end are never delivered
            del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
            seq.num_pending = 0
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.ending:
            self.ending.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        # Last block first: with prefix caching the evictable list is least recently used first,
        # so a sequence's tail goes before its head, which other prompts are likelier to share.
        if self.held.keep_resume(seq):  # issue 38: a resumed sequence waiting on keeps its held blocks
            return
        for block in reversed(seq.block_table):
            self.allocator.free(block)
        seq.block_table = []
        seq.block_table_version += 1
        seq.num_computed = 0

    def _grow_to(self, seq: Sequence, num_tokens: int) -> None:
        """Allocate blocks until `seq` can hold `num_tokens` tokens."""
        while len(seq.block_table) < blocks_needed(num_tokens, self.block_size):
            seq.block_table.append(self.allocator.allocate())

    def _admit(self, seq: Sequence, reserve_tokens: int) -> None:
        if self.prefix_caching:
            self.allocator.record_lookup(seq.num_tokens, seq.num_computed)
        self.waiting.remove(seq)
        self._grow_to(seq, reserve_tokens)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
            seq.num_cached_tokens = seq.num_computed
        self.running.append(seq)

    # -- the policies ---------------------------------------------------------------------------

    def schedule(self) -> Batch:
        if self.by_priority:
            self._order_by_priority()
        self.waiting, held = hold_back(self.waiting, self.adapters_in_use, self.max_loras)  # week 23
        self.num_held_for_adapters += bool(held)
        chunk = self.max_num_batched_tokens if self.chunked_prefill else self.max_model_len
        self.held.room_for_queue(self.waiting, self.running, chunk)  # issue 38: held KV gives way first
        if self.batching == "admit-all":
            batch = self._schedule_admit_all()
        elif self.batching == "static":
            batch = self._schedule_static()
        elif self.chunked_prefill:
            batch = self._schedule_chunked()
        else:
            batch = self._schedule_continuous()
        self.num_scheduled_tokens += batch.num_scheduled_tokens
        self.waiting.extend(held)
        self.attach_copies(batch)
        return batch

    def attach_copies(self, batch: Batch) -> None:
        """The CPU tier's copies scheduled so far go with the batch, to run before its forward pass.
        A batch without sequences never runs: they wait for the next one. (`schedule` calls this;
        whoever allocates blocks for the batch afterwards, as speculative decoding's guesses do,
        calls it again.)"""
        if isinstance(self.allocator, TieredPrefixAllocator) and batch.seqs:
            offloads, reloads = self.allocator.take_copies()
            batch.offloads += offloads
            batch.reloads += reloads

    def adapters_in_use(self) -> set[int]:
        """The adapter ids of the running sequences (and of those whose last step is in flight)."""
        return {s.lora_id for s in self.running + self.ending if s.lora_id}

    def _schedule_admit_all(self) -> Batch:
        """Week 5: prefill every waiting request that fits, else decode every running one."""
        # >>> week05: schedule
        admitted: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            if blocks_needed(seq.num_tokens, self.block_size) > self.allocator.num_free:
                break
            self._admit(seq, seq.num_tokens)
            admitted.append(seq)
        if admitted:
            return Batch(admitted, [s.num_tokens - s.num_computed for s in admitted])
        for seq in self.running:  # decode: each sequence needs room for one more token
            try:
                self._grow_to(seq, seq.num_tokens)
            except OutOfBlocks:
                raise OutOfBlocks(
                    "the KV pool is full and this batching cannot preempt: use continuous batching "
                    "(--batching continuous) with preemption, more blocks, or fewer concurrent requests"
                ) from None
        return Batch(list(self.running), [1] * len(self.running))
        # <<< week05: schedule

    def _schedule_static(self) -> Batch:
        """Week 7: a new batch only when the last one has completely finished."""
        # >>> week07: static
        if self.running:  # the batch in flight runs to its end; newcomers wait
            return Batch(list(self.running), [1] * len(self.running))
        admitted: list[Sequence] = []
        for seq in list(self.waiting):
            # Reserve everything the request may ever need, so a batch never runs out mid-way.
            reserve = min(seq.max_total_tokens, self.max_model_len)
            if len(admitted) == self.max_num_seqs or blocks_needed(reserve, self.block_size) > self.allocator.num_free:
                break
            self._admit(seq, reserve)
            admitted.append(seq)
        return Batch(admitted, [s.num_tokens - s.num_computed for s in admitted])
        # <<< week07: static

    def _schedule_continuous(self) -> Batch:
        """Week 8: decode all running sequences, and admit waiting ones into the same step."""
        # >>> week08: continuous
        decoding: list[Sequence] = []
        preemptions_before = self.num_preemptions
        for seq in list(self.running):  # oldest first: they keep their blocks longest
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            if self._make_room(seq):
                decoding.append(seq)
        preempted_now = self.num_preemptions > preemptions_before  # memory is tight: admit no one
        budget = self.max_num_batched_tokens - len(decoding)
        admitted: list[Sequence] = []
        while self.waiting and not preempted_now and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._reuse_cached_prefix(seq)  # week 14: start past the blocks the pool still holds
            new_tokens = seq.num_tokens - seq.num_computed
            fits_budget = new_tokens <= budget or not (decoding or admitted)
            fits_memory = blocks_needed(seq.num_tokens, self.block_size) - len(seq.block_table) <= self.allocator.num_free
            if not (fits_budget and fits_memory):
                self._free_blocks(seq)  # it waits without holding anything
                break  # FCFS: nobody overtakes the head of the queue
            self._admit(seq, seq.num_tokens)
            budget -= new_tokens
            admitted.append(seq)
        seqs = decoding + admitted
        return Batch(seqs, [1] * len(decoding) + [s.num_tokens - s.num_computed for s in admitted])
        # <<< week08: continuous

    def _order_by_priority(self) -> None:
        """Age the queue by one step, then sort the queue and the running set by rank (lower runs
        first: the request's priority, one level better per `aging_steps` steps it has waited),
        keeping their order among equals (so FCFS, and preempted sequences first in line, still
        hold within one rank). The policies then need nothing else: admission takes the head of
        the queue, and preemption the last of the running set, which is now the worst-ranked."""
        # >>> week16: priority
        for seq in self.waiting:
            seq.steps_waiting += 1
        def rank(seq: Sequence) -> int:
            return seq.priority - seq.steps_waiting // self.aging_steps
        self.waiting = deque(sorted(self.waiting, key=rank))  # sorted() is stable: equals keep their order
        self.running.sort(key=rank)
        # <<< week16: priority

    # -- week 14: prefix caching -----------------------------------------------------------------

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """Hand a waiting sequence the cached blocks of its longest cached prefix, and count them
        as computed. Never the whole sequence: its last token must run to give logits. Nor any of
        it when the request wants its prompt's logprobs (week 10): a cached block has no logits.
        A request resuming held KV (issue 38) starts from its held blocks instead."""
        if self.held.resume(seq) or not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return
        # >>> week14: reuse-prefix
        reusable = (seq.num_tokens - 1) // self.block_size
        seq.block_table = self.allocator.match(seq.block_hashes, reusable, seq.token_ids, self.block_size)
        seq.num_computed = len(seq.block_table) * self.block_size
        # <<< week14: reuse-prefix

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The names of the sequence's first `num_blocks` full blocks (computed once, kept)."""
        return chain_hashes(seq.block_hashes, seq.token_ids, num_blocks, self.block_size)

    def _cache_full_blocks(self, seq: Sequence, computed_before: int, computed_after: int | None = None) -> None:
        """Name the blocks this step filled, so later prompts can reuse them."""
        after = seq.num_computed if computed_after is None else computed_after
        name_first_block(seq, self.block_size)  # week 23
        first, end = computed_before // self.block_size, after // self.block_size
        hashes = self._block_hashes(seq, end)
        for i in range(first, end):
            self.allocator.register(seq.block_table[i], hashes[i])

    def _schedule_chunked(self) -> Batch:
        """Week 15: decodes first, then prompts (the unfinished ones, then new ones) in chunks,
        all within the token budget. A prompt samples its first token after its last chunk."""
        # >>> week15: chunked
        seqs: list[Sequence] = []
        num_new: list[int] = []
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        running = [s for s in self.running if s.num_tokens - s.num_computed == 1]  # decodes first
        running += [s for s in self.running if s.num_tokens - s.num_computed > 1]  # then prompts under way
        for seq in running:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older one
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                break  # the budget is spent: the rest runs next step
            if self._make_room(seq, seq.num_computed + n):
                seqs.append(seq)
                num_new.append(n)
                budget -= n
        if self.num_preemptions == preemptions_before:  # memory is tight after a preemption: admit no one
            self._admit_chunks(seqs, num_new, budget)
        # Preempted after it was scheduled (a prompt under way needed its blocks): not this step.
        kept = [(s, n) for s, n in zip(seqs, num_new) if s.status is SequenceStatus.RUNNING]
        # A sequence samples only once its last prompt token has run: 1 row, or 0 for a partial chunk.
        return Batch([s for s, _ in kept], [n for _, n in kept],
                     [int(s.num_computed + n == s.num_tokens) for s, n in kept])
        # <<< week15: chunked

    def _admit_chunks(self, seqs: list[Sequence], num_new: list[int], budget: int) -> None:
        """Week 15: admit waiting prompts, in FCFS order, into what is left of the step's token
        budget, the last one cut to a chunk; append each to `seqs` with its tokens in `num_new`."""
        # >>> week15: admit-chunks
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._reuse_cached_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed
            n = min(remaining, budget)
            too_small = seqs and n < min(remaining, self.min_chunk)  # a sliver costs more than it moves
            fits_memory = blocks_needed(seq.num_computed + n, self.block_size) - len(seq.block_table) \
                <= self.allocator.num_free
            if too_small or not fits_memory:
                self._free_blocks(seq)
                break  # FCFS: nobody overtakes the head of the queue
            self._admit(seq, seq.num_computed + n)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        # <<< week15: admit-chunks

    def _make_room(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Give a running sequence room for `num_tokens` tokens (default: all it has, so the next
        one fits). False if it was preempted itself."""
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        needed = blocks_needed(num_tokens, self.block_size) - len(seq.block_table)
        if needed > 0 and needed > self.allocator.num_free:
            self.held.evict_until(needed, self.waiting)  # issue 38: held KV goes before anyone is preempted
        if needed > 0 and needed > self.allocator.num_free:
            if not self.preemption:
                raise OutOfBlocks(
                    "the KV pool is full and preemption is off: enable it, give the engine more "
                    "blocks, or admit fewer requests"
                )
            if not self._preempt_until_fits(seq, needed):
                return False
        self._grow_to(seq, num_tokens)
        return True

    def _preempt_until_fits(self, seq: Sequence, needed: int) -> bool:
        """Week 9: preempt the newest sequences until `needed` blocks are free for `seq`.

        Returns False if `seq` itself had to go (it was the newest one left).
        """
        # >>> week09: make-room
        while needed > self.allocator.num_free:
            victim = self.running[-1]  # the most recently admitted sequence
            self._preempt(victim)
            if victim is seq:
                return False
        return True
        # <<< week09: make-room

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, go first in line."""
        # >>> week09: preempt-sequence
        self.running.remove(seq)
        self._free_blocks(seq)  # its K/V are gone: it will be prefilled again, tokens and all
        seq.status = SequenceStatus.PREEMPTED  # waiting again, at the front of the queue
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        # <<< week09: preempt-sequence

    def update(self, batch: Batch, new_tokens: list[list[int]]) -> None:
        """After the step: each sequence's scheduled tokens are computed, and `new_tokens[i]` (as
        many as `batch.num_samples[i]`) are appended one by one, until one of them ends the
        sequence: a stop token, a stop string (the sequence's `stop_checker`), or a length limit.
        Tokens after the end are dropped."""
        now = time.perf_counter()
        for seq, n, tokens in zip(batch.seqs, batch.num_new_tokens, new_tokens):
            if seq.is_finished:  # aborted while its step was running
                continue
            computed_before = seq.num_computed
            seq.num_computed += n
            ended = None
            for token in tokens:
                seq.token_ids.append(token)
                seq.token_times.append(now)
                ended = self._ended_by(seq, token, seq.num_tokens)
                if ended:
                    break
            if seq.num_computed >= seq.num_tokens:  # week 17: guesses past the first rejection ran
                self._drop_rejected(seq)
            if self.prefix_caching and seq.num_computed // self.block_size > computed_before // self.block_size:
                self._cache_full_blocks(seq, computed_before)  # this step filled a block
            if ended:
                self.finish(seq, ended)

    def _ended_by(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        return seq.ended_by(token, num_tokens, self.max_model_len)

    # -- async scheduling (week 12): one step ahead of the GPU ---------------------------------------

    def launched(self, batch: Batch) -> list[tuple[int, int]]:
        """The batch is on its way to the GPU and the host will schedule the next step before its
        tokens come back. So the scheduler takes the step as done: the scheduled tokens count as
        computed (any later step runs after this one on the GPU), and each sequence that samples
        gets a placeholder token, `PENDING`, which the next step's input reads from the GPU. A
        sequence whose placeholder reaches a length limit ends whatever the token is: it leaves
        `running` for `ending`, and is never scheduled again. Returns, per sequence, what
        `resolve` needs: its computed length before the step and its block table's version."""
        # >>> week12: launched
        before = []
        for seq, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_samples):
            before.append((seq.num_computed, seq.block_table_version))
            seq.num_computed += n
            if k:
                seq.token_ids.append(PENDING)
                seq.num_pending += 1
                if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                    self.running.remove(seq)
                    self.ending.append(seq)
        return before
        # <<< week12: launched

    def resolve(self, batch: Batch, new_tokens: list[list[int]], before: list[tuple[int, int]]) -> None:
        """A launched step's tokens are on the host: each replaces its sequence's oldest
        placeholder, and the stop checks run, one step late. A sequence that ends drops the
        placeholder of the step launched meanwhile (`finish`): that token was computed for nothing.
        A sequence already finished (ended by the previous step's token, or aborted) is skipped.
        The blocks the step filled are named now that their tokens are known (prefix caching)."""
        # >>> week12: resolve
        now = time.perf_counter()
        for seq, tokens, (computed, version), n in zip(batch.seqs, new_tokens, before, batch.num_new_tokens):
            if seq.is_finished:
                continue
            ended = None
            if tokens:
                position = len(seq.token_ids) - seq.num_pending
                seq.token_ids[position] = tokens[0]
                seq.num_pending -= 1
                seq.token_times.append(now)
                ended = self._ended_by(seq, tokens[0], position + 1)
            if self.prefix_caching and seq.block_table_version == version \
                    and (computed + n) // self.block_size > computed // self.block_size:
                self._cache_full_blocks(seq, computed, computed + n)
            if ended:
                self.finish(seq, ended)
        # <<< week12: resolve

    # -- week 17: speculative decoding -------------------------------------------------------------

    def add_drafts(self, batch: Batch, drafts: list[list[int]]) -> list[list[int]]:
        """Turn the batch's decodes into verifications: sequence i runs its last token and the
        guesses `drafts[i]`, and samples from all of those rows (`verify` keeps the guesses the
        target agrees with). Guesses are cut to what fits: the step's token budget, the request's
        max_tokens (the target adds one token of its own), the context, and the free blocks (a
        guess never preempts anyone). The guesses are appended to `token_ids` for the forward
        pass only; `remove_drafts` takes them off again. Returns the guesses scheduled."""
        # >>> week17: add-drafts
        budget = self.max_num_batched_tokens - batch.num_scheduled_tokens
        scheduled = []
        for i, (seq, draft) in enumerate(zip(batch.seqs, drafts)):
            k = 0
            if draft and batch.num_new_tokens[i] == 1 and batch.num_samples[i] == 1:
                room = (len(seq.block_table) + self.allocator.num_free) * self.block_size - seq.num_tokens
                k = max(0, min(len(draft), budget, room, seq.params.max_tokens - seq.num_output_tokens - 1,
                               self.max_model_len - seq.num_tokens))
            if k:
                self._grow_to(seq, seq.num_tokens + k)
                seq.token_ids += draft[:k]
                batch.num_new_tokens[i] = batch.num_samples[i] = 1 + k
                budget -= k
            scheduled.append(list(draft[:k]))
        return scheduled
        # <<< week17: add-drafts

    def remove_drafts(self, batch: Batch, drafts: list[list[int]]) -> None:
        """After the forward pass: the guesses leave `token_ids` (`update` appends those accepted)."""
        for seq, draft in zip(batch.seqs, drafts):
            if draft:
                del seq.token_ids[len(seq.token_ids) - len(draft) :]

    def _drop_rejected(self, seq: Sequence) -> None:
        """The K/V written for rejected guesses are garbage: the sequence's computed length rolls
        back to its tokens (all but the last, whose K/V the next step writes), and the blocks past
        them go back to the pool. The table shrank, so its version changes (CUDA graphs' staging
        rewrites a table row only when its version or length changes)."""
        # >>> week17: drop-rejected
        seq.num_computed = seq.num_tokens - 1
        keep = blocks_needed(seq.num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            for block in reversed(seq.block_table[keep:]):
                self.allocator.free(block)
            del seq.block_table[keep:]
            seq.block_table_version += 1
        # <<< week17: drop-rejected
