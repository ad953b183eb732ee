"""Week 20: pipeline parallelism, the model cut into stages of whole layers.

Tensor parallelism (week 18) splits every layer over the GPUs and pays two all-reduces per
layer, so it wants the fast links inside one host. Pipeline parallelism cuts the model the other
way: stage s keeps whole layers [first, last) and their weights, and the only traffic is the
residual stream handed from one stage to the next, once per stage boundary: [tokens, hidden]
values, where tensor parallelism moves that much twice per *layer*. It suits slower links (between
hosts) and models whose weights do not fit one GPU. Stages compose with tensor parallelism: each
stage may be split over its own tensor-parallel group (`shard_model`, after the cut).

Who holds what (P stages, L layers):

    stage 0       embedding, layers [0, l1),     and the head: the final norm and lm_head
    stage s       layers [l_s, l_{s+1})
    stage P-1     layers [l_{P-1}, L); sends back only the rows that are sampled

Why stage 0 holds the head. The driver, rank 0, owns the scheduler and the sampler, and stage 0 is
its stage. Were the head on the last stage, every step would ship logits back to the driver:
[rows, vocab] floats, and Llama 3's vocabulary (128256) is 62 times the 1B model's hidden size
(2048). Kept on stage 0, the last stage sends back the residual stream of the rows that are
sampled (one per decoding sequence, a prompt's last row), plus the rows that prompt logprobs
score: [rows, hidden], 62 times fewer bytes, and never a row that nobody samples. The embedding
and lm_head of Llama 3.2 are one tied table, which stage 0 then holds once.

The split. L // P layers per stage, and the L % P left over go one each to the *last* stages:
stage 0 already embeds, runs the head (for Llama-3.2-1B, the head over one decode row costs about
as much as four layers: 263M weights against 61M), and its process is the driver, which also
schedules and samples. So stage 0 gets the fewest layers.

One tensor between stages, not two. The layers hand the stream on as a pair (x, residual) whose
sum is the stream, each add left to the norm that follows it (`DecoderLayer`). The next layer's
first operation adds the two (`input_layernorm(x, residual)`) and uses nothing else of them. So the
sending stage adds them and sends the sum; the receiving stage's first layer gets it as x with
residual None, and computes normalize(sum) and keeps sum as the residual: the same add, of the
same two tensors, in the same dtype, done before the link instead of after it. That is bit for bit
what one process computes, in float32 and in bf16 alike (week 12's fused add+RMSNorm also adds in
the model's dtype before it normalizes), and it halves the bytes on the link.

Each stage's attention layers index its own KV cache: the cut renumbers them from 0, so a stage's
pool holds its layers only (`ModelRunner` sizes the pool from `config.num_layers`, made local).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.model.llama import Llama
from nanoserve.model.registry import model_class


@dataclass(frozen=True)
class Stage:
    """One rank's place in a pipeline: its stage, the layers the stage holds, and its rank in the
    stage's tensor-parallel group. Global rank = index × tp_size + tp_rank; rank 0 is the driver."""

    index: int
    num_stages: int
    first_layer: int
    last_layer: int  # exclusive
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        """Stage 0: the embedding and the head."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of `stage`'s member with my tensor-parallel rank: my peer there. Rank r of
        one stage talks to rank r of the next (both hold the whole stream, after their all-reduce)."""
        return stage * self.tp_size + self.tp_rank


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """The layers [first, last) of `stage`: num_layers // num_stages each, the remainder one each to
    the last stages (stage 0 also runs the embedding and the head; see the module's docstring)."""
    base, extra = divmod(num_layers, num_stages)
    first_long = num_stages - extra  # stages from here on hold base + 1 layers
    first = stage * base + max(0, stage - first_long)
    return first, first + base + (stage >= first_long)


def check_pipelinable(config, num_stages: int) -> None:
    """Refuse, with the reason, a model that `num_stages` stages cannot hold."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, not {num_stages}")
    if model_class(config) is not Llama:
        raise ValueError(f"pipeline parallelism cuts Llama-shaped models (Llama, Mistral, Qwen2, Qwen3); "
                         f"{config.architecture} has a forward pass of its own: run it with one stage")
    if num_stages > config.num_layers:
        raise ValueError(f"pipeline parallelism over {num_stages} stages needs a layer per stage at least; this "
                         f"model has {config.num_layers}: use --pipeline-parallel-size {config.num_layers} or fewer")


@torch.no_grad()
def cut_stage(model: Llama, stage: Stage) -> Llama:
    """Turn a whole loaded `Llama` into `stage`'s part of it, in place: its layers only, renumbered
    from 0 for its own KV cache, `model.config` the local view (num_layers, and week 19's per-layer
    kinds), and the vocabulary tables kept on stage 0 only. Returns the model (`model.stage` set)."""
    # >>> week20: cut-stage
    cfg = model.config
    check_pipelinable(cfg, stage.num_stages)
    if not 0 <= stage.first_layer < stage.last_layer <= cfg.num_layers:  # a stage holds at least one layer
        raise ValueError(f"stage {stage.index} of {stage.num_stages} asks for layers [{stage.first_layer}, "
                         f"{stage.last_layer}), which is not a range of this model's {cfg.num_layers} layers")
    model.layers = nn.ModuleList(list(model.layers)[stage.first_layer : stage.last_layer])
    for local, layer in enumerate(model.layers):
        layer.self_attn.layer_idx = local  # the index into this stage's KV pool
    if not stage.is_first:
        # No row of the vocabulary lives here: tables of zero rows keep the model's dtype and device
        # for the runner (and any lookup here would fail loudly instead of reading another stage's rows).
        empty = nn.Parameter(model.embed_tokens.weight.new_empty(0, cfg.hidden_size), requires_grad=False)
        model.embed_tokens.weight = empty
        model.lm_head.weight = empty
        model.norm = None
    kinds = cfg.layer_types[stage.first_layer : stage.last_layer] if cfg.layer_types else cfg.layer_types
    model.config = dataclasses.replace(cfg, num_layers=stage.last_layer - stage.first_layer, layer_types=kinds)
    model.stage = stage
    return model
    # <<< week20: cut-stage


def stage_forward(model: Llama, inputs: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
    """This stage's share of `Llama.forward`. `inputs`: token ids [T] on stage 0, else the stream
    [T, hidden] the stage before sent. Returns the stream after the stage's last layer, [T, hidden],
    as one tensor: x + residual (why that is exact: the module's docstring)."""
    x = model.embed_tokens(inputs) if model.stage.is_first else inputs  # [T, hidden]
    cos, sin = model.rotary(positions, x.dtype)
    residual = None  # a received stream is whole: the first layer takes it as x
    for layer in model.layers:
        x, residual = layer(x, residual, cos, sin, ctx)
    return x + residual


def final_hidden(model: Llama, stream: torch.Tensor) -> torch.Tensor:
    """Stage 0's head, first half: the final norm of the rows the last stage sent back, [N, hidden]
    (what `Llama.forward` returns for those rows); `compute_logits` is the second half."""
    return model.norm(stream)
