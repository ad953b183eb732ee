"""Week 20: several engine steps in flight through a pipeline's stages, each of its own lane of
sequences (nanoserve/engine/steps_in_flight.py, nanoserve/scheduler/lanes.py).

The first tests run in this process: an engine whose runner only *defers* each step's logits
(`Deferred`: computed at launch, handed over when the step lands, as a pipeline would) drives the
lanes through prompts in chunks, preemption, aborts and stop strings, checking the lanes'
invariants at every step. The others start real stage processes (gloo): PP=2, and TP=2 × PP=2.
Float32: greedy tokens equal one process's.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.engine.steps_in_flight import StepsInFlight
from nanoserve.sampling.params import SamplingParams

CPU = dict(device="cpu", dtype=torch.float32)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ONE_AT_A_TIME = pytest.mark.xdist_group("week20-stages")


def prompts(n=6, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (k,), generator=gen).tolist() for k in (3, 17, 9, 30, 1, 22, 5, 11)[:n]]


def tokens(llm, ps, params=GREEDY):
    return [o.token_ids for o in llm.generate(ps, params)]


class Deferred:
    """A runner whose steps land later, as they would from a pipeline: `launch` runs the forward
    pass and keeps its logits; `land_oldest` hands the oldest over."""

    def __init__(self, runner):
        self.runner, self.pending, self.launches = runner, [], 0

    def launch(self, batch):
        self.pending.append(self.runner.execute(batch))
        self.launches += 1

    def land_oldest(self):
        return self.pending.pop(0)


class Checked(StepsInFlight):
    """StepsInFlight that checks the lanes' invariants around every step."""

    def step(self, sample):
        batch, done = super().step(sample)
        lanes = self.lanes
        in_flight = [f.lane for f in self.flights]
        assert in_flight == lanes.in_flight and len(set(in_flight)) == len(in_flight) <= lanes.num_lanes
        if batch.seqs:
            lanes.check(batch, in_flight[-1])  # the batch launched is its lane's
        flying = [s.seq_id for f in self.flights for s in f.batch.seqs]
        assert len(flying) == len(set(flying)), "a sequence is in two steps in flight"
        running = self.scheduler.running
        assert {s.seq_id for s in running} <= set(lanes.lane_of)  # each running sequence in one lane (a dict)
        assert all(0 <= lanes.lane_of[s.seq_id] < lanes.num_lanes for s in running)
        assert len(running) <= self.scheduler.max_num_seqs
        return batch, done


def deferred_llm(depth=2, **kw):
    llm = LLM("tiny", **CPU, **kw)
    runner = Deferred(llm.engine.runner)
    llm.engine.pipelined = Checked(llm.engine.scheduler, runner, depth)
    return llm, runner


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, block_size=4, num_blocks=14, max_num_seqs=4),
    dict(enable_chunked_prefill=False, block_size=4, num_blocks=16, max_num_seqs=5),
])
def test_lanes_give_the_tokens_of_one_step_at_a_time(depth, options):
    """Prompts in chunks, a pool small enough to preempt: the same greedy tokens as an engine
    running one step at a time, every step inside the lanes' rules, and no block left behind."""
    expected = tokens(LLM("tiny", **CPU, **options), prompts())
    llm, runner = deferred_llm(depth, **options)
    assert tokens(llm, prompts()) == expected
    assert runner.launches == llm.engine.num_steps and not runner.pending
    if "num_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0  # the small pool did preempt
    scheduler = llm.engine.scheduler
    assert not scheduler.running and not scheduler.waiting and not llm.engine.pipelined.busy
    assert scheduler.allocator.num_free == scheduler.allocator.num_blocks or scheduler.prefix_caching


def test_steps_overlap_and_lanes_are_balanced():
    """Six requests over two lanes: three each; two steps are in flight once both lanes run."""
    llm, runner = deferred_llm(2, enable_prefix_caching=False)
    engine = llm.engine
    for p in prompts():
        engine.add_request(p, GREEDY)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(runner.pending))
        if engine.num_steps == 2:
            lanes = engine.pipelined.lanes
            assert sorted(lanes.lane_of.values()) == [0, 0, 0, 1, 1, 1]
    assert most == 2
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks  # no block leaked


def test_an_abort_while_in_flight_frees_its_blocks_and_gets_no_token():
    llm, runner = deferred_llm(2, enable_prefix_caching=False)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts(4)]
    engine.step()  # lane 0 launched: the first two requests
    flying = {s.seq_id for f in engine.pipelined.flights for s in f.batch.seqs}
    victim = ids[0]
    assert victim in flying
    assert engine.abort(victim).finish_reason == "abort"
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert victim not in {o.request_id for o in outs}
    assert {o.request_id for o in outs if o.finished} == set(ids[1:])
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_blocks and not runner.pending


