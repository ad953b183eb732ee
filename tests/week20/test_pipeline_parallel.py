"""Week 20: pipeline parallelism. The model cut into stages of whole layers, a step's batch cut into
micro-batches that flow through them, on CPU processes talking gloo (and two GPUs talking NCCL,
marked gpu).

The first tests run in this process: the schedule's invariants, the split of layers and of
sequences, and a chain of stages built from one checkpoint giving bit for bit the hidden states of
the whole model. The others start real stage processes (a few seconds each on the CPU).

Float32 throughout: a stage runs the same layers on the same rows as one process does, and hands
on the stream exactly (nanoserve/model/pipeline.py), so greedy tokens are equal; with tensor
parallelism inside the stages the sums of week 18 add in another order, and tokens stay equal on
these prompts (no near-ties, as in tests/week18).
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time

import psutil
import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.distributed import WorkerFailed
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import load_model, resolve_model_dir
from nanoserve.model.pipeline import (
    Stage,
    check_pipelinable,
    cut_stage,
    final_hidden,
    stage_forward,
    stage_layers,
)
from nanoserve.runner.pipeline import (
    bubble_fraction,
    micro_batches,
    pipeline_schedule,
    split_sequences,
    stage_timeline,
)
from nanoserve.runner.runner import ModelRunner
from nanoserve.runner.step import StepInput
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_checkpoint, make_family_checkpoint, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CPU = dict(device="cpu", dtype=torch.float32)
ONE_AT_A_TIME = pytest.mark.xdist_group("week20-stages")  # tests that start stage processes share one xdist worker


def ragged_prompts(n=5, seed=3):
    """Prompts of different lengths (token ids), so the micro-batches differ in size."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4096, (k,), generator=gen).tolist() for k in (3, 17, 9, 30, 1)[:n]]


def tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def gone_within(pids, seconds=10.0) -> bool:
    """True once none of `pids` runs (a zombie, exited but not yet reaped, counts as gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------------------- the schedule


@pytest.mark.exercise("pipeline-schedule")
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("num_micro", [1, 2, 3, 5, 8])
def test_the_schedule_moves_every_micro_batch_through_every_stage_in_order(num_stages, num_micro):
    schedule = pipeline_schedule(num_stages, num_micro)
    assert len(schedule) == num_micro + num_stages - 1
    for cells in schedule:  # a stage runs one micro-batch at a time
        stages = [s for s, _ in cells]
        assert len(stages) == len(set(stages))
    for i in range(num_micro):  # micro-batch i visits stages 0, 1, ..., P-1 once each, in consecutive slots
        visits = sorted((t, s) for t, cells in enumerate(schedule) for s, m in cells if m == i)
        assert [s for _, s in visits] == list(range(num_stages))
        assert [t for t, _ in visits] == list(range(visits[0][0], visits[0][0] + num_stages))
    for s in range(num_stages):  # each stage runs the micro-batches in order, each once
        assert [m for m in stage_timeline(schedule, s) if m is not None] == list(range(num_micro))
    idle_cells = sum(num_stages - len(cells) for cells in schedule)
    assert idle_cells / (num_stages * len(schedule)) == pytest.approx(bubble_fraction(num_stages, num_micro))
    assert bubble_fraction(num_stages, num_micro) == pytest.approx((num_stages - 1) / (num_micro + num_stages - 1))


def test_more_micro_batches_shrink_the_bubble():
    fractions = [bubble_fraction(4, m) for m in (1, 2, 4, 8, 32)]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] == 0.75 and fractions[-1] < 0.1


# ----------------------------------------------------------------------- layers and sequences


@pytest.mark.parametrize("num_layers,num_stages", [(4, 2), (3, 2), (16, 3), (16, 5), (5, 5), (7, 1)])
def test_every_layer_is_on_one_stage_and_the_remainder_on_the_last(num_layers, num_stages):
    spans = [stage_layers(num_layers, num_stages, s) for s in range(num_stages)]
    assert spans[0][0] == 0 and spans[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, in order
    sizes = [last - first for first, last in spans]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # the longer stages last: stage 0 also embeds and runs the head


def test_too_many_stages_are_refused_with_the_reason():
    config = ModelConfig.from_json(resolve_model_dir("tiny"))  # 4 layers
    with pytest.raises(ValueError, match="5 stages needs a layer per stage at least; this model has 4"):
        check_pipelinable(config, 5)
    with pytest.raises(ValueError, match="at least 1"):
        check_pipelinable(config, 0)


def test_sequences_split_into_balanced_runs():
    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([1, 1, 1, 7, 40]) for _ in range(rng.randint(1, 9))]
        m = rng.randint(1, 6)
        runs = split_sequences(counts, m)
        assert len(runs) == min(m, len(counts))
        assert runs[0][0] == 0 and runs[-1][1] == len(counts)
        assert all(a < b for a, b in runs) and all(x[1] == y[0] for x, y in zip(runs, runs[1:]))
    assert split_sequences([500] + [1] * 10, 2) == [(0, 1), (1, 11)]  # the prompt, then the decodes
    assert split_sequences([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]


def test_micro_batches_put_the_step_back_together():
    """Each micro-batch is a step of its own (rows from 0); side by side they are the whole step,
    and the rows sent back are the sampled ones plus those prompt logprobs score."""
    qsl = [0, 5, 6, 13, 14]
    n = qsl[-1]
    step = StepInput(list(range(100, 100 + n)), list(range(n)), list(range(200, 200 + n)), qsl, [5, 9, 7, 30],
                     [[0, 1], [2, 3], [4], [5, 6]], [(i, 0) for i in range(4)], sample_rows=[4, 5, 13])
    prompt_rows = [(7, 3, 2, 11, 1), (8, 3, 3, 12, 1)]  # (row, seq id, position, token, alternatives)
    parts = micro_batches(step, prompt_rows, 3)
    assert len(parts) == 3
    assert sum((p.step.input_ids for p in parts), []) == step.input_ids
    assert sum((p.step.slot_mapping for p in parts), []) == step.slot_mapping
    assert sum((p.step.block_tables for p in parts), []) == step.block_tables
    assert [p.start + r for p in parts for r in p.step.sample_rows] == step.sample_rows
    assert [p.start + r for p in parts for r in p.rows] == [4, 5, 7, 8, 13]
    for p in parts:
        assert p.step.query_start_loc[0] == 0 and p.step.query_start_loc[-1] == len(p.step.input_ids)


@pytest.mark.parametrize("coalesced", [True, False])
def test_every_transfer_of_a_boundary_gets_a_handle(coalesced, monkeypatch):
    """NCCL posts a boundary's transfers as one group and hands back one handle for them all (it
    ends when they all have); gloo hands back one per transfer. Either way every receive has a
    handle to wait on, and every send is kept until the end of the step."""
    from types import SimpleNamespace

    from nanoserve.runner import pipeline

    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1

    handles = (lambda ops: [Work()]) if coalesced else (lambda ops: [Work() for _ in ops])
    monkeypatch.setattr(pipeline.dist, "P2POp", lambda op, tensor, peer: SimpleNamespace(op=op, tensor=tensor, peer=peer))
    monkeypatch.setattr(pipeline.dist, "batch_isend_irecv", handles)
    boundary = pipeline.Boundary()
    boundary.send(torch.ones(2, 3), 1)
    first, second = boundary.receive((2, 3), torch.zeros(1), 1), boundary.receive((4, 3), torch.zeros(1), 2)
    sends = boundary.post()
    assert len(sends) == 1 and torch.equal(sends[0][1], torch.ones(2, 3))
    assert first.get().shape == (2, 3) and second.get().shape == (4, 3) and Work.waited == 2


# ------------------------------------------------------------------ stages in one process


def stage_models(path, num_stages):
    """Every stage of a checkpoint, each cut from its own copy of the whole model."""
    models = []
    for s in range(num_stages):
        first, last = stage_layers(load_model(path).config.num_layers, num_stages, s)
        models.append(cut_stage(load_model(path), Stage(s, num_stages, first, last)))
    return models


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    """Qwen3 with a sliding window on some layers: the stages keep each layer's own kind."""
    path, _ = make_family_checkpoint(tmp_path_factory.mktemp("qwen3-windows"), "qwen3", use_sliding_window=True,
                                     sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention"])
    return path


@pytest.mark.exercise("cut-stage")
@pytest.mark.parametrize("model,num_stages", [("tiny", 2), ("tiny", 3), ("windowed", 2)])
@torch.no_grad()
def test_a_chain_of_stages_is_the_whole_model_bit_for_bit(model, num_stages, windowed_dir):
    """Two steps (prompts, then a decode each) through the stages, each with a KV pool of its own
    layers, handing on one tensor: the final hidden states equal the whole model's exactly."""
    path = "tiny" if model == "tiny" else windowed_dir
    whole = ModelRunner(load_model(path), num_blocks=8, block_size=4)
    stages = [ModelRunner(m, num_blocks=8, block_size=4) for m in stage_models(path, num_stages)]
    for runner in stages:  # a pool of the stage's layers only, each layer of its own kind
        st = runner.model.stage
        assert runner.cache.k.shape[0] == st.last_layer - st.first_layer == runner.model.config.num_layers
        for i in range(runner.model.config.num_layers):
            assert runner.model.config.window(i) == whole.model.config.window(st.first_layer + i)
    assert stages[1].model.embed_tokens.weight.numel() == 0 and stages[1].model.norm is None
    prefill = StepInput(list(range(7, 16)) + [40, 41, 42], list(range(9)) + list(range(3)),
                        list(range(9)) + [12, 13, 14], [0, 9, 12], [9, 3], [[0, 1, 2], [3]], [(0, 0), (1, 0)], [8, 11])
    decode = StepInput([99, 98], [9, 3], [9, 15], [0, 1, 2], [10, 4], [[0, 1, 2], [3]], [(0, 0), (1, 0)], [0, 1])
    for step in (prefill, decode):
        ids, positions, ctx = whole.prepare(step)
        expected = whole.model(ids, positions, ctx)
        stream = ids
        for runner in stages:
            ids, positions, ctx = runner.prepare(step)
            stream = stage_forward(runner.model, stream, positions, ctx)
        assert torch.equal(final_hidden(stages[0].model, stream), expected)


@pytest.mark.exercise("cut-stage")
@pytest.mark.parametrize("first,last", [(2, 2), (3, 1), (2, 5), (-1, 2)])
def test_a_stage_that_is_not_a_range_of_layers_is_refused(first, last):
    """An empty range, a reversed one, or one past the model's layers: refused before anything is cut."""
    model = load_model("tiny")
    with pytest.raises(ValueError, match="not a range of this model's 4 layers"):
        cut_stage(model, Stage(1, 2, first, last))
    assert model.config.num_layers == 4 and len(model.layers) == 4  # untouched


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("options,message", [
    (dict(pipeline_parallel_size=2, async_scheduling=True), "async scheduling does not work with pipeline"),
    (dict(pipeline_parallel_size=2, speculative="ngram"), "speculative decoding is not combined with pipeline"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batches=0), "pipeline_micro_batches must be at least 1"),
    (dict(pipeline_parallel_size=5), "needs a layer per stage"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be at least 1"),
    (dict(pipeline_micro_batches=4), "needs pipeline_parallel_size > 1"),
])
def test_what_stages_refuse_is_said_before_any_process_starts(options, message):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **CPU, **options)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_family_with_its_own_forward_pass_is_refused(tmp_path):
    path, _ = make_family_checkpoint(tmp_path, "gemma3")
    with pytest.raises(ValueError, match="Gemma3ForCausalLM has a forward pass of its own"):
        LLM(str(path), **CPU, pipeline_parallel_size=2)


