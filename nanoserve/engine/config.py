"""EngineConfig: every option of an engine, its command-line flags derived from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import torch

from nanoserve.attention.fp8_cache import KV_CACHE_DTYPES
from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.ray_cluster import PLACEMENTS as RAY_PLACEMENTS
from nanoserve.engine.tool_templates import TOOL_TEMPLATES
from nanoserve.model.loader import MODEL_NAMES_HELP, gguf_source
from nanoserve.model.quantized import SCHEMES

# fp8: e4m3 weights and activations on FP8 tensor cores; gguf: a GGUF file's own blocks (Q8_0 ... Q6_K)
QUANTIZATION_SCHEMES = [*SCHEMES, "fp8", "gguf"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_fp8(device: str, dtype: torch.dtype | None) -> None:
    """Refuse --quantization fp8 where it cannot run, in one line each."""
    if not device.startswith("cuda"):
        raise ValueError("--quantization fp8 runs on FP8 tensor cores (a GPU of compute capability 8.9 or more: "
                         "Ada, Hopper); on the CPU use int8 or int4")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < (8, 9):
        raise ValueError(f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9 or more); this GPU is "
                         f"{major}.{minor}: use int8 or int4")
    if dtype not in (None, torch.bfloat16):
        raise ValueError(f"--quantization fp8 returns bfloat16 from its products: run with --dtype bfloat16, not {dtype}")


def check_fp8_kv(device: str) -> None:
    """Refuse --kv-cache-dtype fp8 where it cannot run, in one line each: the Triton kernels write and
    read e4m3, which needs a GPU of compute capability 8.9 or more."""
    if not device.startswith("cuda"):
        raise ValueError("--kv-cache-dtype fp8 is for the Triton attention kernel of a GPU with FP8 (compute "
                         "capability 8.9 or more: Ada, Hopper); on the CPU keep --kv-cache-dtype auto")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8 needs a GPU with FP8 (compute capability 8.9 or more); this GPU is "
                         f"{major}.{minor}: keep --kv-cache-dtype auto")


@dataclass
class EngineConfig:
    """Everything an engine is built from. The command line, the benchmarks and the tests all
    make one of these (`nanoserve.cli.add_engine_arguments` defines the matching options)."""

    model: str | os.PathLike = "tiny"  # see nanoserve.model.loader.resolve_model_dir
    dtype: torch.dtype | None = None  # default: float32 on the CPU, bfloat16 on CUDA
    device: str | None = None  # default: cuda when available
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; default: from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the pool; default: measured on a GPU (below), 256 MiB on the CPU
    kv_cache_dtype: str = "auto"  # issue 33: "auto" stores K/V in the model's dtype; "fp8" as float8 e4m3 codes
    # with a float16 scale per token and KV head (about half the bytes: nanoserve/attention/fp8_cache.py; GPU only)
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int | None = None  # tokens through the model per step; default: 8192, or 2048 with
    # chunked prefill (week 15: measured on an H100, docs/benchmarks.md)
    max_model_len: int | None = None  # default: the model's context length
    attention_backend: str | None = None  # "torch" or "triton"; default: triton on CUDA
    batching: str = "continuous"  # week 5 "admit-all", week 7 "static", week 8 "continuous"
    preemption: bool = True  # week 9
    enable_prefix_caching: bool | None = None  # week 14: reuse the KV blocks of shared prefixes; default: on with
    # continuous batching (it costs nothing measurable without sharing), once week 14 is done (see below)
    cpu_offload_gb: float = 0.0  # issue 35: GiB of (pinned) host memory per rank for a CPU tier behind the prefix
    # cache: blocks the GPU pool evicts are kept there and copied back on a hit; 0: off
    enable_chunked_prefill: bool | None = None  # week 15: decodes first, prompts in chunks; default: on with
    # continuous batching (it won at every load measured: docs/benchmarks.md), once week 15 is done (see below)
    scheduling_policy: str = "fcfs"  # or "priority" (continuous batching): lower priority values run first
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
    pipeline_parallel_size: int = 1  # week 20: stages the model's layers are cut into (world: tensor × pipeline)
    expert_parallel_size: int = 1  # week 24: ranks the experts of a mixture of experts are split over (attention
    # replicated on each); not combined with tensor or pipeline parallelism yet
    pipeline_micro_batches: int | None = None  # week 20: micro-batches per step through the stages; default:
    # pipeline_parallel_size with one step in flight, else 1 (why: nanoserve/runner/pipeline.py)
    pipeline_steps_in_flight: int | None = None  # week 20: engine steps (of disjoint lanes of sequences) in the
    # stages at once; default: pipeline_parallel_size (1: one step at a time; nanoserve/engine/steps_in_flight.py)
    distributed_executor: str = "mp"  # week 18: how the other ranks start: "mp" (processes) or "ray" (actors)
    distributed_timeout: float = 300.0  # week 18: seconds a rank waits for the others before failing
    all_reduce: str = "auto"  # week 20: "auto" (one-shot over peer-to-peer memory for small messages) or "nccl"
    ray_placement: str = "pack"  # week 20: where Ray puts the ranks: "pack", "spread", "strict-pack", "strict-spread"
    async_scheduling: bool | None = None  # week 12: schedule step N+1 while the GPU runs step N; default: on
    # with CUDA graphs on a GPU (once week 12 is done), off on the CPU (nothing to overlap there)
    quantization: str | None = None  # issue 33: "int8" or "int4" weight-only (round to nearest, per group), "fp8"
    # (e4m3 weights and activations, GPU only), "gguf" (a GGUF file's own blocks); None: off
    quantization_group_size: int | None = None  # inputs that share one scale and offset; default: 128, or the
    # largest of 64 and 32 that divides every projection's inputs
    kv_role: str | None = None  # issue 35: "prefill" or "decode", an instance of disaggregated serving; None: both
    kv_connector: str = "gloo"  # issue 35: how KV moves between the two: "gloo" (host memory) or "nccl" (GPU to GPU)
    kv_address: str = "127.0.0.1:29650"  # issue 35: host:port of the KV connector's store (the decode instance's)
    kv_transfer_timeout: float = 30.0  # issue 35: seconds a KV transfer may take before its request fails
    lora_modules: dict[str, str] | None = None  # week 23: LoRA adapters to load at start, name -> PEFT folder
    max_loras: int | None = None  # week 23: adapters resident on the device at once; default: 4 with lora_modules,
    # else 0 (no LoRA layers; a positive value turns them on, for adapters loaded at run time)
    max_lora_rank: int | None = None  # week 23: the largest adapter rank accepted; default: 16 (with LoRA on)
    tool_template: str | None = None  # issue 38: "hermes" gives a chat template without a tools slot one
    # (nanoserve/engine/tool_templates.py); None: the model's own template as it is

    @property
    def lora(self) -> bool:
        """Week 23: whether the model gets LoRA layers."""
        return bool(self.max_loras)

    @property
    def world_size(self) -> int:
        """The processes of one engine (week 20): each stage of the pipeline is a tensor-parallel group (week 24:
        or the expert-parallel ranks)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size

    def __post_init__(self) -> None:
        if self.enable_chunked_prefill is None:
            # In a learner's workspace, off until week 15's exercises are written, so that earlier
            # weeks never run a stub (nanoserve/course/stubs.py, `stubbed_weeks`).
            self.enable_chunked_prefill = self.batching == "continuous" and 15 not in stubbed_weeks()
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else 8192
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb={self.cpu_offload_gb}: GiB of host memory, 0 (off) or more")
        if self.all_reduce not in ("auto", "nccl"):
            raise ValueError(f"all_reduce={self.all_reduce!r}: 'auto' (one-shot for small messages) or 'nccl'")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"unknown quantization {self.quantization!r}: one of {', '.join(QUANTIZATION_SCHEMES)}")
        if self.quantization == "gguf" and gguf_source(self.model) is None:
            raise ValueError(f"--quantization gguf runs a GGUF file's blocks as they are: {self.model} is not a GGUF "
                             "file (use int8 or int4 to quantize other checkpoints)")
        if self.quantization_group_size is not None and self.quantization not in SCHEMES:
            raise ValueError(f"--quantization-group-size sets the groups of int8 and int4, not of "
                             f"{self.quantization or 'unquantized weights'} (fp8 scales rows; gguf keeps the file's groups)")
        if self.quantization == "fp8":
            check_fp8(self.device or default_device(), self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8":
            check_fp8_kv(self.device or default_device())
        if self.quantization is not None and self.world_size > 1:
            raise ValueError("--quantization runs on one GPU for now: tensor and pipeline parallelism shard "
                             "unquantized layers")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role={self.kv_role!r}: 'prefill' or 'decode' (or None: an engine that does both)")
        if self.kv_transfer_timeout <= 0:
            raise ValueError(f"kv_transfer_timeout={self.kv_transfer_timeout}: seconds, more than 0")
        if self.tool_template not in (None, *TOOL_TEMPLATES):
            raise ValueError(f"unknown tool_template {self.tool_template!r}: one of {', '.join(TOOL_TEMPLATES)}")
        if self.ray_placement not in RAY_PLACEMENTS:
            raise ValueError(f"unknown ray_placement {self.ray_placement!r}: one of {', '.join(RAY_PLACEMENTS)}")
        self._check_lora()
        self._check_expert_parallel()
        if self.ray_placement != "pack" and self.distributed_executor != "ray":
            raise ValueError(f"--ray-placement {self.ray_placement} places Ray actors: it needs --distributed-executor ray")

    def _check_expert_parallel(self) -> None:
        """Week 24: what expert parallelism refuses (the model's experts are checked once it is found)."""
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size}: ranks, 1 (off) or more")
        if self.expert_parallel_size == 1:
            return
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("--expert-parallel-size runs attention replicated on every rank: it is not combined with "
                             "--tensor-parallel-size or --pipeline-parallel-size yet (leave them at 1)")

    def _check_lora(self) -> None:
        """Week 23: LoRA's defaults, and what it refuses."""
        if self.max_loras is None:
            self.max_loras = 4 if self.lora_modules else 0
        if self.max_loras < 0 or (self.lora_modules and not self.max_loras):
            raise ValueError(f"max_loras={self.max_loras}: adapters need at least one device slot (--max-loras ≥ 1)")
        if not self.max_loras:
            if self.max_lora_rank is not None:
                raise ValueError("max_lora_rank is set but LoRA is off: give --lora-modules or --max-loras")
            return
        self.max_lora_rank = 16 if self.max_lora_rank is None else self.max_lora_rank
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank}: an adapter's rank is at least 1")
        if self.world_size > 1:
            raise ValueError("LoRA adapters run on one device: tensor and pipeline parallelism do not take them yet "
                             "(serve replicas with --data-parallel-size instead)")
        untried = [name for name, on in (("--quantization", self.quantization), ("--role (disaggregation)", self.kv_role))
                   if on is not None]
        if untried:
            raise ValueError(f"LoRA adapters with {' and '.join(untried)} are not supported yet")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny", several_models: bool = False) -> None:
        """The command-line options of an engine, shared by generate, chat, serve and bench
        (`several_models`: serve's --model, which may be repeated, issue 38)."""

        p = parser.add_argument_group("engine")
        if several_models:  # a list; `nanoserve serve` reads it (nanoserve/cli.py, `split_models`)
            p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                           help=f"{MODEL_NAMES_HELP}; repeated as NAME=MODEL, several models in one server, each "
                                f"requested by its NAME (issue 38; default: {default_model})")
        else:
            p.add_argument("--model", default=default_model, help=f"{MODEL_NAMES_HELP} (default: {default_model})")
        p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                       help="default: triton on CUDA, torch on the CPU")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
        p.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from --kv-cache-memory)")
        p.add_argument("--kv-cache-memory", type=float, default=None,
                       help="GiB for the KV pool (default: what --gpu-memory-utilization leaves after a "
                            "measured step; 0.25 on the CPU)")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of the GPU's memory for weights, activations, graphs and the KV pool "
                            "(default: %(default)s)")
        p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once (default: %(default)s)")
        p.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per engine step (default: 2048 with chunked prefill, 8192 without)")
        p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
        p.add_argument("--batching", choices=["admit-all", "static", "continuous"], default="continuous",
                       help="week 5's admit-all, week 7's static or week 8's continuous batching (default)")
        p.add_argument("--no-preemption", dest="preemption", action="store_false",
                       help="fail instead of preempting when the KV pool runs dry")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV blocks of prompt prefixes the engine has seen (week 14; default: on with "
                            "continuous batching)")
        p.add_argument("--cpu-offload-gb", type=float, default=0.0,
                       help="GiB of pinned host memory per rank for a CPU tier behind the prefix cache: blocks "
                            "evicted from the GPU pool are copied there and brought back on a hit instead of "
                            "being recomputed (needs prefix caching; default: %(default)s, off)")
        p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                       help="order of the queue and of preemption (continuous batching): arrival, or each request's "
                            "priority, lower first, with aging so that none waits forever (default: fcfs)")
        p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                       help="decodes first, then prompts cut to fit --max-num-batched-tokens (week 15; default: on "
                            "with continuous batching)")
        p.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                       help="speculative decoding (week 17): guesses from prompt lookup or a draft model, "
                            "verified in one target pass (default: off)")
        p.add_argument("--num-speculative-tokens", type=int, default=4, help="guesses per decode step (default: %(default)s)")
        p.add_argument("--draft-model", default=None, help="--speculative draft: the draft model (same tokenizer)")
        p.add_argument("--speculative-max-batch", type=int, default=2,
                       help="no speculation in steps with more decodes than this (default: %(default)s)")
        p.add_argument("--ngram-min", type=int, default=2,
                       help="--speculative ngram: the shortest suffix worth looking up, in tokens (default: %(default)s)")
        p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False, default=None,
                       help="run decode steps eagerly on CUDA")
        p.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_const", const=False, default=None,
                       help="run the PyTorch norms, RoPE and SwiGLU on CUDA instead of week 12's fused kernels (and "
                            "the experts of a mixture one at a time instead of week 24's grouped kernels)")
        add_parallel_arguments(p)
        add_quantization_arguments(p)
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch the next step while the GPU runs this one, its new tokens fed "
                            "from the GPU (default: on with CUDA graphs; not with speculation)")
        add_lora_arguments(p)
        p.add_argument("--tool-template", choices=list(TOOL_TEMPLATES), default=None,
                       help="give a model whose chat template takes no tools (SmolLM2, Gemma 3) a tools slot: "
                            "hermes lists the tools in the system message and reads calls written as "
                            "<tool_call>{...}</tool_call> (issue 38, docs/agents.md; default: none, the model's "
                            "own template)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config the options of `add_arguments` describe: every field with an option of the
        same name (`trace` has none), in the field's units (a dtype by name, the KV pool in GiB)."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if given.get("dtype") is not None:
            given["dtype"] = DTYPES[given["dtype"]]
        if given.get("kv_cache_memory") is not None:
            given["kv_cache_memory"] = int(given["kv_cache_memory"] * 2**30)
        if given.get("lora_modules") is not None:
            given["lora_modules"] = parse_lora_modules(given["lora_modules"])
        return cls(**given)


def add_parallel_arguments(p) -> None:
    """Weeks 18, 20 and 24's options (several processes for one engine), in the engine's group."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs (or CPU processes), one process each (week 18; "
                        "default: %(default)s)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="cut the model's layers into this many stages, one process (or --tensor-parallel-size "
                        "processes) each (week 20; default: %(default)s)")
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=1,
                   help="split the experts of a mixture of experts over this many GPUs (or CPU processes), "
                        "attention replicated on each, tokens moved to their experts by all-to-all (week 24; "
                        "default: %(default)s)")
    p.add_argument("--pipeline-micro-batches", type=int, default=None,
                   help="micro-batches each step is cut into for the stages (week 20; default: "
                        "--pipeline-parallel-size with one step in flight, else 1)")
    p.add_argument("--pipeline-steps-in-flight", type=int, default=None,
                   help="engine steps, each of its own lane of sequences, in the pipeline's stages at once (week 20; "
                        "default: --pipeline-parallel-size; 1: one step at a time)")
    p.add_argument("--distributed-executor", choices=["mp", "ray"], default="mp",
                   help="start the other ranks as local processes (mp) or as Ray actors, which may run on other "
                        "hosts of a Ray cluster (ray; needs `pip install ray`; default: %(default)s)")
    p.add_argument("--distributed-timeout", type=float, default=300.0,
                   help="seconds a rank waits for the others before the engine fails (default: %(default)g)")
    p.add_argument("--all-reduce", choices=["auto", "nccl"], default="auto",
                   help="tensor parallelism on the GPUs of one host: auto sums small messages in one kernel "
                        "over peer-to-peer memory and large ones with NCCL; nccl always uses NCCL (week 20; "
                        "default: %(default)s)")
    p.add_argument("--ray-placement", choices=list(RAY_PLACEMENTS), default="pack",
                   help="with --distributed-executor ray: put the ranks on as few nodes as possible (pack: "
                        "tensor parallelism wants one host's NVLink), over as many as possible (spread), on one "
                        "node or fail (strict-pack), one per node or fail (strict-spread) (default: %(default)s)")


def add_quantization_arguments(p) -> None:
    """Issue 33's options, in the engine's group."""
    p.add_argument("--quantization", choices=list(QUANTIZATION_SCHEMES), default=None,
                   help="store the decoder's projections as int8 or int4 codes in groups, rounded to nearest at "
                        "load (activations stay in --dtype), as float8 e4m3 with per-row scales on FP8 tensor cores "
                        "(fp8, GPU only), or as a GGUF file's own blocks, Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and the k-quants "
                        "Q4_K/Q5_K/Q6_K (gguf) (default: off)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="with --quantization int8|int4: inputs that share one scale and offset (default: 128, or "
                        "the largest of 64 and 32 that divides every projection's inputs)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="how the KV cache stores K and V: auto, in the model's dtype; fp8, as float8 e4m3 codes with a "
                        "float16 scale per token and KV head, about half the bytes a block (GPU of compute capability "
                        "8.9 or more; default: %(default)s)")


def add_lora_arguments(p) -> None:
    """Week 23's options, in the engine's group."""
    p.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve, each by a name requests give as their model "
                        "(week 23; repeatable)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident on the device at once, the others waiting in host memory "
                        "(week 23; default: 4 with --lora-modules, else 0: no LoRA)")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank accepted (week 23; default: 16 with LoRA on)")


def parse_named_paths(specs: list[str], flag: str) -> dict[str, str]:
    """["NAME=PATH", ...] -> {NAME: PATH}; a malformed or repeated name is a one-line error naming `flag`."""
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} takes NAME=PATH, got {spec!r}")
        if name in named:
            raise ValueError(f"{flag} names {name!r} twice")
        named[name] = path
    return named


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules NAME=PATH ...` -> {NAME: PATH} (week 23)."""
    return parse_named_paths(specs, "--lora-modules")
