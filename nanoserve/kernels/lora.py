"""Week 23: the adapters' low-rank products of a whole batch, in two Triton kernels.

A step's rows belong to different adapters (or none). Looping over the adapters in Python, as
the reference `nanoserve.model.lora.add_lora` does, costs a gather, two matrix products and a
scatter per adapter and layer, and reads the row lists on the host: no CUDA graph could hold it.
Instead the rows are grouped by adapter slot (`LoRARows`: the segments, written into fixed
buffers before each step), and two kernels cover every segment at once:

    shrink   t[i] = x[i] A[s]ᵀ          for each row i of slot s     [T, in] -> [T, R]
    expand   y[i] += t[i] B[s]ᵀ                                     [T, R] -> [T, out]

(the SGMV idea of Punica and S-LoRA: a segmented gather-matrix-vector product). The grid has one
program per (slot, block of BLOCK_T rows of that slot's segment[, block of output columns]);
its size depends on the number of slots and rows only, never on how the rows are spread over
the slots, so a captured graph replays it for any mix of adapters. A program past its
segment's end stops at once; rows of no adapter are in no segment, so the padding rows of a
graph and requests on the base model cost nothing. The rank R is small (a few tens), so t is a
thin matrix: shrink reads x once and A once per block of rows, expand reads B once per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.model.lora import LoRARows, LoRAState

BLOCK_T = 16  # rows per program: the smallest tile tl.dot takes
BLOCK_K = 64  # input features per step of shrink's loop
BLOCK_N = 64  # output features per program of expand


@triton.jit
def _shrink_kernel(X, A, T, Order, Starts, stride_x, stride_as, stride_ar, stride_t, k_dim, rank,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # Program (slot, j): rows j·BLOCK_T .. (j + 1)·BLOCK_T − 1 of the slot's segment, all R ranks of t.
    # >>> week23: sgmv-shrink
    slot = tl.program_id(0)
    start = tl.load(Starts + slot)
    end = tl.load(Starts + slot + 1)
    first = start + tl.program_id(1) * BLOCK_T
    if first < end:  # else this segment has fewer rows: nothing to do
        in_segment = first + tl.arange(0, BLOCK_T) < end
        rows = tl.load(Order + first + tl.arange(0, BLOCK_T), mask=in_segment, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=in_segment[:, None] & (k[None, :] < k_dim),
                        other=0.0)  # [BLOCK_T, BLOCK_K]
            a = tl.load(A + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                        mask=(r[None, :] < rank) & (k[:, None] < k_dim), other=0.0)  # [BLOCK_K, BLOCK_R]: Aᵀ
            if IEEE:  # float32: exact products, as the reference (no TF32)
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(T + rows[:, None] * stride_t + r[None, :], acc.to(T.dtype.element_ty),
                 mask=in_segment[:, None] & (r[None, :] < rank))
    # <<< week23: sgmv-shrink


@triton.jit
def _expand_kernel(T, B, Y, Order, Starts, stride_t, stride_bs, stride_bn, stride_y, n_dim, rank,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    slot = tl.program_id(0)
    start = tl.load(Starts + slot)
    end = tl.load(Starts + slot + 1)
    first = start + tl.program_id(1) * BLOCK_T
    if first < end:
        in_segment = first + tl.arange(0, BLOCK_T) < end
        rows = tl.load(Order + first + tl.arange(0, BLOCK_T), mask=in_segment, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.load(T + rows[:, None] * stride_t + r[None, :], mask=in_segment[:, None] & (r[None, :] < rank),
                    other=0.0)  # [BLOCK_T, BLOCK_R]
        b = tl.load(B + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                    mask=(r[:, None] < rank) & (n[None, :] < n_dim), other=0.0)  # [BLOCK_R, BLOCK_N]: Bᵀ
        if IEEE:
            delta = tl.dot(t, b, input_precision="ieee")
        else:
            delta = tl.dot(t, b)
        mask = in_segment[:, None] & (n[None, :] < n_dim)
        out = Y + rows[:, None] * stride_y + n[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """t [T, R] with t[i] = x[i] A[s]ᵀ for the rows of each slot s (rows of no slot: not written)."""
    num_tokens, k_dim = x.shape
    slots, rank, _ = a.shape
    t = x.new_empty(num_tokens, rank)  # rows of no slot stay unwritten: expand never reads them
    grid = (slots, triton.cdiv(num_tokens, BLOCK_T))
    _shrink_kernel[grid](x, a, t, rows.order, rows.starts, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
                         k_dim, rank, BLOCK_T=BLOCK_T, BLOCK_R=max(16, triton.next_power_of_2(rank)),
                         BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return t


def lora_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """y[i] += t[i] B[s]ᵀ for the rows of each slot s, in place; returns y."""
    num_tokens, n_dim = y.shape
    slots, _, rank = b.shape
    grid = (slots, triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(n_dim, BLOCK_N))
    _expand_kernel[grid](t, b, y, rows.order, rows.starts, t.stride(0), b.stride(0), b.stride(1), y.stride(0),
                         n_dim, rank, BLOCK_T=BLOCK_T, BLOCK_R=max(16, triton.next_power_of_2(rank)),
                         BLOCK_N=BLOCK_N, IEEE=y.dtype == torch.float32)
    return y


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """`nanoserve.model.lora.add_lora` in two kernels: shrink, then expand into y (in place)."""
    if not x.is_contiguous():
        x = x.contiguous()
    return lora_expand(y, lora_shrink(x, a, rows), b, rows)


def use_lora_kernels(state: LoRAState, on: bool = True) -> None:
    """Hand the kernels to every LoRA layer of a model (they share `state`), or the reference back."""
    from nanoserve.model.lora import add_lora

    state.add = add_lora_triton if on else add_lora