def test_the_command_line_options():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    config = EngineConfig.from_args(parser.parse_args(["-pp", "2", "-tp", "2", "--pipeline-micro-batches", "3"]))
    assert (config.pipeline_parallel_size, config.pipeline_micro_batches, config.world_size) == (2, 3, 4)
    config = EngineConfig.from_args(parser.parse_args(["--pipeline-parallel-size", "3"]))
    assert (config.pipeline_parallel_size, config.pipeline_micro_batches, config.world_size) == (3, None, 3)


# ----------------------------------------------------------------------- stage processes


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """Three layers over two stages (1 + 2: the remainder on the last), an untied head, and the HF model."""
    return make_checkpoint(tmp_path_factory.mktemp("three-layers"), tiny_config(num_hidden_layers=3,
                                                                                tie_word_embeddings=False))


@pytest.mark.slow
@ONE_AT_A_TIME
def test_pp2_greedy_tokens_equal_pp1_and_hf(three_layers):
    """Ragged prompts in one continuous batch, three micro-batches a step; prompt logprobs come
    back through the same rows. Then the engine is dropped: garbage collection ends its stage."""
    path, hf = three_layers
    prompts = ragged_prompts()
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    one = LLM(str(path), **CPU)
    expected, expected_scored = tokens(one, prompts), one.generate(prompts[:2], scored)
    llm = LLM(str(path), **CPU, pipeline_parallel_size=2, pipeline_micro_batches=3, pipeline_steps_in_flight=1)
    stage = llm.engine.runner.model.stage
    assert (stage.first_layer, stage.last_layer) == (0, 1)  # stage 0: one layer of three, the remainder on stage 1
    assert tokens(llm, prompts) == expected
    for p, got in zip(prompts, expected):
        hf_out = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert got == hf_out[0, len(p):].tolist()
    for a, b in zip(expected_scored, llm.generate(prompts[:2], scored)):
        assert b.token_ids == a.token_ids
        assert [e.logprob for e in b.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in a.prompt_logprobs[1:]],
                                                                           abs=1e-5)
        assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-5)
    stats = llm.engine.pipeline_stats()
    assert stats["steps"] == llm.engine.num_steps and len(stats["busy_s"]) == 2
    assert all(0 < b <= stats["wall_s"] for b in stats["busy_s"])
    assert all(0 <= f < 1 for f in stats["idle_fraction"])
    assert bubble_fraction(2, 3) <= stats["scheduled_idle_fraction"] <= bubble_fraction(2, 1)  # 1..3 per step
    pids = [p.pid for p in llm.engine.workers.procs]
    del llm
    gc.collect()
    assert gone_within(pids), "a stage process outlived its engine by 10 s (garbage collection)"


