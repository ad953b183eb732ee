"""Week 2: the simplest possible generation loop, with no KV cache.

Every step runs the whole sequence again and keeps only the last token's logits. That costs
O(n^2) work for n tokens, which is exactly what week 3's KV cache removes, but it is obviously
correct, and it is what we compare everything else against.
"""

from __future__ import annotations

import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.attention.naive import NaiveCacheContext, NaiveKVCache
from nanoserve.model.llama import Llama


@torch.no_grad()
def greedy_generate_no_cache(
    model: Llama, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy decoding by full recomputation. Returns the new tokens only."""
    # >>> week02: greedy-no-cache
    device = model.embed_tokens.weight.device
    tokens = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        ids = torch.tensor(tokens, device=device)
        positions = torch.arange(len(tokens), device=device)
        hidden = model(ids, positions, PrefillContext([len(tokens)]))  # [T, hidden]
        next_id = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        new.append(next_id)
        tokens.append(next_id)
        if next_id in stop_ids:
            break
    return new
    # <<< week02: greedy-no-cache


@torch.no_grad()
def greedy_generate_naive_cache(model: Llama, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Week 3: greedy decoding of a batch of prompts with the naive KV cache.

    One prefill step runs every prompt (packed); then each decode step feeds one token per
    sequence, and attention reads the past from the cache instead of recomputing it.
    """

    cfg, device = model.config, model.embed_tokens.weight.device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache = NaiveKVCache(cfg.num_layers, len(prompts), max_len, cfg.num_kv_heads, cfg.head_dim,
                         dtype=model.embed_tokens.weight.dtype, device=device)
    slots = list(range(len(prompts)))
    # >>> week03: naive-cache-generate
    outputs: list[list[int]] = [[] for _ in prompts]
    new_tokens = [list(p) for p in prompts]  # what each sequence feeds this step
    cached = [0] * len(prompts)
    for _ in range(max_new_tokens):
        ids = torch.tensor([t for seq in new_tokens for t in seq], device=device)
        positions = torch.tensor([c + i for c, seq in zip(cached, new_tokens) for i in range(len(seq))],
                                 device=device)
        ctx = NaiveCacheContext(cache, slots, cached, [len(s) for s in new_tokens])
        hidden = model(ids, positions, ctx)
        next_ids = model.compute_logits(hidden[ctx.last_token_indices]).argmax(dim=-1).tolist()
        cached = [c + len(s) for c, s in zip(cached, new_tokens)]
        for out, t in zip(outputs, next_ids):
            out.append(t)
        new_tokens = [[t] for t in next_ids]
    return outputs
    # <<< week03: naive-cache-generate
