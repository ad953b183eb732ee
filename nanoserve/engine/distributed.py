"""Week 18: tensor parallelism, one model split over several devices.

One process per device, a *rank*. Every rank holds a slice of every weight matrix and a slice of
the KV cache, and all ranks run the same forward pass on the same tokens at the same time. The
slices are cut so that a layer needs only two collectives (Megatron-LM's scheme):
    attention:  x ─▶ qkv_proj (column-parallel: my heads) ─▶ attend my heads ─▶ o_proj (row-parallel) ─▶ all-reduce
    MLP:        x ─▶ gate_up_proj (column-parallel: my slice of I) ─▶ SwiGLU ─▶ down_proj (row-parallel) ─▶ all-reduce

A column-parallel linear keeps some *output* features: rank r computes its own heads (or its own
slice of the MLP's intermediate features) from the whole input, and needs nobody. A row-parallel
linear keeps the matching *input* features: rank r multiplies its slice of the activations by its
slice of the weight's columns, which gives a partial sum of the full output; one all-reduce adds
the partial sums of all ranks, and every rank has the whole output again, ready for the norm and
the residual (both cheap, so every rank does them in full).

The vocabulary is split too: rank r holds rows [r·V/N, (r+1)·V/N) of the embedding, looks up the
ids that fall in its rows (zeros for the others) and one all-reduce assembles the embeddings; the
output projection (tied to the embedding, or not) gives each rank its slice of the logits, and an
all-gather puts the whole rows together. Sampling happens on rank 0 only, the driver: it owns the
scheduler, the tokenizer and the requests (`nanoserve/engine/engine.py`); the other ranks, the workers,
only execute steps. Each step the driver sends the step's description (a `StepInput`: token
ids, positions, slot mapping, block tables; `nanoserve/runner/runner.py`) to every worker, through a
`nanoserve/engine/step_channel.py` channel (week 20: shared memory on one host), and all ranks run it.
With async scheduling (week 20) the step's first tokens may still be on the driver's GPU; the
driver then broadcasts them over the device group, GPU to GPU, and no rank waits for the host. The block
tables are the same on every rank: a block id names the same tokens everywhere, each rank storing
its own heads of them.

The model code (`nanoserve/model/llama.py`, `nanoserve/layers.py`) does not change: `shard_model` swaps
these layers in after the loader has read the checkpoint, and sets each attention's and MLP's
head counts and sizes to the local ones.

Processes are started here (`start_workers`: torch.multiprocessing, or Ray actors with
`executor="ray"`, the way to span several hosts), or by `torchrun`, whose environment variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are honoured. NCCL moves the tensors between GPUs,
gloo between CPU processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import pickle
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.device import build_device_side
from nanoserve.engine.pipeline import rank_name
from nanoserve.engine.ray_cluster import RayRanks
from nanoserve.engine.step_channel import open_channel
from nanoserve.model.config import ModelConfig
from nanoserve.model.expert_parallel import check_expert_parallel
from nanoserve.model.loader import resolve_model_dir
from nanoserve.model.tensor_parallel import Group

DEFAULT_TIMEOUT = 300.0  # seconds a collective may wait for the other ranks before it fails


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


# --------------------------------------------------------------------------- starting the ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or anything that sets its
    variables), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_group(rank: int, size: int, init_method: str, device: str, timeout: float) -> Group:
    """Join the process group (every rank calls this with the same `init_method`): NCCL for the
    forward pass on CUDA, gloo on the CPU; and a gloo group for the step descriptions. `device`
    is this rank's own ("cuda:1", or "cpu")."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group: one tensor-parallel engine per "
                           "process (close the other engine first)")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
        # NVLink multicast (NVLS; symmetric memory's multimem objects) stays off unless the environment
        # says otherwise: nanoserve's collectives are written without it (the one-shot all-reduce reads
        # peers' buffers one by one), and some shared machines forbid it.
        for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                            ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(name, value)
    else:  # CPU ranks share the machine's cores: more threads than cores makes every collective wait
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    wait = datetime.timedelta(seconds=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=wait)
    cpu_group = dist.new_group(backend="gloo", timeout=wait) if cuda else dist.group.WORLD
    return Group(rank, size, dist.group.WORLD, cpu_group)


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` runs on: its own GPU, or the CPU. Under torchrun, LOCAL_RANK picks
    the GPU (ranks of several hosts)."""
    if not device.startswith("cuda"):
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"


def receive_last_tokens(group: Group, count: int, device: str):
    """Async scheduling under tensor parallelism: the tokens the driver sampled last step, which
    this step's decodes read on the device; `count` of them, broadcast from rank 0 over the device
    group (NCCL: GPU to GPU, queued on the stream like the forward pass, no host round trip)."""
    if count == 0:
        return None
    tokens = torch.empty(count, dtype=torch.long, device=device)
    dist.broadcast(tokens, src=0, group=group.device_group)
    return tokens


def worker_main(config, rank: int, size: int, init_method: str, timeout: float, device: str) -> None:
    """A worker rank's whole life: join the group, build the same device side as the driver
    (its shard of the model, its KV pool, its CUDA graphs), then run the steps the driver
    sends until it sends None. `device`: this rank's own."""

    group = init_group(rank, size, init_method, device, timeout)
    side = channel = None
    try:
        channel = open_channel(group, cuda=device.startswith("cuda"))
        side = build_device_side(dataclasses.replace(config, device=device), group)
        runner = side.runner
        while (message := channel.recv()) is not None:
            if len(message) == 4:  # week 20: steps in flight through a pipeline, in the driver's order
                step, prompt_rows, _, lands = message
                runner.follow(step, prompt_rows, lands)
                runner.prompt_logprobs.clear()
                continue
            step, prompt_rows, num_last = message
            runner.run(step, prompt_rows, receive_last_tokens(group, num_last, device))
            runner.prompt_logprobs.clear()  # only the driver reports them
    finally:
        if side is not None:
            release_graphs(side.runner)
        if channel is not None:
            channel.close()
        side = runner = None
        leave_group()


def release_graphs(runner) -> None:
    """Free a runner's CUDA graphs and wait for the GPU, before the process group goes: graphs that
    captured NCCL all-reduces still hold the communicator's resources, and destroying it under them
    can hang (it did, on two GPUs, at the end of a benchmark)."""
    runner.graphs = None
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def stop_workers(runner, workers: "Workers") -> None:
    """The driver's side of the end: its graphs freed first (they hold the NCCL communicator the
    workers share), then the workers told to stop and waited for, then the group left."""
    if not workers.closed:
        release_graphs(runner)
    workers.close()


LEAVE_TIMEOUT = 10.0  # seconds `destroy_process_group` may take before a rank stops waiting for it


def leave_group(timeout: float = LEAVE_TIMEOUT) -> bool:
    """Destroy the process group, but never wait for it longer than `timeout`: a rank on its way out
    must not hang there (the process then exits with the group undestroyed). True if it finished."""
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="nanoserve-leave-group", daemon=True).start()
    if not done.wait(timeout):
        print(f"nanoserve: leaving the process group took over {timeout:.0f} s; exiting without it", file=sys.stderr)
        return False
    return True


class Workers:
    """The driver's handle on ranks 1..N-1: started as processes (or Ray actors), told each step,
    checked for life, and stopped."""

    def __init__(self, config, size: int, executor: str = "mp", timeout: float = DEFAULT_TIMEOUT):
        """Start ranks 1..size-1 of the engine `config` describes (its `device`: "cuda" or "cpu")."""
        self.size, self.executor, self.timeout = size, executor, timeout
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size  # week 20: for rank_name
        self.procs: list = []
        self.refs: list = []
        self.group: Group | None = None
        self.channel = None  # how steps reach the workers (`open_channel`), once the group is joined
        self.failed: str | None = None  # why the group broke, once it has
        self.closed = False
        host, self.driver_device = "127.0.0.1", rank_device(config.device, 0)
        if executor == "ray":  # week 20: a placement group on RAY_ADDRESS's cluster (nanoserve/engine/ray_cluster.py)
            cuda = config.device.startswith("cuda")
            self.cluster = RayRanks(size, cuda, config.ray_placement, timeout, _same_package_env()["PYTHONPATH"])
            host, self.driver_device = self.cluster.host, self.cluster.driver_device
        self.init_method = f"tcp://{host}:{free_port()}"
        if executor == "mp":
            # Plain child processes running `worker_from_stdin` (WORKER_COMMAND): a fresh interpreter
            # (CUDA cannot be forked), and unlike multiprocessing's "spawn" it never re-imports the
            # caller's script, so `LLM(..., tensor_parallel_size=2)` works at a script's top level.
            for rank in range(1, size):
                args = (config, rank, size, self.init_method, timeout, rank_device(config.device, rank))
                p = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND], stdin=subprocess.PIPE,
                                     env=_same_package_env())
                p.stdin.write(pickle.dumps(args))
                p.stdin.close()
                self.procs.append(p)
        elif executor == "ray":
            # Ray gives each actor its own GPU and shows it that GPU only (as cuda:0).
            device = "cuda:0" if cuda else "cpu"
            self.procs, self.refs = self.cluster.start(
                worker_main, lambda rank: (config, rank, size, self.init_method, timeout, device))
        else:
            raise ValueError(f"unknown distributed executor {executor!r}: 'mp' (processes) or 'ray'")

    @classmethod
    def started_elsewhere(cls, group: Group, timeout: float) -> "Workers":
        """The handle on ranks that torchrun started: nothing to start or watch, the same steps
        to broadcast, and the same None to send at the end."""
        workers = cls.__new__(cls)
        workers.size, workers.executor, workers.timeout = group.size, "torchrun", timeout
        workers.tp, workers.pp = group.size, 1  # (names in failures only: torchrun watches its own ranks)
        workers.procs, workers.refs, workers.group, workers.failed, workers.closed = [], [], group, None, False
        workers.channel = None
        return workers

    def open_channel(self, cuda: bool) -> None:
        """Agree with the workers on the step channel (they call `open_channel` as they start)."""
        self.channel = open_channel(self.group, cuda, poll=self.check_alive, timeout=self.timeout)

    def check_alive(self) -> None:
        """Raise WorkerFailed if a worker has exited (it never should before `close`)."""
        if self.executor in ("mp", "torchrun"):  # (torchrun watches its own: no processes here)
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise WorkerFailed(f"{rank_name(rank, self.tp, self.pp)} exited (exit code {p.returncode}); the engine "
                                       "cannot run without it: restart it")
        else:
            import ray

            done, _ = ray.wait(self.refs, timeout=0, num_returns=len(self.refs))
            for ref in done:
                rank = self.refs.index(ref) + 1
                try:
                    ray.get(ref)
                    reason = "returned early"
                except Exception as e:  # noqa: BLE001 - what Ray reports is the message
                    reason = f"failed: {type(e).__name__}: {e}"
                raise WorkerFailed(f"{rank_name(rank, self.tp, self.pp)} (a Ray actor) {reason}; restart the server")

    def run_step(self, run, step, prompt_rows, last_tokens=None):
        """Send one step's description to the workers, then run it here too (`run` is the
        driver's `ModelRunner.run`). With async scheduling, the tokens of the step before that
        this one reads on the device (`last_tokens`) follow over the device group. A rank that
        died, or stopped answering for `timeout` seconds, raises WorkerFailed, and every later
        step too: the group is broken for good."""
        if self.failed is not None:
            raise WorkerFailed(self.failed)
        try:
            self.check_alive()
            num_last = last_tokens.numel() if step.from_last else 0
            self.channel.send((step, prompt_rows, num_last))
            if num_last:
                dist.broadcast(last_tokens.contiguous(), src=0, group=self.group.device_group)
            return run(step, prompt_rows, last_tokens)
        except (RuntimeError, TimeoutError, dist.DistBackendError) as e:  # a collective failed, or timed out
            raise self.broken(e) from e

    def run_in_flight(self, start, step, prompt_rows, lands: int):
        """Week 20, steps in flight through a pipeline: tell the workers to land their `lands` oldest
        steps, then start `step` (None: none) without waiting for it (`PipelineRunner.follow`), and
        start it here too (`start`: the driver's `PipelineRunner.start`; None with no step)."""
        def send_and_start():
            self.check_alive()
            self.channel.send((step, prompt_rows, 0, lands))
            return None if start is None else start(step, prompt_rows)

        return self.guard(send_and_start)

    def guard(self, work, *args):
        """Run `work(*args)`, a part of a step that talks to the other ranks, as `run_step` does."""
        if self.failed is not None:
            raise WorkerFailed(self.failed)
        try:
            return work(*args)
        except (RuntimeError, TimeoutError, dist.DistBackendError) as e:
            raise self.broken(e) from e

    def broken(self, e: BaseException) -> WorkerFailed:
        """A collective failed or timed out: the group is broken for good (every later step fails too)."""
        self.failed = str(e) if isinstance(e, WorkerFailed) else \
            f"a tensor-parallel rank stopped answering ({type(e).__name__}: {e}); restart the engine"
        return WorkerFailed(self.failed)

    def close(self) -> None:
        """Tell the workers to stop, leave the process group together with them, and wait for
        their processes (briefly). The group is left right after the stop message, not after the
        workers have exited: NCCL's teardown waits for every rank, so a driver that first waited for
        the workers while they waited for it would hang until the timeouts."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.channel is not None:
                self.check_alive()
                self.channel.send(None)
        except Exception:  # noqa: BLE001 - a dead worker: stop the others below
            pass
        if self.channel is not None:
            self.channel.close()
        leave_group()
        if self.executor in ("mp", "torchrun"):
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        else:  # the actors end, and the placement group is removed, within ray_cluster.CLOSE_TIMEOUT
            self.cluster.close()


def _same_package_env() -> dict[str, str]:
    """This environment, with the directory of the running nanoserve package first on the path:
    the workers must run the driver's code (a learner's workspace, say), not another copy."""
    import nanoserve

    root = os.path.dirname(os.path.dirname(os.path.abspath(nanoserve.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


# `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH: run from the
# repository root, a learner's workers would import the reference `nanoserve/` there instead of the
# workspace's (`_same_package_env`). The empty entry goes before anything is imported.
WORKER_COMMAND = ("import sys; sys.path = [p for p in sys.path if p]; "
                  "from nanoserve.engine.distributed import worker_from_stdin; worker_from_stdin()")


