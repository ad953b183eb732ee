"""Week 12: a step's small operations, fused into three Triton kernels.

Inside a CUDA graph a decode step of Llama-3.2-1B still runs about 600 kernels, and all but a
hundred of them are tiny element-wise operations on a few kilobytes: RMSNorm alone is eight
(to float32, square, mean, add eps, rsqrt, multiply, back to bf16, multiply by the weight), RoPE
five per tensor, SwiGLU two, plus the residual adds and two K/V scatters per layer. Each costs
a couple of microseconds however little it computes. Fused, a layer becomes:

    add_rmsnorm     residual += x;  h = rmsnorm(residual)          (1 kernel instead of 9)
    qkv_proj        matrix product
    rope_write_kv   rotate q and k, store k and v in the paged pool (1 instead of 12; issue 33's
                    FP8 pool has a twin, rope_write_kv_fp8, that also quantizes them)
    attention       the week-6 paged-attention kernel (+ its merge)
    o_proj          matrix product
    add_rmsnorm
    gate_up_proj    matrix product
    silu_mul        silu(gate) * up                                 (1 instead of 2; at
                    batch 1 fused into the gate_up product itself, `gate_up_silu`)
    down_proj       matrix product

At batch 1 (one row, issue 39) each add_rmsnorm goes into the product after it, whose programs
compute the row's norm in their prologue (`nanoserve/kernels/normed_gemv.py`):

    qkv_proj        add_rmsnorm + matrix product                   (`normed_gemv`)
    rope_write_kv, attention, o_proj
    gate_up_proj    add_rmsnorm + matrix product + silu(gate) * up  (`normed_gate_up_silu`)
    down_proj       matrix product

The kernels sit behind the modules they replace, so `Llama.forward` stays the one forward pass:
`use_fused_kernels(model)` hands `add_rmsnorm` to every `RMSNorm`, `gate_up_silu` to every `MLP`
and `fused_decoder_layer` (the batch-1 layer above; it declines other steps) to every
`DecoderLayer` of the model, and a paged context built with `fused=True` calls `rope_write_kv`, in
decode and prefill steps alike. Each kernel rounds to the model's dtype at the same points as the PyTorch
reference in `nanoserve/model/layers.py`, so bf16 results match it except for the order of a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.model.layers import MLP, DecoderLayer, RMSNorm
from nanoserve.kernels.moe import use_moe_kernels
from nanoserve.kernels.normed_gemv import fused_decoder_layer, gate_up_silu_row, plain_product
from nanoserve.model.llama import Llama
from nanoserve.model.quantized import FP8_MAX, KV_SCALE_FLOOR


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, n, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual <- residual + x, one add in the dtype, as the reference's `x + residual`
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    y = (h * inv_rms).to(Y.dtype.element_ty).to(tl.float32)  # back to the dtype, then the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (y * w).to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`RMSNorm.forward` in one kernel: rmsnorm(x); with a residual, (rmsnorm(residual + x),
    residual + x), the sum written into `residual` in place."""
    T, n = x.shape
    y = torch.empty_like(x)
    r = x if residual is None else residual
    _add_rmsnorm_kernel[(T,)](x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), n, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return y if residual is None else (y, r)


