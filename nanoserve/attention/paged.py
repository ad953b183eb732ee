"""The paged KV cache (weeks 4-5), and the attention context that reads and writes it.

Week 4, the paged cache: one shared pool of fixed-size blocks per layer. A sequence owns a list
of blocks (its *block table*) and grows one block at a time, so it wastes at most one partly
filled block (compare week 3's naive cache, `nanoserve/attention/naive.py`). Which sequence owns
which block is bookkeeping, kept apart from the tensors in `nanoserve/scheduler/blocks.py` (the
`BlockAllocator`, slot arithmetic); this file holds the pool itself.

Week 5, `PagedContext`: the attention context over that pool, for any mix of prompts and
decode tokens. Its PyTorch `read` is the ground truth for week 6's Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention.base import causal_attention
from nanoserve.model.layers import apply_rope
from nanoserve.scheduler.blocks import blocks_needed

# ------------------------------------------------------------------------ week 3: naive cache




# ------------------------------------------------------------------------ week 4: paged cache


class PagedKVCache:
    """The block pool: k, v [num_layers, num_blocks, block_size, num_kv_heads, head_dim].

    Layout: a block is `block_size` consecutive tokens, each holding all its KV heads, so one
    token's K (or V) for one layer is one contiguous row of `num_kv_heads * head_dim` values, and
    writing a new token is a single row store. Viewed flat, a layer's pool is [num_slots,
    num_kv_heads, head_dim] with slot = block * block_size + offset.

    `dtype` is the dtype K/V are written and read in (the model's); this pool also stores them in
    it. Issue 33's `Fp8PagedKVCache` (nanoserve/attention/fp8_cache.py) stores float8 codes with
    a scale per token and head instead, behind the same methods.
    """

    kv_cache_dtype = "auto"  # --kv-cache-dtype: "auto" stores K/V in the model's dtype
    k_scale = v_scale = None  # issue 33: an FP8 pool's scales, [num_layers, num_blocks, block_size, num_kv_heads]

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Device bytes the whole pool takes (scales included, for a pool that has them)."""
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block as `read_blocks` returns it: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]."""
        layers, _, block_size, heads, head_dim = self.k.shape
        return (layers, 2, block_size, heads, head_dim)

    @property
    def block_dtype(self) -> torch.dtype:
        """The dtype of what `read_blocks` returns (and `write_blocks` takes)."""
        return self.k.dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize  # 2: K and V

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slots [T] (int64); k, v [T, Hkv, D]."""
        # >>> week04: write-kv
        flat_k = self.k[layer_idx].view(-1, *self.k.shape[-2:])  # [num_slots, Hkv, D], no copy
        flat_v = self.v[layer_idx].view(-1, *self.v.shape[-2:])
        flat_k.index_copy_(0, slots, k)  # one scatter kernel each, and capturable in a CUDA graph
        flat_v.index_copy_(0, slots, v)
        # <<< week04: write-kv

    def gather(self, layer_idx: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` keys and values, in order: two [length, Hkv, D] tensors."""
        # >>> week04: gather-kv
        n_blocks = blocks_needed(length, self.block_size)
        blocks = block_table[:n_blocks]
        k = self.k[layer_idx, blocks].flatten(0, 1)[:length]  # [n_blocks * block_size, Hkv, D] -> [length, ...]
        v = self.v[layer_idx, blocks].flatten(0, 1)[:length]
        return k, v
        # <<< week04: gather-kv

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks, every layer's K and V, as one contiguous tensor [n, num_layers, 2, block_size,
        num_kv_heads, head_dim], block-major: what moves between pools (the CPU tier, the KV connector)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        # [layers, n, block_size, heads, head_dim] twice -> [n, layers, 2, block_size, heads, head_dim]
        return torch.stack((self.k[:, index], self.v[:, index]), dim=2).transpose(0, 1).contiguous()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_blocks`: `data` [n, num_layers, 2, ...] into the pool's `blocks`."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        data = data.to(self.k.device, non_blocking=True)
        self.k[:, index] = data[:, :, 0].transpose(0, 1)  # [layers, n, block_size, heads, head_dim]
        self.v[:, index] = data[:, :, 1].transpose(0, 1)


# --------------------------------------------------------------- week 5: the paged context


@dataclass
class PagedAttentionMetadata:
    """Where one step's tokens are, for N sequences and T new tokens in all, on the device. A
    sequence may bring any number of new tokens over its cached past: the same data says it."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the pool
    query_start_loc: torch.Tensor  # [N + 1] int32: sequence i's new tokens are rows [i] : [i + 1]
    context_lens: torch.Tensor  # [N] int32: tokens of sequence i in the cache after this step (past + new)
    block_tables: torch.Tensor  # [N, max_blocks] int32: each sequence's physical blocks, padded with 0s
    max_query_len: int  # host-side bounds on the two above: kernels choose their launch shape from them
    max_context_len: int

    @classmethod
    def build(cls, slot_mapping: list[int], query_start_loc: list[int], context_lens: list[int],
              block_tables: list[list[int]], device: str | torch.device = "cpu") -> "PagedAttentionMetadata":
        """From plain lists (a `StepInput`'s) to tensors on `device`."""
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]  # padded: one rectangular tensor
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_context_len=max(context_lens),
        )


