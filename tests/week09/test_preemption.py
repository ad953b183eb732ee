"""Week 9: preemption by recomputation when the block pool runs dry."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence, SequenceStatus
from nanoserve.testing import check_block_invariants, fitting_arrivals, make_checkpoint, run_scheduler, tiny_config

pytestmark = pytest.mark.exercise("make-room", "preempt-sequence")


def seq(prompt_len, max_tokens):
    return Sequence([3] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_preempts_the_newest_and_puts_it_first_in_line():
    s = Scheduler(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a, b = seq(4, 8), seq(4, 8)  # 12 tokens each at the end: 3 blocks each, 6 > 4
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [[7], [7]])  # both prefilled
    later = seq(1, 1)
    s.add(later)
    while s.num_preemptions == 0:
        batch = s.schedule()
        check_block_invariants(s, batch)
        s.update(batch, [[7]] * len(batch))
    assert b.num_preemptions == 1 and a.num_preemptions == 0  # the newer one gave way
    assert list(s.waiting) == [b, later]  # first in line, ahead of requests that never ran
    assert b.status is SequenceStatus.PREEMPTED
    assert not b.block_table and b.num_computed == 0  # its KV is gone...
    assert len(b.output_ids) == 5 and b.num_tokens == 9  # ... its tokens are not (9 > 2 blocks)
    assert s.running == [a]


def test_preempted_sequence_resumes_and_finishes():
    s = Scheduler(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    seqs = [seq(4, 12) for _ in range(3)]
    run_scheduler(s, {0: seqs}, on_step=lambda step, batch: check_block_invariants(s, batch))
    assert s.num_preemptions > 0
    assert all(len(q.output_ids) == 12 and q.finish_reason == "length" for q in seqs)
    assert s.allocator.num_free == 6


def test_a_request_that_can_never_fit_is_rejected():
    s = Scheduler(num_blocks=4, block_size=4, max_model_len=1000)
    with pytest.raises(ValueError, match="can never fit in the KV pool"):
        s.add(seq(10, 7))  # 17 tokens > 16 slots
    s.add(seq(10, 6))  # 16 tokens: fits alone


def test_without_preemption_running_dry_is_a_clear_error():
    from nanoserve.scheduler.blocks import OutOfBlocks

    s = Scheduler(num_blocks=3, block_size=4, max_model_len=64, preemption=False)
    with pytest.raises(OutOfBlocks, match="preemption is off"):
        run_scheduler(s, {0: [seq(4, 8), seq(4, 8)]})


def test_thousands_of_requests_with_a_small_pool():
    s = Scheduler(num_blocks=24, block_size=8, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=512)
    seqs = [seq(1 + i % 37, 1 + (i * 7) % 60) for i in range(2000)]
    arrivals = {i // 10: seqs[i : i + 10] for i in range(0, 2000, 10)}
    run_scheduler(s, arrivals)
    assert all(len(q.output_ids) == q.params.max_tokens for q in seqs)
    assert s.num_preemptions > 0 and s.allocator.num_free == 24


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20), st.integers(1, 30)), min_size=1, max_size=20),
       st.integers(6, 20), st.sampled_from([2, 4, 8]))
def test_random_runs_with_preemption_keep_the_invariants(requests, num_blocks, block_size):
    s = Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=1024)
    arrivals, seqs = fitting_arrivals(s, [(step, seq(prompt, out)) for step, prompt, out in requests])
    run_scheduler(s, arrivals, on_step=lambda step, batch: check_block_invariants(s, batch))
    assert all(len(q.output_ids) == q.params.max_tokens for q in seqs)
    assert s.allocator.num_free == num_blocks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("preempt") / "ckpt", tiny_config(num_hidden_layers=2))


def prompts():
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 20, 33, 2, 14, 9, 40, 11)]


def test_preemption_changes_no_token(ckpt):
    path, hf = ckpt
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ample = LLM(str(path), device="cpu", num_blocks=256, block_size=4).generate(prompts(), params)
    small = LLM(str(path), device="cpu", num_blocks=18, block_size=4)  # 72 slots for ~400 tokens
    squeezed = small.generate(prompts(), params)
    assert small.engine.scheduler.num_preemptions >= 5
    for p, a, b in zip(prompts(), ample, squeezed):
        assert a.token_ids == b.token_ids
        expected = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert b.token_ids == expected[0, len(p):].tolist()
    assert small.engine.scheduler.allocator.num_free == 18


def test_abort_mid_run_frees_everything_and_changes_nothing_else(ckpt):
    path, _ = ckpt
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = LLM(str(path), device="cpu", num_blocks=64, block_size=4).generate(prompts(), params)
    llm = LLM(str(path), device="cpu", num_blocks=30, block_size=4)
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts()]
    done = {}
    for step in range(200):
        if step == 6:
            eng.abort(ids[1])
            eng.abort(ids[6])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if not eng.has_unfinished():
            break
    assert set(done) == set(ids) - {ids[1], ids[6]}
    for i, rid in enumerate(ids):
        if rid in done:
            assert done[rid] == reference[i].token_ids
    assert eng.scheduler.allocator.num_free == 30 and not eng.requests
