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
Shrink's long input axis (2,048 to 8,192 features) is split over programs, `SPLIT_K` features
each, which write float32 partial sums; expand adds them up as it reads t. One row walking
8,192 features alone would be a chain of dependent loads: the step's latency, not its bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.model.lora import LoRARows, LoRAState

BLOCK_T = 16  # rows per program: the smallest tile tl.dot takes
BLOCK_K = 128  # input features per step of shrink's loop
SPLIT_K = 256  # input features per shrink program: the K axis is split over programs
BLOCK_N = 64  # output features per program of expand


@triton.jit
def _shrink_kernel(X, A, P, Order, Starts, stride_x, stride_as, stride_ar, stride_ps, stride_pt, k_dim, rank,
                   BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   IEEE: tl.constexpr):
    # One program: one slot, BLOCK_T rows of its segment, SPLIT_K input features. A decode step has a
    # row or a few per slot, so a program walking all of K alone would be a long chain of dependent
    # loads; split, the K axis is read by many programs at once, and each writes its partial sum.
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
        part = tl.program_id(2)
        for k0 in range(part * SPLIT_K, tl.minimum(k_dim, (part + 1) * SPLIT_K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=in_segment[:, None] & (k[None, :] < k_dim),
                        other=0.0)  # [BLOCK_T, BLOCK_K]
            a = tl.load(A + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                        mask=(r[None, :] < rank) & (k[:, None] < k_dim), other=0.0)  # [BLOCK_K, BLOCK_R]: Aᵀ
            if IEEE:  # float32: exact products, as the reference (no TF32)
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(P + part * stride_ps + rows[:, None] * stride_pt + r[None, :], acc,
                 mask=in_segment[:, None] & (r[None, :] < rank))
    # <<< week23: sgmv-shrink


@triton.jit
def _expand_kernel(P, B, Y, Order, Starts, stride_ps, stride_pt, stride_bs, stride_bn, stride_y, n_dim, rank,
                   parts, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    slot = tl.program_id(0)
    start = tl.load(Starts + slot)
    end = tl.load(Starts + slot + 1)
    first = start + tl.program_id(1) * BLOCK_T
    if first < end:
        in_segment = first + tl.arange(0, BLOCK_T) < end
        rows = tl.load(Order + first + tl.arange(0, BLOCK_T), mask=in_segment, other=0).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for part in range(parts):  # shrink's partial sums, added up
            t += tl.load(P + part * stride_ps + rows[:, None] * stride_pt + r[None, :],
                         mask=in_segment[:, None] & (r[None, :] < rank), other=0.0)  # [BLOCK_T, BLOCK_R]
        b = tl.load(B + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                    mask=(r[:, None] < rank) & (n[None, :] < n_dim), other=0.0)  # [BLOCK_R, BLOCK_N]: Bᵀ
        if IEEE:
            delta = tl.dot(t, b.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(t.to(b.dtype), b)  # t rounded to the model's dtype, as the reference's t is
        mask = in_segment[:, None] & (n[None, :] < n_dim)
        out = Y + rows[:, None] * stride_y + n[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(Y.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """Partial sums p [parts, T, R] (float32) of t[i] = x[i] A[s]ᵀ for the rows of each slot s, one
    per SPLIT_K input features: t = p.sum(0). Rows of no slot are not written (expand never reads them)."""
    num_tokens, k_dim = x.shape
    slots, rank, _ = a.shape
    parts = triton.cdiv(k_dim, SPLIT_K)
    p = x.new_empty(parts, num_tokens, rank, dtype=torch.float32)
    grid = (slots, triton.cdiv(num_tokens, BLOCK_T), parts)
    _shrink_kernel[grid](x, a, p, rows.order, rows.starts, x.stride(0), a.stride(0), a.stride(1), p.stride(0),
                         p.stride(1), k_dim, rank, BLOCK_T=BLOCK_T, BLOCK_R=max(16, triton.next_power_of_2(rank)),
                         BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, IEEE=x.dtype == torch.float32)
    return p


def lora_expand(y: torch.Tensor, p: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """y[i] += t[i] B[s]ᵀ for the rows of each slot s, in place, t being the sum of shrink's partials p; returns y."""
    num_tokens, n_dim = y.shape
    slots, _, rank = b.shape
    grid = (slots, triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(n_dim, BLOCK_N))
    _expand_kernel[grid](p, b, y, rows.order, rows.starts, p.stride(0), p.stride(1), b.stride(0), b.stride(1),
                         y.stride(0), n_dim, rank, p.shape[0], BLOCK_T=BLOCK_T,
                         BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N, IEEE=y.dtype == torch.float32)
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
