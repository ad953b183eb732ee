"""Week 24: the alignment of `nanoserve.kernels.moe` in two Triton kernels, for a GPU.

`align_by_expert` (in `nanoserve/kernels/moe.py`, the lesson's `align-tokens` exercise) builds the
pair list with a dozen small PyTorch operations; on a GPU each is a launch, 0.5 ms in all on a
Mixtral block. `align_by_expert_triton` returns the same lists from two launches, with no value
read on the host: `_count_kernel` counts each chunk's pairs per expert, `_place_kernel` turns the
counts into each expert's padded start and puts every pair of its chunk in place. It lives in a
file of its own so that a learner's workspace, where the exercise is blank, does not show the
method beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(Ids, Counts, num_pairs, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Counts[c, e] = how many of chunk c's pairs (c*CHUNK .. (c+1)*CHUNK - 1) chose expert e."""
    chunk = tl.program_id(0)
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.arange(0, E_PAD)
    expert = tl.load(Ids + p, mask=p < num_pairs, other=-1)
    hits = (expert[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]: one 1 per real pair
    tl.store(Counts + chunk * E_PAD + e, tl.sum(hits, axis=0))


@triton.jit
def _place_kernel(Ids, Counts, Pairs, BlockExpert, num_pairs, num_chunks, num_experts, size,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Program c: writes chunk c's pairs at their places, then entries c*CHUNK .. (c+1)*CHUNK - 1 of
    Pairs where no pair lands (the sentinel) and the expert of each block starting among them."""
    chunk = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    # every expert's pairs, in all chunks and in the chunks before this one (in pair order)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for r0 in range(0, num_chunks, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        rows = tl.load(Counts + r[:, None] * E_PAD + e[None, :], mask=r[:, None] < num_chunks, other=0)
        total += tl.sum(rows, axis=0)
        before += tl.sum(tl.where(r[:, None] < chunk, rows, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]: each group, padded (0 if no pair)
    end = tl.cumsum(padded, axis=0)
    start = end - padded  # [E_PAD]: where each expert's group begins, a multiple of BLOCK_M
    # this chunk's pairs: the group's start + the same expert's pairs in earlier chunks + in this one
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(Ids + p, mask=p < num_pairs, other=-1)
    hits = (expert[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
    earlier = tl.cumsum(hits, axis=0) - hits  # same-expert pairs before each one in the chunk
    place = tl.sum(hits * (earlier + (start + before)[None, :]), axis=1)  # [CHUNK]
    tl.store(Pairs + place, p.to(tl.int32), mask=p < num_pairs)
    # this chunk's entries: the sentinel where no pair lands (disjoint from the stores above)
    s = chunk * CHUNK + tl.arange(0, CHUNK)
    taken = (s[:, None] >= start[None, :]) & (s[:, None] < (start + total)[None, :])  # [CHUNK, E_PAD]
    tl.store(Pairs + s, num_pairs, mask=(s < size) & (tl.sum(taken.to(tl.int32), axis=1) == 0))
    # a block's expert: how many groups end at or before its first entry (E or more: none, -1)
    owner = tl.sum((end[None, :] <= s[:, None]).to(tl.int32), axis=1)
    tl.store(BlockExpert + s // BLOCK_M, tl.where(owner < num_experts, owner, -1),
             mask=(s < size) & (s % BLOCK_M == 0))


def align_by_expert_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert` in two launches, with the same result (pairs in token order within each expert).

    `_count_kernel` counts each chunk's pairs per expert; `_place_kernel` sums those counts (every
    program reads the whole [chunks, E] table: no third launch for a prefix sum), places its chunk's
    pairs, and fills the sentinels and block experts of its share of the entries. Every size follows
    from T * k and E: no value goes to the host, and a CUDA graph can hold both launches.
    """
    flat = ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    size = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m  # as align_by_expert
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, 8192 // e_pad)  # a [chunk, E_PAD] tile: 8192 numbers, 32 per thread of 8 warps
    num_chunks = max(1, triton.cdiv(num_pairs, chunk))
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=ids.device)
    pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    _count_kernel[(num_chunks,)](flat, counts, num_pairs, CHUNK=chunk, E_PAD=e_pad, num_warps=8)
    _place_kernel[(max(1, triton.cdiv(size, chunk)),)](
        flat, counts, pairs, block_expert, num_pairs, num_chunks, num_experts, size,
        BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, num_warps=8)
    return pairs, block_expert
