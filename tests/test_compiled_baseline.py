"""The compiled static-cache baseline of `nanoserve bench latency` (issue 20): on the CPU, run
eagerly, its greedy tokens equal nanoserve's (float32); compiled, on a GPU."""

import pytest
import torch

from nanoserve.bench.compiled_baseline import CompiledStaticDecoder
from nanoserve.engine.engine import LLM
from nanoserve.model.loader import load_model
from nanoserve.sampling.params import SamplingParams
from nanoserve.model.tiny import tiny_model_dir


@pytest.mark.parametrize("prompt_len", [1, 7, 40])
def test_static_cache_decode_equals_the_engine(prompt_len):
    llm = LLM("tiny", device="cpu", dtype=torch.float32)
    prompt = llm.tokenizer.encode("The list of functions in the os module: " * 4)[:prompt_len]
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    model = load_model(tiny_model_dir(), dtype=torch.float32, device="cpu")
    seen = []
    got = CompiledStaticDecoder(model, max_len=prompt_len + 20, compile=False).generate(prompt, 20, seen.append)
    assert got == want and seen == list(range(20))


@pytest.mark.gpu
def test_compiled_on_the_gpu_equals_eager():
    model = load_model(tiny_model_dir(), dtype=torch.float32, device="cuda")
    prompt = list(range(3, 30))
    eager = CompiledStaticDecoder(model, max_len=64, compile=False).generate(prompt, 24)
    compiled = CompiledStaticDecoder(model, max_len=64, compile=True).generate(prompt, 24)
    assert compiled == eager