def test_stop_strings_and_eos_end_a_request_in_its_lane():
    """A stop token and a stop string, found when the step lands: the same text and reasons as one
    step at a time, and nothing sampled past the end is delivered."""
    one = LLM("tiny", **CPU)
    free = one.generate(prompts(3), GREEDY)
    stop_token = free[1].token_ids[4]
    stop_text = free[2].text[3:7]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0, max_tokens=12, stop=[stop_text], ignore_eos=True),
              GREEDY]
    expected = one.generate(prompts(3)[1:3] + prompts(3)[:1], params)
    llm, _ = deferred_llm(2)
    got = llm.generate(prompts(3)[1:3] + prompts(3)[:1], params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in expected]
    assert got[0].finish_reason == "stop" and got[1].finish_reason == "stop"


def test_the_option_and_what_it_refuses():
    with pytest.raises(ValueError, match="pipeline_steps_in_flight shapes the flow"):
        LLM("tiny", **CPU, pipeline_steps_in_flight=2)
    with pytest.raises(ValueError, match="pipeline_steps_in_flight must be at least 1"):
        LLM("tiny", **CPU, pipeline_parallel_size=2, pipeline_steps_in_flight=0)
    with pytest.raises(ValueError, match="needs batching='continuous'"):
        LLM("tiny", **CPU, pipeline_parallel_size=2, pipeline_steps_in_flight=2, batching="static")


def test_the_defaults():
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.pipeline import pipeline_depths

    assert pipeline_depths(EngineConfig()) == (1, 1)
    assert pipeline_depths(EngineConfig(pipeline_parallel_size=2)) == (2, 1)  # steps in flight, one micro-batch
    assert pipeline_depths(EngineConfig(pipeline_parallel_size=3, pipeline_steps_in_flight=1)) == (1, 3)  # week 20's
    assert pipeline_depths(EngineConfig(pipeline_parallel_size=2, pipeline_micro_batches=2)) == (2, 2)
    assert pipeline_depths(EngineConfig(pipeline_parallel_size=2, batching="static")) == (1, 2)


# ----------------------------------------------------------------------- stage processes


@pytest.mark.slow
@ONE_AT_A_TIME
@pytest.mark.parametrize("micro", [1, 2])
def test_pp2_steps_in_flight_with_chunks_preemption_and_aborts(micro):
    """Two stage processes, two steps in flight (with one or two micro-batches each): prompts in
    chunks and a small pool (preemption) give one process's tokens; then a request aborted while
    its step is in flight, and every block back."""
    kw = dict(CPU, enable_chunked_prefill=True, max_num_batched_tokens=16, num_blocks=14, block_size=4,
              max_num_seqs=4, enable_prefix_caching=False)
    expected = tokens(LLM("tiny", **kw), prompts())
    with LLM("tiny", pipeline_parallel_size=2, pipeline_micro_batches=micro, **kw) as llm:
        engine = llm.engine
        assert engine.pipelined is not None and engine.pipelined.lanes.num_lanes == 2
        assert tokens(llm, prompts()) == expected
        assert engine.scheduler.num_preemptions > 0
        stats = engine.pipeline_stats()
        assert stats["steps"] == engine.num_steps and stats["steps_in_flight"] == 2
        ids = [engine.add_request(p, GREEDY) for p in prompts(4)]
        engine.step()
        engine.step()
        flying = [s.seq_id for f in engine.pipelined.flights for s in f.batch.seqs]
        assert flying
        engine.abort(flying[0])
        done = set()
        while engine.has_unfinished():
            done |= {o.request_id for o in engine.step() if o.finished}
        assert done == set(ids) - {flying[0]}
        assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks


@pytest.mark.slow
@ONE_AT_A_TIME
def test_tp2_times_pp2_steps_in_flight():
    """Stage 0 of two tensor-parallel ranks: the worker beside the driver lands each step when the
    driver does (the head's collectives pair up), by the driver's messages."""
    expected = tokens(LLM("tiny", **CPU), prompts(5))
    with LLM("tiny", **CPU, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        assert llm.engine.pipelined is not None
        assert tokens(llm, prompts(5)) == expected


@pytest.mark.slow
@ONE_AT_A_TIME
def test_bench_throughput_says_how_many_steps_were_in_flight(tmp_path, capsys):
    """`nanoserve bench throughput -pp 2` on the CPU: the bubble line names the steps in flight, and
    the saved bubble says two overlapped."""
    import json

    from nanoserve.cli import main

    assert main(["bench", "throughput", "--model", "tiny", "--device", "cpu", "--pipeline-parallel-size", "2",
                 "--num-requests", "6", "--lengths", "8,16", "--output-len", "4,8", "--no-hf",
                 "--out", str(tmp_path)]) == 0
    assert "up to 2 steps in flight" in capsys.readouterr().out
    bubble = json.loads((tmp_path / "throughput.json").read_text())["rows"][0]["pipeline_bubble"]
    assert bubble["steps_in_flight"] == 2