@triton.jit
def _rope_write_kv_kernel(Qin, Kin, Vin, Cos, Sin, Qout, K, V, Slots,
                          stride_qin, stride_qin_head, stride_kin, stride_kin_head, stride_vin, stride_vin_head,
                          stride_cos, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HALF: tl.constexpr):  # HALF = HEAD_DIM // 2
    # >>> week12: rope-write-kv
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. NUM_Q_HEADS - 1: a query head; then the KV heads
    kv_head = head - NUM_Q_HEADS
    slot = tl.load(Slots + t).to(tl.int64)  # int64: slot * row width can pass 2**31
    if head < NUM_Q_HEADS:
        src = Qin + t * stride_qin + head * stride_qin_head
        dst = Qout + (t * NUM_Q_HEADS + head) * HEAD_DIM
    else:  # a KV head: the rotated key goes straight into the paged pool
        src = Kin + t * stride_kin + kv_head * stride_kin_head
        dst = K + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
    d = tl.arange(0, HALF)
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    c = tl.load(Cos + t * stride_cos + d).to(tl.float32)  # the tables' two halves are equal
    s = tl.load(Sin + t * stride_cos + d).to(tl.float32)
    dt = Qout.dtype.element_ty
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1], rounded as the reference
    tl.store(dst + d, ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt))
    tl.store(dst + HALF + d, ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt))
    if head >= NUM_Q_HEADS:  # and the value, unrotated, to the same place in V
        full = tl.arange(0, HEAD_DIM)
        v = tl.load(Vin + t * stride_vin + kv_head * stride_vin_head + full)
        tl.store(V + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + full, v)
    # <<< week12: rope-write-kv


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] (views of the qkv projection are fine) -> rotated q
    [T, Hq, D]; rotated k and v are stored at `slots` of one layer's pool (k_pool, v_pool
    [num_blocks, block_size, Hkv, D], contiguous: slot s is row s of Hkv * D values)."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = q.new_empty(T, num_heads, head_dim)  # contiguous
    _rope_write_kv_kernel[(T, num_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_pool, v_pool, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
    )
    return q_out


# Issue 33's FP8 KV format (nanoserve/attention/fp8_cache.py), as constants a kernel can read
E4M3_MAX = tl.constexpr(FP8_MAX)
INV_E4M3_MAX = tl.constexpr(1 / FP8_MAX)  # (a product, as `quantize_kv` takes it, for the same bits)
SCALE_FLOOR = tl.constexpr(KV_SCALE_FLOOR)


@triton.jit
def _round_to_e4m3(x):
    """float32 x, within ±448 -> the nearest e4m3 number (ties to even), still in float32, so that the
    conversion that follows is exact. (Rounding here rather than in the conversion: Triton 3.9's
    interpreter drops the carry when float32 -> e4m3 rounds up into the next power of two, 124 -> 64.)
    e4m3's step at |x| in [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 below 2^-6 (subnormals): adding and
    subtracting 1.5 · 2^23 steps rounds |x| to a multiple of the step, in float32's own rounding."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # the binade of |x| (float32's exponent field)
    magic = ((e + 146) << 23).to(tl.float32, bitcast=True) * 3.0  # 3 · 2^(e + 19): its last bit is 2^(e - 3)
    r = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign of x, -0.0 included


@triton.jit
def _store_e4m3_row(x1, x2, Codes, Scales, row, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Issue 33: one token-head row, given as its two halves (float32), into an FP8 pool: its float16
    scale (the row's largest magnitude over 448, at least 2^-14) at Scales[row], its e4m3 codes,
    chosen against the rounded scale, at row `row` of Codes. As `quantize_kv`, in registers."""
    amax = tl.maximum(tl.max(tl.abs(x1), axis=0), tl.max(tl.abs(x2), axis=0))
    scale = tl.maximum(amax * INV_E4M3_MAX, SCALE_FLOOR).to(tl.float16)
    tl.store(Scales + row, scale)
    s = scale.to(tl.float32)
    d = tl.arange(0, HALF)
    codes_ty = Codes.dtype.element_ty
    c1 = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x1, s), -E4M3_MAX), E4M3_MAX))
    c2 = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x2, s), -E4M3_MAX), E4M3_MAX))
    tl.store(Codes + row * HEAD_DIM + d, c1.to(codes_ty))
    tl.store(Codes + row * HEAD_DIM + HALF + d, c2.to(codes_ty))


