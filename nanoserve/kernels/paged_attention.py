"""Week 6: a Triton kernel for decode attention over the paged KV cache.

In a decode step every sequence brings one new query token, and that token must attend over all
the keys and values the sequence has cached, wherever their blocks sit in the pool. The PyTorch
reference (`nanoserve.cache.paged_attention_reference`) gathers each sequence's blocks into a
contiguous copy first and then attends: two trips through memory, and one small kernel launch
per sequence per layer. This kernel reads K and V exactly once, straight through the block table.

One program handles one (sequence, KV head, context split):

    for each tile of BLOCK_N cached tokens in its split of the context:
        physical slot of each token  = block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        K, V tile                      [BLOCK_N, D]   (read once, shared by the GROUP query heads)
        scores = Q @ K^T * scale       [GROUP, BLOCK_N]
        online softmax: keep a running max m, running sum l, and a rescaled accumulator acc
    out = acc / l                      [GROUP, D]

With few sequences the grid would be too small to fill the GPU, so the context can be split
across programs (flash-decoding): each split writes its partial (acc, m, l) and a second small
kernel merges them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q, K, V, BlockTables, ContextLens, Out, PartialAcc, PartialM, PartialL,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head,
    scale_log2,  # softmax scale * log2(e): we exponentiate with exp2
    num_splits,  # programs per (sequence, KV head), each taking one slice of the context
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to >= 16 (the smallest tile tl.dot takes)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block in the pool
    BLOCK_N: tl.constexpr,  # tokens per loop iteration (several blocks)
    SPLIT: tl.constexpr,  # write partials for the merge kernel instead of the output
    PRECISION: tl.constexpr,  # "ieee" keeps float32 exact; tensor cores otherwise
):
    # >>> week06: decode-kernel
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + seq)
    partition = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N  # this sequence's slice
    start = split * partition
    end = tl.minimum(start + partition, context_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g  # the query heads that share this KV head
    q = tl.load(Q + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)  # [GROUP_PAD, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running sum of exp(score - m) * v

    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)  # logical positions in the sequence
        valid = pos < end
        block = tl.load(BlockTables + seq * stride_bt_seq + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)  # block * stride can pass 2**31 in a large pool
        offset = pos % BLOCK_SIZE
        k = tl.load(K + block[:, None] * stride_k_block + offset[:, None] * stride_k_slot
                    + kv_head * stride_k_head + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + block[:, None] * stride_v_block + offset[:, None] * stride_v_slot
                    + kv_head * stride_v_head + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    head_mask = g < GROUP
    if not SPLIT:
        out = acc / l[:, None]
        tl.store(Out + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
                 out.to(Out.dtype.element_ty), mask=head_mask[:, None])
    else:
        # Partials laid out [seq, query head, split(, D)], contiguous.
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(PartialM + row, m, mask=head_mask)
        tl.store(PartialL + row, l, mask=head_mask)
        tl.store(PartialAcc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=head_mask[:, None])
    # <<< week06: decode-kernel


@triton.jit
def _merge_splits_kernel(
    PartialAcc, PartialM, PartialL, Out, stride_o_seq, stride_o_head, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Combine the splits of one (sequence, query head): rescale each to the common max."""
    # >>> week06: merge-splits
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = (seq * tl.num_programs(1) + head) * num_splits
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    in_range = s < num_splits
    m = tl.load(PartialM + row + s, mask=in_range, other=float("-inf"))  # [SPLITS_PAD]
    l = tl.load(PartialL + row + s, mask=in_range, other=0.0)
    acc = tl.load(PartialAcc + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=in_range[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)  # empty splits (past the context) weigh 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # [HEAD_DIM]
    tl.store(Out + seq * stride_o_seq + head * stride_o_head + d, out.to(Out.dtype.element_ty))
    # <<< week06: merge-splits


@functools.lru_cache(maxsize=None)
def _num_sm(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                      min_partition: int = 64) -> int:
    """Split the context only when the grid would otherwise leave the GPU idle.

    Measured on an H100 (docs/benchmarks.md): decode is fastest with about four programs per
    SM, and a split still pays off down to one 64-token tile per program.
    """
    programs = num_seqs * num_kv_heads
    want = round(4 * _num_sm(device) / programs)
    most = max(1, math.ceil(max_context / min_partition))
    return max(1, min(want, most))


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    context_lens: torch.Tensor,  # [num_seqs] int
    max_context: int,  # an upper bound on context_lens (host-side, to choose the number of splits)
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode attention through block tables -> [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    block_n = max(16, min(block_n, triton.next_power_of_2(max_context)))
    if num_splits > 1:
        partial_acc = torch.empty(num_seqs * num_heads * num_splits, head_dim, device=q.device, dtype=torch.float32)
        partial_m = torch.empty(num_seqs * num_heads * num_splits, device=q.device, dtype=torch.float32)
        partial_l = torch.empty_like(partial_m)
    else:
        partial_acc = partial_m = partial_l = out  # unused
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_acc, partial_m, partial_l,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        (1.0 / math.sqrt(head_dim)) * 1.4426950408889634, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1,
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial_acc, partial_m, partial_l, out, out.stride(0), out.stride(1), num_splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        )
    return out