def worker_from_stdin() -> None:
    """A worker process started by `Workers` (executor "mp", as `python -c WORKER_COMMAND`): its
    arguments come pickled on stdin. (Not `python -m` this module: the package's own imports load
    it first, and Python then warns that it runs a second copy.)"""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver, which then stops us
    worker_main(*pickle.loads(sys.stdin.buffer.read()))


def start_tensor_parallel(c: EngineConfig):
    """Week 18: start ranks 1..N-1 (or, under torchrun, find them) and join them as rank 0.
    Returns (rank 0's Group, the Workers handle). (Week 20: N is tensor × pipeline parallel size.)"""
    from nanoserve.engine.distributed import (
        Workers,
        init_group,
        rank_device,
        torchrun_rank,
    )

    if c.speculative is not None:
        raise ValueError("speculative decoding is not combined with tensor parallelism yet: use one of them")
    if c.expert_parallel_size > 1:  # week 24: the experts must split evenly, said before any process starts
        check_expert_parallel(ModelConfig.from_json(resolve_model_dir(c.model)), c.expert_parallel_size)
    if torchrun_rank() is not None:
        rank, size = torchrun_rank()
        if rank != 0 or size != c.world_size:
            raise ValueError(f"under torchrun the engine is built on rank 0 with --tensor-parallel-size (times "
                             f"--pipeline-parallel-size) equal to WORLD_SIZE ({size}); the other ranks run "
                             "nanoserve.engine.distributed.worker_main")
        init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        group = init_group(0, size, init, rank_device(c.device, 0), c.distributed_timeout)
        workers = Workers.started_elsewhere(group, c.distributed_timeout)
        workers.open_channel(c.device.startswith("cuda"))
        return group, workers
    workers = Workers(c, c.world_size, c.distributed_executor, c.distributed_timeout)
    try:
        workers.group = init_group(0, c.world_size, workers.init_method, workers.driver_device,
                                   c.distributed_timeout)
        workers.open_channel(c.device.startswith("cuda"))
    except BaseException:
        workers.close()
        raise
    return workers.group, workers

