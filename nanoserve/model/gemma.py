"""Week 19: Gemma 3 (text), the family that differs most from Llama.

On the same shared layers (`nanoserve/model/layers.py`), Gemma 3 changes five things:

- embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype) before the first layer;
- "sandwich" norms: each sub-block's output is normalized too, before it joins the residual
  stream, so a layer has four RMSNorms (before and after attention, before and after the MLP);
- its RMSNorms multiply by (1 + w), so a checkpoint stores w around 0: the loader folds the 1 into
  the weights once (`finish_loading`), and the norms are then Llama's, fused kernel included;
- a GELU-gated MLP (`GeluMLP`), q/k norms and its own softmax scale (`FamilyAttention`);
- local layers with a sliding window and their own RoPE base (10,000), and every sixth layer
  global (full attention, RoPE base 1,000,000): two rotary tables per step, each layer takes its own.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import FamilyAttention, GeluMLP, RMSNorm, RotaryEmbedding
from nanoserve.model.llama import Llama


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(norm(x))), on the (x, residual) stream
    of week 2: every add is left to the norm that follows it."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = FamilyAttention(config, layer_idx)
        self.mlp = GeluMLP(config)
        self.sliding = config.window(layer_idx) is not None  # which rotary table this layer takes

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, ctx))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3(Llama):
    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        local = replace(config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None)
        self.rotary_local = RotaryEmbedding(local)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as the model's dtype holds it (the checkpoint was trained with that value)."""
        return torch.tensor(self.config.hidden_size**0.5).to(dtype).item()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                hidden_states_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """As `Llama.forward`, with scaled embeddings and a rotary table for each kind of layer."""
        x = self.embed_tokens(input_ids) * self.embed_scale(self.embed_tokens.weight.dtype)
        rotary = {False: self.rotary(positions, x.dtype), True: self.rotary_local(positions, x.dtype)}
        if hidden_states_out is not None:
            hidden_states_out.append(x.clone())
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, *rotary[layer.sliding], ctx)
            if hidden_states_out is not None:
                hidden_states_out.append(x + residual)
        x, _ = self.norm(x, residual)
        return x

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Gemma's norms compute x_normalized * (1 + w): fold the 1 into w, once."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight += 1.0
