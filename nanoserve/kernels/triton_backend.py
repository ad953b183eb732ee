"""Week 6: the paged attention context with Triton doing the reading.

Same interface and same cache as `nanoserve.cache.PagedContext`; only `attend` differs:
- writing the new tokens' K/V: the cache's own `write` (week 4), one scatter kernel per tensor
  already, so a Triton version would buy nothing.
- decode steps (one new token per sequence): the Triton kernel in `paged_attention.py`.
- prefill (a fresh prompt, nothing cached yet): all of its keys are the new ones, so the paged
  pool need not be read at all; PyTorch's fused `scaled_dot_product_attention` does it, one
  sequence at a time. A sequence that brings several tokens on top of a cached past (a chunked
  prompt) falls back to the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanoserve.attention import causal_attention
from nanoserve.cache import PagedContext, PagedKVCache
from nanoserve.kernels.paged_attention import paged_decode_attention


class TritonPagedContext(PagedContext):
    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, query_start_loc: list[int],
                 context_lens: list[int], block_tables: torch.Tensor):
        super().__init__(cache, slot_mapping, query_start_loc, context_lens, block_tables)
        device = slot_mapping.device
        self.query_lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
        # Sequences with one new token go to the kernel; the others (prompts) take the torch path.
        self.decode_seqs = [i for i, n in enumerate(self.query_lens) if n == 1]
        self.prefill_seqs = [i for i, n in enumerate(self.query_lens) if n > 1]
        self.all_decode = not self.prefill_seqs
        if self.decode_seqs:
            idx = torch.tensor(self.decode_seqs, device=device)
            self.decode_rows = torch.tensor([query_start_loc[i] for i in self.decode_seqs], device=device)
            self.decode_tables = block_tables if self.all_decode else block_tables[idx]
            self.decode_lens = torch.tensor([context_lens[i] for i in self.decode_seqs], dtype=torch.int32,
                                            device=device)
            self.max_decode_context = max(context_lens[i] for i in self.decode_seqs)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # >>> week06: triton-attend
        self.cache.write(layer_idx, self.slot_mapping, k, v)
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [blocks, block_size, Hkv, D]
        if self.all_decode:  # the common case: one kernel launch for the whole batch
            return paged_decode_attention(q, k_pool, v_pool, self.decode_tables, self.decode_lens,
                                          self.max_decode_context)
        out = torch.empty_like(q)
        if self.decode_seqs:
            out[self.decode_rows] = paged_decode_attention(q[self.decode_rows], k_pool, v_pool, self.decode_tables,
                                                           self.decode_lens, self.max_decode_context)
        for i in self.prefill_seqs:
            a, b = self.query_start_loc[i], self.query_start_loc[i + 1]
            past = self.context_lens[i] - (b - a)
            if past == 0:  # a fresh prompt: attend over its own new keys, no pool read needed
                out[a:b] = _sdpa_causal(q[a:b], k[a:b], v[a:b])
            else:  # new tokens on top of a cached past (a chunked prompt): the reference path
                keys, values = self.cache.gather(layer_idx, self.block_tables[i], self.context_lens[i])
                out[a:b] = causal_attention(q[a:b], keys, values, q_start=past)
        return out
        # <<< week06: triton-attend


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, Hq, D], [T, Hkv, D] x2 -> [T, Hq, D] with PyTorch's fused attention.

    Two details decide whether PyTorch picks a fused flash-attention kernel or its slow
    reference ("math") path, which computes in float32 with the whole [T, T] score matrix: the
    inputs must be 4-D ([batch, heads, T, D]), and the KV heads are repeated to match the query
    heads rather than passed with `enable_gqa`. Week 12 found the math path in a profile: it
    took most of the GPU time of a prefill step. The backend is pinned to the memory-efficient
    kernel: cuDNN's, PyTorch's first choice on an H100, builds a plan for every new prompt
    length, which tripled the median time to first token in serving (docs/benchmarks.md).
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)


_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # math: the CPU
