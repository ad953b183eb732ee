"""Week 15: chunked prefill. Decodes first, prompts cut to fit the token budget; the same tokens
as without chunks, every step within the budget, running streams never stalled by a long prompt."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence, SequenceStatus
from nanoserve.testing import check_block_invariants, fitting_arrivals, make_checkpoint, run_scheduler, tiny_config

pytestmark = pytest.mark.exercise("chunked")


def seq(prompt_len, max_tokens, token=3):
    return Sequence([token] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens))


def chunked(num_blocks=512, block_size=16, budget=64, max_num_seqs=64, **kw):
    return Scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=8192, chunked_prefill=True, **kw)


# ------------------------------------------------------------------------------ the scheduler


def test_a_prompt_is_cut_to_the_budget_and_samples_after_its_last_chunk():
    s = chunked(budget=16)
    a = seq(40, 2)
    s.add(a)
    sizes, samples = [], []
    while a.num_output_tokens == 0:
        batch = s.schedule()
        sizes.append(batch.num_new_tokens[0])
        samples.append(batch.num_samples[0])
        s.update(batch, [[7] * k for k in batch.num_samples])
    assert sizes == [16, 16, 8] and samples == [0, 0, 1]


@pytest.mark.exercise("admit-chunks")
def test_decodes_first_then_chunks_and_min_chunk():
    s = chunked(budget=20, block_size=4)
    streams = [seq(2, 50) for _ in range(6)]
    run_steps = 0
    for q in streams:
        s.add(q)
    s.update(s.schedule(), [[7]] * 6)  # all six prefilled together (12 tokens)
    long = seq(100, 1)
    s.add(long)
    while long.num_output_tokens == 0:
        batch = s.schedule()
        assert batch.seqs[:6] == streams and batch.num_new_tokens[:6] == [1] * 6  # every stream, every step
        assert batch.num_scheduled_tokens <= 20
        s.update(batch, [[7] * k for k in batch.num_samples])
        run_steps += 1
    assert run_steps == -(-100 // 14)  # 14 tokens a step are left for the prompt
    # A new prompt is not admitted for a sliver of the budget (less than min_chunk = block size)
    s2 = chunked(budget=9, block_size=4)
    for q in [seq(1, 50) for _ in range(6)]:
        s2.add(q)
    s2.update(s2.schedule(), [[7]] * 6)
    s2.add(seq(30, 1))
    batch = s2.schedule()
    assert len(batch) == 6 and batch.num_scheduled_tokens == 6  # 3 left < 4: the prompt waits
    s3 = chunked(budget=10, block_size=4)
    for q in [seq(1, 50) for _ in range(6)]:
        s3.add(q)
    s3.update(s3.schedule(), [[7]] * 6)
    s3.add(seq(30, 1))
    assert s3.schedule().num_new_tokens == [1] * 6 + [4]


def test_a_4000_token_prompt_never_stalls_32_decoding_streams():
    s = chunked(num_blocks=2048, budget=512)
    streams = [seq(50 + i, 400) for i in range(32)]
    arrivals = {0: streams, 5: [seq(4000, 5)]}
    got_token = []

    def on_step(step, batch):
        check_block_invariants(s, batch)
        assert batch.num_scheduled_tokens <= 512
        if step >= 5:
            decoding = [q for q in streams if q.status is SequenceStatus.RUNNING]
            got_token.append(all(q in batch.seqs for q in decoding))

    run_scheduler(s, arrivals, on_step=on_step)
    assert got_token and all(got_token)
    assert all(q.num_output_tokens == 400 for q in streams)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=20),
       st.integers(8, 40), st.sampled_from([2, 4, 8]), st.integers(1, 48), st.booleans(), st.lists(st.integers(0, 60)))
def test_random_runs_keep_the_invariants(requests, num_blocks, block_size, budget, caching, aborts):
    """Arrivals, chunks, preemption (small pools), prefix caching on or off, aborts: after every
    step the blocks are consistent, the budget holds, a sequence samples only after its last
    prompt token, and every request that was not aborted ends with all its tokens."""
    s = Scheduler(num_blocks, block_size, max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=1024,
                  chunked_prefill=True, prefix_caching=caching)
    arrivals, seqs = fitting_arrivals(s, [(step, seq(prompt, out, token=1 + step % 3))
                                          for step, prompt, out in requests])

    def on_step(step, batch):
        if caching:
            s.allocator.check_invariants([q.block_table for q in s.running])
        else:
            check_block_invariants(s, batch)
        assert batch.num_scheduled_tokens <= budget
        for q, n, k in zip(batch.seqs, batch.num_new_tokens, batch.num_samples):
            assert len(q.block_table) * block_size >= q.num_computed + n
            assert k == (q.num_computed + n == q.num_tokens)
        if step in aborts and s.running:
            s.finish(s.running[0], "abort")

    run_scheduler(s, arrivals, on_step=on_step)
    assert s.allocator.num_free == num_blocks
    assert all(q.num_output_tokens == q.params.max_tokens for q in seqs if q.finish_reason != "abort")


# ------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("w15") / "ckpt", tiny_config(num_hidden_layers=2))


def prompts():
    gen = torch.Generator().manual_seed(15)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 40, 17, 70, 1, 33)]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def generate(path, **kw):
    args = dict(dtype=torch.float32, device="cpu", num_blocks=64, block_size=8, trace=True, max_num_seqs=8)
    llm = LLM(str(path), **(args | kw))
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)], llm.engine


@pytest.mark.parametrize("budget", [1, 3, 16, 50, 500])
def test_chunked_equals_unchunked(ckpt, budget):
    path, hf = ckpt
    expected, _ = generate(path)
    # A budget under the 8 seats: the engine warns that prompts could starve behind the decodes.
    warned = pytest.warns(UserWarning, match="lower --max-num-seqs") if budget < 8 else contextlib.nullcontext()
    with warned:
        got, engine = generate(path, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    assert got == expected
    assert all(sum(r.num_new_tokens) <= budget for r in engine.trace)
    assert engine.scheduler.allocator.num_free == 64
    if budget == 16:
        for prompt, out in zip(prompts(), got):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert out == ref[0, len(prompt):].tolist()


def test_chunks_with_preemption_and_prefix_caching(ckpt):
    """A pool of 16 blocks of 8: partly prefilled sequences are preempted and come back; with
    prefix caching too, they find their own chunks in the cache."""
    path, _ = ckpt
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    shared = prompts()[3]
    ps = [shared[:24] + p for p in prompts()[:4]]
    outs = []
    for kw in ({}, dict(enable_chunked_prefill=True, max_num_batched_tokens=24),
               dict(enable_chunked_prefill=True, max_num_batched_tokens=24, enable_prefix_caching=True)):
        llm = LLM(str(path), dtype=torch.float32, device="cpu", num_blocks=16, block_size=8, max_num_seqs=4, **kw)
        outs.append([o.token_ids for o in llm.generate(ps, params)])
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.allocator.num_used == 0
    assert outs[0] == outs[1] == outs[2]


def test_streams_get_a_token_every_step_while_a_long_prompt_prefills(ckpt):
    """The engine's own trace: while a 600-token prompt goes through in chunks, each of the 8
    streams already decoding is in every step; and their tokens are those of an unchunked run."""
    path, _ = ckpt
    gen = torch.Generator().manual_seed(3)
    streams = [torch.randint(0, 4096, (6,), generator=gen).tolist() for _ in range(8)]
    long_prompt = torch.randint(0, 4096, (600,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    results = {}
    for chunk in (False, True):
        llm = LLM(str(path), dtype=torch.float32, device="cpu", num_blocks=256, block_size=8, trace=True,
                  enable_chunked_prefill=chunk, max_num_batched_tokens=64 if chunk else 8192, max_num_seqs=16)
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in streams]
        engine.step()  # the streams' prompts
        engine.step()  # their first decode
        long_id = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        results[chunk] = [outs[i] for i in ids + [long_id]]
        if chunk:
            steps = [r for r in engine.trace[2:] if long_id in r.seq_ids]
            assert len(steps) >= 600 // 64
            for r in steps:
                assert sum(r.num_new_tokens) <= 64
                assert all(i in r.seq_ids for i in ids)  # no stream skipped a step
    assert results[True] == results[False]


@pytest.mark.slow
def test_mixed_steps_on_the_triton_backend(ckpt):
    """Decodes and prompt chunks in one launch of the paged-attention kernel (interpreted on the
    CPU), with the fused kernels: the same tokens as HF."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    path, hf = ckpt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), dtype=torch.float32, device=device, attention_backend="triton", num_blocks=64, block_size=8,
              enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=8, fused_kernels=True,
              cuda_graphs=False)
    assert_greedy_equals_hf(llm, hf, device)


