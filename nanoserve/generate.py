"""Week 2: the simplest possible generation loop, with no KV cache.

Every step runs the whole sequence again and keeps only the last token's logits. That costs
O(n^2) work for n tokens, which is exactly what week 3's KV cache removes, but it is obviously
correct, and it is what we compare everything else against.
"""

from __future__ import annotations

import torch

from nanoserve.attention import PrefillContext
from nanoserve.model import Llama


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
