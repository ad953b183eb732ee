"""A yardstick for batch-1 decode: the same model and weights over a dense, static KV cache,
each decode step compiled whole with `torch.compile(mode="reduce-overhead", fullgraph=True)`.

That is the recipe of the small compiled inference scripts: one sequence, a cache preallocated at
its final length so every step has the same shapes, and the compiler fusing the step's kernels
and replaying them from a CUDA graph. It serves one request and knows nothing of batching or
paging, so it is not a server; it is what nanoserve's batch-1 path is measured against
(`nanoserve bench latency` prints both).

The model code is nanoserve's own (`Llama.forward` with the PyTorch modules, not week 12's Triton
kernels, so that the compiler sees the whole step): only the attention context differs. Where the
paged context writes K/V to slots and reads them through block tables, `StaticKVContext` writes
position p of a sequence to row p of a [max_len] cache and attends over the whole cache with a
mask that hides the rows past the current position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.model.layers import apply_rope
from nanoserve.model.llama import Llama


class StaticKVContext(torch.nn.Module):
    """A dense cache for one sequence: k, v [num_layers, max_len, num_kv_heads, head_dim]. The
    positions of the tokens being run are in `input_pos`. The cache is a module's buffers, not
    loose tensors: the compiler's CUDA graphs accept in-place writes to a module's buffers (their
    addresses never change), and would fall back to plain launches for written graph inputs."""

    def __init__(self, model: Llama, max_len: int):
        super().__init__()
        cfg = model.config
        weight = model.embed_tokens.weight
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.register_buffer("v", torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.register_buffer("all_positions", torch.arange(max_len, device=weight.device))
        self.input_pos = torch.zeros(1, dtype=torch.long, device=weight.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] for the positions in `input_pos` -> [T, Hq, D]. `window`
        and `scale` as in `nanoserve.attention.base.causal_attention`."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k[layer_idx].index_copy_(0, self.input_pos, k)
        self.v[layer_idx].index_copy_(0, self.input_pos, v)
        visible = self.all_positions[None, :] <= self.input_pos[:, None]  # [T, max_len]: causal, and no row past
        if window is not None:  # and none that slid out of the window
            visible = visible & (self.all_positions[None, :] > self.input_pos[:, None] - window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], self.k[layer_idx].transpose(0, 1)[None], self.v[layer_idx].transpose(0, 1)[None],
            attn_mask=visible[None, None], enable_gqa=True, scale=scale)  # [1, Hq, T, D]
        return out[0].transpose(0, 1)


class DecodeStep(torch.nn.Module):
    """One token at one position -> the next token (greedy), all on the device."""

    def __init__(self, model: Llama, ctx: StaticKVContext):
        super().__init__()
        self.model, self.ctx = model, ctx

    def forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.ctx.input_pos = position
        hidden = self.model(token, position, self.ctx)
        return self.model.compute_logits(hidden).argmax(dim=-1)


class CompiledStaticDecoder:
    """Greedy batch-1 generation: an eager prefill into the static cache, then one compiled
    module call per decode step (`compile=False` runs the same code eagerly: the CPU tests)."""

    def __init__(self, model: Llama, max_len: int, compile: bool = True):
        self.model = model
        self.ctx = StaticKVContext(model, max_len)
        step = DecodeStep(model, self.ctx)
        self.decode = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile else step

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, on_token=None) -> list[int]:
        """Greedy continuation of `prompt`; `on_token(i)` is called after token i is on the host."""
        device = self.ctx.k.device
        ids = torch.tensor(prompt, device=device)
        self.ctx.input_pos = torch.arange(len(prompt), device=device)  # the prefill, eager
        hidden = self.model(ids, self.ctx.input_pos, self.ctx)
        token = self.model.compute_logits(hidden[-1:]).argmax(dim=-1)
        position = torch.zeros(1, dtype=torch.long, device=device)
        out = [int(token)]
        if on_token:
            on_token(0)
        for i in range(1, new_tokens):
            position.fill_(len(prompt) + i - 1)
            token = self.decode(token, position).clone()  # clone: the graph's output is reused
            out.append(int(token))
            if on_token:
                on_token(i)
        return out
