"""Week 20: the tensor-parallel step without a host round trip. The step description through a
shared-memory channel, and async scheduling under tensor parallelism (the workers read the
driver's sampled tokens from the device group). Two CPU processes over gloo here; the same code
runs on GPUs with NCCL (docs/benchmarks.md, week 20)."""

import os
import signal
import time

import pytest
import torch

from nanoserve.engine.distributed import WorkerFailed
from nanoserve.engine.engine import LLM
from nanoserve.engine.step_channel import GlooChannel, SharedMemoryChannel
from nanoserve.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # each test starts processes (a few seconds on the CPU)

PROMPTS = ["The list", "A dictionary is a", "Once upon a time there was a"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CPU = dict(device="cpu", dtype=torch.float32)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference():
    return tokens(LLM("tiny", **CPU))


@pytest.fixture
def shared_memory_channel(monkeypatch):
    """CPU ranks would use gloo; force the shared-memory channel (the workers inherit it)."""
    monkeypatch.setenv("NANOSERVE_STEP_CHANNEL", "shm")


def test_steps_through_shared_memory_equal_one_process(reference, shared_memory_channel):
    with LLM("tiny", tensor_parallel_size=2, **CPU) as llm:
        assert isinstance(llm.engine.workers.channel, SharedMemoryChannel)
        assert tokens(llm) == reference
        name = llm.engine.workers.channel.memory.name
    assert not os.path.exists(f"/dev/shm/{name}")  # the driver unlinked its slot


def test_a_message_larger_than_the_slot_goes_over_gloo(reference, shared_memory_channel, monkeypatch):
    """A slot of 64 bytes: every step is too large for it and travels over gloo, flagged as such."""
    monkeypatch.setattr("nanoserve.engine.step_channel.SLOT_BYTES", 64)
    with LLM("tiny", tensor_parallel_size=2, **CPU) as llm:
        assert tokens(llm) == reference


@pytest.mark.parametrize("channel", ["gloo", "shm"])
def test_async_scheduling_under_tensor_parallelism(reference, channel, monkeypatch):
    """The engine runs a step ahead; each decode's input is the token the driver sampled a step
    ago, still on its device, broadcast to the workers there. Tokens equal the plain loop."""
    monkeypatch.setenv("NANOSERVE_STEP_CHANNEL", channel)
    with LLM("tiny", tensor_parallel_size=2, async_scheduling=True, **CPU) as llm:
        assert llm.engine.async_scheduling
        assert isinstance(llm.engine.workers.channel, GlooChannel if channel == "gloo" else SharedMemoryChannel)
        assert tokens(llm) == reference
        seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=3)
        assert tokens(llm, PROMPTS[:2], seeded) == tokens(LLM("tiny", **CPU), PROMPTS[:2], seeded)


def test_a_killed_worker_is_noticed_through_shared_memory(shared_memory_channel):
    with LLM("tiny", tensor_parallel_size=2, distributed_timeout=20, **CPU) as llm:
        assert tokens(llm, PROMPTS[:1])
        os.kill(llm.engine.workers.procs[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="rank 1 exited"):
            tokens(llm, PROMPTS[:1])
        assert time.monotonic() - start < 10


def test_a_worker_whose_driver_died_stops(tmp_path):
    """The reader side checks that the driver lives while it waits for a step."""
    from nanoserve.engine.step_channel import check_alive

    check_alive(os.getpid())  # alive: nothing happens
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match="is gone"):
        check_alive(gone.pid)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: run on a 2-GPU machine")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("all_reduce", ["auto", "nccl"])
def test_tp2_fast_path_on_two_gpus_equals_tp1(all_reduce):
    """The whole fast path on two GPUs: steps through shared memory, async scheduling, CUDA graphs
    with (auto) the one-shot all-reduce or (nccl) NCCL's inside them. Float32: equal tokens."""
    from nanoserve.engine.device import MAPPED_GROUP_NAMES

    kw = dict(device="cuda", dtype=torch.float32, gpu_memory_utilization=0.3)
    one = tokens(LLM("tiny", **kw))
    first_in_process = not MAPPED_GROUP_NAMES  # (a later engine in this process sums with NCCL: next test)
    with LLM("tiny", tensor_parallel_size=2, all_reduce=all_reduce, **kw) as llm:
        assert llm.engine.async_scheduling and llm.engine.runner.graphs.capture
        assert isinstance(llm.engine.workers.channel, SharedMemoryChannel)
        assert (llm.engine.model.group.one_shot is not None) == (all_reduce == "auto" and first_in_process)
        assert tokens(llm) == one


