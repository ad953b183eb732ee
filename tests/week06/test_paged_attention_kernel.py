"""Week 6: the Triton paged-attention kernel equals the PyTorch reference.

Every case is a batch of sequences, each with `past` tokens already cached and `new` tokens
this step: decode (new = 1), fresh prompts (past = 0), and new tokens over a cached past (a chunk
of a prompt, a speculative guess). On a machine without a GPU these run through Triton's
interpreter (TRITON_INTERPRET=1, set in tests/conftest.py), so CI checks the kernel's logic; on
a CUDA machine the same tests run the compiled kernel, and the bf16/fp16 cases run too.
"""

import random

import pytest
import torch

pytest.importorskip("triton", reason="week 6 needs the triton package: pip install triton (Linux)")

from nanoserve.attention.paged import PagedKVCache, paged_attention_reference  # noqa: E402
from nanoserve.kernels import fusion  # noqa: E402
from nanoserve.kernels.paged_attention import choose_num_splits, launch_shape, paged_attention  # noqa: E402
from nanoserve.testing import random_paged_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def every_fusion_on():
    """Every fusion on for the tests here (the merge in the attention's launch is off by default: nanoserve/kernels/fusion.py says why)."""
    fusion.switch_fusions("")
    yield
    fusion.switch_fusions(None)


def check(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, num_splits=None, atol=2e-5,
          seed=0, merge_in_kernel=False):
    """seqs: (past, new) per sequence. The pool holds random K/V in shuffled, unordered blocks."""
    cache, _, block_tables, starts, lens, q = random_paged_step(seqs, block_size, num_heads, num_kv_heads, head_dim,
                                                               dtype, DEVICE, seed, spare_blocks=5)
    expected = paged_attention_reference(q.float(), _as_float(cache), 0, starts, lens, block_tables)
    out = paged_attention(q, cache.k[0], cache.v[0], block_tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                          torch.tensor(lens, dtype=torch.int32, device=DEVICE), max(n for _, n in seqs), max(lens),
                          num_splits=num_splits, merge_in_kernel=merge_in_kernel)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


def _as_float(cache):
    if cache.k.dtype == torch.float32:
        return cache
    copy = PagedKVCache(1, cache.num_blocks, cache.block_size, cache.k.shape[-2], cache.k.shape[-1], device=DEVICE)
    copy.k.copy_(cache.k)
    copy.v.copy_(cache.v)
    return copy


def decode(*lens):
    return [(n - 1, 1) for n in lens]


@pytest.mark.exercise("paged-attention-kernel")
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_grid_of_shapes(block_size, head_dim, group):
    """One new token each; contexts of 1 token, around block boundaries, and a few blocks long."""
    b = block_size
    check(decode(1, b - 1, b, b + 1, 2 * b + 3, 97), block_size, num_heads=2 * group, num_kv_heads=2,
          head_dim=head_dim)


@pytest.mark.exercise("merge-splits")
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_long_and_short_mixed_with_context_splits(num_splits):
    """Flash-decoding: splitting a 2k context across programs changes nothing but speed."""
    check(decode(2048, 5, 1500, 16), block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_splits=num_splits)


@pytest.mark.exercise("paged-attention-kernel")
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fresh_prompts(group):
    """Prefill: nothing cached before, causal attention among the prompt's own tokens; lengths
    below, at and above one tile of queries."""
    check([(0, 1), (0, 15), (0, 16), (0, 17), (0, 70)], block_size=16, num_heads=2 * group, num_kv_heads=2,
          head_dim=64)


@pytest.mark.exercise("paged-attention-kernel", "merge-splits")
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5])
def test_new_tokens_over_a_cached_past(num_splits):
    """Decode, a fresh prompt, a chunk over a long past, a 5-token guess over a short one, in one
    launch: each new token sees the whole past and the new tokens up to itself."""
    check([(40, 1), (0, 33), (300, 64), (7, 5), (15, 17)], block_size=16, num_heads=8, num_kv_heads=2,
          head_dim=64, num_splits=num_splits)


def split_counters():
    return fusion.persistent_buffer("split counters", torch.device(DEVICE), 1, torch.int32, 0)


@pytest.mark.exercise("merge-splits")
@pytest.mark.parametrize("num_splits", [2, 3, 8, 64])
def test_merge_in_the_attention_launch(num_splits):
    """Issue 39: a split decode step merges in its own launch (the last split of each sequence and
    KV head to finish), with the same result; the counters it uses are all back to 0 after, so
    the next call (another layer, step or graph replay) finds them ready. 64 splits over short
    contexts, as the batch-1 CUDA graph has them: most splits are empty."""
    batches = [(2048, 5, 1500, 16), (1, 300, 64), (97,)]
    for seed, lens in enumerate(batches[1:] if num_splits == 64 else batches):  # (the interpreter: keep 64 short)
        check(decode(*lens), block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_splits=num_splits,
              merge_in_kernel=True, seed=seed)
        assert not split_counters().any()


