"""Week 20: each pipeline stage in CUDA graphs for decode micro-batches (nanoserve/runner/stage_graphs.py).

On the CPU nothing is captured (`capture=False`): the stage's static buffers, the padding to a
captured size and the copies around the replay feed an eager pass over the stage's layers, which
is all but the replay itself. First two stages in this process, then real stage processes over
gloo (with the Triton backend through its interpreter, as the graph path needs); a test marked
`gpu` captures on two GPUs. Float32: greedy tokens equal one process's.
"""

from __future__ import annotations

import gc
import subprocess

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.model.loader import load_model
from nanoserve.model.pipeline import Stage, cut_stage, final_hidden, stage_forward, stage_layers
from nanoserve.runner.cuda_graphs import padded_size
from nanoserve.runner.pipeline import PipelineRunner
from nanoserve.runner.runner import ModelRunner
from nanoserve.runner.stage_graphs import StageGraphs
from nanoserve.runner.step import StepInput
from nanoserve.sampling.params import SamplingParams

CPU = dict(device="cpu", dtype=torch.float32)
ONE_AT_A_TIME = pytest.mark.xdist_group("week20-stages")


def decode_heavy():
    """Seven short prompts whose outputs end at different steps: decode batches of 7, 6, 5, 4 and 3
    sequences, most of them not a captured size (1, 2, 4, 8), so the padding is exercised."""
    gen = torch.Generator().manual_seed(20)
    prompts = [torch.randint(5, 4096, (k,), generator=gen).tolist() for k in (4, 2, 7, 3, 5, 1, 6)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 4, 6, 3, 5, 2, 6)]
    return prompts, params


@pytest.fixture(scope="module")
def expected():
    """One process's greedy tokens for `decode_heavy`, eager."""
    return tokens(LLM("tiny", **CPU), *decode_heavy())


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@torch.no_grad()
def test_two_stages_replay_their_buffers_like_the_whole_model():
    """Two stage runners with graph buffers in one process: a prompt step (eager), then decode steps
    of 3 and then 2 sequences through the buffers (3 padded to 4: a padding row with the scratch
    slot), the stream handed on as its real rows only. The final hidden states match the whole
    model's."""
    whole = ModelRunner(load_model("tiny"), num_blocks=8, block_size=4)
    stages = []
    for s in range(2):
        first, last = stage_layers(4, 2, s)
        model = cut_stage(load_model("tiny"), Stage(s, 2, first, last))
        stages.append(PipelineRunner(model, num_blocks=8, block_size=4, cuda_graphs=True, max_model_len=32,
                                     max_batch=8))
    assert all(isinstance(r.graphs, StageGraphs) and not r.graphs.capture for r in stages)
    assert stages[0].graphs.stream_in is None and stages[1].graphs.stream_in.shape == (8, 192)
    prefill = StepInput(list(range(7, 12)) + [40, 41, 42, 43, 44, 45], list(range(5)) + list(range(3)) + [0, 1, 2],
                        list(range(5)) + [8, 9, 10] + [16, 17, 18], [0, 5, 8, 11], [5, 3, 3],
                        [[0, 1], [2], [4]], [(0, 0), (1, 0), (2, 0)], [4, 7, 10])
    decode = StepInput([99, 98, 97], [5, 3, 3], [5, 11, 19], [0, 1, 2, 3], [6, 4, 4], [[0, 1], [2], [4]],
                       [(0, 0), (1, 0), (2, 0)], [0, 1, 2])
    decode2 = StepInput([96, 95], [6, 4], [6, 12], [0, 1, 2], [7, 5], [[0, 1], [2, 3]], [(0, 0), (1, 0)], [0, 1])
    for step in (prefill, decode, decode2):
        ids, positions, ctx = whole.prepare(step)
        expected = whole.model(ids, positions, ctx)
        stream = None
        for runner in stages:
            if step.is_decode:
                stream = runner.graphs.run_stage(step, stream)
            else:
                ids, positions, ctx = runner.prepare(step)
                stream = stage_forward(runner.model, ids if stream is None else stream, positions, ctx)
            assert stream.shape == (len(step.input_ids), 192)  # only the real rows travel
        torch.testing.assert_close(final_hidden(stages[0].model, stream), expected, rtol=1e-5, atol=1e-5)
        if step is decode:  # 3 rows padded to 4 on both stages: the padding row writes to the scratch slot
            for runner in stages:
                assert runner.graphs.inputs[2, :4].tolist() == [5, 11, 19, runner.graphs.scratch_slot]
            assert stages[1].graphs.stream_in[3].abs().sum() == 0  # a padding row of the input: zeros


def graph_llm(steps_in_flight, **kw):
    """PP = 2 on the CPU; a rank that hangs fails the test within a minute (`distributed_timeout`)."""
    return LLM("tiny", **CPU, pipeline_parallel_size=2, pipeline_steps_in_flight=steps_in_flight,
               max_num_seqs=8, enable_prefix_caching=False, distributed_timeout=60, **kw)


def ended_cleanly(procs, seconds=10.0) -> bool:
    """Every stage process exited with status 0 within `seconds` (killed, and False, otherwise)."""
    try:
        return all(p.wait(timeout=seconds) == 0 for p in procs)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return False


@pytest.mark.slow
@ONE_AT_A_TIME
@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_pp2_stage_graph_buffers_equal_pp1(steps_in_flight, expected):
    """Two stage processes (gloo), each decode micro-batch through its stage's graph buffers and
    padded to a captured size: the greedy tokens of one process, no KV block left behind, and the
    stage processes gone after `close`. With one step in flight, two micro-batches a step (4 + 3
    sequences); with two, a lane of 4 and one of 3."""
    prompts, params = decode_heavy()
    with graph_llm(steps_in_flight, attention_backend="triton", cuda_graphs=True) as llm:
        graphs = llm.engine.runner.graphs
        assert isinstance(graphs, StageGraphs) and not graphs.capture
        seen = []
        run_stage = graphs.run_stage
        graphs.run_stage = lambda step, received: seen.append(step.num_seqs) or run_stage(step, received)
        assert tokens(llm, prompts, params) == expected
        assert seen and any(n != padded_size(n, graphs.sizes) for n in seen)  # decodes padded on stage 0
        alloc = llm.engine.scheduler.allocator
        assert alloc.num_free == alloc.num_blocks
        procs = list(llm.engine.workers.procs)
    assert ended_cleanly(procs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: run on a 2-GPU machine")
@pytest.mark.parametrize("steps_in_flight", [1, 2])
def test_pp2_stage_graphs_on_two_gpus_equal_one_gpu(steps_in_flight):
    """Real captures: each stage replays its graphs (the default on CUDA with the Triton backend),
    NCCL between them. Float32: the greedy tokens of one GPU with its own graphs."""
    kw = dict(device="cuda", dtype=torch.float32, gpu_memory_utilization=0.3, max_num_seqs=8)
    prompts, params = decode_heavy()
    one = LLM("tiny", **kw)
    assert one.engine.runner.graphs.capture
    expected = tokens(one, prompts, params)
    del one
    gc.collect()
    with LLM("tiny", pipeline_parallel_size=2, pipeline_steps_in_flight=steps_in_flight, **kw) as llm:
        graphs = llm.engine.runner.graphs
        assert isinstance(graphs, StageGraphs) and graphs.capture and graphs.graphs
        assert tokens(llm, prompts, params) == expected
        procs = list(llm.engine.workers.procs)
    assert ended_cleanly(procs)
