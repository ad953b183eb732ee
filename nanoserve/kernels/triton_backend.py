"""Week 6: the paged attention context with Triton doing the reading.

Same interface and same cache as `nanoserve.cache.PagedContext`; only `attend` differs:
- writing the new tokens' K/V: one `index_copy_` per layer into the flattened pool. It is a
  single scatter kernel in PyTorch already, so a Triton version would buy nothing.
- decode steps (one new token per sequence): the Triton kernel in `paged_attention.py`.
- prefill (a fresh prompt, nothing cached yet): all of its keys are the new ones, so the paged
  pool need not be read at all; PyTorch's fused `scaled_dot_product_attention` does it, one
  sequence at a time. A sequence that brings several tokens on top of a cached past (a chunked
  prompt) falls back to the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention import causal_attention
from nanoserve.cache import PagedContext, PagedKVCache
from nanoserve.kernels.paged_attention import paged_decode_attention


class TritonPagedContext(PagedContext):
    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, query_start_loc: list[int],
                 context_lens: list[int], block_tables: torch.Tensor):
        super().__init__(cache, slot_mapping, query_start_loc, context_lens, block_tables)
        self.query_lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
        self.is_decode = all(n == 1 for n in self.query_lens)
        self.max_context = max(context_lens)
        self.context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=slot_mapping.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # >>> week06: triton-attend
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [blocks, block_size, Hkv, D]
        k_pool.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k)
        v_pool.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v)
        if self.is_decode:
            return paged_decode_attention(q, k_pool, v_pool, self.block_tables, self.context_lens_t,
                                          self.max_context)
        outs = []
        for i, n in enumerate(self.query_lens):
            a, b = self.query_start_loc[i], self.query_start_loc[i + 1]
            past = self.context_lens[i] - n
            if past == 0:  # a fresh prompt: attend over its own new keys, no pool read needed
                outs.append(_sdpa_causal(q[a:b], k[a:b], v[a:b]))
            else:
                keys, values = self.cache.gather(layer_idx, self.block_tables[i], self.context_lens[i])
                outs.append(causal_attention(q[a:b], keys, values, q_start=past))
        return torch.cat(outs, dim=0)
        # <<< week06: triton-attend


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, Hq, D], [T, Hkv, D] x2 -> [T, Hq, D] with PyTorch's fused attention (GQA-aware)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)
