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

`Fp8Linear` (`--quantization fp8`) multiplies with `torch._scaled_mm` on FP8 tensor cores, which
needs the activations cut to e4m3 too: three small kernels a call, and a product built for many
rows. Measured at batch 1 on an H100 it ran at 0.57x bf16 (docs/benchmarks.md, week 22). Up to
`GEMV_ROWS` rows it goes through `fp8_gemv` instead: the integer layers' matrix-vector kernel, the
e4m3 bytes widened in registers (`BITS=0`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.model.quantized import Fp8Linear, QuantizedLinear


@triton.jit
def _widen_tile(Q, S, O, cols, k0, in_cols, K, stride_q, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[cols, k0 : k0 + BLOCK_K] widened in registers: [BLOCK_N, BLOCK_K] float32 codes · s + o.

    The codes are read as stored (4 bits: BLOCK_K / 2 bytes a row, each split into its low nibble,
    the even input, and its high one; BITS = 0: float8 e4m3 bytes, `fp8_gemv`'s, read as numbers). When BLOCK_K is a multiple of a power-of-two GROUP, each row
    reads BLOCK_K / GROUP scales and offsets, broadcast over their groups; otherwise (a group size
    such as 48) every weight gathers its own group's, which is slower but any size works."""
    if BITS == 8 or BITS == 0:
        ks = k0 + tl.arange(0, BLOCK_K)
        code = tl.load(Q + cols[:, None] * stride_q + ks[None, :], mask=in_cols[:, None] & (ks[None, :] < K), other=0)
        if BITS == 0:
            code = code.to(tl.float8e4nv, bitcast=True)
        code = code.to(tl.float32)
    else:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(Q + cols[:, None] * stride_q + half[None, :], mask=in_cols[:, None] & (half[None, :] < K // 2),
                       other=0).to(tl.int32)
        code = tl.interleave(byte & 0xF, byte >> 4).to(tl.float32)  # inputs 2j and 2j + 1
    if BLOCK_K % GROUP == 0 and (GROUP & (GROUP - 1)) == 0:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        at = cols[:, None] * stride_s + g[None, :]
        both = in_cols[:, None] & (g[None, :] < K // GROUP)
        s = tl.load(S + at, mask=both, other=0.0).to(tl.float32)
        o = tl.load(O + at, mask=both, other=0.0).to(tl.float32)
        w = tl.reshape(code, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None] + o[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        at = cols[:, None] * stride_s + (ks // GROUP)[None, :]
        both = in_cols[:, None] & (ks[None, :] < K)
        s = tl.load(S + at, mask=both, other=0.0).to(tl.float32)
        o = tl.load(O + at, mask=both, other=0.0).to(tl.float32)
        return code * s + o


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
        x = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=in_rows[:, None] & (ks[None, :] < K), other=0.0)
        w = _widen_tile(Q, S, O, cols, k0, in_cols, K, stride_q, stride_s, BITS, GROUP, BLOCK_N, BLOCK_K)
        w = w.to(x.dtype)  # [BLOCK_N, BLOCK_K], rounded as the reference rounds the weight
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=in_rows[:, None] & in_cols[None, :])


@triton.jit
def _quant_gemv_kernel(X, Q, S, O, Y, N, K, stride_x, stride_q, stride_s, stride_y,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One activation row (program_id 0) against BLOCK_N rows of W (program_id 1): a decode step's
    # product is a matrix-vector one, and a 16-row tile product would be 15/16 padding. The row
    # axis is the grid's first, so a block of W's programs for all rows run side by side and
    # W crosses the memory bus once, the other rows reading it from the L2 cache.
    # >>> week22: quant-gemv
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * stride_x + ks, mask=ks < K, other=0.0)
        w = _widen_tile(Q, S, O, cols, k0, in_cols, K, stride_q, stride_s, BITS, GROUP, BLOCK_N, BLOCK_K)
        w = w.to(x.dtype).to(tl.float32)  # rounded as the reference rounds the weight
        acc += tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    tl.store(Y + row * stride_y + cols, acc.to(Y.dtype.element_ty), mask=in_cols)
    # <<< week22: quant-gemv


GEMV_ROWS = 4  # up to this many rows, one matrix-vector product per row (a decode step of a small batch)
GEMV_BLOCKS = (4, 1024, 4)  # BLOCK_N, BLOCK_K, warps: within 5% of the best of 7 on an H100 for every 1B projection
THIN = (16, 32, 256, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: up to 64 rows of a projection of < 8,192 outputs
WIDE = (64, 64, 128, 4, 3)  # wider outputs, or more rows (docs/benchmarks.md: bench_quant_matmul.py --sweep)


def tile_sizes(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the tile product for m rows and n outputs: thin
    tiles for the small batches of decode, so that enough programs read W at once."""
    return THIN if m <= 16 or (m <= 64 and n < 8192) else WIDE


def _block_k(block_k: int, layer: QuantizedLinear) -> int:
    """A tile's inputs: at least one whole group when the group size is a power of two."""
    g = layer.group_size
    return max(block_k, g) if g & (g - 1) == 0 else block_k


def quant_matmul(x: torch.Tensor, layer: QuantizedLinear, config: tuple | None = None) -> torch.Tensor:
    """x [T, K] (any leading shape) · Wᵀ for the layer's grouped codes -> [T, N] in x's dtype.
    `config` overrides the block sizes (scripts/bench_quant_matmul.py --sweep tries several)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    n = layer.out_features
    y = x2.new_empty(m, n)
    if m <= GEMV_ROWS:
        bn, bk, warps = config or GEMV_BLOCKS
        bk = _block_k(bk, layer)
        _quant_gemv_kernel[(m, triton.cdiv(n, bn))](x2, layer.packed, layer.scales, layer.offsets, y, n, k,
                                                    x2.stride(0), layer.packed.stride(0), layer.scales.stride(0),
                                                    y.stride(0), BITS=layer.bits, GROUP=layer.group_size,
                                                    BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        return y.reshape(*shape[:-1], n)
    bm, bn, bk, warps, stages = config or tile_sizes(m, n)
    bk = _block_k(bk, layer)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_matmul_kernel[grid](x2, layer.packed, layer.scales, layer.offsets, y, m, n, k,
                               x2.stride(0), layer.packed.stride(0), layer.scales.stride(0), y.stride(0),
                               BITS=layer.bits, GROUP=layer.group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               # float32 models are the token-exact ones: no TF32 rounding of their products
                               PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
                               num_warps=warps, num_stages=stages)
    return y.reshape(*shape[:-1], n)


def fp8_gemv(x: torch.Tensor, layer: Fp8Linear, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] · (W8 · s)ᵀ -> [..., N] in x's dtype (no bias): up to `GEMV_ROWS` rows, the weights'
    bytes read once and widened in registers by the integer layers' matrix-vector kernel (its
    e4m3 mode, `BITS=0`), the activations kept in their dtype (weight-only, as the integer layers);
    more rows go to the layer's `_scaled_mm` product. A row's one scale is handed to the kernel as
    groups of `GROUP` inputs that all share it, and offsets of zero."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    m, k = x2.shape
    if m > GEMV_ROWS:
        return layer.scaled_product(x)  # a batch: FP8 tensor cores, the activations cut per token
    n = layer.out_features
    group = fp8_group(k)
    if getattr(layer, "gemv_scales", None) is None:  # made once: the row scales as groups, and their zero offsets
        layer.gemv_scales = layer.scales.expand(n, k // group).contiguous()
        layer.gemv_offsets = torch.zeros_like(layer.gemv_scales)
    y = x2.new_empty(m, n)
    codes = layer.weight_fp8.view(torch.uint8)  # the kernel reads the bytes and widens them as e4m3
    bn, bk, warps = config or GEMV_BLOCKS
    _quant_gemv_kernel[(m, triton.cdiv(n, bn))](x2, codes, layer.gemv_scales, layer.gemv_offsets, y, n, k,
                                                x2.stride(0), codes.stride(0), layer.gemv_scales.stride(0), y.stride(0),
                                                BITS=0, GROUP=group, BLOCK_N=bn, BLOCK_K=max(bk, group), num_warps=warps)
    return y.reshape(*shape[:-1], n)


def fp8_group(k: int) -> int:
    """The largest power of two up to `GEMV_BLOCKS`' BLOCK_K that divides k: as few copies of a row's
    scale as the kernel's power-of-two path allows (2 for k = 2,048, 64 for SmolLM2's 576)."""
    group = GEMV_BLOCKS[1]
    while k % group:
        group //= 2
    return group


def use_quantized_kernels(model: torch.nn.Module, on: bool = True) -> int:
    """Hand the kernels to (or take them from) every `QuantizedLinear` and `Fp8Linear` of the model;
    returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, Fp8Linear))]
    for layer in layers:
        layer.kernel = (fp8_gemv if isinstance(layer, Fp8Linear) else quant_matmul) if on else None
    return len(layers)
