"""Week 7: static batching. A batch runs to its end; newcomers wait for the whole batch."""

import pytest
import torch

from nanoserve.scheduler.blocks import blocks_needed
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence, SequenceStatus
from nanoserve.testing import check_block_invariants, make_checkpoint, run_scheduler, tiny_config

pytestmark = pytest.mark.exercise("static")


def seq(prompt_len, max_tokens):
    return Sequence([3] * prompt_len, SamplingParams(temperature=0, max_tokens=max_tokens))


def static(**kw):
    args = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    args.update(kw)
    return Scheduler(**args, batching="static")


def test_never_admits_into_a_running_batch():
    s = static()
    first = [seq(5, 3), seq(2, 10), seq(7, 1)]
    late = [seq(4, 2), seq(4, 2)]
    admitted_at = {}

    def watch(step, batch):
        check_block_invariants(s, batch)
        for q in batch.seqs:
            admitted_at.setdefault(q.seq_id, step)
        # While any of the first batch runs, nobody else does.
        if any(q.status is SequenceStatus.RUNNING for q in first):
            assert all(q in first for q in batch.seqs)

    steps = run_scheduler(s, {0: first, 2: late}, on_step=watch)
    assert [admitted_at[q.seq_id] for q in first] == [0, 0, 0]
    # The batch lasts as long as its longest member (10 tokens): head-of-line blocking.
    assert [admitted_at[q.seq_id] for q in late] == [10, 10]
    assert steps == 12
    assert s.allocator.num_free == s.allocator.num_blocks


def test_reserves_each_requests_whole_length_up_front():
    s = static()
    a, b = seq(5, 11), seq(1, 2)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 1]
    assert len(a.block_table) == blocks_needed(16, 4) and len(b.block_table) == blocks_needed(3, 4)


def test_fcfs_and_limits():
    s = static(max_num_seqs=2)
    seqs = [seq(4, 2), seq(4, 2), seq(4, 2), seq(9, 1), seq(1, 1)]

    def watch(step, batch):
        check_block_invariants(s, batch)
        assert len(batch) <= 2
        ids = [q.seq_id for q in batch.seqs]
        assert ids == sorted(ids)  # first come, first served

    run_scheduler(s, {0: seqs}, on_step=watch)
    assert all(q.finish_reason == "length" for q in seqs)


def test_memory_limits_the_batch():
    s = static(num_blocks=6, block_size=4)  # 24 token slots
    seqs = [seq(4, 4), seq(4, 4), seq(4, 4)]  # 8 slots each: 2 blocks each... 3 fit exactly
    s.add(seqs[0])
    s.add(seqs[1])
    s.add(seqs[2])
    s.add(seq(4, 4))
    assert len(s.schedule()) == 3  # the fourth would need blocks nobody has


def test_static_engine_matches_hf(tmp_path):
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config())
    llm = LLM(str(path), device="cpu", num_blocks=128, batching="static", max_num_seqs=3)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (3, 30, 9, 17, 1)]
    lengths = [5, 12, 3, 8, 6]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths])
    for p, m, out in zip(prompts, lengths, outs):
        expected = hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
        assert out.token_ids == expected[0, len(p):].tolist()
    assert llm.engine.scheduler.allocator.num_free == 128


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown batching 'fifo'"):
        Scheduler(8, 4, batching="fifo")
