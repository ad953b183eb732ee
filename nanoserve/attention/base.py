"""Attention contexts: how attention finds the keys and values a query may look at.

The model never changes after week 2. What changes from week to week is the object handed to
its forward pass as `ctx`, which answers one question for every layer:

    ctx.attend(layer_idx, q, k, v, cos, sin, window=None, scale=None) -> out
        q:   [T, num_heads, head_dim]      the new tokens' queries (packed, all sequences)
        k,v: [T, num_kv_heads, head_dim]   the new tokens' keys and values
        cos, sin: [T, head_dim]            each token's rotary tables (week 1)
        window: None, or W >= 1            the layer's sliding window (week 19): see `causal_attention`
        scale: None, or a float            the layer's softmax scale; None is head_dim ** -0.5
        out: [T, num_heads, head_dim]

The context first rotates q and k by their positions (RoPE), then keeps k and v wherever it
keeps them, then attends. Rotation and storage belong together: a cache holds rotated keys,
and on a GPU one kernel does both (week 12).

- week 2, `PrefillContext`: no cache; each sequence attends causally to its own new tokens.
- week 3, `nanoserve.attention.naive.NaiveCacheContext`: keys/values also go to a per-sequence slab.
- week 5, `nanoserve.attention.paged.PagedContext`: keys/values live in a pool of fixed-size blocks.
- week 6, `nanoserve.attention.triton.TritonPagedContext`: the same, read by a Triton kernel.

`causal_attention` below is the reference every one of them is checked against.

Week 19 (model families) adds two per-layer settings every context honours, passed by the model's
attention layer with each call: a sliding window (Mistral, Gemma 3's local layers: a query sees
only the last W positions, itself included) and a softmax scale other than head_dim ** -0.5
(Gemma 3's query_pre_attn_scalar ** -0.5). Both default to None: plain causal attention.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol

import torch

from nanoserve.model.layers import apply_rope


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int = 0,
                     window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Reference attention for one sequence, with grouped-query heads.

    q: [Tq, Hq, D] are the queries of positions q_start .. q_start + Tq - 1.
    k, v: [Tk, Hkv, D] are the keys/values of positions 0 .. Tk - 1 (Tk >= q_start + Tq).
    Query at position p may look at keys 0..p; with a sliding `window` W (>= 1), only at the W
    keys p - W < j <= p, itself included. Scores are scaled by `scale`, head_dim ** -0.5 if None.
    Scores and softmax in float32. Returns [Tq, Hq, D] in q's dtype.
    """
    # >>> week02: causal-attention
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    group = Hq // Hkv  # query heads that share one key/value head
    # View the query heads as [Hkv, group] so each group meets its own KV head, without copying K/V.
    qg = q.float().view(Tq, Hkv, group, D)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k.float())  # [Hkv, group, Tq, Tk]
    scores = scores / D**0.5 if scale is None else scores * scale
    q_pos = torch.arange(q_start, q_start + Tq, device=q.device)[:, None]  # [Tq, 1]
    k_pos = torch.arange(Tk, device=q.device)[None, :]  # [1, Tk]
    hidden = k_pos > q_pos  # the future
    if window is not None:
        hidden = hidden | (k_pos <= q_pos - window)  # keys that slid out of the window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())  # [Tq, Hkv, group, D]
    return out.reshape(Tq, Hq, D).to(q.dtype)
    # <<< week02: causal-attention


class PrefillContext:
    """Week 2's context: a batch of whole sequences, no cache.

    `seq_lens` gives the number of tokens of each packed sequence, in order; the tokens of
    sequence i are rows cu_seqlens[i] : cu_seqlens[i + 1] of q, k and v.
    """

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = list(seq_lens)
        self.cu_seqlens = [0, *accumulate(self.seq_lens)]  # running totals: where each sequence starts

    @property
    def last_token_indices(self) -> list[int]:
        """Row of each sequence's last token: the rows whose logits predict the next token."""
        return [end - 1 for end in self.cu_seqlens[1:]]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # >>> week02: prefill-context
        outs = []
        for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]):
            outs.append(causal_attention(q[start:end], k[start:end], v[start:end], window=window, scale=scale))
        return torch.cat(outs, dim=0)
        # <<< week02: prefill-context
