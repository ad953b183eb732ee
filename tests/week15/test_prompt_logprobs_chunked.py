"""Week 15 and issue 17: a prompt prefilled in chunks gives its logprobs chunk by chunk; together
they equal those of the prompt prefilled at once, and HF's."""

import torch
from transformers import LlamaForCausalLM

from nanoserve.engine import LLM
from nanoserve.sampling import SamplingParams
from nanoserve.tiny import TINY_MODEL_DIR

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
