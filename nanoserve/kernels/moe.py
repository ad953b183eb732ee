"""Week 24: a mixture of experts in two grouped matrix products, over all experts at once.

The reference (`nanoserve.model.moe.experts_loop`) runs one expert at a time: a gather, two
products, a scatter per expert, each product on the few rows that expert received, and it finds
those rows on the host. At 64 tokens, 2 of 8 experts each, an expert gets ~16 rows: 8 small
products where one large one would do, and 8 host round trips. Here:

1. `align_by_expert` lists the (token, slot) pairs expert by expert, each expert's list padded to
   a multiple of BLOCK_M with a sentinel, and names the expert of every block of BLOCK_M entries.
   Sizes depend only on the number of pairs and experts, never on how tokens are spread, and no
   value goes to the host: a CUDA graph can hold it.
2. `_gate_up_kernel`: one program per (block of BLOCK_M pairs, block of BLOCK_N features). Its
   block belongs to one expert, so it is a plain tiled product of the rows it gathers from x
   with that expert's gate and up weights; SiLU(gate) · up is applied before anything is written.
   One launch covers every expert: a grouped GEMM.
3. `_down_kernel`: the same over the down projection, reading the activations in the sorted order
   the first kernel wrote them, and multiplying each row by its routing weight on the way out,
   into the pair's own row.
4. The weighted rows of each token are summed, slot by slot (as the reference's `combine`).

Blocks past the last expert's padded list have no expert (-1) and return at once; a padded entry
(the sentinel) loads zeros and stores nothing. An expert id equal to the number of experts names
none (the padding rows of expert parallelism's fixed-capacity dispatch, `exchange_fixed`): the
alignment gives those pairs a group after the experts', whose blocks get -1 too, so they cost no
product, and their output rows are left unwritten (whoever sent them never reads them).

On a GPU, step 1 is `align_by_expert_triton` (`nanoserve/kernels/moe_align.py`): the same lists in two
small kernels instead of a dozen PyTorch operations; `align_by_expert` stays the CPU path and the
lesson's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.moe_align import align_by_expert_triton
from nanoserve.model.moe import moe_blocks


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (pairs [P] int32, block_expert [P // block_m] int32).

    pairs lists pair indices (token * k + slot) grouped by expert, each group padded to a multiple of
    block_m with the sentinel T * k; block_expert[b] is the expert of entries b*block_m .. (b+1)*block_m - 1,
    or -1 past the end. P = T*k + E*(block_m - 1) rounded up to block_m: the most padding can take.
    """
    # >>> week24: align-tokens
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]: each expert's rows, padded
    padded_end = padded.cumsum(0)
    order = flat.sort(stable=True).indices  # pairs grouped by expert, in token order within each
    expert_of = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert_of]
    size = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    pairs = torch.full((size,), num_pairs, dtype=torch.int32, device=ids.device)
    pairs[(padded_end - padded)[expert_of] + rank_in_expert] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # the expert whose padded rows hold the start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pairs, block_expert
    # <<< week24: align-tokens


@triton.jit
def _gate_up_kernel(X, W, Act, Pairs, BlockExpert, num_pairs, top_k, hidden, inter,
                    stride_x, stride_we, stride_wn, stride_act,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Act[sorted row] = SiLU(x W_gateᵀ) · (x W_upᵀ) for the pairs of one block, one expert."""
    # >>> week24: grouped-gate-up
    expert = tl.load(BlockExpert + tl.program_id(0)).to(tl.int64)
    if expert >= 0:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(Pairs + rows)
        real = pair < num_pairs
        token = (pair // top_k).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = W + expert * stride_we
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + token[:, None] * stride_x + k[None, :], mask=real[:, None] & (k[None, :] < hidden),
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            wmask = (k[:, None] < hidden) & (n[None, :] < inter)
            wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)  # [BLOCK_K, BLOCK_N]: W_gateᵀ
            wu = tl.load(w + (inter + n[None, :]) * stride_wn + k[:, None], mask=wmask, other=0.0)
            if IEEE:  # float32: exact products, as the reference (no TF32)
                gate += tl.dot(x, wg, input_precision="ieee")
                up += tl.dot(x, wu, input_precision="ieee")
            else:
                gate += tl.dot(x, wg)
                up += tl.dot(x, wu)
        act = gate * tl.sigmoid(gate) * up
        tl.store(Act + rows[:, None].to(tl.int64) * stride_act + n[None, :], act.to(Act.dtype.element_ty),
                 mask=real[:, None] & (n[None, :] < inter))
    # <<< week24: grouped-gate-up


@triton.jit
def _down_kernel(Act, W, Out, Pairs, BlockExpert, Weights, num_pairs, hidden, inter,
                 stride_act, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Out[pair] = weight[pair] · (act W_downᵀ) for the pairs of one block, one expert."""
    expert = tl.load(BlockExpert + tl.program_id(0)).to(tl.int64)
    if expert >= 0:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(Pairs + rows)
        real = pair < num_pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = W + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(Act + rows[:, None].to(tl.int64) * stride_act + k[None, :],
                        mask=real[:, None] & (k[None, :] < inter), other=0.0)  # [BLOCK_M, BLOCK_K]
            wd = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=(k[:, None] < inter) & (n[None, :] < hidden),
                         other=0.0)  # [BLOCK_K, BLOCK_N]: W_downᵀ
            if IEEE:
                acc += tl.dot(a, wd, input_precision="ieee")
            else:
                acc += tl.dot(a, wd)
        weight = tl.load(Weights + pair, mask=real, other=0.0)
        acc = acc * weight[:, None]
        tl.store(Out + pair[:, None].to(tl.int64) * stride_out + n[None, :], acc,
                 mask=real[:, None] & (n[None, :] < hidden))


