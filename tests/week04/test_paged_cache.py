"""Week 4: the block allocator, slot arithmetic, and the paged pool."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.scheduler.blocks import BlockAllocator, OutOfBlocks, blocks_needed, paged_cache_waste, slot_of
from nanoserve.attention.paged import PagedKVCache
from nanoserve.attention.naive import naive_cache_waste


@pytest.mark.exercise("allocate", "free")
@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=300))
def test_allocator_invariants(num_blocks, ops):
    """Random allocs and frees: no block handed out twice, none lost, free + used = total."""
    alloc = BlockAllocator(num_blocks)
    held: list[int] = []
    for is_alloc, pick in ops:
        if is_alloc:
            if alloc.num_free == 0:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate()
            else:
                block = alloc.allocate()
                assert block not in held and 0 <= block < num_blocks
                held.append(block)
        elif held:
            alloc.free(held.pop(pick % len(held)))
        assert alloc.num_free + alloc.num_used == num_blocks
        assert sorted(held) == sorted(alloc.used)
        assert set(alloc.free_blocks).isdisjoint(held)
        assert len(set(alloc.free_blocks)) == alloc.num_free
    for b in held:
        alloc.free(b)
    assert alloc.num_free == num_blocks


@pytest.mark.exercise("allocate", "free")
def test_double_free_and_bad_pool():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(0)


@pytest.mark.exercise("allocate")
def test_out_of_blocks_is_clear():
    alloc = BlockAllocator(1)
    alloc.allocate()
    with pytest.raises(OutOfBlocks, match="all 1 KV blocks"):
        alloc.allocate()


@pytest.mark.exercise("slot-of")
def test_slot_arithmetic():
    table = [7, 2, 9]
    assert [slot_of(table, p, 4) for p in range(10)] == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.exercise("write-kv", "gather-kv")
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 50])
def test_write_and_gather_through_a_shuffled_block_table(block_size, length):
    rng = random.Random(length * 100 + block_size)
    num_blocks = 64
    cache = PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_dim=8)
    table = rng.sample(range(num_blocks), blocks_needed(length, block_size))  # any blocks, any order
    k, v = torch.randn(length, 2, 8), torch.randn(length, 2, 8)
    slots = torch.tensor([slot_of(table, p, block_size) for p in range(length)])
    cache.write(1, slots, k, v)
    got_k, got_v = cache.gather(1, torch.tensor(table), length)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert cache.k[0].abs().sum() == 0  # the other layer is untouched
    used = torch.zeros(num_blocks, dtype=torch.bool)
    used[table] = True
    assert cache.k[1][~used].abs().sum() == 0  # nothing written outside the sequence's blocks


@pytest.mark.exercise("write-kv", "gather-kv")
def test_two_sequences_share_the_pool_without_clobbering():
    cache = PagedKVCache(1, 8, 4, 1, 2)
    tables = {"a": [5, 0], "b": [3, 6, 1]}
    data = {"a": torch.randn(7, 1, 2), "b": torch.randn(11, 1, 2)}
    for name, table in tables.items():
        slots = torch.tensor([slot_of(table, p, 4) for p in range(len(data[name]))])
        cache.write(0, slots, data[name], data[name] * 2)
    for name, table in tables.items():
        k, v = cache.gather(0, torch.tensor(table), len(data[name]))
        assert torch.equal(k, data[name]) and torch.equal(v, data[name] * 2)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=64), block_size=st.sampled_from([8, 16, 32]))
def test_memory_accounting(lengths, block_size):
    max_len = 2048
    paged = paged_cache_waste(lengths, block_size)
    assert paged <= len(lengths) * (block_size - 1)  # at most one partial block per sequence
    assert naive_cache_waste(lengths, max_len) == sum(max_len - n for n in lengths)
    assert paged <= naive_cache_waste(lengths, max_len) + len(lengths) * block_size


def test_bytes_per_block_llama_3_2_1b():
    # 16 layers x 2 (K, V) x 16 tokens x 8 heads x 64 dims x 2 bytes
    assert PagedKVCache.bytes_per_block(16, 16, 8, 64, torch.bfloat16) == 16 * 2 * 16 * 8 * 64 * 2
