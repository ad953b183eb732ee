"""Week 12: decode steps replayed from CUDA graphs.

At batch 1 an eager decode step of Llama-3.2-1B launches about 535 kernels, and the host takes
far longer to issue them than the GPU takes to run them. A CUDA graph records the whole forward
pass once and replays it with a single launch. The price: a graph replays *exactly* what it
recorded, so every tensor it touches must live at a fixed address with a fixed shape:

- the inputs (token ids, positions, slot mapping, block tables, context lengths) are copied into
  preallocated buffers before each replay;
- one graph per batch size in `CAPTURE_SIZES`; a batch is padded up to the next size, and the
  padding rows write their K/V into a scratch block that no sequence owns;
- the attention kernel's launch shape (its context splits) is fixed at capture time, sized for
  the longest context the engine allows.
Prefill steps, and batches larger than the largest size, run eagerly as before.
"""

from __future__ import annotations

import torch

from nanoserve.cache import PagedKVCache
from nanoserve.kernels.paged_attention import choose_num_splits, paged_decode_attention
from nanoserve.model import Llama

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class StaticDecodeContext:
    """Decode-only paged attention reading its metadata from fixed buffers."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, max_context: int):
        self.cache = cache
        self.slot_mapping, self.block_tables, self.context_lens = slot_mapping, block_tables, context_lens
        self.max_context = max_context
        self.num_splits = choose_num_splits(len(slot_mapping), cache.k.shape[-2], max_context, slot_mapping.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_pool.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k)
        v_pool.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v)
        return paged_decode_attention(q, k_pool, v_pool, self.block_tables, self.context_lens,
                                      self.max_context, num_splits=self.num_splits)


class CUDAGraphDecoder:
    """Captures one decode graph per batch size and replays it with fresh inputs."""

    def __init__(self, model: Llama, cache: PagedKVCache, scratch_block: int, max_model_len: int,
                 max_batch: int = 256):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch]
        device = model.embed_tokens.weight.device
        n, width = self.sizes[-1], -(-max_model_len // cache.block_size)
        self.scratch_slot = scratch_block * cache.block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _forward(self, bs: int) -> torch.Tensor:
        ctx = StaticDecodeContext(self.cache, self.slot_mapping[:bs], self.block_tables[:bs],
                                  self.context_lens[:bs], self.max_model_len)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # warm up: compiles kernels, moves lazily-placed tensors
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    @torch.no_grad()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """One decode step for n sequences -> logits [n, vocab]."""
        n = len(input_ids)
        bs = next(s for s in self.sizes if s >= n)
        pad = bs - n
        width = max(len(t) for t in tables)  # entries past a row's context are never read
        rows = [t + [self.scratch_block] * (width - len(t)) for t in tables] + [[self.scratch_block] * width] * pad
        # One host->device copy per buffer; padding rows point at the scratch block.
        self.input_ids[:bs].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:bs].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slot_mapping[:bs].copy_(torch.tensor(slots + [self.scratch_slot] * pad), non_blocking=True)
        self.context_lens[:bs].copy_(torch.tensor(context_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:bs, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
