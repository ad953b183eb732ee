"""One rank's device side: the model (or its shard), the KV pool sized to the memory left, the runner."""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import torch

from nanoserve.attention.backend import select_backend
from nanoserve.attention.cpu_pool import CPUKVPool
from nanoserve.attention.fp8_cache import kv_bytes_per_block
from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.pipeline import build_stage_model, pipeline_depths
from nanoserve.engine.step_channel import one_host
from nanoserve.kernels.quant_matmul import use_quantized_kernels
from nanoserve.model.llama import Llama
from nanoserve.model.gguf_quantized import use_gguf_blocks
from nanoserve.model.loader import gguf_source, load_model
from nanoserve.model.expert_parallel import shard_experts, use_fixed_capacity
from nanoserve.model.lora import enable_lora
from nanoserve.model.moe import check_moe_supported, moe_blocks, reset_expert_load
from nanoserve.model.quantized import quantize_model
from nanoserve.model.tensor_parallel import OneShotAllReduce, min_over_ranks, shard_model
from nanoserve.runner.lora import AdapterPool
from nanoserve.runner.pipeline import PipelineRunner
from nanoserve.runner.runner import ModelRunner


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
    num_cpu_blocks: int = 0  # the CPU tier's slots (issue 35), the same on every rank


def build_device_side(c: EngineConfig, group=None) -> DeviceSide:
    """Load the model and build its runner on `c.device`. `group` (week 18): this rank's place
    in a tensor-parallel group; every rank calls this with the same config, and their collective
    steps (the measured step, the CUDA graph captures) pair up."""
    device = c.device
    attention_backend = select_backend(device, c.attention_backend)
    dtype = c.dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    pipeline = c.pipeline_parallel_size > 1  # week 20: this rank holds one stage of the model
    if pipeline:
        model = build_stage_model(c, group, dtype, device)
    elif group is None:  # (a GGUF file's blocks replace the widened projections on the host: never on the device)
        model = load_model(c.model, dtype=dtype, device="cpu" if c.quantization == "gguf" else device)
    elif c.expert_parallel_size > 1:  # week 24: this rank's experts, everything else whole
        model = shard_experts(load_model(c.model, dtype=dtype, device="cpu"), group).to(device)
    else:  # load whole on the CPU, keep this rank's shard, then move it
        model = shard_model(load_model(c.model, dtype=dtype, device="cpu"), group).to(device)
        if c.all_reduce == "auto" and device.startswith("cuda"):  # week 20
            group.one_shot = one_shot_all_reduce(group, dtype, device)
    check_moe_supported(model, c.quantization, c.lora)  # week 24
    if c.quantization is not None:  # issue 33: the projections as grouped codes, before the pool is sized
        if c.quantization == "gguf":
            use_gguf_blocks(model, gguf_source(c.model))
            model = model.to(device)
        else:
            quantize_model(model, c.quantization, c.quantization_group_size)
        if device.startswith("cuda"):
            use_quantized_kernels(model)
    cfg = model.config
    max_model_len = min(c.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    # Week 12: CUDA graphs for decode steps and fused kernels (Triton backend; on by default on
    # CUDA, in a learner's workspace once week 12 is written, so no earlier week runs its stubs).
    # `cuda_graphs=True` on the CPU runs the same static buffers and padding without capturing
    # anything: that is how the CPU tests check them. Under a pipeline each stage captures its own
    # layers (week 20: nanoserve/runner/stage_graphs.py).
    week12 = device.startswith("cuda") and 12 not in stubbed_weeks()
    use_graphs = (c.cuda_graphs if c.cuda_graphs is not None else week12) and attention_backend == "triton"
    fused = c.fused_kernels if c.fused_kernels is not None else week12
    use_graphs = use_graphs and moe_graphs_allowed(c, model, fused)  # week 24
    # Week 24: steps that may be captured exchange fixed-capacity buffers (no size goes to the host); every
    # step then does, the eager ones too, so the measured step below is the one that will run.
    use_fixed_capacity(model, use_graphs)
    runner_args = dict(attention_backend=attention_backend, cuda_graphs=use_graphs,
                       max_model_len=max_model_len, max_batch=c.max_num_seqs,
                       verify_tokens=c.num_speculative_tokens if c.speculative else 0,
                       verify_batch=c.speculative_max_batch,
                       mixed_tokens=c.max_num_batched_tokens if c.enable_chunked_prefill else 0,
                       fused_kernels=fused, kv_cache_dtype=c.kv_cache_dtype)
    if c.lora:  # week 23: LoRA layers swapped in for the model's linear layers, their slots in a pool
        runner_args["lora"] = AdapterPool(*enable_lora(model, c.max_loras, c.max_lora_rank))
    runner_class = PipelineRunner if pipeline else ModelRunner
    if pipeline:
        runner_args.update(micro_batches=pipeline_depths(c)[1], cpu_group=group.cpu_group)
    kv_sizing = None
    num_blocks = c.num_blocks
    if num_blocks is None:
        num_blocks, kv_sizing = kv_pool_blocks(c, model, dtype, runner_args, runner_class)
    runner_args["cpu_blocks"] = cpu_tier_blocks(c, model, dtype, group)  # (not in the measured step's runner)
    if group is not None:  # the block tables must fit on every rank (of every stage)
        num_blocks = min_over_ranks(group, num_blocks)
    runner = runner_class(model, num_blocks, c.block_size, **runner_args)
    reset_expert_load(model)  # week 24: count the served steps' routing, not the measured step's or the captures'
    return DeviceSide(model, runner, num_blocks, max_model_len, attention_backend, kv_sizing,
                      runner_args["cpu_blocks"])


def moe_graphs_allowed(c: EngineConfig, model: Llama, fused: bool) -> bool:
    """Week 24: whether a mixture of experts may run in CUDA graphs: not with the per-expert loop on a
    GPU (it finds each expert's rows on the host); the grouped kernels read nothing there, nor does
    expert parallelism's fixed-capacity exchange (`use_fixed_capacity`)."""
    if not moe_blocks(model):
        return True
    loop_on_gpu = c.device.startswith("cuda") and not fused
    if loop_on_gpu and c.cuda_graphs:
        raise ValueError("cuda_graphs=True with --no-fused-kernels on a mixture of experts: the per-expert loop "
                         "cannot be captured in a CUDA graph (keep the fused kernels, or leave cuda_graphs unset)")
    return not loop_on_gpu


def cpu_tier_blocks(c: EngineConfig, model: Llama, dtype: torch.dtype, group=None) -> int:
    """How many blocks of this rank's pool (its heads, its layers) `cpu_offload_gb` holds, the
    fewest over the ranks of `group` (the scheduler's slots must exist on every rank); 0: no tier."""
    if not c.cpu_offload_gb:
        return 0
    per_block = pool_bytes_per_block(c, model, dtype)
    slots = CPUKVPool.num_slots_for(int(c.cpu_offload_gb * 2**30), per_block)
    if slots < 1:
        raise ValueError(f"--cpu-offload-gb {c.cpu_offload_gb} holds no KV block ({per_block} bytes each): "
                         "give it more, or 0 to turn the CPU tier off")
    return slots if group is None else min_over_ranks(group, slots)


# The one-shot all-reduce up to this size, NCCL above: on two H100s (NV18) in CUDA graphs the one-shot
# path took 8.9 µs at 8 KB (NCCL 11.5), 23.5 at 2 MiB (NCCL 34.9), a tie at 4 MiB, and lost at 8 MiB
# (scripts/bench_all_reduce.py; docs/benchmarks.md, week 20).
ONE_SHOT_MAX_BYTES = 2 << 20


# The device groups whose buffers this process has mapped. PyTorch's symmetric memory keeps what it learns
# about a group, by the group's name, for the life of the process; a later engine in the same process makes
# its group anew under the same name, and its rendezvous waited forever (on two H100s, 2026-11-27: a second
# `LLM(..., tensor_parallel_size=2)` in one pytest process). Such an engine sums with NCCL instead.
MAPPED_GROUP_NAMES: set[str] = set()


def one_shot_all_reduce(group, dtype: torch.dtype, device: str) -> OneShotAllReduce | None:
    """Week 20: the one-shot all-reduce for this group's small messages, if its ranks share a
    host (peer-to-peer memory does not cross hosts) and this PyTorch can map the buffers;
    otherwise None, and NCCL does every sum. Every rank calls this at the same point."""
    if not one_host(group):
        return None
    name = group.device_group.group_name
    if not min_over_ranks(group, int(name not in MAPPED_GROUP_NAMES)):
        warnings.warn(f"a second tensor-parallel engine in this process: NCCL does every sum (symmetric memory "
                      f"remembers group {name!r} of the first one for the life of the process)", stacklevel=2)
        return None
    MAPPED_GROUP_NAMES.add(name)
    one_shot = None
    try:
        one_shot = OneShotAllReduce(group, dtype, device, ONE_SHOT_MAX_BYTES)
    except (ImportError, RuntimeError, AttributeError) as e:
        warnings.warn(f"the one-shot all-reduce is not available ({type(e).__name__}: {e}); NCCL does every sum",
                      stacklevel=2)
    # Every rank must take the same path for every message: all one-shot, or none.
    return one_shot if min_over_ranks(group, int(one_shot is not None)) else None


def pool_bytes_per_block(c: EngineConfig, model: Llama, dtype: torch.dtype) -> int:
    """One KV block of this rank's pool (its layers, its heads), in bytes: in `dtype`, or issue 33's
    e4m3 codes and scales with `kv_cache_dtype` fp8 (about half: nanoserve/attention/fp8_cache.py)."""
    cfg = model.config
    return kv_bytes_per_block(cfg.num_layers, c.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, c.kv_cache_dtype)


def kv_pool_blocks(c: EngineConfig, model: Llama, dtype: torch.dtype, runner_args: dict,
                   runner_class: type[ModelRunner] = ModelRunner) -> tuple[int, dict | None]:
    """How many KV blocks fit: `kv_cache_memory` if given; on the CPU 256 MiB; on a GPU, what is
    left of `gpu_memory_utilization` of its memory once the weights and the measured peak of the
    largest step (and the CUDA graphs) are accounted for. Also returns those measured figures."""
    per_block = pool_bytes_per_block(c, model, dtype)
    if c.kv_cache_memory is not None:
        return max(1, c.kv_cache_memory // per_block), None
    if not c.device.startswith("cuda"):
        return max(1, 256 * 2**20 // per_block), None
    gc.collect()  # an engine nobody references any more may still hold its pool, through a reference cycle
    step_bytes = runner_class.measure_step_memory(model, c.block_size, c.max_num_batched_tokens, **runner_args)
    free, total = torch.cuda.mem_get_info()
    budget = int(total * c.gpu_memory_utilization) - (total - free) - step_bytes
    if budget < per_block:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {(total - free) / 2**30:.1f} GiB in use (weights and "
            f"other processes), a step needs {step_bytes / 2**30:.1f} GiB more, and gpu_memory_utilization is "
            f"{c.gpu_memory_utilization}: raise it, lower max_num_batched_tokens or max_num_seqs, or free the GPU"
        )
    return budget // per_block, dict(step_bytes=step_bytes, budget_bytes=budget, total_bytes=total)



def release_cached_memory() -> None:
    """Issue 38, after an engine is dropped (a model unloaded): collect it now (its pool and weights
    may sit in reference cycles), and give the GPU memory PyTorch keeps cached back to the device, so
    that the next model's KV pool, sized from what the device reports free, gets it."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
