"""Week 6: the paged attention context with Triton doing the reading.

Same cache and same K/V write as `nanoserve.attention.paged.PagedContext`; only `read` differs: one launch
of the kernel in `paged_attention.py` attends for every sequence of the step, whatever number of
new tokens each brings. Its metadata is on the device already and its launch shape depends only
on host-side bounds, so the same context also runs inside a CUDA graph (week 12). Over issue 33's
FP8 pool the same kernel reads the codes and their scales (`read_fp8`). With week 12's fused kernels
(`fused=True`) a decode step split over the context merges its splits inside that one launch (issue 39).
"""

from __future__ import annotations

import torch

from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext, PagedKVCache
from nanoserve.kernels.paged_attention import paged_attention


class TritonPagedContext(PagedContext):
    def __init__(self, cache: PagedKVCache, meta: PagedAttentionMetadata, fused: bool = False):
        super().__init__(cache, meta, fused)
        self.merge_in_kernel = fused  # week 12 (issue 39): a split decode step merges in the kernel's own launch

    def read(self, layer_idx: int, q: torch.Tensor, window: int | None = None,
             scale: float | None = None) -> torch.Tensor:
        if self.cache.k_scale is not None:  # issue 33: an FP8 pool; the kernel applies its scales
            return self.read_fp8(layer_idx, q, window, scale)
        # >>> week06: triton-read
        m = self.meta
        return paged_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx], m.block_tables,
                               m.query_start_loc, m.context_lens, m.max_query_len, m.max_context_len,
                               window=window, scale=scale, merge_in_kernel=self.merge_in_kernel)
        # <<< week06: triton-read

    def read_fp8(self, layer_idx: int, q: torch.Tensor, window: int | None, scale: float | None) -> torch.Tensor:
        m, c = self.meta, self.cache
        return paged_attention(q, c.k[layer_idx], c.v[layer_idx], m.block_tables, m.query_start_loc, m.context_lens,
                               m.max_query_len, m.max_context_len, window=window, scale=scale,
                               k_scale=c.k_scale[layer_idx], v_scale=c.v_scale[layer_idx],
                               merge_in_kernel=self.merge_in_kernel)
