"""Week 12: the decode step's small operations, fused into three Triton kernels.

Inside a CUDA graph a decode step of Llama-3.2-1B still runs about 600 kernels, and all but a
hundred of them are tiny element-wise operations on a few kilobytes: RMSNorm alone is eight
(to float32, square, mean, add eps, rsqrt, multiply, back to bf16, multiply by the weight), RoPE
five per tensor, SwiGLU two, plus the residual adds and two K/V scatters per layer. Each costs
a couple of microseconds however little it computes. Fused, a layer becomes:

    add_rmsnorm     residual += x;  h = rmsnorm(residual)          (1 kernel instead of 9)
    qkv_proj        matrix product
    rope_write_kv   rotate q and k, store k and v in the paged pool (1 instead of 12)
    attention       the week-6 decode kernel (+ its merge)
    o_proj          matrix product
    add_rmsnorm
    gate_up_proj    matrix product
    silu_mul        silu(gate) * up                                 (1 instead of 2)
    down_proj       matrix product

Each kernel rounds to the model's dtype at the same points as the PyTorch reference in
`nanoserve/layers.py`, so bf16 results match it except for the order of a sum (float32 results
match to rounding). `fused_decode_forward` is the model's forward pass for decode steps written
with them; `nanoserve/model.py` stays the specification it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.cache import PagedKVCache
from nanoserve.kernels.paged_attention import paged_decode_attention
from nanoserve.model import Llama


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, n, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual <- residual + x, rounded to the dtype as `x + attn(...)` is
        x = (tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32))
        x = x.to(Y.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    y = (h * inv_rms).to(Y.dtype.element_ty).to(tl.float32)  # back to the dtype, then the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (y * w).to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x); the sum is written into `residual` in place.

    With residual None (the first layer): (rmsnorm(x), x).
    """
    T, n = x.shape
    y = torch.empty_like(x)
    r = x if residual is None else residual
    _add_rmsnorm_kernel[(T,)](x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), n, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return y, r


@triton.jit
def _rope_write_kv_kernel(QKV, Cos, Sin, Q, K, V, Slots,
                          stride_qkv, stride_cos, stride_q, stride_q_head, stride_k_slot, stride_v_slot,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HALF: tl.constexpr):  # HEAD_DIM // 2
    # >>> week12: rope-write-kv
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0 .. NUM_Q_HEADS - 1: a query head; then the KV heads
    d = tl.arange(0, HALF)
    row = QKV + t * stride_qkv + head * HEAD_DIM  # q heads then k heads sit back to back in qkv
    x1 = tl.load(row + d).to(tl.float32)
    x2 = tl.load(row + HALF + d).to(tl.float32)
    c1 = tl.load(Cos + t * stride_cos + d).to(tl.float32)
    c2 = tl.load(Cos + t * stride_cos + HALF + d).to(tl.float32)
    s1 = tl.load(Sin + t * stride_cos + d).to(tl.float32)
    s2 = tl.load(Sin + t * stride_cos + HALF + d).to(tl.float32)
    dt = Q.dtype.element_ty
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1], rounded as the reference
    out1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    if head < NUM_Q_HEADS:
        dst = Q + t * stride_q + head * stride_q_head
        tl.store(dst + d, out1)
        tl.store(dst + HALF + d, out2)
    else:  # a KV head: the rotated key and the value go straight into the paged pool
        kv_head = head - NUM_Q_HEADS
        slot = tl.load(Slots + t)
        dst = K + slot * stride_k_slot + kv_head * HEAD_DIM
        tl.store(dst + d, out1)
        tl.store(dst + HALF + d, out2)
        full = tl.arange(0, HEAD_DIM)
        v = tl.load(QKV + t * stride_qkv + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + full)
        tl.store(V + slot * stride_v_slot + kv_head * HEAD_DIM + full, v)
    # <<< week12: rope-write-kv


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] -> rotated q [T, Hq, D]; rotated k and v are stored at `slots`
    of one layer's pool (k_pool, v_pool [num_blocks, block_size, Hkv, D])."""
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k_flat, v_flat = k_pool.view(-1, num_kv_heads * head_dim), v_pool.view(-1, num_kv_heads * head_dim)
    _rope_write_kv_kernel[(T, num_heads + num_kv_heads)](
        qkv, cos, sin, q, k_flat, v_flat, slots,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), k_flat.stride(0), v_flat.stride(0),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
    )
    return q


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
    T, two_n = gate_up.shape
    n = two_n // 2
    y = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, y, gate_up.stride(0), y.stride(0), n, BLOCK=block)
    return y


def fused_decode_forward(model: Llama, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                         slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                         max_context: int, num_splits: int) -> torch.Tensor:
    """`Llama.forward` for a decode step (one new token per sequence) with fused kernels.

    Returns the final-normed hidden states [T, hidden], like the model's forward.
    """
    cfg = model.config
    eps = cfg.rms_norm_eps
    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary(positions, x.dtype)
    residual = None
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h, residual = add_rmsnorm(x, residual, layer.input_layernorm.weight, eps)
        q = rope_write_kv(attn.qkv_proj(h), cos, sin, cache.k[i], cache.v[i], slots,
                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        out = paged_decode_attention(q, cache.k[i], cache.v[i], block_tables, context_lens, max_context,
                                     num_splits=num_splits)
        x = attn.o_proj(out.view(len(q), -1))
        h, residual = add_rmsnorm(x, residual, layer.post_attention_layernorm.weight, eps)
        x = layer.mlp.down_proj(silu_mul(layer.mlp.gate_up_proj(h)))
    h, _ = add_rmsnorm(x, residual, model.norm.weight, eps)
    return h
