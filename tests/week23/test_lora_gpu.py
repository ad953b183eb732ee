"""Week 23 on a GPU (skipped, with the reason, on the CPU): the adapters inside captured CUDA graphs.

Decode, mixed and padded steps replay graphs whose LoRA kernels read the rows of each slot from
fixed buffers; async scheduling stages the next step's rows while the GPU runs this one. In
float32 the tokens equal the eager path's (no graphs, the PyTorch reference); in bf16 the logits
of one replayed step are close to the eager ones.
"""

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu


def engines(tiny, adapters, dtype, **options):
    modules = {k: str(v) for k, v in adapters.items()}
    common = dict(device="cuda", dtype=dtype, lora_modules=modules, max_loras=3, max_num_seqs=16,
                  kv_cache_memory=2**28, **options)  # a fixed pool: two engines share the GPU
    graphs = LLM(str(tiny[0]), attention_backend="triton", **common)
    eager = LLM(str(tiny[0]), attention_backend="torch", cuda_graphs=False, **common)
    assert graphs.engine.runner.graphs is not None and graphs.engine.runner.graphs.capture
    return graphs, eager


def test_graphs_with_adapters_equal_the_eager_path_in_float32(tiny, adapters):
    graphs, eager = engines(tiny, adapters, torch.float32)
    prompts = [[1] + [(i * 37 + j) % 4000 + 5 for j in range(5 + 3 * i)] for i in range(12)]
    loras = ["attn8", None, "mlp4", "qv2"] * 3  # three adapters and the base model in every step
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = graphs.generate(prompts, params, lora=loras)
    want = eager.generate(prompts, params, lora=loras)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graphs.engine.async_scheduling  # the default with graphs: staging one step ahead


def test_graphs_with_adapters_are_close_in_bf16(tiny, adapters):
    graphs, eager = engines(tiny, adapters, torch.bfloat16)
    prompts = [[1, 50 + i, 60, 70 + i, 80] for i in range(6)]
    loras = ["all16", None, "qv2", "all16", "mlp4", None]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    for o_graph, o_eager in zip(graphs.generate(prompts, params, lora=loras), eager.generate(prompts, params, lora=loras)):
        top_graph, top_eager = dict(o_graph.logprobs[0].top), dict(o_eager.logprobs[0].top)
        shared = set(top_graph) & set(top_eager)
        assert len(shared) >= 3
        assert max(abs(top_graph[t] - top_eager[t]) for t in shared) < 0.1
