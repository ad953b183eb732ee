"""Week 2: the whole Llama model. Embeddings -> decoder layers -> final norm -> logits.

This file stops changing after week 2. Caches, paging and kernels all arrive through the
attention context `ctx` (see `nanoserve/attention/base.py`), never through edits here. Week 19's
families reuse it: Mistral, Qwen2 and Qwen3 are this class with options on its layers (the
config's), and Gemma 3 (`nanoserve/model/gemma.py`) a subclass; `nanoserve/model/registry.py` picks.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding


class Llama(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer  # week 19: a family with another block swaps its own in

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx,
                hidden_states_out: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (packed tokens of all sequences) -> hidden states [T, hidden].

        The result is after the final norm; `compute_logits` turns the rows you need into logits.
        If `hidden_states_out` is a list, the embeddings and the output of every layer (before
        the final norm) are appended to it: that is what the per-layer debugger compares.
        """
        # >>> week02: model-forward
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)  # [T, head_dim] each
        if hidden_states_out is not None:
            hidden_states_out.append(x.clone())  # a copy: a fused norm adds into x in place
        residual = None  # the stream is x + residual (see DecoderLayer)
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
            if hidden_states_out is not None:
                hidden_states_out.append(x + residual)
        x, _ = self.norm(x, residual)
        return x
        # <<< week02: model-forward

    def finish_loading(self) -> None:
        """Called by the loader once the checkpoint's weights are in (week 19: Gemma adjusts its norms)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab], in float32 (sampling wants the precision)."""
        return self.lm_head(hidden).float()