@pytest.mark.slow
@ONE_AT_A_TIME
def test_pp2_chunked_prefill_and_preemption():
    """A pool too small for the batch (preemption), prompts in chunks (mixed steps): the same
    tokens as one process. Then `close` ends the stage process, cleanly."""
    kw = dict(CPU, enable_chunked_prefill=True, max_num_batched_tokens=16, num_blocks=12, block_size=4, max_num_seqs=4)
    prompts = ragged_prompts()
    expected = tokens(LLM("tiny", **kw), prompts)
    llm = LLM("tiny", pipeline_parallel_size=2, **kw)
    assert tokens(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    procs = list(llm.engine.workers.procs)
    llm.close()
    assert gone_within([p.pid for p in procs]) and all(p.poll() == 0 for p in procs)


@pytest.mark.slow
@ONE_AT_A_TIME
def test_tp2_times_pp2_equals_tp1():
    """Four processes: two stages of two tensor-parallel ranks each."""
    prompts = ragged_prompts(4)
    expected = tokens(LLM("tiny", **CPU), prompts)
    with LLM("tiny", **CPU, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        assert len(llm.engine.workers.procs) == 3
        assert tokens(llm, prompts) == expected
        assert llm.engine.runner.cache.k.shape[0] == 2  # stage 0's two layers of four
        assert llm.engine.runner.cache.k.shape[-2] == 1  # and its rank's one KV head of two
        pids = [p.pid for p in llm.engine.workers.procs]
    assert gone_within(pids)


@pytest.mark.slow
@ONE_AT_A_TIME
def test_a_killed_stage_fails_loudly_and_at_once():
    with LLM("tiny", **CPU, pipeline_parallel_size=2) as llm:
        assert tokens(llm, ragged_prompts(1))
        os.kill(llm.engine.workers.procs[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"pipeline stage 1 \(rank 1\) exited"):
            tokens(llm, ragged_prompts(1))
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerFailed):  # and stays failed
            llm.engine.add_request("again", GREEDY)


# ----------------------------------------------------------------------------------- GPUs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: run on a 2-GPU machine")
def test_pp2_on_two_gpus_equals_one_gpu():
    """NCCL between the stages (each boundary's sends and receives posted as one group), eager
    steps, float32: the same greedy tokens as one GPU running eagerly."""
    kw = dict(device="cuda", dtype=torch.float32, gpu_memory_utilization=0.3)
    prompts = ragged_prompts()
    expected = tokens(LLM("tiny", cuda_graphs=False, **kw), prompts)
    with LLM("tiny", pipeline_parallel_size=2, cuda_graphs=False, **kw) as llm:  # (graphs: test_stage_graphs.py)
        assert tokens(llm, prompts) == expected
        stats = llm.engine.pipeline_stats()
        assert stats["steps"] == llm.engine.num_steps and all(0 < b <= stats["wall_s"] for b in stats["busy_s"])
        pids = [p.pid for p in llm.engine.workers.procs]
    assert gone_within(pids)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs: run on a 4-GPU machine")
@pytest.mark.parametrize("graphs", [False, True])
def test_tp2_times_pp2_on_four_gpus_equals_one_gpu(graphs):
    """Eager stages, then each stage's CUDA graphs (its all-reduces captured inside them)."""
    kw = dict(device="cuda", dtype=torch.float32, gpu_memory_utilization=0.3)
    prompts = ragged_prompts()
    expected = tokens(LLM("tiny", cuda_graphs=False, **kw), prompts)
    with LLM("tiny", tensor_parallel_size=2, pipeline_parallel_size=2, cuda_graphs=graphs, **kw) as llm:
        assert (llm.engine.runner.graphs is not None) == graphs
        assert tokens(llm, prompts) == expected
