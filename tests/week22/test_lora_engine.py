"""Week 22: nanoserve with adapters equals HF + PEFT, alone and in mixed batches."""

import pytest

from conftest import hf_greedy
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams

PROMPTS = [[1, 45, 802, 13, 99, 7, 1200, 64, 3000, 18, 22, 5, 601, 77, 903, 12, 40, 41],
           [1, 300, 301, 302, 2048], [1, 17, 4000, 25, 3, 9, 9, 1000, 20, 55, 66]]
N = 8
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny, adapters):
    return LLM(str(tiny[0]), device="cpu", lora_modules={k: str(v) for k, v in adapters.items()}, max_loras=2,
               max_lora_rank=16)


@pytest.mark.parametrize("name", ["attn8", "mlp4", "all16", "qv2"])
def test_each_adapter_equals_hf_peft(llm, tiny, adapters, name):
    _, hf = tiny
    for prompt in PROMPTS:
        expected = hf_greedy(hf, adapters[name], prompt, N)
        assert llm.generate(prompt, GREEDY, lora=name)[0].token_ids == expected
    assert hf_greedy(hf, adapters[name], PROMPTS[0], N) != hf_greedy(hf, None, PROMPTS[0], N), "the adapter changes nothing"