@pytest.mark.exercise("merge-splits")
def test_merge_in_the_launch_for_a_sliding_window_and_its_switch(monkeypatch):
    """Issue 39: with a sliding window (week 19) the one-launch merge gives the merge kernel's
    result; prompts keep the merge kernel; NANOSERVE_FUSE_OFF=merge takes the merge kernel again."""
    seqs = decode(700, 33, 150)
    cache, _, tables, starts, lens, q = random_paged_step(seqs, 16, 8, 2, 64, device=DEVICE, seed=3)
    args = (q, cache.k[0], cache.v[0], tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE), 1, max(lens))
    plain = paged_attention(*args, num_splits=5, window=100)
    torch.testing.assert_close(paged_attention(*args, num_splits=5, window=100, merge_in_kernel=True), plain,
                               atol=1e-6, rtol=1e-6)
    check([(40, 1), (0, 33), (300, 64)], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_splits=3,
          merge_in_kernel=True)  # not a decode step: the merge kernel runs
    monkeypatch.setenv("NANOSERVE_FUSE_OFF", "merge")
    fusion.switch_fusions(None)
    try:
        counters = split_counters()
        counters[:8] = 5  # the one-launch merge would count on from here, and never merge
        torch.testing.assert_close(paged_attention(*args, num_splits=5, merge_in_kernel=True),
                                   paged_attention(*args, num_splits=5), atol=1e-6, rtol=1e-6)
        assert counters[:8].tolist() == [5] * 8
        counters[:8] = 0
    finally:
        monkeypatch.delenv("NANOSERVE_FUSE_OFF")
        fusion.switch_fusions(None)


def test_llama_3_2_1b_heads_long_context():
    check(decode(2000, 777) + [(500, 20)], block_size=16, num_heads=32, num_kv_heads=8, head_dim=64)


def test_launch_shape_and_split_heuristic():
    assert launch_shape(4, 1) == (1, 16)  # decode: one token per program, heads padded to 16 rows
    block_q, group_pad = launch_shape(4, 300)
    assert block_q * group_pad == 64 and group_pad == 4
    assert choose_num_splits(256, 8, 2048, torch.device("cpu")) == 1
    assert choose_num_splits(1, 8, 100, torch.device("cpu")) == 1
    if DEVICE == "cuda":  # few sequences, long context: split to fill the GPU
        assert choose_num_splits(1, 8, 8192, torch.device("cuda")) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_half_precision_on_gpu(dtype, atol, num_splits):
    check(decode(1, 16, 17, 300, 2048, 4097), block_size=16, num_heads=32, num_kv_heads=8, head_dim=64,
          dtype=dtype, num_splits=num_splits, atol=atol)
    check([(0, 1000), (0, 17), (2000, 300), (50, 4)], block_size=16, num_heads=32, num_kv_heads=8, head_dim=64,
          dtype=dtype, num_splits=num_splits, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_many_sequences_on_gpu(block_size):
    rng = random.Random(block_size)
    check(decode(*[rng.randint(1, 3000) for _ in range(64)]), block_size, num_heads=32, num_kv_heads=8, head_dim=64)
    check([(rng.randint(0, 2000), rng.randint(1, 300)) for _ in range(32)], block_size, num_heads=32, num_kv_heads=8,
          head_dim=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_in_the_launch_inside_a_cuda_graph(dtype):
    """Issue 39 on the GPU: the batch-1 decode of the Llama-3.2-1B heads, captured with 64 splits and
    the merge in the launch, replayed as its context grows and jumps; every replay equals the
    reference (the counters reset inside the kernel, replay after replay)."""
    seqs = decode(4000)
    cache, _, tables, starts, _, q = random_paged_step(seqs, 16, 32, 8, 64, dtype, DEVICE, seed=5)
    starts_t = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    run = lambda: paged_attention(q, cache.k[0], cache.v[0], tables, starts_t, lens_t, 1, 4000,  # noqa: E731
                                  num_splits=64, merge_in_kernel=True)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for n in (1, 17, 130, 131, 1000, 64, 4000, 3999):
        lens_t.fill_(n)
        graph.replay()
        expected = paged_attention_reference(q.float(), _as_float(cache), 0, starts, [n], tables)
        atol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
    assert not split_counters().any()
