"""Week 5: the engine loop, and the offline `LLM` API on top of it.

    while has_work:
        batch   = scheduler.schedule()           # who runs this step
        logits  = runner.execute(batch)          # one forward pass for the whole batch
        tokens  = sampler(logits, ...)           # the tokens each sequence samples (usually one)
        scheduler.update(batch, tokens)          # append; stop tokens, stop strings, limits; free blocks
        deliver(outputs)                         # text deltas, finished requests

`Engine.step()` is one turn of that loop. `LLM.generate()` runs it until every prompt is done.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import gc
import itertools
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from nanoserve.cache import PagedKVCache
from nanoserve.kernels import select_backend
from nanoserve.loader import load_model, resolve_model_dir
from nanoserve.model import Llama
from nanoserve.parallel import WorkerFailed
from nanoserve.runner import ModelRunner
from nanoserve.sampling import Sampler, SamplingParams, TokenLogprob
from nanoserve.scheduler import Scheduler, Sequence
from nanoserve.structured import TokenConstraint, make_tokenizer
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestMetrics:
    """A finished request's timeline (`time.perf_counter` seconds) and sizes: what week 16's
    metrics and request logs are made of."""

    arrival_time: float
    first_scheduled_time: float | None  # None: it never got KV blocks (aborted in the queue)
    token_times: list[float]  # when each output token came out
    finished_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        return cls(seq.arrival_time, seq.first_scheduled_time, list(seq.token_times), time.perf_counter(),
                   seq.prompt_len, seq.num_output_tokens, seq.num_preemptions)


@dataclass
class RequestOutput:
    """What a request produced so far (`finished` tells whether that is all)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    delta: str = ""  # the text this step added (for streaming)
    metrics: RequestMetrics | None = None  # on the finished output only
    # Issue 17, when the request asks (SamplingParams.logprobs, .prompt_logprobs):
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids
    delta_logprobs: list[TokenLogprob] | None = None  # those of the tokens whose text `delta` completes
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token (the first: logprob None)


@dataclass
class StepRecord:
    """What one engine step did (kept when the engine runs with `trace=True`)."""

    step: int
    start: float  # perf_counter seconds
    end: float
    seq_ids: list[int]
    num_new_tokens: list[int]  # per sequence: > 1 for a prefill, 1 for a decode
    num_waiting: int
    blocks_used: int


@dataclass
class _InFlight:
    """Issue 20: a step launched on the GPU whose tokens the host has not seen yet."""

    batch: object  # the scheduler's Batch
    tokens: torch.Tensor  # [sampled rows] on the device: the next step's inputs read them there
    rows: dict[int, int]  # sequence id -> its row in `tokens`
    host: torch.Tensor  # where the tokens land on the host (pinned)
    event: torch.cuda.Event | None  # recorded after the copy to the host
    before: list  # Scheduler.launched's record, for Scheduler.resolve


@dataclass
class _Request:
    """A request's text: the detokenizer, the stop strings, what was already delivered."""

    detok: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already delivered as deltas
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # False: no output until the end, and the text is decoded once
    cut: bool = False  # the text was cut at a stop string
    # Issue 17: the logprobs of the output tokens so far (None: not asked), how many of them were
    # delivered, and, per token given to add_token, the length of `text` once its text is there.
    logprobs: list[TokenLogprob] | None = None
    num_delivered: int = 0
    ends: list[int] = field(default_factory=list)
    num_added: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None

    def add_token(self, token: int) -> bool:
        """The sequence's stop checker: decode one more token, True once a stop string appeared."""
        piece = self.detok.add(token)
        self.text += piece
        self.num_added += 1
        if piece:  # this token's text is here, and that of the tokens before it that had none yet
            self.ends += [len(self.text)] * (self.num_added - len(self.ends))
        return self.cut_at_stop_string()

    def cut_at_stop_string(self) -> bool:
        """Cut the text before the earliest stop string in it, if any; True if it did."""
        # >>> week05: stop-strings
        found = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i != -1]
        if found:  # the stop string is not part of the output
            self.text = self.text[: min(found)]
            self.cut = True
        return bool(found)
        # <<< week05: stop-strings


