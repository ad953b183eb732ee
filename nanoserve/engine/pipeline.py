"""Week 20: the ranks of a pipeline-parallel engine, and what it refuses.

P stages of T tensor-parallel ranks each make P × T processes, started exactly as week 18's are
(`Workers`, `worker_main`: the same step, broadcast from rank 0 to every rank). Global rank
= stage × T + tp_rank, so rank 0, the driver, is stage 0's first rank: the stage with the embedding
and the head (`nanoserve/model/pipeline.py` says why). Each rank then:

    1. finds its stage and its rank in the stage (`join_stages`), and joins the stage's own
       tensor-parallel group (every rank creates every stage's group, in the same order:
       `dist.new_group` is a collective of the whole world);
    2. loads the model, keeps its stage's layers (`cut_stage`) and, with T > 1, its shard of them
       (`shard_model`, week 18's) (`build_stage_model`);
    3. builds a `PipelineRunner` over a KV pool of its own layers (`build_device_side`), of as many
       blocks as every rank can hold, since a block id names the same tokens on every stage.

What is not combined with stages yet is refused before any process starts (`check_pipeline_config`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from nanoserve.engine.config import EngineConfig
from nanoserve.model.config import ModelConfig
from nanoserve.model.loader import load_model
from nanoserve.model.pipeline import Stage, check_pipelinable, cut_stage, stage_layers
from nanoserve.model.tensor_parallel import Group, shard_model


def check_pipeline_config(c: EngineConfig, model_dir) -> None:
    """One clear line for each setting that pipeline parallelism does not take (yet), raised
    before any process starts. With one stage, only a micro-batch count is refused (it would be
    ignored)."""
    if c.pipeline_parallel_size == 1:
        for name in ("pipeline_micro_batches", "pipeline_steps_in_flight"):
            if getattr(c, name) is not None:
                raise ValueError(f"{name} shapes the flow through the stages of a pipeline: it needs "
                                 "pipeline_parallel_size > 1")
        return
    check_pipelinable(ModelConfig.from_json(model_dir), c.pipeline_parallel_size)
    for name in ("pipeline_micro_batches", "pipeline_steps_in_flight"):
        if getattr(c, name) is not None and getattr(c, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(c, name)}")
    if (c.pipeline_steps_in_flight or 1) > 1 and (c.batching != "continuous" or c.kv_role is not None):
        raise ValueError("pipeline_steps_in_flight > 1 splits continuously batched sequences into lanes: it needs "
                         "batching='continuous' and no kv_role (use pipeline_steps_in_flight=1)")
    refused = [(c.async_scheduling, "async scheduling does not work with pipeline parallelism (the stages "
                                    "would need the sampled tokens): leave it unset"),
               (c.speculative is not None, "speculative decoding is not combined with pipeline parallelism yet: "
                                           "use one of them")]
    for on, why in refused:
        if on:
            raise ValueError(why)


def pipeline_depths(c: EngineConfig) -> tuple[int, int]:
    """(steps in flight, micro-batches per step) of a pipeline, their defaults resolved; every rank
    computes the same. Steps in flight: P by default, so that each stage has a step of its own
    (nanoserve/engine/steps_in_flight.py), except where lanes do not apply (other batchings, a
    disaggregated instance). Micro-batches: P with one step in flight (the bubble drops to
    (P - 1) / (2P - 1)), else 1: the steps in flight already keep the stages busy, and every
    micro-batch re-reads the stage's weights (nanoserve/runner/pipeline.py)."""
    p = c.pipeline_parallel_size
    if p == 1:
        return 1, 1
    lanes_apply = c.batching == "continuous" and c.kv_role is None
    steps = c.pipeline_steps_in_flight or (p if lanes_apply else 1)
    return steps, c.pipeline_micro_batches or (p if steps == 1 else 1)


def join_stages(c: EngineConfig, world: Group) -> tuple[Stage, Group]:
    """This rank's `Stage` and its stage's tensor-parallel `Group`, from its place in the world
    (`world`: what `init_group` returned). Every rank calls this, in the same order."""
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    index, tp_rank = divmod(world.rank, tp)
    mine = None
    if tp > 1:
        for s in range(pp):  # a collective of the whole world: every rank creates every group
            group = dist.new_group(ranks=[s * tp + r for r in range(tp)])
            mine = group if s == index else mine
    # NCCL: the world's first operation must involve every rank, and a boundary's sends only
    # involve two; one small all-reduce of everybody comes first.
    if dist.get_backend(world.device_group) == "nccl":
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())),
                        group=world.device_group)
    # (A stage's group runs the forward pass's collectives only: steps come over the world's.)
    return Stage(index, pp, 0, 0, tp_rank, tp), Group(tp_rank, tp, mine, None)


def build_stage_model(c: EngineConfig, world: Group, dtype: torch.dtype, device: str):
    """This rank's part of the model: loaded whole on the CPU, cut to its stage's layers, sharded
    over its stage's tensor-parallel group (if any), then moved to `device`."""
    stage, tp_group = join_stages(c, world)
    model = load_model(c.model, dtype=dtype, device="cpu")
    first, last = stage_layers(model.config.num_layers, stage.num_stages, stage.index)
    model = cut_stage(model, dataclasses.replace(stage, first_layer=first, last_layer=last))
    if tp_group.size > 1:
        model = shard_model(model, tp_group)
    return model.to(device)


def rank_name(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """How a failure names a rank: 'tensor-parallel rank 1', or under pipeline parallelism its
    stage too, 'pipeline stage 1 (rank 2)'."""
    if pipeline_parallel_size == 1:  # (one stage of one rank each: the ranks of expert parallelism, week 24)
        return f"{'tensor' if tensor_parallel_size > 1 else 'expert'}-parallel rank {rank}"
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    within = f", tensor-parallel rank {tp_rank}" if tensor_parallel_size > 1 else ""
    return f"pipeline stage {stage}{within} (rank {rank})"
