"""The CPU tier's memory (issue 35): block-sized slots of host memory, and the copies between them
and the paged pool (`PagedKVCache`). Which name lives in which slot, and which copies a step needs,
is decided by the scheduler (nanoserve/scheduler/cpu_tier.py, whose docstring tells the story);
this module only moves bytes.

Layout: slots [num_slots, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], slot-major (an
FP8 pool's blocks are bytes, head_dim + 2 a row: the codes and their scale; `cache.block_shape`),
so that one block of every layer is one contiguous run of host memory and its copy is a single
DMA transfer (a layer-major layout, like the GPU pool's, would cut it into 2 x num_layers pieces).
On the GPU side a step's blocks are gathered into (or scattered from) one contiguous staging
tensor first, one kernel for all of them. Under tensor parallelism every rank holds its own heads
of each slot (its pool's `num_kv_heads`); a pipeline stage holds its own layers. Every rank runs
the same copies, which travel in the step (`StepInput.offloads`, `StepInput.reloads`).
"""

from __future__ import annotations

import torch

from nanoserve.attention.paged import PagedKVCache


class CPUKVPool:
    """`num_slots` blocks of K/V in host memory (pinned when the pool is on CUDA), shaped like
    the blocks of `cache`, and the copies to and from it.

    What `copy` guarantees, on CUDA (on the CPU every copy is done when it returns):
      - the copies run on a side stream, after all the work queued on the current (compute)
        stream before the call: an offload reads the block's final content, written by any
        earlier step (even one still running, with async scheduling), and a reload never
        overwrites a block an earlier step still reads or writes;
      - on that stream every offload runs before every reload, and the steps' copies run in
        step order: a reload reads what the latest offload into its slot wrote;
      - the work queued on the compute stream after the call (the step's forward pass) waits for
        all of them: no block is overwritten before its offload has read it, and no reloaded
        block is read before it has arrived.
    The host never waits: it goes on preparing the step (its inputs, their copies to the GPU)
    while the copies run. They do not overlap the step's own forward pass, which needs them.
    """

    def __init__(self, cache: PagedKVCache, num_slots: int):
        self.device = cache.k.device
        pinned = self.device.type == "cuda"  # page-locked: the GPU's DMA engines copy it without the CPU
        # (Never read before an offload has written it, so not zeroed. PyTorch's pinned allocator
        # rounds a request up to a power of two of bytes: size --cpu-offload-gb with that in mind.)
        self.slots = torch.empty((num_slots, *cache.block_shape), dtype=cache.block_dtype, pin_memory=pinned)
        self.stream = torch.cuda.Stream(self.device) if pinned else None
        self.num_slots = num_slots

    def copy(self, cache: PagedKVCache, offloads: list[tuple[int, int]], reloads: list[tuple[int, int]]) -> None:
        """Run a step's offloads (GPU block -> slot), then its reloads (slot -> GPU block), in
        order, as the class docstring says."""
        if self.stream is None:
            self.offload(cache, offloads)
            self.reload(cache, reloads)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self.offload(cache, offloads)
            self.reload(cache, reloads)
        compute.wait_stream(self.stream)

    def offload(self, cache: PagedKVCache, offloads: list[tuple[int, int]]) -> None:
        if not offloads:
            return
        staged = cache.read_blocks([b for b, _ in offloads])  # [n, layers, 2, block_size, heads, head_dim]
        for i, (_, slot) in enumerate(offloads):  # in order: a slot written twice keeps the later block
            self.slots[slot].copy_(staged[i], non_blocking=True)

    def reload(self, cache: PagedKVCache, reloads: list[tuple[int, int]]) -> None:
        if not reloads:
            return
        staged = torch.empty((len(reloads), *self.slots.shape[1:]), dtype=self.slots.dtype, device=self.device)
        for i, (slot, _) in enumerate(reloads):
            staged[i].copy_(self.slots[slot], non_blocking=True)
        cache.write_blocks([b for _, b in reloads], staged)

    @staticmethod
    def num_slots_for(num_bytes: int, bytes_per_block: int) -> int:
        """How many slots `num_bytes` of host memory hold (a slot is as large as a GPU block)."""
        return num_bytes // bytes_per_block