def _with_grammar(stop_checker, constraint: TokenConstraint):
    """A sequence's stop check that also feeds its grammar each token appended: it stops on a
    stop string, or once the grammar is complete."""

    def check(token: int) -> bool:
        stopped = stop_checker(token) if stop_checker is not None else False
        return constraint.consume(token) or stopped  # consume first: every token goes to the grammar

    return check


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Everything an engine is built from. The command line, the benchmarks and the tests all
    make one of these (`nanoserve.cli.add_engine_arguments` defines the matching options)."""

    model: str | os.PathLike = "tiny"  # see nanoserve.loader.resolve_model_dir
    dtype: torch.dtype | None = None  # default: float32 on the CPU, bfloat16 on CUDA
    device: str | None = None  # default: cuda when available
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; default: from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the pool; default: measured on a GPU (below), 256 MiB on the CPU
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int | None = None  # tokens through the model per step; default: 8192, or 2048 with
    # chunked prefill (week 15: measured on an H100, docs/benchmarks.md)
    max_model_len: int | None = None  # default: the model's context length
    attention_backend: str | None = None  # "torch" or "triton"; default: triton on CUDA
    scheduler_policy: str = "continuous"  # week 5 "admit-all", week 7 "static", week 8 "continuous"
    preemption: bool = True  # week 9
    enable_prefix_caching: bool | None = None  # week 14: reuse the KV blocks of shared prefixes; default: on with
    # the continuous policy (it costs nothing measurable without sharing), once week 14 is done (see below)
    enable_chunked_prefill: bool = False  # week 15 (continuous policy): decodes first, prompts in chunks
    scheduling_policy: str = "fcfs"  # or "priority" (continuous policy): lower priority values run first
    speculative: str | None = None  # week 17: "ngram" (prompt lookup) or "draft" (a smaller model); None: off
    num_speculative_tokens: int = 4  # guesses per decode and step
    draft_model: str | os.PathLike | None = None  # speculative="draft": the draft's checkpoint (same tokenizer)
    speculative_max_batch: int = 2  # no guesses in a step with more decodes than this (measured: docs/benchmarks.md)
    ngram_min: int = 2  # speculative="ngram": the shortest suffix (in tokens) worth looking up
    trace: bool = False  # keep a StepRecord per step
    cuda_graphs: bool | None = None  # week 12; default: on with CUDA and the Triton backend
    fused_kernels: bool | None = None  # week 12's fused kernels in every step; default: on with CUDA and Triton
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory the engine may take in all
    tensor_parallel_size: int = 1  # week 18: ranks the model is split over (one GPU each, or CPU processes)
    distributed_executor: str = "mp"  # week 18: how the other ranks start: "mp" (processes) or "ray" (actors)
    distributed_timeout: float = 300.0  # week 18: seconds a rank waits for the others before failing
    async_scheduling: bool | None = None  # issue 20: schedule step N+1 while the GPU runs step N; default: on
    # with CUDA graphs on a GPU (once week 12 is done), off on the CPU (nothing to overlap there)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else 8192

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny") -> None:
        """The command-line options of an engine, shared by generate, chat, serve and bench."""
        from nanoserve.loader import MODEL_NAMES_HELP

        p = parser.add_argument_group("engine")
        p.add_argument("--model", default=default_model, help=f"{MODEL_NAMES_HELP} (default: {default_model})")
        p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                       help="default: triton on CUDA, torch on the CPU")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        p.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", type=float, default=None,
                       help="GiB for the KV pool (default: what --gpu-memory-utilization leaves after a "
                            "measured step; 0.25 on the CPU)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of the GPU's memory for weights, activations, graphs and the KV pool")
        p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
        p.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per engine step (default: 8192; 2048 with --enable-chunked-prefill)")
        p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
        p.add_argument("--scheduler-policy", choices=["admit-all", "static", "continuous"], default="continuous",
                       help="week 5's admit-all, week 7's static or week 8's continuous batching (default)")
        p.add_argument("--no-preemption", dest="preemption", action="store_false",
                       help="fail instead of preempting when the KV pool runs dry")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV blocks of prompt prefixes the engine has seen (week 14; default: on with "
                            "the continuous policy)")
        p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                       help="order of the queue and of preemption (continuous policy): arrival, or each request's "
                            "priority, lower first, with aging so that none waits forever (default: fcfs)")
        p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=False,
                       help="decodes first, then prompts cut to fit --max-num-batched-tokens (week 15; default: off)")
        p.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                       help="speculative decoding (week 17): guesses from prompt lookup or a draft model, "
                            "verified in one target pass (default: off)")
        p.add_argument("--num-speculative-tokens", type=int, default=4, help="guesses per decode step (default: 4)")
        p.add_argument("--draft-model", default=None, help="--speculative draft: the draft model (same tokenizer)")
        p.add_argument("--speculative-max-batch", type=int, default=2,
                       help="no speculation in steps with more decodes than this (default: 2)")
        p.add_argument("--ngram-min", type=int, default=2,
                       help="--speculative ngram: the shortest suffix worth looking up, in tokens (default: 2)")
        p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                       help="run decode steps eagerly on CUDA")
        p.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_const", const=False, default=None,
                       help="run the PyTorch norms, RoPE and SwiGLU on CUDA instead of week 12's fused kernels")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over this many GPUs (or CPU processes), one process each (week 18)")
        p.add_argument("--distributed-executor", choices=["mp", "ray"], default="mp",
                       help="start the other ranks as local processes (mp) or as Ray actors, which may run on other "
                            "hosts of a Ray cluster (ray; needs `pip install ray`)")
        p.add_argument("--distributed-timeout", type=float, default=300.0,
                       help="seconds a rank waits for the others before the engine fails (default: 300)")
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch the next step while the GPU runs this one, its new tokens fed "
                            "from the GPU (default: on with CUDA graphs; not with tensor parallelism or speculation)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config the options of `add_arguments` describe."""
        memory = None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30)
        return cls(model=args.model, dtype=DTYPES[args.dtype] if args.dtype else None, device=args.device,
                   block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=memory,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, attention_backend=args.attention_backend,
                   scheduler_policy=args.scheduler_policy, preemption=args.preemption,
                   enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
                   scheduling_policy=args.scheduling_policy, speculative=args.speculative,
                   num_speculative_tokens=args.num_speculative_tokens, draft_model=args.draft_model,
                   speculative_max_batch=args.speculative_max_batch, ngram_min=args.ngram_min,
                   cuda_graphs=args.cuda_graphs, fused_kernels=args.fused_kernels,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   tensor_parallel_size=args.tensor_parallel_size, distributed_executor=args.distributed_executor,
                   distributed_timeout=args.distributed_timeout, async_scheduling=args.async_scheduling)


