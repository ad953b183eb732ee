"""Week 3: greedy generation with the naive KV cache equals recomputation and HF generate."""

import pytest
import torch

from nanoserve.attention.naive import NaiveCacheContext, NaiveKVCache, naive_cache_waste
from nanoserve.runner.generate import greedy_generate_naive_cache, greedy_generate_no_cache
from nanoserve.model.loader import load_model
from nanoserve.testing import make_checkpoint, tiny_config


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path, hf = make_checkpoint(tmp_path_factory.mktemp("naive") / "ckpt", tiny_config(num_hidden_layers=3))
    return hf, load_model(path)


@pytest.mark.exercise("naive-cache-attend", "naive-cache-generate")
def test_cache_equals_recompute_and_hf(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (1, 6, 13, 40)]
    cached = greedy_generate_naive_cache(ours, prompts, max_new_tokens=24)
    for prompt, got in zip(prompts, cached):
        assert got == greedy_generate_no_cache(ours, prompt, 24)
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False)[0, len(prompt):].tolist()
        assert got == expected
        assert len(set(got)) >= 6


@pytest.mark.exercise("naive-cache-attend")
@torch.no_grad()
def test_decode_step_reads_the_past_from_the_cache(pair):
    """Feeding the prompt, then one token, gives the logits of running the whole sequence."""
    _, ours = pair
    cfg = ours.config
    ids = torch.randint(0, 4096, (10,))
    cache = NaiveKVCache(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim)
    ours(ids[:9], torch.arange(9), NaiveCacheContext(cache, [0], [0], [9]))
    step = ours(ids[9:], torch.tensor([9]), NaiveCacheContext(cache, [0], [9], [1]))
    from nanoserve.attention.base import PrefillContext

    full = ours(ids, torch.arange(10), PrefillContext([10]))
    torch.testing.assert_close(step[-1], full[-1], atol=1e-5, rtol=1e-5)


def test_overflowing_the_slab_is_an_error():
    cache = NaiveKVCache(1, 1, 8, 1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        NaiveCacheContext(cache, [0], [6], [3])


def test_naive_waste():
    assert naive_cache_waste([10, 100, 1], max_len=128) == 118 + 28 + 127