TWO_ENGINES = """
import warnings, torch
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = []
for cuda_graphs in (True, False):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with LLM("tiny", device="cuda", dtype=torch.float32, gpu_memory_utilization=0.3, tensor_parallel_size=2,
                 cuda_graphs=cuda_graphs) as llm:
            outs.append([o.token_ids for o in llm.generate([[1, 2, 3], list(range(5, 30))], params)])
            print("one-shot", llm.engine.model.group.one_shot is not None, any("second tensor-parallel" in str(w.message) for w in seen))
print("equal", outs[0] == outs[1])
"""


@pytest.mark.gpu
@two_gpus
def test_a_second_tensor_parallel_engine_in_one_process_does_not_hang():
    """Symmetric memory remembers a group by its name for the life of the process, and a second
    engine's group has the same name: its rendezvous waited forever (two H100s, 2026-11-27). The
    second engine sums with NCCL, says so, and gives the same tokens."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", TWO_ENGINES], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the second engine hung (killed after 240 s); its last output: {str(e.stderr)[-2000:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["one-shot True False", "one-shot False True", "equal True"], done.stdout


@pytest.mark.gpu
@two_gpus
def test_bench_latency_with_two_ranks_exits_cleanly(tmp_path):
    """The benchmark that hung in NCCL's teardown (a reference to the CUDA graphs outlived the
    engine): it must exit 0, on its own, well inside its time limit, and leave no rank behind."""
    import subprocess
    import sys

    import psutil

    cmd = [sys.executable, "-m", "nanoserve.cli", "bench", "latency", "--model", "tiny", "-tp", "2", "--runs", "2",
           "--new-tokens", "16", "--prompt-len", "8", "--no-hf", "--no-baseline", "--out", str(tmp_path)]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`bench latency -tp 2` hung (killed after 240 s); its last output: {str(e.stderr)[-2000:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaving the process group took over" not in done.stderr
    children = [p for p in psutil.process_iter(["cmdline"]) if "nanoserve.engine.distributed" in " ".join(p.info["cmdline"] or [])]
    assert not children, f"ranks left running: {[p.pid for p in children]}"
    print(f"bench latency -tp 2 exited in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_tensor_parallel_server_ends_every_rank_on_a_signal(stop):
    """`nanoserve serve -tp 2` stopped as a user or a process manager would: the server and its
    worker rank are gone within 10 s, and the server says it stopped cleanly (exit code 0)."""
    import subprocess
    import sys
    import tempfile

    import httpx
    import psutil

    from nanoserve.engine.distributed import free_port
    from nanoserve.server.data_parallel import wait_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny", "--device", "cpu", "-tp", "2",
           "--port", str(port), "--log-level", "warning"]
    log = tempfile.TemporaryFile(mode="w+")  # not a pipe: a leaked rank would hold it open
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        wait_healthy([f"http://127.0.0.1:{port}"], [proc], timeout=120)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "nanoserve.engine.distributed" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        body = {"model": "tiny", "prompt": "The list", "max_tokens": 4}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        started = time.monotonic()
        proc.send_signal(stop)
        code = proc.wait(timeout=30)
        _, alive = psutil.wait_procs(ranks, timeout=max(0.1, 10 - (time.monotonic() - started)))
        log.seek(0)
        assert not alive, f"a rank still runs {time.monotonic() - started:.1f} s after {stop.name}: {log.read()[-2000:]}"
        assert code == 0 and time.monotonic() - started < 10, log.read()[-2000:]
    finally:
        for p in [proc, *ranks]:
            if p.poll() is None if hasattr(p, "poll") else p.is_running():
                p.kill()


def test_an_engine_that_goes_out_of_scope_ends_its_ranks():
    """No `close`, no `with`: the last reference goes, and the worker rank is gone within 10 s
    (the engine's finalizer stops it)."""
    import gc

    import psutil

    llm = LLM("tiny", tensor_parallel_size=2, **CPU)
    assert tokens(llm, PROMPTS[:1])
    ranks = [psutil.Process(p.pid) for p in llm.engine.workers.procs]
    started = time.monotonic()
    del llm
    gc.collect()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"a rank outlived its engine by {time.monotonic() - started:.1f} s"