# The grouped kernels' tiles on a GPU, by the rows an expert gets on average (T * k / E): the first
# entry whose bound is at least that. `python scripts/bench_moe.py --sweep` times a list of tiles on a
# Mixtral-8x7B block (bf16, top-2 of 8) at several token counts and prints this table with each
# count's fastest tiles (bound: between two measured counts, their geometric mean). Measured on: two
# H200s' first card, 2026-11-27, `--sweep --tokens 1 64 1024 4096` (docs/benchmarks.md, week 24):
# 64 tokens 0.823 ms (16x128x64) against the first choice's 0.852; 1,024 tokens 1.681 ms (128x128x64,
# 8 warps) against 2.393.
GPU_TILES: list[tuple[float, dict[str, int]]] = [
    (2, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (64, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)),
    (float("inf"), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
]


def moe_blocks_for(num_pairs: int, num_experts: int, interpreted: bool) -> dict[str, int]:
    """Tile sizes: on a GPU from `GPU_TILES` (BLOCK_M near the rows an expert gets: a decode batch's
    experts get a few rows, and most of a bigger block would be padding); small ones in the
    interpreter (it runs every program in Python). A table, not `triton.autotune`: BLOCK_M shapes the
    alignment, which runs before the kernels, and each new size met while serving would stop to time
    every candidate."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    per_expert = num_pairs / num_experts
    return dict(next(tiles for bound, tiles in GPU_TILES if per_expert <= bound))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              blocks: dict[str, int] | None = None, align_kernel: bool | None = None) -> torch.Tensor:
    """`nanoserve.model.moe.experts_loop` in two grouped kernels: x [T, H] -> [T, H] in x's dtype. A pair
    whose id is num_experts runs no expert, and the rows of tokens with such a pair are not to be read.

    align_kernel: align by `align_by_expert_triton` (True) or `align_by_expert` (False); by default
    the first on CUDA, the second elsewhere."""
    T, top_k = ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter, num_pairs = two_inter // 2, T * top_k
    if num_pairs == 0:
        return x.new_zeros(0, hidden)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    blocks = blocks or moe_blocks_for(num_pairs, num_experts, not x.is_cuda)
    bm, bn, bk, warps = blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"], blocks["num_warps"]
    stages = blocks.get("num_stages", 3)  # 3: Triton's own default on NVIDIA GPUs
    align = align_by_expert_triton if (x.is_cuda if align_kernel is None else align_kernel) else align_by_expert
    # One group more than the experts: ids == num_experts (padding rows, no expert) land there, and run nothing.
    pairs, block_expert = align(ids, num_experts + 1, bm)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    act = x.new_empty(pairs.numel(), inter)  # by sorted row; padded rows stay unwritten and unread
    ieee = x.dtype == torch.float32
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, bn))](
        x, w13, act, pairs, block_expert, num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, num_warps=warps, num_stages=stages)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # each real pair's row written once
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, bn))](
        act, w2, pair_out, pairs, block_expert, weights.float().contiguous(), num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, num_warps=warps, num_stages=stages)
    return pair_out.view(T, top_k, hidden).sum(dim=1).to(x.dtype)  # the combine, slot by slot (weights are in)


def use_moe_kernels(model, on: bool = True) -> None:
    """Hand `fused_moe` to every MoE block of the model (or, with on=False, the loop back)."""
    for block in moe_blocks(model):
        block.kernel = fused_moe if on else None
