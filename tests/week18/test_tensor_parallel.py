"""Week 18: real ranks. Two CPU processes talking gloo (CI), two GPUs talking NCCL (marked gpu).

Float32 on the CPU: the sums of the row-parallel layers add the same numbers in another order,
so the hidden states differ in the last bits, and greedy tokens stay equal unless two logits tie
to that precision (the tiny models have no such near-ties on these prompts).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nanoserve.engine.engine import LLM
from nanoserve.engine.distributed import WorkerFailed
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_checkpoint, tiny_config

pytestmark = pytest.mark.slow  # each test starts processes (a few seconds on the CPU)

PROMPTS = ["The list", "A dictionary is a", "Once upon a time there was a"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """One KV head for two ranks: each rank keeps a copy of it."""
    path = tmp_path_factory.mktemp("gqa1")
    make_checkpoint(path, tiny_config(model_type="llama", num_key_value_heads=1, num_attention_heads=4,
                                      tie_word_embeddings=False))
    from nanoserve.testing import TINY_MODEL_DIR

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((TINY_MODEL_DIR / name).read_bytes())
    return path


@pytest.mark.parametrize("model", ["tiny", "gqa"])
def test_tp2_greedy_tokens_equal_tp1(model, gqa_dir):
    name = "tiny" if model == "tiny" else str(gqa_dir)
    one = tokens(LLM(name, device="cpu", dtype=torch.float32))
    with LLM(name, device="cpu", dtype=torch.float32, tensor_parallel_size=2) as llm:
        assert llm.engine.model.config.num_kv_heads == 1  # tiny: 2 over 2 ranks; gqa: 1, replicated
        assert tokens(llm) == one
        # the pool holds each rank's own heads: the same blocks, half (or all, replicated) the heads
        assert llm.engine.runner.cache.k.shape[-2] == 1


def test_tp2_chunked_prefill_preemption_and_graph_buffers():
    """Mixed steps, chunks, preemption and the static buffers of the graph path (on the CPU: no
    capture; through Triton's interpreter, so only where it is on) all go through the one step
    description every rank runs."""
    kw = dict(device="cpu", dtype=torch.float32, enable_chunked_prefill=True, max_num_batched_tokens=16,
              num_blocks=12, block_size=4, max_num_seqs=4)
    if os.environ.get("TRITON_INTERPRET") == "1":  # a CPU-only machine (tests/conftest.py): the graph buffers too
        kw.update(attention_backend="triton", cuda_graphs=True)
    one = tokens(LLM("tiny", **kw))
    with LLM("tiny", tensor_parallel_size=2, **kw) as llm:
        assert tokens(llm) == one
        assert llm.engine.scheduler.num_preemptions > 0


def test_tp2_sampling_with_a_seed_and_logprobs():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, logprobs=2)
    one = LLM("tiny", device="cpu", dtype=torch.float32).generate(PROMPTS[:2], params)
    with LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2) as llm:
        two = llm.generate(PROMPTS[:2], params)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-4)


def _worker_pids(llm):
    return [p.pid for p in llm.engine.workers.procs]


def test_a_killed_worker_fails_loudly_and_at_once():
    with LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2) as llm:
        assert tokens(llm, PROMPTS[:1])
        os.kill(_worker_pids(llm)[0], signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="rank 1 exited"):
            tokens(llm, PROMPTS[:1])
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerFailed):  # and stays failed: no request is taken any more
            llm.engine.add_request("again", GREEDY)


def test_a_hung_worker_fails_within_the_timeout():
    with LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2, distributed_timeout=5) as llm:
        assert tokens(llm, PROMPTS[:1])
        pid = _worker_pids(llm)[0]
        os.kill(pid, signal.SIGSTOP)  # alive, but answering nobody
        try:
            start = time.monotonic()
            with pytest.raises(WorkerFailed, match="stopped answering"):
                tokens(llm, PROMPTS[:1])
            assert time.monotonic() - start < 30
        finally:
            os.kill(pid, signal.SIGCONT)


def test_close_stops_the_workers():
    llm = LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2)
    procs = list(llm.engine.workers.procs)
    llm.close()
    assert all(p.poll() == 0 for p in procs)  # they left the loop and exited cleanly
    with LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2) as again:  # the group is free again
        assert tokens(again, PROMPTS[:1])


def test_ray_executor_on_a_local_cluster():
    ray = pytest.importorskip("ray", reason="the Ray executor needs ray: pip install ray")
    one = tokens(LLM("tiny", device="cpu", dtype=torch.float32))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        with LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=2,
                 distributed_executor="ray") as llm:
            assert tokens(llm) == one
            ray.kill(llm.engine.workers.procs[0])  # a lost actor is a failed rank too
            with pytest.raises(WorkerFailed):
                tokens(llm, PROMPTS[:1])
    finally:
        ray.shutdown()


def test_torchrun_starts_the_ranks(tmp_path):
    """Under torchrun (its RANK, WORLD_SIZE, MASTER_ADDR variables), `nanoserve generate` on rank 0
    is the driver and the other ranks serve it: the same text as one process."""
    cmd = ["-m", "nanoserve.cli", "generate", "--model", "tiny", "--device", "cpu", "The list",
           "--max-tokens", "8", "--temperature", "0"]
    one = subprocess.run([sys.executable] + cmd, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(_port())] + cmd + ["--tensor-parallel-size", "2"],
                         capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.strip() and two.stdout.strip().endswith(one.stdout.strip())


def _port():
    from nanoserve.engine.distributed import free_port

    return free_port()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: run on a 2-GPU machine")
@pytest.mark.parametrize("graphs", [False, True])
def test_tp2_on_two_gpus_equals_tp1(graphs):
    """NCCL, and (graphs=True) the all-reduces captured inside the CUDA graphs."""
    kw = dict(device="cuda", dtype=torch.float32, cuda_graphs=graphs, gpu_memory_utilization=0.3)
    one = tokens(LLM("tiny", **kw))
    with LLM("tiny", tensor_parallel_size=2, **kw) as llm:
        assert tokens(llm) == one


def test_an_executor_without_ranks_to_start_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM("tiny", device="cpu", distributed_executor="ray")


def test_bench_never_replays_the_drivers_graph_alone():
    """`nanoserve bench latency` times one graph replay alone, but a tensor-parallel rank's graph
    holds its all-reduces: the driver replaying its own would wait for the workers forever (it did,
    on two GPUs). With workers, the measurement is skipped; without, it replays."""
    from types import SimpleNamespace

    from nanoserve.bench.latency import replay_ms

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    graphs = SimpleNamespace(capture=True, graphs={1: Graph()})
    assert replay_ms(SimpleNamespace(runner=SimpleNamespace(graphs=graphs), workers=object())) is None
    assert Graph.replays == 0
    if torch.cuda.is_available():
        assert replay_ms(SimpleNamespace(runner=SimpleNamespace(graphs=graphs), workers=None), reps=3) is not None
        assert Graph.replays == 4


def test_leaving_the_group_never_hangs(monkeypatch, capsys):
    """A rank on its way out waits at most the timeout for `destroy_process_group` (NCCL's teardown
    hung at the end of a 2-GPU benchmark), then goes on without it."""
    import threading
    import time

    from nanoserve.engine import distributed

    release = threading.Event()
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: release.wait(30))
    started = time.monotonic()
    assert distributed.leave_group(timeout=0.5) is False
    assert time.monotonic() - started < 5 and "exiting without it" in capsys.readouterr().err
    release.set()
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: None)
    assert distributed.leave_group(timeout=5) is True
