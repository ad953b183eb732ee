"""Week 8: continuous batching. Every step retires the finished and admits the waiting."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence
from nanoserve.testing import check_block_invariants, make_checkpoint, run_scheduler, tiny_config

pytestmark = pytest.mark.exercise("continuous")


def seq(prompt_len, max_tokens):
    return Sequence([3] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens))


def sched(batching="continuous", **kw):
    args = dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)
    args.update(kw)
    return Scheduler(**args, batching=batching, preemption=False)


def arrival_pattern():
    rng = random.Random(0)
    return {step: [seq(rng.randint(1, 12), rng.randint(1, 20)) for _ in range(rng.randint(0, 3))]
            for step in range(0, 40, 3)}


def test_fewer_steps_than_static():
    static_steps = run_scheduler(sched("static"), arrival_pattern())
    continuous_steps = run_scheduler(sched("continuous"), arrival_pattern())
    assert continuous_steps < static_steps, (continuous_steps, static_steps)


def test_joins_mid_flight_and_leaves_when_done():
    s = sched()
    long, short, late = seq(4, 10), seq(4, 2), seq(3, 2)
    steps_of = {}

    def watch(step, batch):
        for q, n in zip(batch.seqs, batch.num_new_tokens):
            steps_of.setdefault(q.seq_id, []).append((step, n))

    run_scheduler(s, {0: [long, short], 3: [late]}, on_step=watch)
    assert steps_of[short.seq_id] == [(0, 4), (1, 1)]  # prefill, one decode, gone
    assert steps_of[late.seq_id] == [(3, 3), (4, 1)]  # joined while `long` was still running
    assert steps_of[long.seq_id][3] == (3, 1)  # ... in the same step as long's decode


def test_limits_hold_every_step():
    s = sched(max_num_seqs=3, max_num_batched_tokens=12, num_blocks=40)
    pattern = arrival_pattern()

    def watch(step, batch):
        check_block_invariants(s, batch)
        assert len(s.running) <= 3 and len(batch) <= 3
        prefills = [n for n in batch.num_new_tokens if n > 1]
        assert batch.num_scheduled_tokens <= 12 or (len(prefills) == 1 and batch.num_scheduled_tokens == prefills[0] + len(batch) - 1)

    run_scheduler(s, pattern, on_step=watch)
    assert s.allocator.num_free == 40


def test_fcfs_nobody_overtakes_the_head():
    s = sched(num_blocks=6, max_num_batched_tokens=100)  # 24 token slots
    big, small = seq(18, 2), seq(1, 1)
    s.add(seq(8, 14))  # takes 2 blocks, runs long
    s.schedule()
    s.add(big)  # needs 5 blocks, 4 are free: it waits
    s.add(small)  # would fit now, but must not jump the queue
    batch = s.schedule()
    assert big not in batch.seqs and small not in batch.seqs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20), st.integers(1, 25)), min_size=1, max_size=25),
       st.integers(1, 6), st.sampled_from([8, 16, 64]))
def test_random_runs_keep_the_invariants(requests, max_seqs, budget):
    s = sched(num_blocks=200, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    arrivals = {}
    seqs = []
    for step, prompt, out in requests:
        q = seq(prompt, out)
        seqs.append(q)
        arrivals.setdefault(step, []).append(q)
    run_scheduler(s, arrivals, on_step=lambda step, batch: check_block_invariants(s, batch))
    assert all(len(q.output_ids) == q.params.max_tokens for q in seqs)
    assert s.allocator.num_free == 200


def test_engine_with_staggered_arrivals_matches_hf(tmp_path):
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config())
    llm = LLM(str(path), device="cpu", num_blocks=128, max_num_seqs=3, max_num_batched_tokens=40)
    eng = llm.engine
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (3, 30, 9, 17, 1, 25)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids = {}
    results = {}
    step = 0
    while len(results) < len(prompts):
        if step < len(prompts):  # one new request per step, while others are mid-flight
            ids[eng.add_request(prompts[step], params)] = step
        for out in eng.step():
            if out.finished:
                results[ids[out.request_id]] = out.token_ids
        step += 1
    for i, p in enumerate(prompts):
        expected = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert results[i] == expected[0, len(p):].tolist()
    assert eng.scheduler.allocator.num_free == 128
