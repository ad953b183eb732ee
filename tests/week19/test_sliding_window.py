"""Week 19: sliding-window attention and a per-layer softmax scale, in every attention context.

With a window W, the query at position p sees the keys p - W < j <= p (W keys, itself included:
HuggingFace's `sliding_window` for Mistral and Gemma 3). `causal_attention` is checked against a
loop over queries; every context (prefill, naive cache, paged, Triton, the compiled baseline's
static cache) against `causal_attention`, over steps that mix prompts, decodes and chunks; the
Triton kernel (through Triton's interpreter on a machine without a GPU) against the PyTorch
reference, and for not reading the K/V tiles that lie wholly before a window.
"""

import random
import warnings
from types import SimpleNamespace

import pytest
import torch

from nanoserve.attention.base import PrefillContext, causal_attention
from nanoserve.attention.naive import NaiveCacheContext, NaiveKVCache
from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext, PagedKVCache, paged_attention_reference
from nanoserve.bench.compiled_baseline import StaticKVContext
from nanoserve.scheduler.blocks import blocks_needed, slot_of
from nanoserve.testing import random_paged_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def brute_force(q, k, v, q_start, window, scale):
    """One query and one head at a time: softmax over exactly the keys it may see, in float64."""
    Tq, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty(Tq, Hq, D, dtype=torch.float64)
    for i in range(Tq):
        p = q_start + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(Hq):
            keys, values = k[lo : p + 1, h // group].double(), v[lo : p + 1, h // group].double()
            s = keys @ q[i, h].double() * (D**-0.5 if scale is None else scale)
            out[i, h] = torch.softmax(s, dim=0) @ values
    return out


def old_causal_attention(q, k, v, q_start=0):
    """Week 2's formula as it was before week 19, kept verbatim: the default path must not move a bit."""
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    group = Hq // Hkv
    qg = q.float().view(Tq, Hkv, group, D)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k.float()) / D**0.5
    q_pos = torch.arange(q_start, q_start + Tq, device=q.device)[:, None]
    k_pos = torch.arange(Tk, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(Tq, Hq, D).to(q.dtype)


# ----------------------------------------------------------------------- causal_attention


@pytest.mark.parametrize("window", [1, 3, 8, 30, 1000])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("q_start", [0, 11])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_causal_attention_with_a_window_equals_a_loop(window, heads, kv_heads, q_start, scale):
    Tq, D = 19, 16
    q = torch.randn(Tq, heads, D)
    k, v = torch.randn(q_start + Tq, kv_heads, D), torch.randn(q_start + Tq, kv_heads, D)
    out = causal_attention(q, k, v, q_start=q_start, window=window, scale=scale)
    torch.testing.assert_close(out.double(), brute_force(q, k, v, q_start, window, scale), atol=1e-5, rtol=1e-5)


def test_window_one_is_the_own_value():
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    torch.testing.assert_close(causal_attention(q, k, v, window=1), v.repeat_interleave(2, dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_start", [0, 5])
def test_defaults_are_bit_identical_to_before(dtype, q_start):
    q = torch.randn(9, 8, 32, dtype=dtype)
    k, v = torch.randn(q_start + 9, 2, 32, dtype=dtype), torch.randn(q_start + 9, 2, 32, dtype=dtype)
    old = old_causal_attention(q, k, v, q_start)
    assert torch.equal(causal_attention(q, k, v, q_start), old)
    assert torch.equal(causal_attention(q, k, v, q_start, window=None, scale=None), old)
    assert torch.equal(causal_attention(q, k, v, q_start, window=q_start + 9), old)  # a window hiding nothing


# -------------------------------------------------------- the contexts, over steps of a batch

LAYERS = [(5, None), (None, 0.25), (16, 0.2), (1, None)]  # (window, scale) of each layer


def steps_of_a_batch():
    """Per step, (sequence, new tokens): prompts, decodes, a chunk over a cached past, a 4-token guess."""
    return [
        [(0, 10), (1, 3)],  # a first chunk and a short prompt
        [(0, 13), (1, 1), (2, 7)],  # the chunk over a 10-token past, a decode, a prompt
        [(0, 1), (1, 1), (2, 4)],  # decodes, and 4 tokens over a past of 7
        [(0, 1), (2, 1), (3, 21)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ]


def run_steps(make_context, block_size=4, heads=8, kv_heads=2, head_dim=16, seed=0):
    """Runs `steps_of_a_batch` through contexts built by make_context(step, caches) and checks each
    layer's output against `causal_attention` over the whole sequence so far."""
    torch.manual_seed(seed)
    total = {}
    for step in steps_of_a_batch():
        for s, n in step:
            total[s] = total.get(s, 0) + n
    full = {s: (torch.randn(n, heads, head_dim), torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim))
            for s, n in total.items()}
    done = {s: 0 for s in total}
    state = {}
    for step in steps_of_a_batch():
        ctx = make_context(state, step, done, total, block_size, kv_heads, head_dim)
        rows = [(s, done[s], done[s] + n) for s, n in step]
        q = torch.cat([full[s][0][a:b] for s, a, b in rows])
        k = torch.cat([full[s][1][a:b] for s, a, b in rows])
        v = torch.cat([full[s][2][a:b] for s, a, b in rows])
        no_rotation = torch.ones(len(q), head_dim), torch.zeros(len(q), head_dim)
        for layer, (window, scale) in enumerate(LAYERS):
            out = ctx.attend(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), *(t.to(DEVICE) for t in no_rotation),
                             window=window, scale=scale).cpu()
            expected = torch.cat([causal_attention(full[s][0][a:b], full[s][1][:b], full[s][2][:b], q_start=a,
                                                   window=window, scale=scale) for s, a, b in rows])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for s, n in step:
            done[s] += n


def paged(context_class):
    def make(state, step, done, total, block_size, kv_heads, head_dim):
        if not state:
            num_blocks = sum(blocks_needed(n, block_size) for n in total.values()) + 3
            state["cache"] = PagedKVCache(len(LAYERS), num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
            free = list(range(num_blocks))
            random.Random(0).shuffle(free)  # blocks anywhere in the pool, in any order
            state["tables"] = {s: [free.pop() for _ in range(blocks_needed(n, block_size))] for s, n in total.items()}
        tables = state["tables"]
        slots = [slot_of(tables[s], p, block_size) for s, n in step for p in range(done[s], done[s] + n)]
        starts = [0]
        for _, n in step:
            starts.append(starts[-1] + n)
        meta = PagedAttentionMetadata.build(slots, starts, [done[s] + n for s, n in step],
                                            [tables[s] for s, _ in step], device=DEVICE)
        return context_class(state["cache"], meta)
    return make


def naive(state, step, done, total, block_size, kv_heads, head_dim):
    if not state:
        state["cache"] = NaiveKVCache(len(LAYERS), len(total), max(total.values()), kv_heads, head_dim, device=DEVICE)
    return NaiveCacheContext(state["cache"], [s for s, _ in step], [done[s] for s, _ in step], [n for _, n in step])


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_reference_context(block_size):
    run_steps(paged(PagedContext), block_size=block_size)


def test_naive_cache_context():
    run_steps(naive)


def test_triton_paged_context():
    pytest.importorskip("triton")
    from nanoserve.attention.triton import TritonPagedContext

    run_steps(paged(TritonPagedContext), block_size=4)


@pytest.mark.parametrize("window", [None, 1, 4, 100])
def test_prefill_context(window):
    lens, heads, kv_heads, D = [5, 1, 12], 4, 2, 16
    q, k, v = torch.randn(sum(lens), heads, D), torch.randn(sum(lens), kv_heads, D), torch.randn(sum(lens), kv_heads, D)
    ctx = PrefillContext(lens)
    out = ctx.attend(0, q, k, v, torch.ones(sum(lens), D), torch.zeros(sum(lens), D), window=window, scale=0.3)
    cu = ctx.cu_seqlens
    expected = torch.cat([causal_attention(q[a:b], k[a:b], v[a:b], window=window, scale=0.3)
                          for a, b in zip(cu, cu[1:])])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("window,scale", [(None, None), (3, None), (6, 0.2)])
def test_static_cache_context_of_the_compiled_baseline(window, scale):
    """The mask of `nanoserve bench latency`'s yardstick: a prompt, then decodes."""
    heads, kv_heads, D, max_len = 4, 2, 16, 24
    config = SimpleNamespace(num_layers=1, num_kv_heads=kv_heads, head_dim=D)
    ctx = StaticKVContext(SimpleNamespace(config=config, embed_tokens=SimpleNamespace(weight=torch.zeros(1))), max_len)
    n = 14
    q, k, v = torch.randn(n, heads, D), torch.randn(n, kv_heads, D), torch.randn(n, kv_heads, D)
    for a, b in [(0, 10), (10, 11), (11, 12), (12, 14)]:
        ctx.input_pos = torch.arange(a, b)
        out = ctx.attend(0, q[a:b], k[a:b], v[a:b], torch.ones(b - a, D), torch.zeros(b - a, D),
                         window=window, scale=scale)
        expected = causal_attention(q[a:b], k[:b], v[:b], q_start=a, window=window, scale=scale)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ the Triton kernel

BLOCK_N = 16  # the kernel's keys per loop iteration in these tests: small, so that windows skip tiles


def check_kernel(seqs, window, block_size=4, heads=4, kv_heads=2, head_dim=16, scale=None, num_splits=1, seed=0):
    """seqs: (past, new) per sequence. K/V in shuffled blocks of a pool. The kernel must equal the
    reference; and with a window, the K/V of every tile that lies wholly before the window of a
    sequence's first new token is poisoned with NaN after the reference ran: if the kernel read
    one (even masked: 0 * NaN is NaN in p @ V), its output would hold a NaN. Through the interpreter,
    a 0 / 0 anywhere in the kernel (a padding row that sees no key) is an error too."""
    pytest.importorskip("triton")
    from nanoserve.kernels.paged_attention import paged_attention

    cache, tables, block_tables, starts, lens, q = random_paged_step(seqs, block_size, heads, kv_heads, head_dim,
                                                                    device=DEVICE, seed=seed)
    expected = paged_attention_reference(q, cache, 0, starts, lens, block_tables, window=window, scale=scale)

    poisoned = 0
    if window is not None:  # positions no program may load: before the first new token's window, whole tiles
        for table, (past, _) in zip(tables, seqs):
            skipped = max(0, past - window + 1) // BLOCK_N * BLOCK_N
            slots = torch.tensor([slot_of(table, p, block_size) for p in range(skipped)], dtype=torch.long)
            cache.k[0].view(-1, kv_heads, head_dim)[slots.to(DEVICE)] = float("nan")
            cache.v[0].view(-1, kv_heads, head_dim)[slots.to(DEVICE)] = float("nan")
            poisoned += skipped
        if poisoned:  # the poison shows: the reference, which reads every key, now gives NaNs
            assert paged_attention_reference(q, cache, 0, starts, lens, block_tables, window=window,
                                             scale=scale).isnan().any()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # NumPy's "invalid value encountered in divide"
        out = paged_attention(q, cache.k[0], cache.v[0], block_tables,
                              torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                              torch.tensor(lens, dtype=torch.int32, device=DEVICE), max(n for _, n in seqs), max(lens),
                              num_splits=num_splits, block_n=BLOCK_N, window=window, scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    return poisoned


def decode(*lens):
    return [(n - 1, 1) for n in lens]


@pytest.mark.parametrize("window", [1, 3, 16, 23, 200])
def test_kernel_decode(window):
    """Windows of one key, smaller than a block, one tile, not a multiple of a tile, longer than every context."""
    poisoned = check_kernel(decode(1, 3, 17, 40, 75), window)
    assert poisoned > 0 or window == 200


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("window", [5, 37])
def test_kernel_decode_with_context_splits(num_splits, window):
    """Flash-decoding splits the visible keys, not the whole context: no split reads a poisoned tile."""
    assert check_kernel(decode(2, 30, 97, 130), window, num_splits=num_splits) > 0


@pytest.mark.parametrize("window", [1, 5, 16, 23, 100])
def test_kernel_fresh_prompts(window):
    check_kernel([(0, 1), (0, 7), (0, 17), (0, 40)], window, block_size=16)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [4, 21])
def test_kernel_new_tokens_over_a_cached_past(num_splits, window):
    """A decode, a prompt, a chunk over a long past, a guess over a short one, in one launch."""
    assert check_kernel([(60, 1), (0, 20), (70, 24), (7, 5)], window, num_splits=num_splits) > 0


@pytest.mark.parametrize("window", [None, 9])
def test_kernel_scale(window):
    check_kernel([(30, 1), (10, 6)], window, scale=0.07)


def test_kernel_window_of_a_padded_row_gives_no_nan():
    """Rows past a sequence's tokens (tiles of 16 tokens, 3 used) and heads padded to a power of
    two (3 query heads per KV head) must not spoil the real rows, with a window of one key."""
    check_kernel([(5, 3), (0, 1), (40, 2)], 1, heads=3, kv_heads=1)


def test_kernel_rejects_an_empty_window():
    pytest.importorskip("triton")
    from nanoserve.kernels.paged_attention import paged_attention

    with pytest.raises(ValueError, match="window"):
        paged_attention(torch.zeros(1, 2, 16), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16),
                        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), 1, 1, window=0)


def test_splits_are_chosen_for_the_visible_keys():
    pytest.importorskip("triton")
    from nanoserve.kernels.paged_attention import visible_context

    assert visible_context(8192, 1, None) == 8192
    assert visible_context(8192, 1, 512) == 512  # a decode sees its window
    assert visible_context(8192, 64, 512) == 575  # a tile of 64 queries: the first's window, and 63 more
    assert visible_context(100, 64, 512) == 100