@dataclass
class DeviceSide:
    """What one rank holds on its device: the model (a shard of it, with tensor parallelism),
    the runner with its KV pool and CUDA graphs, and the figures they were built from."""

    model: Llama
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    attention_backend: str
    kv_sizing: dict | None  # on a GPU: the measured figures behind the pool's size


def build_device_side(c: EngineConfig, group=None) -> DeviceSide:
    """Load the model and build its runner on `c.device`. `group` (week 18): this rank's place
    in a tensor-parallel group; every rank calls this with the same config, and their collective
    steps (the measured step, the CUDA graph captures) pair up."""
    device = c.device
    attention_backend = select_backend(device, c.attention_backend)
    dtype = c.dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if group is None:
        model = load_model(c.model, dtype=dtype, device=device)
    else:  # load whole on the CPU, keep this rank's shard, then move it
        from nanoserve.parallel import shard_model

        model = shard_model(load_model(c.model, dtype=dtype, device="cpu"), group).to(device)
    cfg = model.config
    max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    # Week 12: CUDA graphs for decode steps (Triton backend; on by default on CUDA).
    # `cuda_graphs=True` on the CPU runs the same static buffers and padding without capturing
    # anything: that is how the CPU tests check them.
    use_graphs = (c.cuda_graphs if c.cuda_graphs is not None else device.startswith("cuda")) \
        and attention_backend == "triton"
    runner_args = dict(attention_backend=attention_backend, cuda_graphs=use_graphs,
                       max_model_len=max_model_len, max_batch=c.max_num_seqs,
                       verify_tokens=c.num_speculative_tokens if c.speculative else 0,
                       verify_batch=c.speculative_max_batch,
                       mixed_tokens=c.max_num_batched_tokens if c.enable_chunked_prefill else 0,
                       fused_kernels=c.fused_kernels if c.fused_kernels is not None else device.startswith("cuda"))
    kv_sizing = None
    num_blocks = c.num_blocks
    if num_blocks is None:
        num_blocks, kv_sizing = kv_pool_blocks(c, model, dtype, runner_args)
    if group is not None:  # the block tables must fit on every rank
        from nanoserve.parallel import min_over_ranks

        num_blocks = min_over_ranks(group, num_blocks)
    runner = ModelRunner(model, num_blocks, c.block_size, **runner_args)
    return DeviceSide(model, runner, num_blocks, max_model_len, attention_backend, kv_sizing)


