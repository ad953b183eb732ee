"""Week 24's tiny mixtures of experts, built once per session: a Mixtral (8 experts, top-2,
renormalized) and a Qwen2-MoE (16 small experts, top-4 as they come, a shared expert, one dense
layer), random, float32, saved by transformers as real checkpoints."""

import pytest
import torch

from nanoserve.testing import make_family_checkpoint

FAMILIES = ["mixtral", "qwen2_moe"]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict:
    """{family: (checkpoint path, the HF model)}."""
    return {name: make_family_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", name) for name in FAMILIES}


@pytest.fixture(scope="session")
def moe_prompts() -> list[list[int]]:
    """Ragged prompts, the first two sharing a 20-token prefix (for the prefix cache)."""
    gen = torch.Generator().manual_seed(24)
    shared = torch.randint(3, 4096, (20,), generator=gen).tolist()
    own = [torch.randint(3, 4096, (k,), generator=gen).tolist() for k in (13, 29, 9, 41)]
    return [shared + own[0], shared + own[1], own[2], own[3]]


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(hf_model, prompt, n): HF's n greedy tokens after the prompt."""
    return greedy
