"""The building blocks of a Llama decoder.

Week 1: RMSNorm and rotary position embeddings (with Llama 3's frequency scaling).
Week 2: grouped-query attention, the SwiGLU MLP, and the decoder block that joins them.

Every tensor here is *packed*: a batch of sequences is one flat token dimension `T`, with each
token's position given separately. Attention is the only place where tokens of different
sequences must be kept apart, and it delegates that to an *attention context* (see
`nanoserve/attention/base.py`), so nothing in this file knows about batches, caches or padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.config import ModelConfig, RopeScaling

# ----------------------------------------------------------------------------------- week 1


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 whatever the input dtype.

    Given a residual too, it first adds it: `norm(x, residual)` returns (rmsnorm(x + residual),
    x + residual). Every norm of a decoder layer follows a residual add, and on a GPU (week 12)
    `fused` holds a kernel that does both in one pass over the row.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = None  # week 12: nanoserve.kernels.fused.add_rmsnorm, or None for the code below

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused is not None:
            return self.fused(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self.normalize(x), x
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        # >>> week01: rmsnorm
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        # Cast back *before* the weight multiply, as the reference implementation does: in bf16
        # the order of these two steps changes the last bit, and we want to match it.
        return self.weight * x.to(dtype)
        # <<< week01: rmsnorm


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation speed of each pair of channels: inv_freq[i] = theta^(-2i / head_dim).

    Returns a float32 tensor of shape [head_dim // 2]. With llama3 scaling, slow (long
    wavelength) channels are slowed down further by `factor`, fast ones are left alone, and the
    ones in between are blended smoothly.
    """
    # >>> week01: rope-inv-freq
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if scaling is None:
        return inv_freq

    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor  # longer than this: divide by factor
    high_freq_wavelen = old_len / scaling.high_freq_factor  # shorter than this: keep
    wavelen = 2 * math.pi / inv_freq

    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # In between, interpolate from "divided by factor" (smooth=0) to "unchanged" (smooth=1).
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
    # <<< week01: rope-inv-freq


class RotaryEmbedding(nn.Module):
    """Computes the cos/sin tables for the positions of a packed batch of tokens."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: it is derived from the config, never loaded or saved.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim], in `dtype`."""
        # >>> week01: rope-cos-sin
        if self.inv_freq.device != positions.device:  # move once, not every step (CUDA graphs forbid it)
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        # Channel i and channel i + head_dim/2 form one rotating pair ("rotate half" layout).
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)
        # <<< week01: rope-cos-sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair by its position's angle.

    x: [T, num_heads, head_dim]; cos, sin: [T, head_dim]. Returns a tensor shaped like x.
    """
    # >>> week01: apply-rope
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)  # [T, num_heads, head_dim]
    return x * cos[:, None, :] + rotated * sin[:, None, :]
    # <<< week01: apply-rope


# ----------------------------------------------------------------------------------- week 2


class Attention(nn.Module):
    """Grouped-query self-attention.

    q, k and v come from one fused projection (one matrix multiply instead of three); the
    loader fills its rows from the checkpoint's separate q_proj / k_proj / v_proj tensors.
    Rotating q and k, keeping k and v, and attending are the context's job (`nanoserve/attention/base.py`).
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # Llama has no biases; Qwen2 has them on q, k and v (week 19).
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        # >>> week02: attention
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = ctx.attend(self.layer_idx, q, k, v, cos, sin)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.q_size))
        # <<< week02: attention


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fused = None  # week 12: nanoserve.kernels.fused.gate_up_silu, or None for the code below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:  # silu(gate) * up from x and the gate_up projection, fused
            return self.down_proj(self.fused(x, self.gate_up_proj))
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate, then up
        # >>> week02: swiglu
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)
        # <<< week02: swiglu


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is handed from layer to layer in two parts, (x, residual), whose sum is
    the stream: each add is left to the norm that follows it (see `RMSNorm`). The first layer
    gets residual None: x is the whole stream.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_for(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused = None  # week 12: nanoserve.kernels.normed_gemv.fused_decoder_layer, or None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] each -> (x, residual) of the stream after this layer."""
        # Issue 39: at batch 1 the hook runs this layer with each norm folded into the product after it
        # (one launch fewer per norm); it returns None where it does not apply, and the code below runs.
        if self.fused is not None and (fused := self.fused(self, x, residual, cos, sin, ctx)) is not None:
            return fused
        # >>> week02: decoder-layer
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual
        # <<< week02: decoder-layer


# ----------------------------------------------------------------------------------- week 19


class FamilyAttention(Attention):
    """Attention as the other families have it, on week 2's projections.

    Qwen3 and Gemma 3 normalize each head of q and of k (an RMSNorm over head_dim, one weight
    vector shared by the heads) before RoPE: it keeps the scores from growing without bound in
    training. Mistral's layers and Gemma 3's local ones attend over a sliding window of keys, and
    Gemma 3 scales the scores by its own factor: both are the attention context's work, told here.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window, self.scale = config.window(layer_idx), config.attention_scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], as week 2's `Attention.forward` with the families' additions."""
        # >>> week19: family-attention
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # one row of head_dim values per head: [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        out = ctx.attend(self.layer_idx, q, k, v, cos, sin, window=self.window, scale=self.scale)
        return self.o_proj(out.reshape(T, self.q_size))
        # <<< week19: family-attention


def attention_for(config: ModelConfig, layer_idx: int) -> Attention:
    """Week 2's attention, or the families' when the config asks for anything Llama's lacks."""
    plain = not (config.qk_norm or config.window(layer_idx) or config.attention_scale is not None)
    return Attention(config, layer_idx) if plain else FamilyAttention(config, layer_idx)


class GeluMLP(MLP):
    """Gemma's gated MLP: GELU (its tanh approximation) where Llama's has SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
