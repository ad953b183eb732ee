"""Issue 33: an FP8 KV cache (`--kv-cache-dtype fp8`): K and V stored as float8 e4m3 codes, with a
scale per token and KV head.

At long contexts a decode step reads more K/V than weights (a 4k-token sequence of the 1B shape
holds 128 MiB of bf16 K/V; the weights are 2.5 GB for the whole batch), and the pool's size caps
how many sequences run at once. Storing K/V in one byte instead of two nearly halves both.

The format. Each new token's K (and V), for each KV head, is one row of `head_dim` values x. It
is stored as

    scale = max(amax(|x|) / 448, 2^-14), rounded to float16      (448: e4m3's largest number)
    codes = round_to_e4m3(x / scale)                               (chosen against the rounded scale)
    x     ≈ codes · scale

So the row's largest magnitude lands on 448, and every value keeps e4m3's 3 mantissa bits: within
1/16 of itself (values below 2^-6 · scale become subnormal codes, with a step of 2^-9 · scale).

Why one scale per token and head:
  - a token's row is written once, when the token runs, and never again: its scale can be chosen
    from the row alone, in the same kernel that writes it. A scale per block would change as the
    block fills, and the codes already written would have to be rounded again;
  - K rows differ a lot from token to token and head to head (outlier channels, large norms): a
    scale per layer would have to be set ahead of time, from calibration data, and be wrong for
    some rows;
  - in float16 a scale costs 2 bytes a row, so a token-head row of 64 values takes 66 bytes instead
    of bf16's 128 (1.94x the blocks; 130 against 256 with head_dim 128: 1.97x). A float32 scale would
    make it 68 (1.88x). A float16 scale is never smaller than 2^-14, its smallest normal number: a
    row whose largest value is below 2^-14 · 448 ≈ 0.027 uses codes under 448, still at full
    relative precision down to 2^-20.

Bytes per block (both K and V, every layer): 2 · layers · block_size · kv_heads · (head_dim + 2),
against 2 · layers · block_size · kv_heads · head_dim · 2 in bf16. The pool in `kv_pool_blocks`
(nanoserve/engine/device.py) divides the same memory by the smaller figure.

Where it is read: the Triton kernel (nanoserve/kernels/paged_attention.py) loads the codes, widens
them exactly to the queries' dtype, and applies the scales to the scores (K) and the probabilities
(V); `gather` (the PyTorch reference) widens codes · scale to float32, exactly, and attends. The
writes: `write` below (PyTorch), or week 12's fused kernel's FP8 twin (`rope_write_kv_fp8`),
which computes the same scale and codes in registers.

Blocks move between pools (the CPU tier, the KV connector) as bytes: for every token and head the
head_dim codes followed by the scale's two bytes (`read_blocks`).
"""

from __future__ import annotations

import torch

from nanoserve.attention.paged import PagedKVCache
from nanoserve.model.quantized import FP8_MAX, KV_SCALE_FLOOR
from nanoserve.scheduler.blocks import blocks_needed

KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: auto is the model's dtype
SCALE_BYTES = 2  # a float16 scale per token and KV head, for K and for V


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (K or V: [..., head_dim]) -> (codes in float8 e4m3 [..., head_dim], float16 scales
    [..., 1]) with x ≈ codes · scale, each row's largest magnitude mapped to `FP8_MAX`."""
    # >>> week22: fp8-kv
    # (times 1 / 448 rather than over 448: PyTorch may divide by a number that way, and the fused kernel
    # then finds the same scale, bit for bit)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() * (1 / FP8_MAX)).clamp(min=KV_SCALE_FLOOR).to(torch.float16)
    codes = (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale
    # <<< week22: fp8-kv


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., head_dim] (e4m3), scales [...] (float16) -> float32 [..., head_dim]. Exact: a
    code has 4 significant bits and a scale 11, so their product fits float32's 24."""
    return codes.float() * scales.float()[..., None]


class Fp8PagedKVCache(PagedKVCache):
    """The block pool in float8 e4m3 (`k`, `v`, shaped as `PagedKVCache`'s) with float16 scales
    `k_scale`, `v_scale` [num_layers, num_blocks, block_size, num_kv_heads]. Written in the model's
    `dtype`; `gather` returns float32 (exact codes · scale).

    Indexing is done on uint8 views of the codes (same bytes): copies, scatters and gathers of
    bytes work on every device, whatever PyTorch's float8 kernels cover."""

    kv_cache_dtype = "fp8"

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)  # all codes 0.0
        self.v = torch.zeros(shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        self.k_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)
        self.v_scale = torch.ones(shape[:-1], dtype=torch.float16, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype | None = None) -> int:
        """K and V of every layer: one byte a value plus a float16 scale per token and head
        (`dtype`, the model's, does not change it)."""
        return 2 * num_layers * block_size * num_kv_heads * (head_dim + SCALE_BYTES)

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store new tokens' K/V. slots [T] (int64); k, v [T, Hkv, D]."""
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            codes, scale = quantize_kv(x)
            heads, head_dim = pool.shape[-2:]
            pool[layer_idx].view(torch.uint8).view(-1, heads, head_dim).index_copy_(0, slots, codes.view(torch.uint8))
            scales[layer_idx].view(-1, heads).index_copy_(0, slots, scale[..., 0])

    def gather(self, layer_idx: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` keys and values, widened: two float32 [length, Hkv, D]."""
        blocks = block_table[: blocks_needed(length, self.block_size)].long()
        out = []
        for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = pool[layer_idx].view(torch.uint8)[blocks].view(torch.float8_e4m3fn).flatten(0, 1)[:length]
            out.append(dequantize_kv(codes, scales[layer_idx, blocks].flatten(0, 1)[:length]))
        return out[0], out[1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim + 2] bytes: each row's codes, then its scale."""
        layers, _, block_size, heads, head_dim = self.k.shape
        return (layers, 2, block_size, heads, head_dim + SCALE_BYTES)

    @property
    def block_dtype(self) -> torch.dtype:
        return torch.uint8

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks as bytes [n, *block_shape], block-major (see `PagedKVCache.read_blocks`)."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        parts = []
        for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = pool.view(torch.uint8)[:, index]  # [layers, n, block_size, heads, head_dim]
            scale_bytes = scales[:, index].unsqueeze(-1).view(torch.uint8)  # [layers, n, block_size, heads, 2]
            parts.append(torch.cat((codes, scale_bytes), dim=-1))
        return torch.stack(parts, dim=2).transpose(0, 1).contiguous()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_blocks`: bytes [n, *block_shape] into the pool's `blocks`."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
        data = data.to(self.k.device, non_blocking=True)
        head_dim = self.k.shape[-1]
        for i, (pool, scales) in enumerate(((self.k, self.k_scale), (self.v, self.v_scale))):
            part = data[:, :, i].transpose(0, 1)  # [layers, n, block_size, heads, head_dim + 2]
            pool.view(torch.uint8)[:, index] = part[..., :head_dim]
            scales[:, index] = part[..., head_dim:].contiguous().view(torch.float16)[..., 0]


KV_CACHE_CLASSES = {"auto": PagedKVCache, "fp8": Fp8PagedKVCache}


def kv_cache_class(kv_cache_dtype: str) -> type[PagedKVCache]:
    """The pool class of a `--kv-cache-dtype`."""
    if kv_cache_dtype not in KV_CACHE_CLASSES:
        raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_CLASSES[kv_cache_dtype]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Device bytes of one block of every layer's K and V, for a pool of `kv_cache_dtype`."""
    return kv_cache_class(kv_cache_dtype).bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
