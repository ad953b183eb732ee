"""Week 17: speculative decoding inside the engine. Greedy tokens equal those without speculation
(float32) for both proposers, with preemption, prefix caching and chunked prefill in the run;
rejected guesses leave no block behind; seeded sampling reproduces; the switch-off rule."""

import pytest
import torch
from transformers import LlamaForCausalLM

from nanoserve.scheduler.blocks import blocks_needed
from nanoserve.engine.engine import LLM
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import check_block_invariants, save_checkpoint
from nanoserve.model.tiny import tiny_model_dir

pytestmark = pytest.mark.exercise("add-drafts", "drop-rejected")

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",  # copy-heavy: prompt lookup finds it
    "the list, the list, the list, the",
    "A dictionary maps keys to values.",  # little to look up
    "import os\nimport sys\nimport os\nimport",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """The tiny model with noise on its matrices: same tokenizer, agrees with the target often
    but not always (about half of its guesses are accepted)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    return save_checkpoint(model, tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def reference():
    llm = LLM(EngineConfig(model="tiny", device="cpu", dtype=torch.float32))
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


def speculative(method, draft_dir=None, **kw):
    config = dict(model="tiny", device="cpu", dtype=torch.float32, speculative=method,
                  num_speculative_tokens=kw.pop("k", 3), speculative_max_batch=8)
    if method == "draft":
        config["draft_model"] = draft_dir
    return LLM(EngineConfig(**(config | kw)))


def run_checked(llm, prompts, params):
    """Generate step by step, checking the blocks after every step: the pool's invariants, and
    no running sequence holding a block past its tokens (rejected guesses rolled back)."""
    engine = llm.engine
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        if engine.scheduler.prefix_caching:  # shared blocks: reference counts instead
            engine.scheduler.allocator.check_invariants([s.block_table for s in engine.scheduler.running])
        else:
            check_block_invariants(engine.scheduler)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= blocks_needed(seq.num_tokens, engine.scheduler.block_size)
            assert seq.num_computed <= seq.num_tokens - 1
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_blocks, "a block was left behind"
    if engine.speculator.draft is not None:
        draft = engine.speculator.draft
        assert not draft.shadows and draft.allocator.num_free == draft.allocator.num_blocks
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tokens_equal_without_speculation(method, draft_dir, reference):
    llm = speculative(method, draft_dir)
    outs = run_checked(llm, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]
    stats = llm.engine.speculator.stats
    assert stats.num_proposed > 0 and 0 < stats.num_accepted < stats.num_proposed
    assert stats.tokens_per_step > 1
    assert llm.engine.num_steps < GREEDY.max_tokens  # fewer target steps than tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_equal_under_preemption(method, draft_dir, reference):
    """A pool of 12 blocks of 16 tokens for four sequences of up to ~70 tokens: they preempt each
    other, and a preempted sequence comes back and speculates again."""
    llm = speculative(method, draft_dir, num_blocks=12, max_num_seqs=4)
    outs = run_checked(llm, PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]


def test_equal_with_prefix_caching_chunked_prefill_and_a_long_k(reference):
    llm = speculative("ngram", enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=24,
                      max_num_seqs=8, k=7)
    outs = run_checked(llm, PROMPTS + PROMPTS[:2], GREEDY)  # the repeats hit the prefix cache
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS + PROMPTS[:2]]
    assert llm.engine.prefix_cache_stats()["hit_tokens"] > 0


def test_stops_and_max_tokens_hold_inside_accepted_guesses(reference):
    """Accepted guesses past a stop string or max_tokens are dropped: the output ends where the
    plain engine's ends."""
    plain = LLM(EngineConfig(model="tiny", device="cpu", dtype=torch.float32))
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=40, stop=["list"], ignore_eos=True)):
        want = plain.generate(PROMPTS, params)
        got = speculative("ngram", k=5).generate(PROMPTS, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
               [(o.token_ids, o.text, o.finish_reason) for o in want]


def test_seeded_sampling_reproduces_and_differs_across_seeds(draft_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    for method in ("ngram", "draft"):
        first = [o.token_ids for o in speculative(method, draft_dir).generate([PROMPTS[1]] * 3, params)]
        again = [o.token_ids for o in speculative(method, draft_dir).generate([PROMPTS[1]] * 3, params)]
        assert first == again  # the same seeds, the same tokens, run after run
        assert first[0] == first[1] != first[2]


def test_speculation_is_off_above_the_batch_limit():
    llm = speculative("ngram", speculative_max_batch=2)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.engine.speculator.stats.num_proposed == 0  # three decodes every step: never below the limit
    llm = speculative("ngram", speculative_max_batch=3)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.engine.speculator.stats.num_proposed > 0


def test_triton_backend_verifies_the_same_tokens(reference):
    """Verification steps (several new tokens per sequence over the paged cache) through week 6's
    kernel, on Triton's interpreter here and compiled on a GPU."""
    llm = speculative("ngram", attention_backend="triton", device="cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [reference[p][:16] for p in PROMPTS[:2]]
    assert llm.engine.speculator.stats.num_accepted > 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="draft-model"):
        speculative("draft")
    with pytest.raises(ValueError, match="ngram or draft"):
        speculative("medusa")
    with pytest.raises(ValueError, match=">= 1"):
        speculative("ngram", k=0)


@pytest.mark.slow
def test_verification_steps_replay_the_graph_path(reference, monkeypatch):
    """With CUDA graphs, a verification step whose sequences all run the same number of tokens
    goes through the static buffers (captured graphs on a GPU; on the CPU the same buffers and
    padding feed an eager pass). Tokens unchanged."""
    from nanoserve.runner.cuda_graphs import CUDAGraphDecoder

    calls = []
    run_verify = CUDAGraphDecoder.run_verify
    monkeypatch.setattr(CUDAGraphDecoder, "run_verify",
                        lambda self, step, q: calls.append((step.num_seqs, q)) or run_verify(self, step, q))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = speculative("ngram", attention_backend="triton", cuda_graphs=True, device=device, k=2,
                      speculative_max_batch=4, kv_cache_memory=2**28)  # two engines share the GPU: 256 MiB each
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], params)
    if device == "cpu":
        expected = [reference[p][:12] for p in PROMPTS[:3]]
    else:  # against plain decoding on the same device (CPU and GPU float32 may part at a near-tie)
        plain = LLM(EngineConfig(model="tiny", device=device, dtype=torch.float32, kv_cache_memory=2**28))
        expected = [o.token_ids for o in plain.generate(PROMPTS[:3], params)]
    assert [o.token_ids for o in outs] == expected
    assert calls and {q for _, q in calls} <= {2, 3} and any(n == 3 for n, _ in calls)  # batch 3 padded to 4


def test_the_counters_reach_metrics_over_http():
    """Week 16's /metrics exports the speculation counters: the same figures as the engine's."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from nanoserve.testing import ServerThread

    kwargs = dict(speculative="ngram", num_speculative_tokens=3, dtype=torch.float32)
    with ServerThread(engine_kwargs=kwargs) as server:
        body = dict(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, ignore_eos=True)
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(server.url + "/metrics").text
        stats = server.engine.spec_stats()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["nanoserve:spec_decode_num_draft_tokens_total"] == stats["proposed"] > 0
    assert samples["nanoserve:spec_decode_num_accepted_tokens_total"] == stats["accepted"] > 0
    assert samples["nanoserve:spec_decode_num_emitted_tokens_total"] == stats["emitted"]
    assert stats["tokens_per_step"] > 1