@triton.jit
def _rope_write_kv_fp8_kernel(Qin, Kin, Vin, Cos, Sin, Qout, K, V, Slots, KScale, VScale,
                              stride_qin, stride_qin_head, stride_kin, stride_kin_head, stride_vin,
                              stride_vin_head, stride_cos, NUM_Q_HEADS: tl.constexpr,
                              NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    # Issue 33: `_rope_write_kv_kernel` for an FP8 pool. The rotation is the same; a KV head's rotated
    # key and its value are quantized in registers (`_store_e4m3_row`) instead of stored as they are.
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. NUM_Q_HEADS - 1: a query head; then the KV heads
    d = tl.arange(0, HALF)
    c = tl.load(Cos + t * stride_cos + d).to(tl.float32)
    s = tl.load(Sin + t * stride_cos + d).to(tl.float32)
    dt = Qout.dtype.element_ty
    if head < NUM_Q_HEADS:
        src = Qin + t * stride_qin + head * stride_qin_head
    else:
        src = Kin + t * stride_kin + (head - NUM_Q_HEADS) * stride_kin_head
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    r1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)  # rounded as the reference
    r2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    if head < NUM_Q_HEADS:
        dst = Qout + (t * NUM_Q_HEADS + head) * HEAD_DIM
        tl.store(dst + d, r1)
        tl.store(dst + HALF + d, r2)
    else:
        kv_head = head - NUM_Q_HEADS
        row = tl.load(Slots + t).to(tl.int64) * NUM_KV_HEADS + kv_head  # int64: rows * HEAD_DIM can pass 2**31
        _store_e4m3_row(r1.to(tl.float32), r2.to(tl.float32), K, KScale, row, HEAD_DIM, HALF)
        v_src = Vin + t * stride_vin + kv_head * stride_vin_head
        v1 = tl.load(v_src + d).to(tl.float32)
        v2 = tl.load(v_src + HALF + d).to(tl.float32)
        _store_e4m3_row(v1, v2, V, VScale, row, HEAD_DIM, HALF)


def rope_write_kv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> torch.Tensor:
    """Issue 33: `rope_write_kv` into an FP8 pool: k_pool, v_pool [num_blocks, block_size, Hkv, D]
    float8 e4m3, k_scale, v_scale [num_blocks, block_size, Hkv] float16, all contiguous. Returns
    the rotated q; stores the codes and scales `Fp8PagedKVCache.write` would."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = q.new_empty(T, num_heads, head_dim)
    _rope_write_kv_fp8_kernel[(T, num_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_pool, v_pool, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
    )
    return q_out


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, stride_y, n, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(GU + t * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + t * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # silu, rounded as F.silu
    tl.store(Y + t * stride_y + cols, (act * up).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = gate_up.new_empty(T, n)
    _silu_mul_kernel[(T, triton.cdiv(n, 1024))](gate_up, y, gate_up.stride(0), y.stride(0), n, BLOCK=1024)
    return y


def gate_up_silu(x: torch.Tensor, gate_up: torch.nn.Module) -> torch.Tensor:
    """`MLP`'s silu(gate) * up from x [T, H] and its gate_up projection (weight [2I, H], gate
    rows first) -> [T, I]. One row (a batch-1 decode step) is a matrix-vector product: one
    kernel computes it and applies SiLU·mul, so the [2I] product never goes to memory and one
    launch is saved. More rows: the projection's own matrix product, then `silu_mul`."""
    if x.shape[0] != 1 or not plain_product(gate_up) or not x.is_contiguous():
        return silu_mul(gate_up(x))  # a quantized or LoRA projection keeps its own product
    return gate_up_silu_row(x, gate_up.weight)  # the kernel lives in normed_gemv.py, beside its normed form


def use_fused_kernels(model: Llama, on: bool = True) -> None:
    """Swap the fused kernels into (or, with on=False, out of) every norm and MLP of the model (week 24:
    and the grouped expert kernels into every mixture of experts; issue 39: and the batch-1 layer with
    its norms folded into the products into every decoder layer)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = add_rmsnorm if on else None
        elif type(module) is MLP:  # SiLU's: a family's other activation (Gemma's GELU) keeps its own code
            module.fused = gate_up_silu if on else None
        elif isinstance(module, DecoderLayer):  # a subclass's layer (experts) is declined inside the hook
            module.fused = fused_decoder_layer if on else None
    use_moe_kernels(model, on)
