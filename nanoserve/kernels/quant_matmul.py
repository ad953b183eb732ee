"""Issue 33: the product of activations with grouped int8/int4 weights, widened in registers.

`QuantizedLinear`'s reference path (nanoserve/model/quantized.py) widens the whole weight to the
model's dtype and multiplies: correct, but it writes and reads a float copy as large as the
unquantized weight, which is exactly the traffic quantizing was meant to save. This kernel reads
the codes, their group's scale and offset, widens one [BLOCK_N, BLOCK_K] tile in registers and
feeds it to the tile product, so the weight crosses the memory bus in its stored size.

    program (m, n):  out[m·BM : (m+1)·BM, n·BN : (n+1)·BN]
        for each k-tile:
            x tile      [BM, BK]  in the activations' dtype
            code tile   [BN, BK]  bytes -> codes (4 bits: the byte of k // 2, its low nibble for even k)
            w = code · s[k // G] + o[k // G]           (float32, then the activations' dtype)
            acc += x · wᵀ                              (float32 accumulator)

A decode step has few rows. Up to `GEMV_ROWS` rows, each program takes one activation row and
BLOCK_N rows of W and sums products (a matrix-vector product, no padding); above, tiles of rows
and the tile product (`tl.dot`). Tested on the CPU through Triton's interpreter
against `dequantize` followed by a matrix product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.model.quantized import QuantizedLinear


@triton.jit
def _quant_matmul_kernel(X, Q, S, O, Y, M, N, K, stride_x, stride_q, stride_s, stride_y,
                         BITS: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features: rows of W
    in_rows, in_cols = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
        both = in_cols[:, None] & in_k[None, :]
        if BITS == 8:
            code = tl.load(Q + cols[:, None] * stride_q + ks[None, :], mask=both, other=0).to(tl.float32)
        else:
            byte = tl.load(Q + cols[:, None] * stride_q + (ks // 2)[None, :], mask=both, other=0).to(tl.int32)
            code = ((byte >> ((ks % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        group = cols[:, None] * stride_s + (ks // GROUP)[None, :]
        s = tl.load(S + group, mask=both, other=0.0).to(tl.float32)
        o = tl.load(O + group, mask=both, other=0.0).to(tl.float32)
        w = (code * s + o).to(x.dtype)  # [BLOCK_N, BLOCK_K], rounded as the reference rounds the weight
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=in_rows[:, None] & in_cols[None, :])


@triton.jit
def _quant_gemv_kernel(X, Q, S, O, Y, N, K, stride_x, stride_q, stride_s, stride_y,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One activation row (program_id 1) against BLOCK_N rows of W: a decode step's product is a
    # matrix-vector one, and a 16-row tile product would be 15/16 padding. Widen, multiply, sum a row.
    # >>> week22: quant-gemv
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    in_cols = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(X + row * stride_x + ks, mask=in_k, other=0.0)
        both = in_cols[:, None] & in_k[None, :]
        if BITS == 8:
            code = tl.load(Q + cols[:, None] * stride_q + ks[None, :], mask=both, other=0).to(tl.float32)
        else:
            byte = tl.load(Q + cols[:, None] * stride_q + (ks // 2)[None, :], mask=both, other=0).to(tl.int32)
            code = ((byte >> ((ks % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        group = cols[:, None] * stride_s + (ks // GROUP)[None, :]
        s = tl.load(S + group, mask=both, other=0.0).to(tl.float32)
        o = tl.load(O + group, mask=both, other=0.0).to(tl.float32)
        w = (code * s + o).to(x.dtype).to(tl.float32)  # rounded as the reference rounds the weight
        acc += tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    tl.store(Y + row * stride_y + cols, acc.to(Y.dtype.element_ty), mask=in_cols)
    # <<< week22: quant-gemv


GEMV_ROWS = 4  # up to this many rows, one matrix-vector product per row (a decode step of a small batch)
GEMV_BLOCKS = (16, 256)  # BLOCK_N, BLOCK_K: a first guess, to be tuned on a GPU


def tile_sizes(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the tile product: 16-row tiles for small batches, larger above."""
    if m <= 16:
        return 16, 64, 128
    return 64, 64, 64


def quant_matmul(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    """x [T, K] (any leading shape) · Wᵀ for the layer's grouped codes -> [T, N] in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n = layer.out_features
    y = x2.new_empty(m, n)
    if m <= GEMV_ROWS:
        bn, bk = GEMV_BLOCKS
        _quant_gemv_kernel[(triton.cdiv(n, bn), m)](x2, layer.packed, layer.scales, layer.offsets, y, n, k,
                                                    x2.stride(0), layer.packed.stride(0), layer.scales.stride(0),
                                                    y.stride(0), BITS=layer.bits, GROUP=layer.group_size,
                                                    BLOCK_N=bn, BLOCK_K=bk)
        return y.reshape(*shape[:-1], n)
    bm, bn, bk = tile_sizes(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_matmul_kernel[grid](x2, layer.packed, layer.scales, layer.offsets, y, m, n, k,
                               x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), y.stride(0),
                               BITS=layer.bits, GROUP=layer.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               # float32 models are the token-exact ones: no TF32 rounding of their products
                               PRECISION="ieee" if x2.dtype == torch.float32 else "tf32")
    return y.reshape(*shape[:-1], n)


def use_quantized_kernels(model: torch.nn.Module, on: bool = True) -> int:
    """Hand the kernel to (or take it from) every `QuantizedLinear` of the model; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.kernel = quant_matmul if on else None
    return len(layers)
