"""Week 6: one Triton kernel for attention over the paged KV cache, any number of new tokens.

Every step, each scheduled sequence brings new query tokens that attend over all the keys and
values it has cached, wherever their blocks sit in the pool: one token in a decode step, a whole
prompt (its K/V just written), and in later weeks a chunk of a prompt or the k + 1 tokens of a
speculative guess over a cached past. All are one computation: sequence i has `q_len` new tokens
at the end of its `context_len` cached ones, and its new token j, at position
p = context_len - q_len + j, may look at keys 0 .. p. The kernel reads K and V once, straight
through the block table, where the PyTorch reference (`nanoserve.attention.paged.paged_attention_reference`)
first gathers a contiguous copy of each sequence.

One program handles one tile of query rows against one KV head: BLOCK_Q consecutive new tokens
of one sequence times the GROUP query heads that share that KV head (grouped-query attention:
the K/V tile is loaded once for all of them). For each tile of BLOCK_N cached tokens:

    physical slot of a token   = block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    K, V tile                    [BLOCK_N, D]
    scores = Q @ K^T * scale     [BLOCK_Q * GROUP, BLOCK_N], causally masked
    online softmax: keep a running max m, running sum l, and a rescaled accumulator acc
    out = acc / l                [BLOCK_Q * GROUP, D]

A decode step uses BLOCK_Q = 1 (one program per sequence and KV head). With few sequences that
grid is too small to fill the GPU, so the cached context can be split across programs
(flash-decoding): each split writes its partial (acc, m, l) and a second small kernel merges them.

Week 19, sliding windows (Mistral, Gemma 3's local layers): with a window W, the query at position
p sees only keys p - W < j <= p. The mask alone would give the right answer, but a long context
would still be read in full. So a program starts its key loop at the window start of its tile's
earliest query, rounded down to a multiple of BLOCK_N: the tiles before it, invisible to every row
of the tile, are never loaded. With context splits, the splits share this visible range
[window start, kv_end), not [0, kv_end). A decode query then reads about W keys, whatever the
context's length. The window is a runtime argument behind a constexpr switch, SLIDING: one compiled
variant for the full-attention layers and one for the sliding ones, whatever the window's value.

Issue 33, an FP8 KV cache (nanoserve/attention/fp8_cache.py): with FP8_KV the pool holds float8 e4m3
codes, and KScale, VScale a float16 scale per token and KV head (K ≈ codes · scale). The kernel loads
the codes (one byte a value: the point) and widens them to the queries' dtype, which is exact (an
e4m3 number is a bf16, fp16 and fp32 number too). It does not multiply each value by its scale:
a token's scale is the same for its whole row, so it can be applied once per column of the tile,
    scores[i, j] = (q_i · codes_j) · k_scale_j      out_i = Σ_j (p_ij · v_scale_j) · vcodes_j
which is BLOCK_N multiplies instead of BLOCK_N × HEAD_DIM, and keeps the widened codes exact for
the tensor cores. The online softmax's running sum uses p before the V scale.

Issue 39, the merge in the same launch: a split decode step (`merge_in_kernel=True`, week 12's fused
path) launches no merge kernel. Each program, its partials stored, bumps a counter of its (sequence,
KV head); the last of the splits to do so merges them for its GROUP query heads with the same
`_merge_splits` as the merge kernel, and puts the counter back to 0 (nanoserve/kernels/fusion.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fusion import fusion_on, persistent_buffer

# Triton compiles a kernel again for every new constexpr value and for some properties of integer
# arguments (equal to 1, divisible by 16), in most of a second: a variant first met mid-serving stalls
# every stream. So arguments that change per step are not specialized on; the merge takes MAX_SPLITS.
MAX_SPLITS = 64
MERGE_PAD = tl.constexpr(MAX_SPLITS)  # issue 39: the one-launch merge's SPLITS_PAD


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "window"])
def _paged_attention_kernel(
    Q, K, V, BlockTables, QueryStartLoc, ContextLens, Out, PartialAcc, PartialM, PartialL,
    KScale, VScale,  # issue 33: with FP8_KV, [num_blocks, block_size, num_kv_heads] float16; else unused
    stride_q_tok, stride_q_head, stride_k_block, stride_k_slot, stride_k_head,  # V is laid out as K
    stride_s_block, stride_s_slot,  # issue 33: the scales' (VScale is laid out as KScale; heads contiguous)
    stride_bt_seq, stride_o_tok, stride_o_head,
    scale_log2,  # softmax scale * log2(e): we exponentiate with exp2
    num_seqs, num_splits,  # num_splits: programs per tile of queries, each taking one slice of the context
    window,  # week 19: with SLIDING, the query at p sees keys p - window < j <= p (window >= 1); else unused (0)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two (BLOCK_Q * GROUP_PAD >= 16, tl.dot's smallest tile)
    BLOCK_Q: tl.constexpr,  # new tokens per program
    DECODE: tl.constexpr,  # every sequence has one new token: program i is sequence i
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block in the pool
    BLOCK_N: tl.constexpr,  # cached tokens per loop iteration (several blocks)
    SPLIT: tl.constexpr,  # write partials for the merge kernel instead of the output
    PRECISION: tl.constexpr,  # "ieee" keeps float32 exact; tensor cores otherwise
    SLIDING: tl.constexpr,  # week 19: a sliding-window layer (reads `window`)
    FP8_KV: tl.constexpr = False,  # issue 33: K and V are e4m3 codes with a scale per token and head
    Counters=None,  # issue 39: with MERGE_LAST, [num_seqs * num_kv_heads] int32, all 0 (and left so)
    MERGE_LAST: tl.constexpr = False,  # issue 39, DECODE and SPLIT: the last split to finish merges
):
    # >>> week06: paged-attention-kernel
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Which sequence, and which of its query tiles? Sequence i's tiles are numbered from
    # query_start_loc[i] // BLOCK_Q + i on (a bound that needs no table): find the last sequence
    # whose first tile is <= this one.
    seq = tile  # DECODE: program i is sequence i
    if not DECODE:
        lo, hi = 0, num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(QueryStartLoc + mid) // BLOCK_Q + mid <= tile:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    first = 0 if DECODE else (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first new token
    if first >= q_len:
        return  # a tile past the end of the sequence's tokens: nothing to do
    context_len = tl.load(ContextLens + seq)
    past = context_len - q_len  # tokens cached before this step

    # Query rows: BLOCK_Q tokens x GROUP_PAD heads, token-major.
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first + r // GROUP_PAD  # token index within the sequence's new tokens
    g = r % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = past + tok  # each row's position: it sees keys 0 .. q_pos
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(Q + (q_start + tok)[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_Q * GROUP_PAD, D]

    # The keys this tile can see end at its last token's position; cut them into num_splits slices.
    kv_end = tl.minimum(context_len, past + first + BLOCK_Q)
    kv_start = 0
    if SLIDING:  # week 19: and begin at its first token's window, on a tile boundary
        kv_start = tl.maximum(past + first - window + 1, 0) // BLOCK_N * BLOCK_N
        # A row sees keys > win_lo. Rows past the sequence's last token (padding, never stored) take
        # that token's window: every row sees at least one key, and none computes 0 / 0.
        win_lo = tl.minimum(q_pos, context_len - 1) - window
    partition = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * partition
    end = tl.minimum(start + partition, kv_end)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)  # running sum of exp(score - m) * v

    for kv_tile in range(start, end, BLOCK_N):
        pos = kv_tile + tl.arange(0, BLOCK_N)  # logical positions in the sequence
        valid = pos < end
        block = tl.load(BlockTables + seq * stride_bt_seq + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)  # block * stride can pass 2**31 in a large pool
        offset = pos % BLOCK_SIZE
        # The same address for K and V, written out in full in each load: an offset tensor shared
        # by both made large decode batches up to 20% slower on an H100.
        k = tl.load(K + block[:, None] * stride_k_block + offset[:, None] * stride_k_slot
                    + kv_head * stride_k_head + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + block[:, None] * stride_k_block + offset[:, None] * stride_k_slot
                    + kv_head * stride_k_head + d[None, :], mask=valid[:, None], other=0.0)
        if FP8_KV:  # issue 33: codes widened exactly; each token's scale applied to its column below
            at = block * stride_s_block + offset * stride_s_slot + kv_head
            k_scale = tl.load(KScale + at, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_N]
            v_scale = tl.load(VScale + at, mask=valid, other=0.0).to(tl.float32)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [rows, BLOCK_N]
        if FP8_KV:
            s = s * k_scale[None, :]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        if SLIDING:  # week 19: and inside the row's window
            visible = visible & (pos[None, :] > win_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, axis=1)
        if FP8_KV:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out_rows = (q_start + tok)[:, None] * stride_o_tok + heads[:, None] * stride_o_head
    if not SPLIT:
        tl.store(Out + out_rows + d[None, :], (acc / l[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:  # partials laid out [token, query head, split(, D)], contiguous
        part = ((q_start + tok) * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(PartialM + part, m, mask=row_ok)
        tl.store(PartialL + part, l, mask=row_ok)
        tl.store(PartialAcc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    # <<< week06: paged-attention-kernel
    if MERGE_LAST:  # issue 39: no merge kernel after this one
        _merge_if_last(PartialAcc, PartialM, PartialL, Out, Counters, QueryStartLoc, tl.program_id(0),
                       tl.program_id(1), tl.num_programs(1), stride_o_tok, stride_o_head, num_splits, GROUP, HEAD_DIM)


@triton.jit
def _merge_splits(PartialAcc, PartialM, PartialL, Out, tok, head, num_heads, stride_o_tok, stride_o_head, num_splits,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Combine the splits of one (token, query head): rescale each to the common max."""
    # >>> week06: merge-splits
    row = (tok * num_heads + head) * num_splits
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    in_range = s < num_splits
    m = tl.load(PartialM + row + s, mask=in_range, other=float("-inf"))  # [SPLITS_PAD]
    l = tl.load(PartialL + row + s, mask=in_range, other=0.0)
    has_work = in_range & (l > 0)  # an empty split's acc is 0: not worth reading
    acc = tl.load(PartialAcc + (row + s)[:, None] * HEAD_DIM + d[None, :], mask=has_work[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)  # empty splits (past the context) weigh 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # [HEAD_DIM]
    tl.store(Out + tok * stride_o_tok + head * stride_o_head + d, out.to(Out.dtype.element_ty))
    # <<< week06: merge-splits


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(PartialAcc, PartialM, PartialL, Out, stride_o_tok, stride_o_head, num_splits,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    # One program per (token, query head), over all tokens and heads.
    _merge_splits(PartialAcc, PartialM, PartialL, Out, tl.program_id(0), tl.program_id(1), tl.num_programs(1),
                  stride_o_tok, stride_o_head, num_splits, SPLITS_PAD, HEAD_DIM)


@triton.jit
def _merge_if_last(PartialAcc, PartialM, PartialL, Out, Counters, QueryStartLoc, seq, kv_head, num_kv_heads,
                   stride_o_tok, stride_o_head, num_splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Issue 39, a decode step: count this split of (sequence, KV head) in; the last of the
    `num_splits` to arrive merges them all for the GROUP query heads, as `_merge_splits_kernel`
    would in a launch of its own, and sets the counter back to 0 for the next launch."""
    tl.debug_barrier()  # every thread's partials are stored before the count says so
    counter = Counters + seq * num_kv_heads + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")  # acquire: the others' partials, seen
    if arrived == num_splits - 1:
        tl.store(counter, 0)  # nobody else touches it in this launch
        tok = tl.load(QueryStartLoc + seq)  # the sequence's one new token: its row in the partials
        for g in tl.static_range(GROUP):
            _merge_splits(PartialAcc, PartialM, PartialL, Out, tok, kv_head * GROUP + g, GROUP * num_kv_heads,
                          stride_o_tok, stride_o_head, num_splits, MERGE_PAD, HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _num_sm(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split the context only when the grid would otherwise leave the GPU idle. Measured on an
    H100 (docs/benchmarks.md): decode is fastest with about four programs per SM, and a split
    still pays off down to one 64-token tile per program. `max_context`: the most keys one tile of
    queries reads (with a sliding window, see `visible_context`)."""
    programs = num_tiles * num_kv_heads
    want = round(4 * _num_sm(device) / programs)
    most = max(1, math.ceil(max_context / 64))
    return max(1, min(want, most, MAX_SPLITS))


def visible_context(max_context: int, max_query_len: int, window: int | None) -> int:
    """Week 19: the most keys a tile of queries can see: the whole context, or with a sliding
    window, the window of its first query and the keys of its later ones."""
    return max_context if window is None else min(max_context, window + max_query_len - 1)


@functools.lru_cache(maxsize=None)
def launch_shape(group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_PAD): tokens per program, and query heads per KV head padded. A decode step
    (one token per sequence) gets one program per sequence and KV head; longer queries take about
    64 rows (tokens x heads) per program, a good tile for tensor cores."""
    group_pad = triton.next_power_of_2(group)
    block_q = 1 if max_query_len == 1 else max(1, 64 // group_pad)
    return block_q, max(group_pad, triton.cdiv(16, block_q))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]: the new tokens of all sequences, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]: one layer's pool
    v_cache: torch.Tensor,  # the same shape and strides
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int: sequence i's tokens are rows [i] : [i + 1]
    context_lens: torch.Tensor,  # [num_seqs] int: tokens in the cache after this step, new ones included
    max_query_len: int, max_context: int,  # host-side bounds: they choose the launch shape, never read per sequence
    num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,  # tuning
    window: int | None = None,  # week 19: a sliding window of this many keys (itself included); None: all
    scale: float | None = None,  # week 19: the softmax scale; None: head_dim ** -0.5
    k_scale: torch.Tensor | None = None,  # issue 33: with e4m3 pools, [num_blocks, block_size, num_kv_heads]
    v_scale: torch.Tensor | None = None,  # float16 each (nanoserve/attention/fp8_cache.py)
    merge_in_kernel: bool = False,  # issue 39: a split decode step merges in its own launch (fusion.py's "merge")
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V -> [T, num_heads, head_dim]."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 key, got {window}")
    fp8 = k_scale is not None
    if fp8 and not (v_scale is not None and k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1):
        raise ValueError("an FP8 pool needs k_scale and v_scale, laid out alike with the heads contiguous")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    decode = max_query_len == 1
    block_q, group_pad = launch_shape(group, max_query_len)
    # Tiles: exactly one per sequence for decode; otherwise an upper bound (see the kernel).
    num_tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    out = torch.empty_like(q)
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles, num_kv_heads, visible_context(max_context, max_query_len, window),
                                       q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 1 and {MAX_SPLITS}, got {num_splits}")
    partial_acc = partial_m = partial_l = counters = out  # unused without splits
    merge_last = merge_in_kernel and decode and num_splits > 1 and fusion_on("merge")
    if merge_last:
        counters = persistent_buffer("split counters", q.device, num_seqs * num_kv_heads, torch.int32, 0)
    if num_splits > 1:
        partial_acc = torch.empty(num_tokens * num_heads * num_splits, head_dim, device=q.device, dtype=torch.float32)
        partial_m, partial_l = torch.empty(2, num_tokens * num_heads * num_splits, device=q.device, dtype=torch.float32)
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, partial_acc, partial_m, partial_l,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        block_tables.stride(0), out.stride(0), out.stride(1),
        (1.0 / math.sqrt(head_dim) if scale is None else scale) * 1.4426950408889634, num_seqs, num_splits,
        0 if window is None else window,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, DECODE=decode, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SLIDING=window is not None, FP8_KV=fp8,
        Counters=counters, MERGE_LAST=merge_last, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and not merge_last:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial_acc, partial_m, partial_l, out, out.stride(0), out.stride(1), num_splits,
            SPLITS_PAD=MAX_SPLITS, HEAD_DIM=head_dim)
    return out


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_context: int,
            windows: Sequence[int | None] = (None,), dtype: torch.dtype | None = None,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            merge_in_kernel: bool = False) -> None:
    """Compile the kernel's variants before the first request needs them: decode and new tokens
    over a past (a prompt, a chunk), each with and without context splits; for each of the model's
    layer `windows` (None: full attention; any int compiles the one sliding variant). `dtype`: the
    queries' (default: the pool's); issue 33: an FP8 pool's scales; issue 39: with `merge_in_kernel`,
    the split decode's one-launch variant too."""
    device, block_size = k_cache.device, k_cache.shape[1]
    sliding = sorted({w for w in windows if w is not None})
    variants = ([None] if None in windows else []) + sliding[:1]  # one sliding variant serves every window
    context = min(max_context, k_cache.shape[0] * block_size, 1024)
    blocks = torch.arange(triton.cdiv(context, block_size), dtype=torch.int32, device=device)[None]
    for new in (1, 16):
        q = torch.zeros(new, num_heads, k_cache.shape[-1], dtype=dtype or k_cache.dtype, device=device)
        starts = torch.tensor([0, new], dtype=torch.int32, device=device)
        lens = torch.tensor([context], dtype=torch.int32, device=device)
        for splits in (1, 2):
            for window in variants:
                paged_attention(q, k_cache, v_cache, blocks, starts, lens, new, context, num_splits=splits,
                                window=window, k_scale=k_scale, v_scale=v_scale)
                if merge_in_kernel and new == 1 and splits > 1:
                    paged_attention(q, k_cache, v_cache, blocks, starts, lens, new, context, num_splits=splits,
                                    window=window, k_scale=k_scale, v_scale=v_scale, merge_in_kernel=True)
