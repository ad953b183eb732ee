"""Week 23: what the scheduler knows of LoRA adapters: how many distinct ones may run at once (the
device's adapter slots), and that a prompt's KV under one adapter is no other adapter's. Plain
Python, no torch: the scheduler never sees an adapter's weights, only its id (`Sequence.lora_id`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nanoserve.scheduler.prefix_cache import block_hash
from nanoserve.scheduler.sequence import Sequence


def hold_back(waiting: deque[Sequence], in_use: Callable[[], set[int]], max_loras: int
              ) -> tuple[deque[Sequence], list[Sequence]]:
    """Split the queue at the first sequence whose adapter finds no slot, the running sequences
    (their adapters: `in_use()`) and those ahead of it in the queue using `max_loras` adapters already:
    (the queue the policies see this step, the sequences held back). The held ones wait, FCFS, for
    an adapter to finish; nobody behind the first of them overtakes it. (max_loras 0: no LoRA.)"""
    if not max_loras:
        return waiting, []
    # >>> week23: hold-back
    adapters = in_use()
    for i, seq in enumerate(waiting):
        if seq.lora_id and seq.lora_id not in adapters:
            if len(adapters) == max_loras:
                queue = list(waiting)
                return deque(queue[:i]), queue[i:]
            adapters.add(seq.lora_id)
    return waiting, []
    # <<< week23: hold-back


def name_first_block(seq: Sequence, block_size: int) -> None:
    """Under an adapter, a sequence's first full block is named with the adapter in its seed
    (`Sequence.cache_salt`), and every later name chains on it: no block of it is ever shared with
    the base model or another adapter. The scheduler calls this before week 14's code would name
    the block from no seed: at arrival, and before the blocks a step filled are named."""
    if seq.cache_salt is None:  # the base model: week 14 names its blocks from no seed
        return
    # >>> week23: adapter-key
    if not seq.block_hashes and seq.num_tokens >= block_size:
        seq.block_hashes.append(block_hash(seq.cache_salt, seq.token_ids[:block_size]))
    # <<< week23: adapter-key
