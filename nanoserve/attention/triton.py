"""Week 6: the paged attention context with Triton doing the reading.

Same cache and same K/V write as `nanoserve.attention.paged.PagedContext`; only `read` differs: one launch
of the kernel in `paged_attention.py` attends for every sequence of the step, whatever number of
new tokens each brings. Its metadata is on the device already and its launch shape depends only
on host-side bounds, so the same context also runs inside a CUDA graph (week 12).
"""

from __future__ import annotations

import torch

from nanoserve.attention.paged import PagedContext
from nanoserve.kernels.paged_attention import paged_attention


class TritonPagedContext(PagedContext):
    def read(self, layer_idx: int, q: torch.Tensor, window: int | None = None,
             scale: float | None = None) -> torch.Tensor:
        # >>> week06: triton-read
        m = self.meta
        return paged_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx], m.block_tables,
                               m.query_start_loc, m.context_lens, m.max_query_len, m.max_context_len,
                               window=window, scale=scale)
        # <<< week06: triton-read
