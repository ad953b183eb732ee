"""Week 23: nanoserve with adapters equals HF + PEFT, alone and in mixed batches."""

import pytest

from lora_helpers import hf_greedy
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


def mixed_requests():
    """Every prompt under three adapters and the base model: 12 requests, interleaved."""
    return [(prompt, name) for prompt in PROMPTS for name in ("attn8", None, "mlp4", "qv2")]


def alone(llm, requests):
    return [llm.generate(prompt, GREEDY, lora=name)[0].token_ids for prompt, name in requests]


@pytest.mark.parametrize("max_loras", [3, 1])
def test_a_batch_mixing_adapters_equals_each_request_alone(tiny, adapters, max_loras):
    """With 3 slots the three adapters and the base model share steps; with 1 the scheduler keeps a
    request waiting until the adapter of those running is done (FCFS), and the pool swaps adapters
    between slots and host memory. Either way every answer is the one it gets alone."""
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={k: str(v) for k, v in adapters.items()}, max_loras=max_loras,
              trace=True)
    requests = mixed_requests()
    batch = llm.generate([p for p, _ in requests], GREEDY, lora=[name for _, name in requests])
    engine = llm.engine
    by_id = {out.request_id: name for out, (_, name) in zip(batch, requests)}
    adapters_per_step = [len({by_id[i] for i in step.seq_ids} - {None}) for step in engine.trace]
    assert max(adapters_per_step) == max_loras  # the slots are used, and never exceeded
    stats = engine.adapters.stats()
    if max_loras == 1:
        assert stats["steps_held"] > 0 and stats["evictions"] > 0
    assert stats["resident"] <= max_loras
    assert [out.token_ids for out in batch] == alone(llm, requests)


@pytest.mark.slow
def test_the_triton_path_with_graph_buffers_equals_the_reference(tiny, adapters, llm):
    """The Triton backend with CUDA graphs' static buffers and padding (nothing captured on the
    CPU): the LoRA rows go through the graphs' fixed buffers into the kernels, run by the
    interpreter; decode, mixed (chunked prefill) steps and a batch padded to a captured size."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    from nanoserve.kernels.lora import add_lora_triton

    triton = LLM(str(tiny[0]), device="cpu", attention_backend="triton", cuda_graphs=True, max_num_seqs=8,
                 max_num_batched_tokens=64, lora_modules={k: str(v) for k, v in adapters.items()}, max_loras=3)
    assert triton.engine.runner.graphs is not None and triton.engine.runner.graphs.lora is not None
    assert triton.engine.runner.lora.state.add is add_lora_triton
    requests = mixed_requests()[:6]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = triton.generate([p for p, _ in requests], params, lora=[name for _, name in requests])
    want = [llm.generate(p, params, lora=name)[0].token_ids for p, name in requests]
    assert [out.token_ids for out in got] == want


@pytest.mark.parametrize("options", [dict(speculative="ngram", num_speculative_tokens=3),
                                     dict(async_scheduling=True),
                                     dict(enable_chunked_prefill=False, max_num_batched_tokens=4096)],
                         ids=["ngram-speculation", "async-scheduling", "no-chunking"])
def test_adapters_under_the_other_engine_paths(tiny, adapters, llm, options):
    """Speculative verification steps (k + 1 rows per sequence, all under its adapter), async
    scheduling (inputs fed from the last step's tokens) and unchunked prefill give the same tokens."""
    other = LLM(str(tiny[0]), device="cpu", lora_modules={k: str(v) for k, v in adapters.items()}, max_loras=3,
                **options)
    requests = mixed_requests()[:8]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = other.generate([p for p, _ in requests], params, lora=[name for _, name in requests])
    assert [out.token_ids for out in got] == [llm.generate(p, params, lora=n)[0].token_ids for p, n in requests]
