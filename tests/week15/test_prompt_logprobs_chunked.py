"""Week 15 and issue 17: a prompt prefilled in chunks gives its logprobs chunk by chunk; together
they equal those of the prompt prefilled at once, and HF's."""

import pytest
import torch
from transformers import LlamaForCausalLM

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.model.tiny import TINY_MODEL_DIR

PROMPTS = ["A dictionary maps keys to values. The list type is a mutable sequence, and the tuple type an "
           "immutable one; both support indexing and slicing.", "Return the", "import os\nimport sys\n"]


@torch.no_grad()
def test_prompt_logprobs_with_chunked_prefill_equal_hf():
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    whole = LLM("tiny", device="cpu", block_size=8).generate(PROMPTS, params)
    llm = LLM("tiny", device="cpu", block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=12,
              max_num_seqs=4)
    chunked = llm.generate(PROMPTS, params)
    hf = LlamaForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    for a, b in zip(whole, chunked):
        assert a.token_ids == b.token_ids
        assert [e.token for e in a.prompt_logprobs] == [e.token for e in b.prompt_logprobs] == a.prompt_token_ids
        ids = a.prompt_token_ids + a.token_ids
        expected = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        assert b.prompt_logprobs[0].logprob is None
        for p, entry in enumerate(b.prompt_logprobs[1:] + b.logprobs, start=1):
            assert abs(entry.logprob - expected[p - 1, ids[p]].item()) < 1e-4
            assert [t for t, _ in entry.top] == expected[p - 1].topk(2).indices.tolist()
    assert len(whole[0].prompt_token_ids) > 2 * 12  # the long prompt ran in three chunks or more


def test_steps_with_prompt_rows_leave_the_graph_path(monkeypatch):
    """With CUDA graphs, mixed steps replay a graph that returns the sampled rows only (week 15):
    a step with prompt rows to keep runs eagerly instead (on the CPU the graph path is the graphs'
    static buffers, nothing captured), and the prompt logprobs are all there, equal to the eager
    engine's."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    from nanoserve.runner.cuda_graphs import CUDAGraphDecoder

    replays = []
    run_mixed = CUDAGraphDecoder.run_mixed
    monkeypatch.setattr(CUDAGraphDecoder, "run_mixed",
                        lambda self, step, t, *last: replays.append(t) or run_mixed(self, step, t, *last))
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU: Triton's interpreter
    eager = LLM("tiny", device=device, dtype=torch.float32, block_size=8, enable_chunked_prefill=True,
                max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory=2**28)  # two engines share a GPU: 256 MiB each
    graphs = LLM("tiny", device=device, dtype=torch.float32, block_size=8, enable_chunked_prefill=True, max_num_batched_tokens=24,
                 attention_backend="triton", cuda_graphs=True, max_num_seqs=4, kv_cache_memory=2**28)
    graphs.generate(PROMPTS, plain)
    assert replays  # these prompts do make mixed steps that replay a graph...
    replays.clear()
    got = graphs.generate(PROMPTS, params)
    assert not replays  # ...but not with prompt rows to keep
    for a, b in zip(eager.generate(PROMPTS, params), got):
        assert a.token_ids == b.token_ids
        assert [e.token for e in a.prompt_logprobs] == [e.token for e in b.prompt_logprobs]
        got = [e.logprob for e in b.prompt_logprobs[1:] + b.logprobs]
        assert got == pytest.approx([e.logprob for e in a.prompt_logprobs[1:] + a.logprobs], abs=1e-4)