def assert_greedy_equals_hf(llm, hf, device):
    ps = prompts()[:4]
    outs = [o.token_ids for o in llm.generate(ps, GREEDY)]
    hf = hf.to(device)
    for prompt, out in zip(ps, outs):
        ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("budget", [24, 100])
def test_mixed_steps_replay_the_graph_path(ckpt, budget, monkeypatch):
    """With CUDA graphs, mixed steps (decodes and a chunk) go through the static buffers of the
    padded token count (captured graphs on a GPU; on the CPU the same buffers and padding feed an
    eager pass): the same tokens as HF. A budget of 100 is no captured size: the largest graph
    holds exactly the budget."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    from nanoserve.runner.cuda_graphs import CUDAGraphDecoder

    calls = []
    run_mixed = CUDAGraphDecoder.run_mixed
    monkeypatch.setattr(CUDAGraphDecoder, "run_mixed",
                        lambda self, step, t, *last: calls.append((len(step.input_ids), t)) or run_mixed(self, step, t, *last))
    path, hf = ckpt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), dtype=torch.float32, device=device, attention_backend="triton", num_blocks=64, block_size=8,
              enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=8, cuda_graphs=True)
    assert_greedy_equals_hf(llm, hf, device)
    assert calls and all(real <= t <= budget for real, t in calls)
    assert any(real < t for real, t in calls)  # padded


def test_a_budget_below_the_seat_count_warns(ckpt):
    path, _ = ckpt
    with pytest.warns(UserWarning, match="raise --max-num-batched-tokens or lower --max-num-seqs"):
        LLM(str(path), dtype=torch.float32, device="cpu", num_blocks=16, enable_chunked_prefill=True,
            max_num_batched_tokens=8, max_num_seqs=16)
