"""Week 5: the PyTorch paged-attention reference equals dense causal attention."""

import random

import pytest
import torch

from nanoserve.attention.base import causal_attention
from nanoserve.scheduler.blocks import blocks_needed, slot_of
from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext, PagedKVCache

pytestmark = pytest.mark.exercise("paged-attention-reference")


def run_paged(seqs, block_size, heads, kv_heads, head_dim=16, num_blocks=256, seed=0):
    """seqs: list of (cached_len, new_len). Fills the cache with the cached part through random
    block tables, then runs a PagedContext step for the new tokens. Returns (out, expected)."""
    rng = random.Random(seed)
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(blocks_needed(total, block_size))]
        tables.append(table)
        k, v = torch.randn(total, kv_heads, head_dim), torch.randn(total, kv_heads, head_dim)
        full_k.append(k)
        full_v.append(v)
        if cached:
            slots = torch.tensor([slot_of(table, p, block_size) for p in range(cached)])
            cache.write(0, slots, k[:cached], v[:cached])
    q = [torch.randn(new, heads, head_dim) for _, new in seqs]
    slots = [slot_of(t, p, block_size) for t, (c, n) in zip(tables, seqs) for p in range(c, c + n)]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    ctx = PagedContext(cache, PagedAttentionMetadata.build(slots, qsl, [c + n for c, n in seqs], tables))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    T = qsl[-1]
    no_rotation = torch.ones(T, head_dim), torch.zeros(T, head_dim)  # cos 1, sin 0: RoPE leaves q, k as they are
    out = ctx.attend(0, torch.cat(q), new_k, new_v, *no_rotation)
    expected = torch.cat([causal_attention(qi, k, v, q_start=c) for qi, k, v, (c, _) in zip(q, full_k, full_v, seqs)])
    return out, expected


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_prefill_batch(block_size, heads, kv_heads):
    out, expected = run_paged([(0, 1), (0, 16), (0, 17), (0, 40)], block_size, heads, kv_heads)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_batch(block_size):
    out, expected = run_paged([(1, 1), (15, 1), (16, 1), (100, 1), (31, 1)], block_size, 8, 2)
    torch.testing.assert_close(out, expected)


def test_mixed_prefill_and_decode_and_chunks():
    """A decode token, a fresh prompt and the second chunk of a long prompt, in one step."""
    out, expected = run_paged([(20, 1), (0, 13), (32, 9)], 8, 8, 2)
    torch.testing.assert_close(out, expected)


def test_writes_land_in_the_right_slots():
    out, _ = run_paged([(5, 3)], 4, 4, 2)
    assert out.shape == (3, 4, 16)
