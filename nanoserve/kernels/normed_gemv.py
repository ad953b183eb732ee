"""Week 12: batch-1 products with their neighbours folded in (issues 20 and 39).

At batch 1 every projection of a layer is a matrix-vector product (a GEMV): each program of the
kernel reads BLOCK_N rows of the weight and dots them with the one input row. Work on the input
or the output of that row can then ride along in the same launch:

    gate_up_silu        the gate and up products with SiLU·mul in the epilogue (issue 20): each program
                        holds the gate and the up value of its outputs, so the [2I] product never
                        goes to memory
    normed              the add + RMSNorm in the prologue (issue 39): the input row is the norm of
                        s = x + residual, computed by the product itself

The norm is a reduction over the whole row: every output of the product needs the row's rms. A
separate launch computes it once and the product waits for it; here every program computes it
again from the row, a few kilobytes (2,048 values for Llama-3.2-1B, from L2 after the first
program), before streaming its block of the weight. Pass 1 sums the squares of s tile by tile;
pass 2, the product's own loop over K, normalizes each tile of s as it goes, rounding where
`RMSNorm.normalize` rounds (to the dtype, times the weight, to the dtype). The new residual, s
itself, is written by program 0 alone, into a fresh tensor: never over `residual`, which the
other programs are still reading.

`fused_decoder_layer` is the `DecoderLayer` hook that uses them. A batch-1 layer then runs

    qkv (normed by input_layernorm) -> attention (+ the K/V write) -> o_proj
        -> gate_up_silu (normed by post_attention_layernorm) -> down_proj

two launches fewer than with `add_rmsnorm` before each product: 32 for a 16-layer model. With
`qkv-rope` the qkv product also rotates q and k and writes k and v into the pool (`normed_qkv_rope`),
and with `row-gemv` o_proj and down_proj run through the same kernel without the norm (`row_gemv`),
where cuBLAS's GEMV read these two small weights at 48% and 72% of the copy bandwidth on an H100. Each
of the two norms is its own switch (`nanoserve/kernels/fusion.py`): `qkv-norm` and `mlp-norm`, both on
by default. Measured on an H100, the normed qkv product pays only with its blocks tuned (four outputs a
program, the whole row of 2,048 in one tile): it is a Triton GEMV standing in for cuBLAS's, and with
the first blocks tried it lost more than the norm's launch saved. NANOSERVE_FUSE_OFF=norm gives both
separate norms back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fusion import fusion_on
from nanoserve.model.layers import MLP, Attention, RMSNorm
from nanoserve.model.tensor_parallel import ColumnParallelLinear


@triton.jit
def _load_sum(X, R, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """A tile of the stream s = x + residual: one add in the model's dtype, as the reference's `x + residual`."""
    s = tl.load(X + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        s = s + tl.load(R + cols, mask=mask, other=0.0)
    return s


@triton.jit
def _row_inv_rms(X, R, S, k_dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pass 1 of the prologue: 1 / rms of the whole row s, in float32. Program 0 also stores s into
    S (the new residual); the others only read."""
    store_end = tl.where(tl.program_id(0) == 0, k_dim, 0)  # program 0 stores the columns below k_dim, others none
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = cols < k_dim
        s = _load_sum(X, R, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(S + cols, s, mask=cols < store_end)
        h = s.to(tl.float32)
        squares += h * h
    return 1.0 / tl.sqrt(tl.sum(squares, axis=0) / k_dim + eps)  # as `_add_rmsnorm_kernel` computes it


@triton.jit
def _input_tile(X, R, NW, cols, mask, inv_rms, NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Pass 2: the tile of the product's input at `cols`, in float32. Normed: RMSNorm's output,
    rounded as `RMSNorm.normalize` rounds it; else x as it is."""
    if NORMED:
        dt = X.dtype.element_ty
        s = _load_sum(X, R, cols, mask, HAS_RESIDUAL).to(tl.float32)
        w = tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        return ((s * inv_rms).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
    else:
        return tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _two_products(X, R, NW, W, rows_a, rows_b, in_rows, stride_w, k_dim, inv_rms, NORMED: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pass 2 for a program that needs two rows of W per output (gate and up; a RoPE pair): the dot
    products of rows `rows_a` and `rows_b` with the input row, in float32, the input tile read once."""
    acc_a = tl.zeros(rows_a.shape, dtype=tl.float32)
    acc_b = tl.zeros(rows_a.shape, dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_cols = cols < k_dim
        x = _input_tile(X, R, NW, cols, in_cols, inv_rms, NORMED, HAS_RESIDUAL)[None, :]
        both = in_rows[:, None] & in_cols[None, :]
        # both tiles' loads are issued before either sum: the GPU keeps twice the bytes in flight
        w_a = tl.load(W + rows_a[:, None] * stride_w + cols[None, :], mask=both, other=0.0)
        w_b = tl.load(W + rows_b[:, None] * stride_w + cols[None, :], mask=both, other=0.0)
        acc_a += tl.sum(w_a.to(tl.float32) * x, 1)
        acc_b += tl.sum(w_b.to(tl.float32) * x, 1)
    return acc_a, acc_b


@triton.jit
def _normed_gemv_kernel(X, R, NW, S, W, B, Y, stride_w, n_out, k_dim, eps, NORMED: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # One row: y = rmsnorm(x + residual) · Wᵀ (+ b), BLOCK_N outputs per program; not NORMED: y = x · Wᵀ (+ b).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n_out
    inv_rms = 1.0
    if NORMED:
        inv_rms = _row_inv_rms(X, R, S, k_dim, eps, HAS_RESIDUAL, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_cols = cols < k_dim
        h = _input_tile(X, R, NW, cols, in_cols, inv_rms, NORMED, HAS_RESIDUAL)[None, :]
        both = in_rows[:, None] & in_cols[None, :]
        w = tl.load(W + rows[:, None] * stride_w + cols[None, :], mask=both, other=0.0).to(tl.float32)
        acc += tl.sum(w * h, axis=1)
    if HAS_BIAS:  # Qwen2's q/k/v bias, added before the one rounding to the dtype, as a Linear's
        acc += tl.load(B + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=in_rows)


@triton.jit
def _normed_qkv_rope_kernel(X, R, NW, S, W, B, Cos, Sin, Qout, K, V, Slot, stride_w, k_dim, eps,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    # One row: the normed qkv product, then RoPE and the K/V write in the epilogue. RoPE mixes
    # output d of a head with output d + HEAD_DIM/2, so a program takes BLOCK_P such *pairs*: it
    # reads the two rows of W of each pair (each row contiguous along K) and holds both dot products
    # when it rotates them. Pair j is (head j // HALF, offset j % HALF); q heads, then k, then v
    # (which is not rotated), as the rows of W are laid out.
    HALF: tl.constexpr = HEAD_DIM // 2
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_pairs = pairs < (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
    head, d = pairs // HALF, pairs % HALF
    lo = head * HEAD_DIM + d  # rows of W (and outputs of the product) of the pair's two halves
    hi = lo + HALF
    inv_rms = _row_inv_rms(X, R, S, k_dim, eps, HAS_RESIDUAL, BLOCK_K)
    acc_lo, acc_hi = _two_products(X, R, NW, W, lo, hi, in_pairs, stride_w, k_dim, inv_rms, True, HAS_RESIDUAL,
                                   BLOCK_K)
    if HAS_BIAS:
        acc_lo += tl.load(B + lo, mask=in_pairs, other=0.0).to(tl.float32)
        acc_hi += tl.load(B + hi, mask=in_pairs, other=0.0).to(tl.float32)
    dt = Qout.dtype.element_ty
    x1 = acc_lo.to(dt).to(tl.float32)  # rounded where the projection's output is
    x2 = acc_hi.to(dt).to(tl.float32)
    c = tl.load(Cos + d, mask=in_pairs, other=0.0).to(tl.float32)  # the tables' two halves are equal
    sn = tl.load(Sin + d, mask=in_pairs, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rounded as `_rope_write_kv_kernel` rounds it
    rot1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * sn).to(dt).to(tl.float32)).to(dt)
    rot2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * sn).to(dt).to(tl.float32)).to(dt)
    is_q = in_pairs & (head < NUM_Q_HEADS)
    tl.store(Qout + lo, rot1, mask=is_q)
    tl.store(Qout + hi, rot2, mask=is_q)
    kv_head = tl.where(head < NUM_Q_HEADS + NUM_KV_HEADS, head - NUM_Q_HEADS, head - NUM_Q_HEADS - NUM_KV_HEADS)
    row = (tl.load(Slot).to(tl.int64) * NUM_KV_HEADS + kv_head) * HEAD_DIM  # int64: slots * row width pass 2**31
    is_k = in_pairs & (head >= NUM_Q_HEADS) & (head < NUM_Q_HEADS + NUM_KV_HEADS)
    tl.store(K + row + d, rot1, mask=is_k)
    tl.store(K + row + d + HALF, rot2, mask=is_k)
    is_v = in_pairs & (head >= NUM_Q_HEADS + NUM_KV_HEADS)
    tl.store(V + row + d, x1.to(dt), mask=is_v)
    tl.store(V + row + d + HALF, x2.to(dt), mask=is_v)


@triton.jit
def _gate_up_silu_kernel(X, R, NW, S, W, Y, stride_w, inter, k_dim, eps, NORMED: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One row: each program reads BLOCK_N rows of the gate half of W and the matching rows
    # of the up half, so it holds both products of its outputs and applies SiLU·mul before storing.
    # NORMED (issue 39): the input is rmsnorm(x + residual), computed in the prologue.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < inter
    inv_rms = 1.0
    if NORMED:
        inv_rms = _row_inv_rms(X, R, S, k_dim, eps, HAS_RESIDUAL, BLOCK_K)
    gate, up = _two_products(X, R, NW, W, rows, rows + inter, in_rows, stride_w, k_dim, inv_rms, NORMED,
                             HAS_RESIDUAL, BLOCK_K)
    dt = Y.dtype.element_ty
    g = gate.to(dt).to(tl.float32)  # rounded where the reference's projection output is
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu, rounded as F.silu
    tl.store(Y + rows, (act * up.to(dt).to(tl.float32)).to(dt), mask=in_rows)


GATE_UP_BLOCKS = (4, 1024, 4)  # BLOCK_N, BLOCK_K, warps: the best of 8 tried on an H100 (docs/benchmarks.md),
# for the plain form; the normed form runs with them too, untuned (its prologue reads the row twice more)
QKV_ROPE_BLOCKS = (2, 2048, 4)  # pairs a program (two rows of W each), BLOCK_K, warps: as NORMED_GEMV_BLOCKS' 4 rows; untuned
NORMED_GEMV_BLOCKS = (4, 2048, 4)  # BLOCK_N, BLOCK_K, warps for the normed qkv product: the best of 60 on an H100 (scripts/bench_normed_gemv.py --sweep)
O_GEMV_BLOCKS = (2, 2048, 4)  # row_gemv for o_proj and down_proj (switch `row-gemv`): BLOCK_N, BLOCK_K, warps,
DOWN_GEMV_BLOCKS = (1, 2048, 4)  # the best of 48 each on an H100 (scripts/bench_normed_gemv.py --sweep-small)


def plain_product(proj: torch.nn.Module, bias_ok: bool = False) -> bool:
    """Is `proj` x·Wᵀ and nothing else: a Linear without bias (with `bias_ok`, a bias is allowed too:
    the kernel adds it), or week 18's column-parallel slice of one (a rank's rows, laid out as the
    whole weight's: for gate_up, gate first). A quantized or LoRA projection is not: it keeps its own
    product."""
    plain = type(proj) is ColumnParallelLinear or (type(proj) is torch.nn.Linear and (bias_ok or proj.bias is None))
    return plain and proj.weight.is_contiguous()


def _launch_gate_up(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm | None):
    """One row through `_gate_up_silu_kernel`, normed by `norm` when given -> (y [1, I], the new residual)."""
    inter, k_dim = w.shape[0] // 2, w.shape[1]
    y = x.new_empty(1, inter)
    s = torch.empty_like(x) if norm is not None and residual is not None else x
    r = x if residual is None else residual
    nw, eps = (x, 0.0) if norm is None else (norm.weight, norm.eps)  # (x: a placeholder the kernel never reads)
    block_n, block_k, warps = GATE_UP_BLOCKS
    _gate_up_silu_kernel[(triton.cdiv(inter, block_n),)](
        x, r, nw, s, w, y, w.stride(0), inter, k_dim, eps, NORMED=norm is not None,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y, s


def gate_up_silu_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Issue 20: x [1, H] and a gate_up weight [2I, H] (gate rows first) -> silu(x·Wgᵀ) * (x·Wuᵀ) [1, I]."""
    return _launch_gate_up(x, w, None, None)[0]


def normed_gate_up_silu(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, w: torch.Tensor):
    """`norm(x, residual)`, then `gate_up_silu_row` of it, in one launch -> (y [1, I], x + residual).
    With residual None, x is the whole stream: the norm is of x, and x comes back as the residual."""
    return _launch_gate_up(x, w, residual, norm)


def normed_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, proj: torch.nn.Module,
                config: tuple[int, int, int] | None = None):
    """`norm(x, residual)`, then `proj` of it (a plain product: weight [N, H], maybe a bias), in one
    launch -> (y [1, N], x + residual in a fresh tensor; x itself when residual is None). `config`
    overrides NORMED_GEMV_BLOCKS (the sweep of scripts/bench_normed_gemv.py)."""
    w, bias = proj.weight, getattr(proj, "bias", None)
    n_out, k_dim = w.shape
    y = x.new_empty(1, n_out)
    s = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    block_n, block_k, warps = config or NORMED_GEMV_BLOCKS
    _normed_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, r, norm.weight, s, w, w if bias is None else bias, y, w.stride(0), n_out, k_dim, norm.eps, NORMED=True,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return y, s


def row_gemv(x: torch.Tensor, proj: torch.nn.Module, config: tuple[int, int, int]) -> torch.Tensor:
    """x [1, K] · Wᵀ of a plain product (`plain_product(proj)`) through the same kernel, with no norm
    -> [1, N]. cuBLAS's GEMV for o_proj and down_proj reaches about half and three quarters of the copy
    bandwidth at batch 1 on an H100 (docs/benchmarks.md); `config` is (BLOCK_N, BLOCK_K, warps)."""
    w = proj.weight
    n_out, k_dim = w.shape
    y = x.new_empty(1, n_out)
    block_n, block_k, warps = config
    _normed_gemv_kernel[(triton.cdiv(n_out, block_n),)](  # (x stands in for what the kernel does not read)
        x, x, x, x, w, w, y, w.stride(0), n_out, k_dim, 0.0, NORMED=False, HAS_RESIDUAL=False, HAS_BIAS=False,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


def normed_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, attn: torch.nn.Module,
                    cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slot: torch.Tensor, config: tuple[int, int, int] | None = None):
    """`norm(x, residual)`, the qkv product of `attn` (a plain one, maybe with a bias), RoPE of q and k
    and the K/V write at `slot` [1] of one layer's pool (k_pool, v_pool [blocks, block_size, Hkv, D],
    contiguous), in one launch -> (rotated q [1, Hq, D], x + residual as `normed_gemv` returns it).
    What `normed_gemv` followed by `PagedContext.write` (week 12's `rope_write_kv`) computes.
    `config` is (pairs a program, BLOCK_K, warps); QKV_ROPE_BLOCKS by default."""
    w, bias = attn.qkv_proj.weight, getattr(attn.qkv_proj, "bias", None)
    k_dim = w.shape[1]
    q_out = x.new_empty(1, attn.num_heads, attn.head_dim)
    s = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    block_p, block_k, warps = config or QKV_ROPE_BLOCKS
    num_pairs = w.shape[0] // 2
    _normed_qkv_rope_kernel[(triton.cdiv(num_pairs, block_p),)](
        x, r, norm.weight, s, w, w if bias is None else bias, cos, sin, q_out, k_pool, v_pool, slot,
        w.stride(0), k_dim, norm.eps, NUM_Q_HEADS=attn.num_heads, NUM_KV_HEADS=attn.num_kv_heads,
        HEAD_DIM=attn.head_dim, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps)
    return q_out, s


def writes_with_the_product(ctx) -> bool:
    """Can the qkv product write this step's K/V itself? Only where week 12's `rope_write_kv` would
    (a paged context with the fused kernels: `PagedContext.rope_write_kv` set), into a pool of the
    model's dtype (not issue 33's FP8 one, which has scales), at one slot."""
    return (fusion_on("qkv-rope") and getattr(ctx, "rope_write_kv", None) is not None
            and ctx.cache.k_scale is None and ctx.meta.slot_mapping.numel() == 1)


def layer_fuses(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Does `fused_decoder_layer` take this layer and this input? One row, the fusion on, week 2's
    own attention (not the families': q/k norms and windows) and SiLU MLP, week 1's norms, plain
    products in front of the norms; anything else (a quantized or LoRA projection, experts) keeps
    the layer's own code."""
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)  # (Mixtral files its block elsewhere)
    rows_ok = x.shape[0] == 1 and x.is_contiguous() and (residual is None or residual.is_contiguous())
    modules_ok = (type(attn) is Attention and type(mlp) is MLP and type(layer.input_layernorm) is RMSNorm
                  and type(layer.post_attention_layernorm) is RMSNorm)
    return (rows_ok and modules_ok and (fusion_on("qkv-norm") or fusion_on("mlp-norm"))
            and plain_product(attn.qkv_proj, bias_ok=True) and plain_product(mlp.gate_up_proj))


def fused_decoder_layer(layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                        cos: torch.Tensor, sin: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`DecoderLayer.fused`: the layer's forward for one row with each add + RMSNorm folded into the
    product after it -> (x, residual) of the stream after the layer, as `DecoderLayer.forward`
    returns them; None where `layer_fuses` says no (the layer's own code runs then)."""
    if not layer_fuses(layer, x, residual):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if fusion_on("qkv-norm") and writes_with_the_product(ctx):  # norm, qkv, RoPE, K/V write: one launch
        cache, i = ctx.cache, attn.layer_idx
        q, residual = normed_qkv_rope(x, residual, layer.input_layernorm, attn, cos, sin, cache.k[i], cache.v[i],
                                      ctx.meta.slot_mapping)
        out = ctx.read(i, q)  # [1, Hq, D]
    else:
        if fusion_on("qkv-norm"):
            qkv, residual = normed_gemv(x, residual, layer.input_layernorm, attn.qkv_proj)  # [1, q + 2 kv]
        else:  # the norm's own launch, then the projection (cuBLAS), as week 2's layer does
            h, residual = layer.input_layernorm(x, residual) if residual is not None else (layer.input_layernorm(x), x)
            qkv = attn.qkv_proj(h)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(1, attn.num_heads, attn.head_dim)
        k = k.view(1, attn.num_kv_heads, attn.head_dim)
        v = v.view(1, attn.num_kv_heads, attn.head_dim)
        out = ctx.attend(attn.layer_idx, q, k, v, cos, sin)  # [1, Hq, D]
    x = _small_product(out.reshape(1, attn.q_size), attn.o_proj, O_GEMV_BLOCKS)
    if not fusion_on("mlp-norm"):
        h, residual = layer.post_attention_layernorm(x, residual)
        return mlp(h), residual
    h, residual = normed_gate_up_silu(x, residual, layer.post_attention_layernorm, mlp.gate_up_proj.weight)
    return _small_product(h, mlp.down_proj, DOWN_GEMV_BLOCKS), residual


def _small_product(x: torch.Tensor, proj: torch.nn.Module, config: tuple[int, int, int]) -> torch.Tensor:
    """o_proj or down_proj of one row: `row_gemv` with the switch `row-gemv` on and a plain product
    (not week 18's row-parallel slice, whose sum needs an all-reduce); else the module's own forward."""
    if fusion_on("row-gemv") and plain_product(proj):
        return row_gemv(x, proj, config)
    return proj(x)