def kv_pool_blocks(c: EngineConfig, model: Llama, dtype: torch.dtype, runner_args: dict) -> tuple[int, dict | None]:
    """How many KV blocks fit: `kv_cache_memory` if given; on the CPU 256 MiB; on a GPU, what is
    left of `gpu_memory_utilization` of its memory once the weights and the measured peak of the
    largest step (and the CUDA graphs) are accounted for. Also returns those measured figures."""
    cfg = model.config
    per_block = PagedKVCache.bytes_per_block(cfg.num_layers, c.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    if c.kv_cache_memory is not None:
        return max(1, c.kv_cache_memory // per_block), None
    if not c.device.startswith("cuda"):
        return max(1, 256 * 2**20 // per_block), None
    gc.collect()  # an engine nobody references any more may still hold its pool, through a reference cycle
    step_bytes = ModelRunner.measure_step_memory(model, c.block_size, c.max_num_batched_tokens, **runner_args)
    free, total = torch.cuda.mem_get_info()
    budget = int(total * c.gpu_memory_utilization) - (total - free) - step_bytes
    if budget < per_block:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {(total - free) / 2**30:.1f} GiB in use (weights and "
            f"other processes), a step needs {step_bytes / 2**30:.1f} GiB more, and gpu_memory_utilization is "
            f"{c.gpu_memory_utilization}: raise it, lower max_num_batched_tokens or max_num_seqs, or free the GPU"
        )
    return budget // per_block, dict(step_bytes=step_bytes, budget_bytes=budget, total_bytes=total)


def start_tensor_parallel(c: EngineConfig):
    """Week 18: start ranks 1..N-1 (or, under torchrun, find them) and join them as rank 0.
    Returns (rank 0's Group, the Workers handle)."""
    from nanoserve.parallel import Workers, init_group, rank_device, torchrun_rank

    if c.speculative is not None:
        raise ValueError("speculative decoding is not combined with tensor parallelism yet: use one of them")
    if torchrun_rank() is not None:
        rank, size = torchrun_rank()
        if rank != 0 or size != c.tensor_parallel_size:
            raise ValueError(f"under torchrun the engine is built on rank 0 with --tensor-parallel-size equal to "
                             f"WORLD_SIZE ({size}); the other ranks run nanoserve.parallel.worker_main")
        init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        group = init_group(0, size, init, rank_device(c.device, 0), c.distributed_timeout)
        return group, Workers.started_elsewhere(group, c.distributed_timeout)
    workers = Workers(c, c.tensor_parallel_size, c.distributed_executor, c.distributed_timeout)
    try:
        workers.group = init_group(0, c.tensor_parallel_size, workers.init_method, rank_device(c.device, 0),
                                   c.distributed_timeout)
    except BaseException:
        workers.close()
        raise
    return workers.group, workers


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        c = config or EngineConfig()
        self.config = c = dataclasses.replace(c, device=c.device or default_device())
        model_dir = resolve_model_dir(c.model)
        self.model_name = str(c.model)
        self.tokenizer = Tokenizer(model_dir)
        # Week 18: with tensor parallelism this process is rank 0, the driver; the other ranks
        # build the same device side (`build_device_side`) and run the steps it broadcasts.
        self.workers, group = None, None
        if c.tensor_parallel_size == 1 and c.distributed_executor != "mp":
            raise ValueError(f"distributed_executor={c.distributed_executor!r} starts the other ranks of a tensor-"
                             "parallel engine: it needs tensor_parallel_size > 1")
        if c.tensor_parallel_size > 1:
            group, self.workers = start_tensor_parallel(c)
        try:
            side = build_device_side(c, group)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise
        self.model, self.runner, self.kv_sizing = side.model, side.runner, side.kv_sizing
        self.attention_backend, self.max_model_len = side.attention_backend, side.max_model_len
        self.runner.workers = self.workers
        if self.workers is not None:  # stop them when this engine goes away, or at exit
            weakref.finalize(self, self.workers.close)
        cfg = self.model.config
        self.scheduler = Scheduler(side.num_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens,
                                   self.max_model_len, policy=c.scheduler_policy, preemption=c.preemption,
                                   prefix_caching=self._prefix_caching(), chunked_prefill=c.enable_chunked_prefill,
                                   scheduling=c.scheduling_policy)
        if c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_num_seqs:
            warnings.warn(f"chunked prefill with a budget of {c.max_num_batched_tokens} tokens for up to {c.max_num_seqs} "
                          "sequences: when more sequences decode than the budget holds, the newest wait and prompts "
                          "make no progress; raise --max-num-batched-tokens or lower --max-num-seqs", stacklevel=2)
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.runner.device)
        self._grammar_tokenizer = None  # structured output (issue 17): built on first use
        self.requests: dict[int, _Request] = {}
        self.sequences: dict[int, Sequence] = {}
        self.num_steps = 0
        self.trace: list[StepRecord] | None = [] if c.trace else None
        self.speculator = None
        if c.speculative is not None:  # week 17
            from nanoserve.speculative import SpecDecoder

            self.speculator = SpecDecoder(self, c.speculative, c.num_speculative_tokens, c.speculative_max_batch,
                                          draft_model=c.draft_model, ngram_min=c.ngram_min)
        self.schedule_ahead = self._async_scheduling()
        self._in_flight: _InFlight | None = None  # issue 20: the step launched and not yet resolved
        self._needs_tokens: set[int] = set()  # requests whose sampling reads earlier tokens on the host
        self._host_tokens = [torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)]  # pinned, alternated

    def _prefix_caching(self) -> bool:
        """Week 14's prefix caching: as asked, or by default on with the continuous policy. In a
        learner's workspace it stays off by default until week 14's exercises are written, so the
        earlier weeks never run a stub (nanoserve/course.py, `stubbed_weeks`)."""
        c = self.config
        if c.enable_prefix_caching is not None:
            return c.enable_prefix_caching
        from nanoserve.course import stubbed_weeks

        return c.scheduler_policy == "continuous" and 14 not in stubbed_weeks()

    def _async_scheduling(self) -> bool:
        """Issue 20: schedule ahead of the GPU as asked, or by default where it pays: with CUDA
        graphs on a GPU (on the CPU every operation finishes before the next starts, so there is
        nothing to overlap), once week 12 is done in a learner's workspace. Not with tensor
        parallelism (the workers do not have the sampled tokens) nor speculation (its guesses are
        built from the tokens on the host)."""
        c = self.config
        conflicts = [name for name, on in (("tensor parallelism", self.workers is not None),
                                           ("speculative decoding", self.speculator is not None)) if on]
        if c.async_scheduling is not None:
            if c.async_scheduling and conflicts:
                raise ValueError(f"async scheduling does not work with {' or '.join(conflicts)}")
            return c.async_scheduling
        from nanoserve.course import stubbed_weeks

        graphs = self.runner.graphs
        return graphs is not None and graphs.capture and not conflicts and 12 not in stubbed_weeks()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = True, priority: int = 0) -> int:
        """Queue a prompt (text or token ids); returns its request id. `priority` (lower runs
        first) matters only with `scheduling_policy="priority"`.

        With `stream=False` the request produces one output, when it finishes, and its text is
        decoded once at the end instead of token by token (unless it has stop strings, which
        must be looked for as the text grows).
        """
        params = params or SamplingParams()
        if self.workers is not None and self.workers.failed is not None:
            raise WorkerFailed(self.workers.failed)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}")
        vocab_size = self.model.config.vocab_size
        if any(t >= vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}; this model's vocabulary has "
                             f"{vocab_size} tokens")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        req = _Request(IncrementalDetokenizer(self.tokenizer), stop=params.stop, stream=stream or bool(params.stop))
        stop_checker = req.add_token if req.stream else None
        constraint = None
        if params.grammar is not None:  # structured output: the grammar also ends the request
            constraint = TokenConstraint(self.grammar_tokenizer(), params.grammar, vocab_size, frozenset(stop_ids))
            stop_checker = _with_grammar(stop_checker, constraint)
        seq = Sequence(ids, params, stop_ids=frozenset(stop_ids), stop_checker=stop_checker, priority=priority)
        self.scheduler.add(seq)
        self.sampler.add(seq.seq_id, params, seq.prompt_len, constraint)
        if params.logprobs is not None:
            req.logprobs = []
        self.requests[seq.seq_id] = req
        self.sequences[seq.seq_id] = seq
        if params.grammar is not None or params.presence_penalty or params.frequency_penalty \
                or params.repetition_penalty != 1.0:
            self._needs_tokens.add(seq.seq_id)  # issue 20: its steps wait for the host to see each token
        return seq.seq_id

    def grammar_tokenizer(self):
        """Structured output's view of the tokenizer (`nanoserve.structured.make_tokenizer`),
        built the first time a request asks for it."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = make_tokenizer(self.tokenizer.hf)
        return self._grammar_tokenizer

    def abort(self, request_id: int) -> RequestOutput | None:
        """Cancel a request now: its KV blocks go back to the pool at once. Returns its final
        output (finish reason "abort"), or None if it had already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        seq = self.sequences.pop(request_id)
        self.scheduler.finish(seq, "abort")
        self.sampler.release(request_id)
        self._needs_tokens.discard(request_id)
        self.runner.prompt_logprobs.pop(request_id, None)
        return RequestOutput(request_id, seq.prompt_ids, seq.output_ids, req.text, True, "abort",
                             metrics=RequestMetrics.of(seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (week 18), if any. Idempotent."""
        if self.workers is not None:
            self.workers.close()

    def spec_stats(self) -> dict | None:
        """Week 17's counters (guesses proposed and accepted, tokens emitted, sequence-steps
        verified, acceptance rate, tokens per target step), or None without speculation."""
        if self.speculator is None:
            return None
        s = self.speculator.stats
        return dict(proposed=s.num_proposed, accepted=s.num_accepted, emitted=s.num_emitted, steps=s.num_steps,
                    acceptance_rate=s.acceptance_rate, tokens_per_step=s.tokens_per_step)

    def prefix_cache_stats(self) -> dict | None:
        """Week 14's counters (lookups, lookup and hit tokens, hit rate, evictions), or None when
        prefix caching is off."""
        return self.scheduler.allocator.stats() if self.scheduler.prefix_caching else None

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that got a token."""
        if not self._speculation_paused():
            if self.speculator is not None:  # week 17: the same loop, with guesses verified
                return self.speculator.step()
        if self.schedule_ahead:  # issue 20: the same loop, one step ahead of the GPU
            if not self._needs_tokens:
                return self._step_ahead()
            if self._in_flight is not None:  # a request that needs every token on the host came in
                return self.resolve_in_flight()
        # >>> week05: engine-step
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        logits = self.runner.execute(batch)  # [rows to sample, vocab]
        seqs = batch.seqs
        rows = [s for s, n in zip(seqs, batch.num_samples) for _ in range(n)]  # the sequence of each row
        flat = self.sampler(logits, [s.seq_id for s in rows], [s.params for s in rows],
                            [s.token_ids for s in rows]).tolist()  # the step's one device->host copy
        tokens, i = [], 0
        for n in batch.num_samples:  # back to one list per sequence
            tokens.append(flat[i : i + n])
            i += n
        self.scheduler.update(batch, tokens)
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append(StepRecord(self.num_steps - 1, start, time.perf_counter(),
                                         [s.seq_id for s in seqs], list(batch.num_new_tokens),
                                         len(self.scheduler.waiting), self.scheduler.allocator.num_used))
        return [self._process(seq) for seq, n in zip(seqs, batch.num_samples) if n and self._has_output(seq)]
        # <<< week05: engine-step

    # -- issue 20: the loop one step ahead of the GPU ---------------------------------------------

    def _step_ahead(self) -> list[RequestOutput]:
        """One turn of the loop with the host a step ahead: schedule step N+1 and launch it while
        the GPU still runs step N, then wait for step N's tokens and deliver them. The GPU never
        waits for the host between steps; the host's scheduling, staging and output work hide
        behind the GPU's forward pass. Tokens and outputs are exactly those of `step`: stop
        checks run one step late, and the token a sequence sampled after its end is dropped."""
        start = time.perf_counter()
        # >>> week12: step-ahead
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            try:
                launched = self._launch(batch)
            except BaseException:
                self._in_flight = None  # the step before it is lost too: its requests get aborted
                raise
        outputs = self.resolve_in_flight()
        self._in_flight = launched
        # <<< week12: step-ahead
        if batch.seqs:
            self.num_steps += 1
            if self.trace is not None:  # (its end: when the step before it was resolved)
                self.trace.append(StepRecord(self.num_steps - 1, start, time.perf_counter(),
                                             [s.seq_id for s in batch.seqs], list(batch.num_new_tokens),
                                             len(self.scheduler.waiting), self.scheduler.allocator.num_used))
        return outputs

    def resolve_in_flight(self) -> list[RequestOutput]:
        """Issue 20: wait for the step in flight (if any), hand its tokens to the scheduler and
        return its outputs. Afterwards no token is on the GPU that the host has not seen."""
        if self._in_flight is None:
            return []
        f, self._in_flight = self._in_flight, None
        if f.event is not None:
            f.event.synchronize()
        flat = f.host.tolist()
        tokens = [[flat[f.rows[s.seq_id]]] if s.seq_id in f.rows else [] for s in f.batch.seqs]
        self.scheduler.resolve(f.batch, tokens, f.before)  # stop checks, one step late
        return [self._process(seq) for seq, t in zip(f.batch.seqs, tokens) if t and self._has_output(seq)]

    def _launch(self, batch) -> "_InFlight":
        """Run the forward pass and the sampler for `batch` without waiting for either: the
        sampled tokens stay on the device (the next step reads its inputs from there), and a
        copy of them to the host is queued behind them."""
        last = None if self._in_flight is None else (self._in_flight.tokens, self._in_flight.rows)
        logits = self.runner.execute(batch, last)
        sampling = [s for s, k in zip(batch.seqs, batch.num_samples) if k]
        tokens = self.sampler(logits, [s.seq_id for s in sampling], [s.params for s in sampling])
        host, event = tokens, None
        if tokens.is_cuda:  # into one of two reused pinned buffers (the other may still be in use)
            self._host_tokens.reverse()
            if self._host_tokens[0].numel() < tokens.numel():
                self._host_tokens[0] = torch.empty(max(tokens.numel(), 256), dtype=torch.long, pin_memory=True)
            host = self._host_tokens[0][: tokens.numel()]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        before = self.scheduler.launched(batch)
        return _InFlight(batch, tokens, {s.seq_id: i for i, s in enumerate(sampling)}, host, event, before)

    def _speculation_paused(self) -> bool:
        """Issue 17: verification (week 17) samples with neither the raw logits at hand for
        logprobs, nor the output tokens for presence and frequency penalties, and its greedy path
        skips `logit_bias`. So while a request asking for any of these is in the engine, every
        step is a plain one: no guesses, for anybody. The same while a request with structured
        output is in: its grammar would have to check every guess (and roll back the rejected)."""
        return self.speculator is not None and any(
            p.logprobs is not None or p.prompt_logprobs is not None or p.presence_penalty or p.frequency_penalty
            or p.logit_bias or p.grammar is not None for p in (s.params for s in self.sequences.values()))

    def _has_output(self, seq: Sequence) -> bool:
        req = self.requests.get(seq.seq_id)  # None: aborted meanwhile
        return req is not None and (req.stream or seq.is_finished)

    def _process(self, seq: Sequence) -> RequestOutput:
        """Build the request's output: its text so far, and the part of it not yet delivered."""
        req = self.requests[seq.seq_id]
        if seq.is_finished:
            if not req.stream:  # offline, no stop strings: decode the whole output once, at the end
                output = seq.output_ids
                stopped_by_token = seq.finish_reason == "stop" and output and output[-1] in seq.stop_ids
                req.text = self.tokenizer.decode(output[:-1] if stopped_by_token else output)
            elif not req.cut:  # a character still held back by the detokenizer, and its stop strings
                req.text += req.detok.flush()
                if req.cut_at_stop_string():
                    seq.finish_reason = "stop"  # even if the same token hit max_tokens
        # Deliver text that can no longer turn out to be the start of a stop string.
        end = len(req.text) if seq.is_finished else len(req.text) - _held_back(req.text, req.stop)
        delta, req.emitted = req.text[req.emitted : max(end, req.emitted)], max(end, req.emitted)
        logprobs = self._take_logprobs(seq, req)
        metrics = None
        if seq.is_finished:
            del self.requests[seq.seq_id], self.sequences[seq.seq_id]
            self.sampler.release(seq.seq_id)
            self._needs_tokens.discard(seq.seq_id)
            self.runner.prompt_logprobs.pop(seq.seq_id, None)
            metrics = RequestMetrics.of(seq)
        return RequestOutput(seq.seq_id, seq.prompt_ids, seq.output_ids, req.text,
                             seq.is_finished, seq.finish_reason, delta, metrics, *logprobs)

    def _take_logprobs(self, seq: Sequence, req: _Request) -> tuple:
        """Issue 17: (all output logprobs so far, those `delta` delivers, the prompt's) for a
        request that asked, else Nones. A token goes out with the delta that completes its text
        (`req.ends`): one whose text is held back (a possible stop string, half a character, a
        special token with no text) waits for it, and at the end every token goes out, the stop
        token and any past a stop string included. So the deltas' logprobs add up to `logprobs`."""
        if seq.params.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = self.runner.take_prompt_logprobs(seq)  # its prompt has run: it sampled
        if req.logprobs is None:
            return None, None, req.prompt_logprobs
        delivered = len(seq.token_ids) - seq.num_pending - seq.prompt_len  # (not those still on the GPU)
        req.logprobs += self.sampler.take_logprobs(seq.seq_id, delivered - len(req.logprobs))
        covered = len(req.logprobs) if seq.is_finished else bisect.bisect_right(req.ends, req.emitted)
        delta, req.num_delivered = req.logprobs[req.num_delivered : covered], max(covered, req.num_delivered)
        return list(req.logprobs), delta, req.prompt_logprobs


class LLM:
    """Offline generation: give it prompts, get completions, in order.

        llm = LLM("tiny")
        outs = llm.generate(["The list", "A dictionary"], SamplingParams(max_tokens=20))
        print(outs[0].text)
    """

    def __init__(self, model: str | os.PathLike | EngineConfig = "tiny", **engine_config):
        """`model` names the model (with `engine_config`: any other field of `EngineConfig`, such
        as device, dtype or num_blocks), or is a whole `EngineConfig`."""
        config = model if isinstance(model, EngineConfig) else EngineConfig(model=model, **engine_config)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other ranks (with tensor parallelism); nothing to do otherwise."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
        results: dict[int, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else len(prompts) >= 32
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


# ------------------------------------------------------------------ week 10: the engine thread


class QueueFull(RuntimeError):
    """Too many requests in flight: the server answers 429 instead of queueing without bound."""


class AsyncEngine:
    """Runs an `Engine` loop on its own thread and hands each request's outputs to asyncio.

    Why a thread: a forward pass holds the CPU (or waits on the GPU) for milliseconds at a time;
    run on the event loop, it would freeze every connection while it computes. So the engine
    owns a thread, and the asyncio side only ever talks to it through queues:

        asyncio task --(inbox: add / abort, a thread-safe queue.Queue)--> engine thread
        engine thread --(loop.call_soon_threadsafe -> an asyncio.Queue per request)--> task

    The Engine object itself is touched by the engine thread alone, so it needs no locks.
    (Week 16's `stats()` reads a few of its counters from the event loop: plain integers and
    lengths, each read atomic under the GIL, so a scrape costs the engine thread nothing.)

    `listeners` (week 16) are called on the request's event loop with every finished request's
    last `RequestOutput` (aborted ones too, finish reason "abort") and the options it was
    submitted with: metrics and request logs hang there, off the engine thread.
    """

    def __init__(self, engine: Engine, max_pending: int = 256):
        import queue
        import threading

        self.engine = engine
        self.max_pending = max_pending  # requests admitted and not finished, at most
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[int, tuple] = {}  # our key -> (event loop, asyncio.Queue)
        self.request_ids: dict[int, int] = {}  # our key -> the engine's request id
        self.options: dict[int, dict] = {}  # our key -> the options it was submitted with
        self.listeners: list = []  # callables (final RequestOutput, options), run on the event loop
        self.num_pending = 0  # read and written on the event loop only
        self._keys = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    # What the server may know about the engine: no model, no tensors, only these facts.
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts (may exceed the tokenizer's own vocabulary)."""
        return self.engine.model.config.vocab_size

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduling_policy

    @property
    def prefix_caching(self) -> bool:
        """Whether requests with a common prefix share its KV blocks (week 14)."""
        return self.engine.scheduler.prefix_caching

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks, for health checks."""
        alloc = self.engine.scheduler.allocator
        return alloc.num_free, alloc.num_blocks

    def stats(self) -> dict:
        """The engine's state right now, for `/metrics` (read from the event loop: see above)."""
        scheduler = self.engine.scheduler
        free, total = self.kv_blocks()
        stats = dict(running=len(scheduler.running), waiting=len(scheduler.waiting), kv_blocks_used=total - free,
                     kv_blocks_total=total, preemptions=scheduler.num_preemptions, steps=self.engine.num_steps,
                     scheduled_tokens=scheduler.num_scheduled_tokens)
        prefix = self.engine.prefix_cache_stats()
        if prefix is not None:
            stats["prefix_cache"] = prefix
        spec = self.engine.spec_stats()
        if spec is not None:
            stats["speculative"] = spec
        return stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout)
        self.engine.close()

    @property
    def failed(self) -> str | None:
        """Why the engine can serve no more (a tensor-parallel rank died), or None."""
        workers = self.engine.workers
        return None if workers is None else workers.failed

    # -- the asyncio side --------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, **options):
        """Submit a request and yield its `RequestOutput`s as they come (the last is finished).

        If the consumer stops early (the client went away, the task was cancelled), the request
        is aborted on the engine thread and its KV blocks are freed. `options` travel with the
        request: `priority` goes to `Engine.add_request`, and the listeners get all of them
        (the server's request id, for the request log).
        """
        import asyncio

        # >>> week10: async-generate
        if self.num_pending >= self.max_pending:
            raise QueueFull(f"{self.num_pending} requests in flight, the limit is {self.max_pending}")
        key = next(self._keys)
        stream: asyncio.Queue = asyncio.Queue()
        self.num_pending += 1
        self.inbox.put(("add", key, prompt, params, options, asyncio.get_running_loop(), stream))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):  # a bad request, found by the engine thread
                    raise item
                finished = item.finished
                yield item
        finally:
            self.num_pending -= 1
            if not finished:
                self.inbox.put(("abort", key))
                self._wake.set()
        # <<< week10: async-generate

    # -- the engine thread -------------------------------------------------------------------

    def _send(self, key: int, item) -> None:
        loop, stream = self.streams[key]
        loop.call_soon_threadsafe(stream.put_nowait, item)
        if isinstance(item, RequestOutput) and item.finished:
            self._finished(loop, item, self.options.pop(key, {}))
        elif isinstance(item, Exception):  # the request failed: nothing more will come
            self.options.pop(key, None)

    def _finished(self, loop, output: RequestOutput, options: dict) -> None:
        for listener in self.listeners:
            loop.call_soon_threadsafe(listener, output, options)

    def _handle_inbox(self) -> None:
        import queue

        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, key, prompt, params, options, loop, stream = command
                self.streams[key] = (loop, stream)
                try:
                    self.request_ids[key] = self.engine.add_request(prompt, params,
                                                                    priority=options.get("priority", 0))
                    self.options[key] = options
                except (ValueError, WorkerFailed) as e:  # e.g. a prompt that can never fit: tell that request only
                    self._send(key, e)
                    del self.streams[key]
            else:
                _, key = command
                rid = self.request_ids.pop(key, None)
                loop, _ = self.streams.pop(key, (None, None))
                options = self.options.pop(key, {})
                output = self.engine.abort(rid) if rid is not None else None
                if output is not None and loop is not None:
                    self._finished(loop, output, options)

    def _run(self) -> None:
        # >>> week10: engine-thread
        while not self._stop.is_set():
            self._handle_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)  # sleep until a request arrives
                self._wake.clear()
                continue
            by_request = {rid: key for key, rid in self.request_ids.items()}
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not kill the server: fail the requests in flight
                for key, rid in list(self.request_ids.items()):
                    self.engine.abort(rid)
                    self._send(key, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                self.request_ids.clear()
                self.streams.clear()
                continue
            for out in outputs:
                key = by_request.get(out.request_id)
                if key is None or key not in self.streams:
                    continue  # aborted meanwhile
                self._send(key, out)
                if out.finished:
                    del self.streams[key], self.request_ids[key]
        # <<< week10: engine-thread
