"""Week 3: the naive KV cache and its attention context.

One contiguous slab per sequence, sized for the longest sequence it might ever hold. Simple, and
wasteful: a 20-token answer reserves as much memory as a 2000-token one (`naive_cache_waste`
counts it). Week 4's paged cache, `nanoserve/attention/paged.py`, is the answer.
"""

from __future__ import annotations

import torch

from nanoserve.attention.base import PrefillContext, causal_attention
from nanoserve.model.layers import apply_rope


class NaiveKVCache:
    """k, v: [num_layers, max_seqs, max_len, num_kv_heads, head_dim], one slab per sequence slot."""

    def __init__(self, num_layers: int, max_seqs: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, max_seqs, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len


class NaiveCacheContext(PrefillContext):
    """One forward pass over a batch of sequences, each in its own cache slot.

    Sequence i owns slot `slots[i]`, already holds `cached_lens[i]` tokens, and brings
    `new_lens[i]` new tokens this step (the whole prompt at prefill, then 1 per decode step).
    The packing of the new tokens (`cu_seqlens`, `last_token_indices`) is week 2's.
    """

    def __init__(self, cache: NaiveKVCache, slots: list[int], cached_lens: list[int], new_lens: list[int]):
        super().__init__(new_lens)
        self.cache = cache
        self.slots, self.cached_lens, self.new_lens = slots, cached_lens, new_lens
        for start, n in zip(cached_lens, new_lens):
            if start + n > cache.max_len:
                raise ValueError(f"sequence of {start + n} tokens does not fit the cache's {cache.max_len}")

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # >>> week03: naive-cache-attend
        outs = []
        for i, slot in enumerate(self.slots):
            a, b = self.cu_seqlens[i], self.cu_seqlens[i + 1]
            start, end = self.cached_lens[i], self.cached_lens[i] + self.new_lens[i]
            self.cache.k[layer_idx, slot, start:end] = k[a:b]
            self.cache.v[layer_idx, slot, start:end] = v[a:b]
            keys = self.cache.k[layer_idx, slot, :end]  # [end, Hkv, D]: the past and the new
            values = self.cache.v[layer_idx, slot, :end]
            outs.append(causal_attention(q[a:b], keys, values, q_start=start, window=window, scale=scale))
        return torch.cat(outs, dim=0)
        # <<< week03: naive-cache-attend


def naive_cache_waste(lengths: list[int], max_len: int) -> int:
    """Token slots reserved but unused by a naive cache holding sequences of these lengths."""
    return sum(max_len - n for n in lengths)