class PagedContext:
    """Attention over the paged cache for one step of a packed batch: rotate q and k, write the
    new tokens' K/V into their slots (`write`), then attend over each sequence's cached K/V
    (`read`, here the PyTorch reference below; week 6's `TritonPagedContext` replaces only it).
    Prefill, decode and any mix are the same code. With `fused=True` (week 12) `write` is one kernel.
    """

    def __init__(self, cache: PagedKVCache, meta: PagedAttentionMetadata, fused: bool = False):
        self.cache, self.meta = cache, meta
        self.rope_write_kv = None
        if fused:
            from nanoserve.kernels.fused import rope_write_kv, rope_write_kv_fp8

            # issue 33: into an FP8 pool, the kernel that also quantizes and writes the scales
            self.rope_write_kv = rope_write_kv if cache.k_scale is None else rope_write_kv_fp8
        self._host_lists: tuple[list[int], list[int]] | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        q = self.write(layer_idx, q, k, v, cos, sin)
        return self.read(layer_idx, q, window=window, scale=scale)

    def write(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
        """Rotate q and k, store k and v at the step's slots; returns the rotated q."""
        if self.rope_write_kv is not None:
            c = self.cache
            scales = () if c.k_scale is None else (c.k_scale[layer_idx], c.v_scale[layer_idx])  # issue 33
            return self.rope_write_kv(q, k, v, cos, sin, c.k[layer_idx], c.v[layer_idx], self.meta.slot_mapping,
                                      *scales)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.cache.write(layer_idx, self.meta.slot_mapping, k, v)
        return q

    def read(self, layer_idx: int, q: torch.Tensor, window: int | None = None,
             scale: float | None = None) -> torch.Tensor:
        """Attention of the step's (rotated) queries over the cache; `window`, `scale` as in `causal_attention`."""
        if self._host_lists is None:  # once per step: the reference loops over sequences in Python
            self._host_lists = (self.meta.query_start_loc.tolist(), self.meta.context_lens.tolist())
        return paged_attention_reference(q, self.cache, layer_idx, *self._host_lists, self.meta.block_tables,
                                         window=window, scale=scale)


def paged_attention_reference(q: torch.Tensor, cache: PagedKVCache, layer_idx: int, query_start_loc: list[int],
                              context_lens: list[int], block_tables: torch.Tensor, window: int | None = None,
                              scale: float | None = None) -> torch.Tensor:
    """The PyTorch reference: gather each sequence's K/V through its block table, then attend.

    q [T, Hq, D] -> [T, Hq, D]. A sequence with `n` new tokens and `L` cached tokens in all has
    queries at positions L - n .. L - 1. `window` and `scale` as in `causal_attention`.
    """
    # >>> week05: paged-attention-reference
    outs = []
    for i, context_len in enumerate(context_lens):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        keys, values = cache.gather(layer_idx, block_tables[i], context_len)
        outs.append(causal_attention(q[a:b], keys, values, q_start=context_len - (b - a), window=window,
                                     scale=scale))
    return torch.cat(outs, dim=0)
    # <<< week05: paged-attention-reference
