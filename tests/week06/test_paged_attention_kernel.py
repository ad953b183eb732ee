"""Week 6: the Triton decode kernel equals the PyTorch reference.

On a machine without a GPU these run through Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py), so CI checks the kernel's logic; on a CUDA machine the same tests run the
compiled kernel, and the bf16/fp16 cases run too.
"""

import random

import pytest
import torch

pytest.importorskip("triton", reason="week 6 needs the triton package: pip install triton (Linux)")

from nanoserve.blocks import blocks_needed  # noqa: E402
from nanoserve.cache import PagedKVCache, paged_attention_reference  # noqa: E402
from nanoserve.kernels.paged_attention import choose_num_splits, paged_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lens, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(blocks_needed(n, block_size) for n in lens) + 5
    cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cache.k.normal_()
    cache.v.normal_()
    free = list(range(num_blocks))
    rng.shuffle(free)  # sequences own scattered, unordered blocks
    tables = [[free.pop() for _ in range(blocks_needed(n, block_size))] for n in lens]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    q = torch.randn(len(lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    return q, cache, block_tables


def check(lens, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, num_splits=None, atol=2e-5):
    q, cache, tables = make_case(lens, block_size, num_heads, num_kv_heads, head_dim, dtype)
    expected = paged_attention_reference(q.float(), _as_float(cache), 0, list(range(len(lens) + 1)), lens, tables)
    out = paged_decode_attention(q, cache.k[0], cache.v[0], tables,
                                 torch.tensor(lens, dtype=torch.int32, device=DEVICE), max(lens),
                                 num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


def _as_float(cache):
    if cache.k.dtype == torch.float32:
        return cache
    copy = PagedKVCache(1, cache.num_blocks, cache.block_size, cache.k.shape[-2], cache.k.shape[-1], device=DEVICE)
    copy.k.copy_(cache.k)
    copy.v.copy_(cache.v)
    return copy


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_grid_of_shapes(block_size, head_dim, group):
    """Contexts of 1 token, around block boundaries, and a few blocks long, in one ragged batch."""
    b = block_size
    lens = [1, b - 1, b, b + 1, 2 * b + 3, 97]
    check(lens, block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_long_and_short_mixed_with_context_splits(num_splits):
    """Flash-decoding: splitting a 2k context across programs changes nothing but speed."""
    check([2048, 5, 1500, 16], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, num_splits=num_splits)


def test_llama_3_2_1b_heads_long_context():
    check([2000, 777], block_size=16, num_heads=32, num_kv_heads=8, head_dim=64)


def test_split_heuristic():
    assert choose_num_splits(256, 8, 2048, torch.device("cpu")) == 1
    assert choose_num_splits(1, 8, 100, torch.device("cpu")) == 1
    if DEVICE == "cuda":  # few sequences, long context: split to fill the GPU
        assert choose_num_splits(1, 8, 8192, torch.device("cuda")) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_half_precision_on_gpu(dtype, atol, num_splits):
    check([1, 16, 17, 300, 2048, 4097], block_size=16, num_heads=32, num_kv_heads=8, head_dim=64,
          dtype=dtype, num_splits=num_splits, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_many_sequences_on_gpu(block_size):
    lens = [random.Random(i).randint(1, 3000) for i in range(64)]
    check(lens, block_size, num_heads=32, num_kv_heads=8, head_dim=64)
