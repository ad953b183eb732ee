"""Week 16: priority scheduling. Lower priority
values run first, preemption takes the worst-ranked sequence, and aging keeps anyone from
waiting forever. FCFS stays the default and is unchanged."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence
from nanoserve.testing import check_block_invariants, fitting_arrivals, make_checkpoint, run_scheduler, tiny_config

pytestmark = pytest.mark.exercise("priority")


def seq(prompt_len, max_tokens, priority=0):
    return Sequence([3] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens), priority=priority)


def scheduler(num_blocks=64, max_num_seqs=1, **kw):
    return Scheduler(num_blocks, 4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256,
                     scheduling="priority", **kw)


def test_the_best_priority_is_admitted_first_fcfs_among_equals():
    s = scheduler(max_num_seqs=1)
    low1, low2, high, mid = seq(2, 3, 5), seq(2, 3, 5), seq(2, 3, 0), seq(2, 3, 2)
    order = []
    run_scheduler(s, {0: [low1, low2, high, mid]},
                  on_step=lambda step, batch: order.extend(q for q in batch.seqs if q not in order))
    assert order == [high, mid, low1, low2]


def test_fcfs_is_the_default_and_ignores_priority():
    s = Scheduler(64, 4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
    a, b = seq(2, 3, 5), seq(2, 3, 0)
    order = []
    run_scheduler(s, {0: [a, b]}, on_step=lambda step, batch: order.extend(q for q in batch.seqs if q not in order))
    assert order == [a, b]


def test_preemption_takes_the_lowest_priority_even_if_older():
    s = scheduler(num_blocks=6, max_num_seqs=4)
    old_low, new_high = seq(4, 12, priority=9), seq(4, 12, priority=0)
    s.add(old_low)
    s.update(s.schedule(), [[7]])
    s.add(new_high)
    while s.num_preemptions == 0:
        batch = s.schedule()
        check_block_invariants(s, batch)
        s.update(batch, [[7]] * len(batch))
    assert old_low.num_preemptions == 1 and new_high.num_preemptions == 0
    assert s.running == [new_high]


def test_aging_lets_a_low_priority_request_through_a_stream_of_high_ones():
    """One seat; a high-priority request arrives every step. Without aging the low one would never
    run; with aging_steps=5 and a gap of 10 levels it gains a level every 5 steps in the queue."""
    s = scheduler(max_num_seqs=1, aging_steps=5)
    low = seq(1, 1, priority=10)
    highs = [seq(1, 1, priority=0) for _ in range(200)]
    arrivals = {i: [h] for i, h in enumerate(highs)}
    arrivals[0] = [low] + arrivals[0]
    admitted_at = {}

    def on_step(step, batch):
        for q in batch.seqs:
            admitted_at.setdefault(q.seq_id, step)

    run_scheduler(s, arrivals, on_step=on_step)
    assert low.num_output_tokens == 1
    # Its rank reaches 0 after 10 levels x 5 = 50 counted steps (the step it arrives in counts:
    # steps 0..49); from then on it ties with the high ones and wins on arrival order.
    assert admitted_at[low.seq_id] == 49


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 20), st.integers(1, 15), st.integers(0, 4)),
                min_size=1, max_size=16), st.integers(8, 24))
def test_random_runs_keep_the_invariants_and_finish(requests, num_blocks):
    s = Scheduler(num_blocks, 4, max_num_seqs=5, max_num_batched_tokens=48, max_model_len=256,
                  scheduling="priority", aging_steps=3)
    arrivals, seqs = fitting_arrivals(s, [(step, seq(prompt, out, prio)) for step, prompt, out, prio in requests])
    run_scheduler(s, arrivals, on_step=lambda step, batch: check_block_invariants(s, batch))
    assert all(q.num_output_tokens == q.params.max_tokens for q in seqs)
    assert s.allocator.num_free == num_blocks


def test_engine_outputs_do_not_depend_on_the_order(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    gen = torch.Generator().manual_seed(18)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 30, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(str(path), dtype=torch.float32, num_blocks=64, block_size=8, max_num_seqs=2,
                  scheduling_policy=policy)
        engine = llm.engine
        ids = [engine.add_request(p, params, priority=3 - i) for i, p in enumerate(prompts)]  # the last is best
        finished_at = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    finished_at[o.request_id] = (engine.num_steps, o.token_ids)
        outs[policy] = [finished_at[i][1] for i in ids]
        first = min(finished_at, key=lambda i: finished_at[i][0])
        assert first == (ids[-1] if policy == "priority" else ids[0])
    assert outs["priority"] == outs["fcfs"]  # the same tokens, in another order of work


def test_options_of_the_continuous_policy_are_refused_with_another():
    import pytest

    for kw in (dict(scheduling="priority"), dict(prefix_caching=True), dict(chunked_prefill=True)):
        with pytest.raises(ValueError, match="continuous batching only, not 'static'"):
            Scheduler(16, 4, batching="static", **kw)
