"""Issue 35 over several ranks: each rank's CPU tier holds its own heads (tensor parallelism, week
18) or its own layers (pipeline parallelism, week 20) of the blocks, and the copies travel in the
step every rank runs (`StepInput.offloads`, `StepInput.reloads`), so two CPU processes over gloo
give the tokens of one. (The tier itself is tested in test_cpu_tier.py.)"""

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # it starts a process (a few seconds on the CPU)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def conversations(llm):
    """Three chats, three turns each, interleaved: each turn resends its history, and a pool of
    12 blocks of 4 cannot keep the other chats' blocks in between."""
    histories = [list(range(100 + 50 * c, 109 + 50 * c)) for c in range(3)]
    answers = []
    for turn in range(3):
        for c, history in enumerate(histories):
            history += list(range(1000 + 100 * c + 10 * turn, 1003 + 100 * c + 11 * turn))
            answer = llm.generate([history], GREEDY)[0].token_ids
            answers.append(answer)
            history += answer
    return answers


@pytest.mark.exercise("offload-evict", "tiered-match")
@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_with_the_cpu_tier_equal_one(split):
    kw = dict(device="cpu", dtype=torch.float32, block_size=4, num_blocks=12, enable_prefix_caching=True,
              cpu_offload_gb=0.001)
    one = LLM("tiny", **kw)
    expected = conversations(one)
    single = one.engine.prefix_cache_stats()
    assert single["cpu_hit_tokens"] > 0
    with LLM("tiny", **kw, **{f"{split}_parallel_size": 2}) as llm:
        assert conversations(llm) == expected
        stats = llm.engine.prefix_cache_stats()
        # the same hits and copies (each rank's GiB holds twice the blocks of its half: no CPU eviction either way)
        assert stats["cpu_evictions"] == 0 == single["cpu_evictions"]
        assert {k: v for k, v in stats.items() if k != "cpu_blocks"} == {k: v for k, v in single.items() if k != "cpu_blocks"}
        pool, whole = llm.engine.runner.cpu_pool, one.engine.runner.cpu_pool
        assert pool.num_slots == 2 * whole.num_slots
        if split == "tensor":  # 2 KV heads over 2 ranks: one each
            assert pool.slots.shape[-2] == 1 and whole.slots.shape[-2] == 2
        else:  # 4 layers over 2 stages: two each
            assert pool.slots.shape[1] == 2 and whole.slots.shape[1] == 4
